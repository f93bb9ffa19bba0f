#!/bin/bash
# s44 call D (same machine): the batch sweep, part 2: fp16 (again), kbit3, kbit5, kbit2 (again)
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
. /opt/vsite/env.sh
t0=$(date +%s)
timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods fp16,kbit3,kbit5,kbit2 --batch 1,16,64,256 --repeats 7 --warmup 3 --threads --timeout 160 --cpus 0-7 --out-dir $OUT/e2e --tag _h100_s44b 2>&1 | grep -vE "^INFO|^WARNING|^\(|^$" | tail -25
echo "total $(( $(date +%s) - t0 )) s"
