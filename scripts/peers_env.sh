# Source from the repository root on the GPU machine (no network there):
#     source scripts/peers_env.sh
# Puts the repository on PYTHONPATH and installs what was carried into /tmp/site:
#   .whl/*.whl                 FlashMLA's Hopper kernels (sgl-flash-mla), see docs/benchmarking.md
#   .peers/flashinfer_trim.tgz FlashInfer trimmed to its MLA sources, with .peers/apache_tvm_ffi-*.whl
#   $TRITON_BUNDLE             a packed Triton release (.carry/triton-X.Y.Z.tar.xz), put ahead of the installed one
# Anything not carried is left out with one line saying so.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SITE=${PEERS_SITE:-/tmp/site}
mkdir -p "$SITE"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl && echo "peers: FlashMLA from .whl"
else
    echo "peers: no .whl/*.whl (FlashMLA left out)"
fi
if [ -f .peers/flashinfer_trim.tgz ]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .peers/apache_tvm_ffi-*.whl
    tar xzf .peers/flashinfer_trim.tgz -C "$SITE" && echo "peers: FlashInfer from .peers"
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
else
    echo "peers: no .peers/flashinfer_trim.tgz (FlashInfer left out)"
fi
export PYTHONPATH="$SITE:$PYTHONPATH"
if [ -n "${TRITON_BUNDLE:-}" ]; then
    # a fresh directory: a machine kept warm between calls may hold another release's files there
    rm -rf /tmp/tv && mkdir -p /tmp/tv && tar xJf "$TRITON_BUNDLE" -C /tmp/tv && export PYTHONPATH="/tmp/tv:$PYTHONPATH"
    # the bundle leaves out the AMD backend that its entry points name: discover the in-tree backends only
    export TRITON_BACKENDS_IN_TREE=1
    # ... and the Blackwell ptxas, which Triton 3.9 looks up even for sm_90: point it at the bundle's ptxas
    [ -x /tmp/tv/triton/backends/nvidia/bin/ptxas-blackwell ] ||
        export TRITON_PTXAS_BLACKWELL_PATH=/tmp/tv/triton/backends/nvidia/bin/ptxas
    echo "triton: $TRITON_BUNDLE ahead of the installed release"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
