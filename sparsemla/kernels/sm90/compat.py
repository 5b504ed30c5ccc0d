"""The Gluon names the sm_90 kernels use that differ between the supported Triton releases (3.6, 3.8, 3.9).

Each name is bound once, at import, to the form the installed release provides, so that one kernel source
serves every release:

- ``barrier()``: a CTA-wide barrier (``bar.sync``): ``gl.thread_barrier`` up to 3.6, ``gl.barrier`` from 3.8.
- ``async_load(smem, pointer, mask=...)``: ``cp.async`` of a pointer tensor into shared memory:
  ``async_copy_global_to_shared`` up to 3.6, ``async_load`` from 3.8 (3.9 removes the old name).
- ``reinterpret(smem, dtype, shape, layout)``: a view of a shared-memory descriptor with another type, shape
  and layout: the method ``_reinterpret`` up to 3.8, ``reinterpret`` from 3.9.
- ``async_store(dst, value, mbarrier)`` (``st.async`` into the shared memory of the cluster's CTAs) and
  ``cluster_barrier()`` (all threads of a cluster): from 3.8; before, stand-ins that fail when traced (only
  ``sm90-conv``'s 2-CTA kernel uses them, which the plan builds where ``plan.cluster_builds()``).
- ``fence_mbarrier_init_cluster()``: makes this CTA's mbarrier initializations visible to the cluster before a
  cluster barrier: ``mbarrier.fence_init_release_cluster`` on 3.8; 3.9 emits the fence itself (nothing to call).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy

barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret


@gluon.jit
def _no_async_store(dst, value, bar):
    gl.static_assert(False, "st.async into a cluster's shared memory needs Triton >= 3.8")


@gluon.jit
def _no_cluster_barrier():
    gl.static_assert(False, "a cluster barrier needs Triton >= 3.8")


@gluon.jit
def _fence_emitted_by_triton():
    pass


async_store = getattr(hopper, "async_store", None) or _no_async_store
cluster_barrier = getattr(getattr(hopper, "cluster", None), "barrier", None) or _no_cluster_barrier
fence_mbarrier_init_cluster = getattr(hopper.mbarrier, "fence_init_release_cluster", None) or _fence_emitted_by_triton
