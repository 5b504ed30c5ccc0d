"""``python -m sparsemla``: the command line (the same as the ``sparsemla`` script)."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
