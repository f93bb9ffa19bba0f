#!/bin/bash
# s40 call 4: 8B shape (32 layers), batch 1, plain and thread-pinned instances, threads recorded
. /opt/torch/.venv/bin/activate; . /opt/vsite/env.sh
export PYTHONUNBUFFERED=1
t0=$(date +%s)
R=$OUT/e2e; mkdir -p $R
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu --format=csv -lms 500 > $R/smi_l32.csv 2>&1 &
SMI=$!
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_e2e.py --methods fp16,kbit2,kbit2+pin,fp16+pin,kbit2+b,kbit2+pinb \
  --variant pin:KBIT_E2E_PIN_THREADS=1 --variant b: --variant pinb:KBIT_E2E_PIN_THREADS=1 --threads --batch 1 --repeats 9 --warmup 3 --timeout 100 --cpus 0-7 \
  --out-dir $R --tag _h100_s40_l32 2>&1 | grep -E "^\||error|Error|Traceback" | head -20
kill $SMI
echo "total $(( $(date +%s) - t0 )) s"; ls $R
