"""sm_90 (Hopper) warp-specialized Gluon kernels for sparse MLA attention."""
