#!/bin/bash
# s43 call B (carry .gpu/v2): stage v2; memcheck of the GEMV + fused tests (single-job x prologue)
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
cp .gpu/v2/* /opt/stage/
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_fused_linear.py tests/test_cuda_gemv.py -k "fused or xpro or norm or silu" > $OUT/memcheck_fused_h100_s43.log 2>&1; echo "memcheck rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/memcheck_fused_h100_s43.log
echo "total $(( $(date +%s) - t0 )) s"
