#!/bin/bash
# s42 call 1 (carry .gpu/v1): stage v1, build, the whole GPU test suite (aligned()/rows_aligned16
# refactor of the host checks in gemv/mma/moe/moe_gemv/wgmma/dense_gemv + the new dense M=1 test)
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"; grep -i "spill\|warning" /tmp/build.log | grep -v "0 bytes" | head -5
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,driver_version --format=csv,noheader
timeout $(( 560 - $(date +%s) + t0 )) python3 -m pytest -q tests/ -p no:cacheprovider > $OUT/tests_all_gpu_h100_s42.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $OUT/tests_all_gpu_h100_s42.log
grep -E "FAILED|ERROR" $OUT/tests_all_gpu_h100_s42.log | head -10
echo "total $(( $(date +%s) - t0 )) s"
