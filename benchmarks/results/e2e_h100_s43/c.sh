#!/bin/bash
# s43 call C (carry .gpu/deps): install vLLM; batch-1 e2e: fp16, kbit2 (single-job prologue, default),
# kbit2 without it, kbit4, then fp16 and kbit2 again; 9 timed generates after 3 discarded each
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
bash .gpu/deps/install-vllm.sh > /tmp/inst.log 2>&1; tail -1 /tmp/inst.log
. /opt/vsite/env.sh
echo "vllm $(( $(date +%s) - t0 )) s"
lscpu | grep -E "Model name" | head -1
timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods fp16,kbit2,kbit2+kb4,kbit4,fp16+again,kbit2+again --variant kb4:KBIT_GEMV_XPRO_KB1=0 --variant again: --batch 1 --repeats 9 --warmup 3 --threads --timeout 110 --cpus 0-7 --out-dir $OUT/e2e --tag _h100_s43 2>&1 | grep -vE "^INFO|^WARNING|^\(|^$" | tail -25
echo "total $(( $(date +%s) - t0 )) s"
