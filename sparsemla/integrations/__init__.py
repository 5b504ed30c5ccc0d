"""Engine integrations: adapters that let a serving engine run sparsemla as its sparse MLA attention.

``integrations.vllm``: a vLLM attention backend (``--attention-backend SPARSEMLA``), a thin shell over
``integrations.vllm.contract``, which takes vLLM-shaped tensors and imports nothing from vLLM.
"""
