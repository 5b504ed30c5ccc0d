"""Float64 references of the library's math, used by tests, the accuracy report and CPU-only machines."""
from .attention import sparse_mla

__all__ = ["sparse_mla"]
