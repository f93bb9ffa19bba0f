#!/bin/bash
# s42 call 2 (carry .gpu/v2): stage v2; the GPU test files (CUDA ops) with a failure summary,
# then memcheck of the host-check paths (strided / misaligned x of every op)
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
cp .gpu/v2/* /opt/stage/
timeout 330 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda_*.py > $OUT/tests_cuda_h100_s42.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -15 $OUT/tests_cuda_h100_s42.log | cut -c1-300
timeout $(( 570 - $(date +%s) + t0 )) compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_dense_linear.py tests/test_cuda_gemv.py tests/test_cuda_mma.py tests/test_cuda_moe.py tests/test_cuda_fused_linear.py tests/test_cuda_linear_dispatch.py -k "strided or misaligned or unaligned" > $OUT/memcheck_align_h100_s42.log 2>&1; echo "memcheck rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/memcheck_align_h100_s42.log
echo "total $(( $(date +%s) - t0 )) s"
