"""The CUDA-graph-safe runner (:class:`SparseMLA`) and the batch description it plans from."""
from .metadata import BatchMetadata
from .runner import SparseMLA

__all__ = ["BatchMetadata", "SparseMLA"]
