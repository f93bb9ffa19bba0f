#!/bin/bash
# s40 call 3 (carry .gpu/deps): install vLLM, warm up; the batch-1 host floor (1 layer), with the
# busiest host threads recorded, each method in a plain and a thread-pinned engine instance.
. /opt/torch/.venv/bin/activate
t0=$(date +%s)
bash .gpu/deps/install-vllm.sh > /tmp/inst.log 2>&1; tail -1 /tmp/inst.log
. /opt/vsite/env.sh
export PYTHONUNBUFFERED=1
[ -f vllm_kbit/_C.abi3.so ] || ls vllm_kbit/*.so || { echo "NO BUILD"; exit 1; }
VLLM_ENABLE_V1_MULTIPROCESSING=0 bg-run /tmp/warmup.log 'TOKENS|Traceback' 150 -- vllm-warmup > /dev/null 2>&1
echo "warmup $(( $(date +%s) - t0 )) s: $(grep -c TOKENS /tmp/warmup.log) tokens line"
R=$OUT/e2e; mkdir -p $R
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu --format=csv -lms 500 > $R/smi_l1.csv 2>&1 &
SMI=$!
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --layers 1 --methods fp16,kbit2,fp16+pin,kbit2+pin \
  --variant pin:KBIT_E2E_PIN_THREADS=1 --threads --batch 1 --repeats 9 --warmup 3 --timeout 90 --cpus 0-7 \
  --out-dir $R --tag _h100_s40_l1 2>&1 | grep -E "^\||error|Error|Traceback|threads" | cut -c1-900 | head -40
kill $SMI
echo "total $(( $(date +%s) - t0 )) s"; ls $R
