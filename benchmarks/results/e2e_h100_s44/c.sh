#!/bin/bash
# s44 call C (carry .gpu/deps): install vLLM; the batch sweep, part 1: fp16, kbit4, kbit2 at batch
# 1, 16, 64, 256 (each method one engine instance; 7 timed generates after 3 discarded per batch)
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
bash .gpu/deps/install-vllm.sh > /tmp/inst.log 2>&1; tail -1 /tmp/inst.log
. /opt/vsite/env.sh
echo "vllm $(( $(date +%s) - t0 )) s"
timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods fp16,kbit4,kbit2 --batch 1,16,64,256 --repeats 7 --warmup 3 --threads --timeout 180 --cpus 0-7 --out-dir $OUT/e2e --tag _h100_s44 2>&1 | grep -vE "^INFO|^WARNING|^\(|^$" | tail -25
echo "total $(( $(date +%s) - t0 )) s"
