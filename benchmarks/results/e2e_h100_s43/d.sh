#!/bin/bash
# s43 call D (machine warm, vLLM installed): vLLM checks of the single-job prologue build, then
# kbit2 / fp16 / kbit2 without it (KBIT_GEMV_XPRO_KB1=0) again
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
. /opt/vsite/env.sh
t0=$(date +%s)
E2E_DEADLINE=200 bash tools/gpu_e2e.sh prequant_greedy compiled_graphs 2>&1 | grep -E "^E2E|==" | cut -c1-600
echo "checks $(( $(date +%s) - t0 )) s"
timeout $(( 540 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods kbit2,fp16,kbit2+kb4 --variant kb4:KBIT_GEMV_XPRO_KB1=0 --batch 1 --repeats 9 --warmup 3 --threads --timeout 100 --cpus 0-7 --out-dir $OUT/e2e --tag _h100_s43b 2>&1 | grep -E "^\||tok/s|Error" | tail -8
echo "total $(( $(date +%s) - t0 )) s"
