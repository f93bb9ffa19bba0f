#!/bin/bash
# s41 call 1 (carry .gpu/v1): stage v1, build, GPU tests of kbit::dense_linear (+ the gemv tests),
# the lm_head bench, memcheck of the dense GEMV
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"; grep -i "spill\|warning" /tmp/build.log | grep -v "0 bytes" | head -5
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
timeout 200 python3 -m pytest -q -x tests/test_cuda_dense_linear.py > $OUT/tests_dense_h100_s41.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $OUT/tests_dense_h100_s41.log
timeout 200 python3 benchmarks/bench_dense_head.py --m 1,2,4,8 --dtypes fp16,bf16 --out-dir $OUT --tag _s41 2>&1 | grep -E "^\||Error|Traceback" | head -70
echo "bench $(( $(date +%s) - t0 )) s"
timeout $(( 570 - $(date +%s) + t0 )) compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/test_cuda_dense_linear.py -k "awkward and (m1 or m8) or strided or empty" > $OUT/memcheck_dense_h100_s41.log 2>&1; echo "memcheck rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $OUT/memcheck_dense_h100_s41.log
echo "total $(( $(date +%s) - t0 )) s"
