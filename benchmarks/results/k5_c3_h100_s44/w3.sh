#!/bin/bash
# s44 third lease, call 3 (carry .gpu/deps): install vLLM; fp16, kbit5 (C3 where C2w's ring is shallow)
# and kbit5 with C2w as before (KBIT_WG_C2W_MIN_STAGES=2) at batch 128 / 192 / 256
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
bash .gpu/deps/install-vllm.sh > /tmp/inst.log 2>&1; tail -1 /tmp/inst.log
. /opt/vsite/env.sh
echo "vllm $(( $(date +%s) - t0 )) s"
timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods fp16,kbit5,kbit5+c2w --variant c2w:KBIT_WG_C2W_MIN_STAGES=2 --batch 128,192,256 --repeats 5 --warmup 2 --threads --timeout 200 --cpus 0-7 --out-dir $OUT/e2e --tag _h100_s44e 2>&1 | grep -vE "^INFO|^WARNING|^\(|^$|event" | tail -12
echo "total $(( $(date +%s) - t0 )) s"
