#!/bin/bash
# s44 fourth lease (carry nothing): build; kernel level at M = 384..1024, k = 4, 5, the kbit paths of each
# (shape, k, M) timed in rotating rounds (--interleave): does the dispatching linear op match the
# configuration it runs, and where does dequantize + cuBLAS overtake the wgmma kernel at k=5
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 500 > $OUT/smi_x1.csv 2>&1 &)
for r in 1 2; do
timeout $(( 580 - $(date +%s) + t0 )) python3 benchmarks/bench_linear.py --models 8b --bits 4,5 --m 384,512,768,1024 --baselines fp16 --wgmma2-config 3,5 --interleave --out-dir $OUT --tag _s44_large_r$r 2>&1 | grep -vi warn | tail -2
done
pkill -f "nvidia-smi --query" || true
echo "total $(( $(date +%s) - t0 )) s"
