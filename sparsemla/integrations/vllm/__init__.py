"""sparsemla as a vLLM attention backend: ``--attention-backend SPARSEMLA``.

Install ``sparsemla[vllm]``; vLLM calls :func:`register` from the ``vllm.general_plugins`` entry point
``sparsemla = sparsemla.integrations.vllm:register`` in every process it starts, and the backend is then chosen
with ``--attention-backend SPARSEMLA`` (vLLM never picks an out-of-tree backend by itself).

Modules:
    ``backend``   the vLLM classes (backend, metadata builder, impl); imports vLLM.
    ``contract``  the call on vLLM-shaped tensors; imports no vLLM (the GPU tests drive it directly).

``docs/serving-vllm.md`` has the command lines, what is served and refused, and what was tested.
"""
from __future__ import annotations

BACKEND_NAME = "SPARSEMLA"
BACKEND_PATH = "sparsemla.integrations.vllm.backend.SparseMLABackend"


def register() -> None:
    """Register the ``SPARSEMLA`` attention backend with vLLM (idempotent: vLLM may load plugins more than once,
    in every process).

    Raises ``RuntimeError`` if another package already registered the name for a different class.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if member is None:
        register_backend(BACKEND_NAME, BACKEND_PATH)
        return
    path = member.get_path()
    if path != BACKEND_PATH:
        raise RuntimeError(f"the attention backend name {BACKEND_NAME} is already registered for {path}, "
                           f"not {BACKEND_PATH}")


__all__ = ["register", "BACKEND_NAME", "BACKEND_PATH"]
