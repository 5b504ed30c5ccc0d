"""The ``sparsemla`` command line: ``info``, ``demo``, ``bench``, ``check``, ``capacity``.

Entry point ``sparsemla.cli.main:main`` (also ``python -m sparsemla.cli``).  Each subcommand lives in
its own module with ``add_parser(subparsers)`` and ``run(args) -> exit code``.
"""
