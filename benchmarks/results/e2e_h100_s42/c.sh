#!/bin/bash
# s42 call 3 (carry .gpu/deps): install vLLM; batch-1 e2e with the kbit lm_head GEMV (default),
# with it off (KBIT_DENSE_GEMV=0: vLLM's cuBLAS head), kbit4, fp16; 9 timed after 3 discarded
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
bash .gpu/deps/install-vllm.sh > /tmp/inst.log 2>&1; tail -1 /tmp/inst.log
. /opt/vsite/env.sh
echo "vllm $(( $(date +%s) - t0 )) s"
nproc; lscpu | grep -E "Model name|MHz" | head -3
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods fp16,kbit2,kbit2+cublas,kbit4 --variant cublas:KBIT_DENSE_GEMV=0 --batch 1 --repeats 9 --warmup 3 --threads --timeout 130 --cpus 0-7 --out-dir $OUT/e2e --tag _h100_s42 2>&1 | grep -vE "^INFO|^WARNING|^\(|^$" | tail -25
echo "total $(( $(date +%s) - t0 )) s"
