#!/bin/bash
# s41 call T: build the final dense GEMV (M=1: R=8,U=2; M=2: R=8,U=1; M=3,4: R=4,U=2), all of its
# GPU tests, memcheck and initcheck, the lm_head bench again
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m pytest -q tests/test_cuda_dense_linear.py > $OUT/tests_dense_final_h100_s41.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests_dense_final_h100_s41.log
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/test_cuda_dense_linear.py -k "awkward and (m1 or m3) or strided or empty" > $OUT/memcheck_dense_final_h100_s41.log 2>&1; echo "memcheck rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/memcheck_dense_final_h100_s41.log
timeout 60 compute-sanitizer --tool initcheck --error-exitcode 9 python3 -m pytest -q -x tests/test_cuda_dense_linear.py -k "awkward and m1 and float16" > $OUT/initcheck_dense_final_h100_s41.log 2>&1; echo "initcheck rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/initcheck_dense_final_h100_s41.log
timeout $(( 580 - $(date +%s) + t0 )) python3 benchmarks/bench_dense_head.py --m 1,2,3,4 --dtypes fp16,bf16 --out-dir $OUT --tag _s41_final 2>&1 | grep -E "^\||Error|Traceback" | head -70
echo "total $(( $(date +%s) - t0 )) s"
