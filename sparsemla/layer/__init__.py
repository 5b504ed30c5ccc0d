"""The DSA attention layer: lightning indexer, ``DSAAttention`` module, a tiny DSA language model, and
the per-format accuracy report (``python -m sparsemla.layer.accuracy --quick``)."""
from .dsa import DSAAttention, DSAConfig, DSAMetadata, init_dsa_weights_, realistic_hidden, sparse_attention
from .indexer import IndexKeyCache, LightningIndexer
from .model import DSAModel, GenerateResult, ModelCaches, ModelConfig, generate, init_model_weights_

__all__ = ["DSAAttention", "DSAConfig", "DSAMetadata", "IndexKeyCache", "LightningIndexer", "init_dsa_weights_",
           "realistic_hidden", "sparse_attention", "DSAModel", "GenerateResult", "ModelCaches", "ModelConfig",
           "generate", "init_model_weights_"]
