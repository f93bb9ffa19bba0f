#!/bin/bash
# s44 second lease, call 1 (carry .gpu/v1): stage v1, build; kernel level at M = 128 / 192 / 256 on the
# 8B layer, k = 3, 4, 5 vs fp16 cuBLAS: the default dispatch and every wgmma configuration forced
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_linear.py --models 8b --bits 3,4,5 --m 128,192,256 --baselines fp16 --wgmma2-config 1,2,3,4,5 --out-dir $OUT --tag _s44_mid 2>&1 | grep -vi warn | tail -4
echo "total $(( $(date +%s) - t0 )) s"
