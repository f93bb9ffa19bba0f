#!/bin/bash
# s42 call 4 (machine warm, vLLM installed): vLLM checks of the current code (after session 41's
# review mend), then a second kbit2 / fp16 pair of engine instances
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
. /opt/vsite/env.sh
t0=$(date +%s)
E2E_DEADLINE=250 bash tools/gpu_e2e.sh prequant_greedy compiled_graphs 2>&1 | grep -E "^E2E|==" | cut -c1-600
echo "checks $(( $(date +%s) - t0 )) s"
timeout $(( 520 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods kbit2,fp16 --batch 1 --repeats 9 --warmup 3 --threads --timeout 120 --cpus 0-7 --out-dir $OUT/e2e --tag _h100_s42b 2>&1 | grep -E "^\||tok/s|Error" | tail -8
echo "total $(( $(date +%s) - t0 )) s"
