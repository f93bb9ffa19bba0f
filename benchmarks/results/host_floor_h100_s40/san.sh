#!/bin/bash
# s40 lease 3: build main (+ the bench changes), compute-sanitizer on the GEMV after session 39's
# early PDL trigger: memcheck of the fused GEMV ops and of sanitize_cases.py quick, then racecheck
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 170 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scratch/s36/san_fused.py > $OUT/memcheck_fused_h100_s40.log 2>&1; echo "memcheck fused rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/memcheck_fused_h100_s40.log
timeout $(( 560 - $(date +%s) + t0 )) compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitize_cases.py quick > $OUT/memcheck_quick_h100_s40.log 2>&1; echo "memcheck quick rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/memcheck_quick_h100_s40.log
echo "total $(( $(date +%s) - t0 )) s"
