#!/bin/bash
# s41 call A (carry .gpu/v1): stage v1, build with the (R, U) switch of ab.patch, A/B of the
# dense GEMV's rows-per-group R and chunks-per-step U at M = 1, 2; then the committed source again
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/
cp csrc/dense_gemv.cu /tmp/dg.cu && patch -p1 < scratch/s41/ab.patch || exit 1
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
mkdir -p $OUT/ab
for c in 0 1 2 3 4 5 0; do
  KBIT_DENSE_CFG=$c timeout 60 python3 benchmarks/bench_dense_head.py --shapes llama3_8b,qwen3_8b,mistral_7b,llama3_70b_tp2 --m 1,2 --dtypes fp16,bf16 --out-dir $OUT/ab --tag _s41_cfg$c 2>&1 | grep -E "^\| [a-z]|Error|Traceback" | awk -v c=$c '{print "cfg" c " " $0}'
  echo "cfg $c done $(( $(date +%s) - t0 )) s"
done
cp /tmp/dg.cu csrc/dense_gemv.cu
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build2.log 2>&1 || { tail -30 /tmp/build2.log; exit 1; }
echo "rebuild $(( $(date +%s) - t0 )) s"
timeout 100 python3 -m pytest -q tests/test_cuda_dense_linear.py -k "lm_head or awkward and m3" 2>&1 | tail -2
echo "total $(( $(date +%s) - t0 )) s"
