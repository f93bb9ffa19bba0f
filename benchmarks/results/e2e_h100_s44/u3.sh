#!/bin/bash
# s44 second lease, call 3 (carry .gpu/deps): install vLLM; fp16 and kbit4 end to end at the batch sizes
# the first lease did not run (2, 4, 8, 32, 96, 128, 192)
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
bash .gpu/deps/install-vllm.sh > /tmp/inst.log 2>&1; tail -1 /tmp/inst.log
. /opt/vsite/env.sh
echo "vllm $(( $(date +%s) - t0 )) s"
timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods fp16,kbit4 --batch 2,4,8,32,96,128,192 --repeats 5 --warmup 2 --threads --timeout 260 --cpus 0-7 --out-dir $OUT/e2e --tag _h100_s44d 2>&1 | grep -vE "^INFO|^WARNING|^\(|^$|event" | tail -14
echo "total $(( $(date +%s) - t0 )) s"
