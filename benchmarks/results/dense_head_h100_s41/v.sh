#!/bin/bash
# s41 call V: the dense GEMV's tests with M = 1-4 on the awkward shapes (each (R, U)), memcheck of
# them, and bench_dense_head once through the refactored write_results
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m pytest -q tests/test_cuda_dense_linear.py -k "not lm_head" > $OUT/tests_dense_m1234_h100_s41.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/tests_dense_m1234_h100_s41.log
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/test_cuda_dense_linear.py -k "awkward and (m2 or m4)" > $OUT/memcheck_dense_m24_h100_s41.log 2>&1; echo "memcheck rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/memcheck_dense_m24_h100_s41.log
timeout 60 python3 benchmarks/bench_dense_head.py --shapes mistral_7b --m 1 --dtypes fp16 --out-dir $OUT --tag _s41_wr 2>&1 | tail -4
echo "total $(( $(date +%s) - t0 )) s"
