#!/bin/bash
# s44 review: build with the C2w rule inside pick_config; the wgmma and dispatch tests
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda_mma.py tests/test_cuda_linear_dispatch.py -k "ws_ or wgmma or linear" > $OUT/tests_review_h100_s44.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests_review_h100_s44.log | cut -c1-300
