#!/bin/bash
# s40 lease 2, call 3 (carry .gpu/deps): install vLLM, warm up; where the host time of a batch-1
# step goes: one generate under cProfile (engine in-process), 8B shape fp16 and kbit2, 1-layer kbit2
. /opt/torch/.venv/bin/activate
t0=$(date +%s)
bash .gpu/deps/install-vllm.sh > /tmp/inst.log 2>&1; tail -1 /tmp/inst.log
. /opt/vsite/env.sh
export PYTHONUNBUFFERED=1
ls vllm_kbit/*.so || { echo "NO BUILD"; exit 1; }
VLLM_ENABLE_V1_MULTIPROCESSING=0 bg-run /tmp/warmup.log 'TOKENS|Traceback' 150 -- vllm-warmup > /dev/null 2>&1
echo "warmup $(( $(date +%s) - t0 )) s: $(grep -c TOKENS /tmp/warmup.log) tokens line"
R=$OUT/e2e; mkdir -p $R
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods kbit2,fp16 --host-profile --threads \
  --batch 1 --repeats 5 --warmup 3 --timeout 110 --cpus 0-7 --out-dir $R --tag _h100_s40_host 2>&1 | grep -E "^\||error|Error|Traceback|host_profile" | cut -c1-300
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --layers 1 --methods kbit2 --host-profile --threads \
  --batch 1 --repeats 5 --warmup 3 --timeout 100 --cpus 0-7 --out-dir $R --tag _h100_s40_host_l1 2>&1 | grep -E "^\||error|Error|Traceback|host_profile" | cut -c1-300
echo "total $(( $(date +%s) - t0 )) s"; ls $R
