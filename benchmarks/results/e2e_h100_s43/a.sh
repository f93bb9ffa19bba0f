#!/bin/bash
# s43 call A (carry .gpu/v1): stage v1, build (single-job x prologue, KBIT_GEMV_XPRO_KB1), the GEMV and
# fused tests, then the 32-layer 8B chain: fused with the single-job prologue (default) and without
# (KBIT_GEMV_XPRO_KB1=0), fused_nosilu, bare
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda_gemv.py tests/test_cuda_fused_linear.py > $OUT/tests_gemv_fused_h100_s43.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests_gemv_fused_h100_s43.log | cut -c1-300
for r in 1 2; do
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_fused_chain.py --bits 2,4 --m 1,2 --variants inductor,fused,fused+kb4,fused_nosilu,bare --variant kb4:KBIT_GEMV_XPRO_KB1=0 --out-dir $OUT --tag _h100_s43_kb1_$r 2>&1 | grep -v Warning | tail -5 | cut -c1-400
done
echo "total $(( $(date +%s) - t0 )) s"
