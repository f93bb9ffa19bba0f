#!/bin/bash
# s44 call A (carry .gpu/v1): stage v1, build main + the unpack2 merge, the GEMV / fused / dense GEMV
# tests (both use the merged helper), the 8B chain (fused vs bare, k = 2, 4, M = 1, 2)
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,driver_version --format=csv,noheader
lscpu | grep -E "Model name" | head -1
timeout 330 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda_gemv.py tests/test_cuda_fused_linear.py tests/test_cuda_dense_linear.py > $OUT/tests_gemv_fused_dense_h100_s44.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests_gemv_fused_dense_h100_s44.log | cut -c1-300
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_fused_chain.py --bits 2,4 --m 1,2 --variants inductor,fused,fused_nosilu,bare --out-dir $OUT --tag _h100_s44 2>&1 | grep -v Warning | tail -5 | cut -c1-400
echo "total $(( $(date +%s) - t0 )) s"
