"""Triton kernels.  Plain functions on tensors: no state, no planning.

Each kernel module holds one operation and a thin launcher.  On a machine with no GPU the same
kernels run under the Triton interpreter (``TRITON_INTERPRET=1``), which is how CI tests them.
"""
