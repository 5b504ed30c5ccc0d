# Source from the repository root on the H200 machine: puts the repo and the carried peer wheels (.whl:
# sgl-flash-mla; .peers: FlashInfer trimmed + apache-tvm-ffi, see docs/cli.md) on PYTHONPATH.
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .peers/apache_tvm_ffi-*.whl
tar xzf .peers/flashinfer_trim.tgz -C /tmp/site
export PYTHONPATH=/tmp/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws
