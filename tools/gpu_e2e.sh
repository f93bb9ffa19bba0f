#!/usr/bin/env bash
# End-to-end vLLM checks of the kbit plugin on the GPU machine (after vLLM is installed,
# `. /opt/vsite/env.sh` and `pip install -e .` done by the caller). From the repo root:
#   bash tools/gpu_e2e.sh [CHECK...]      (default: the five dense checks, in order)
#   bash tools/gpu_e2e.sh lm_head           (quantize_lm_head: after dummy_online; ~3 engine starts)
#   bash tools/gpu_e2e.sh moe_qwen3         (MoE checks, one per call: each takes minutes;
#   bash tools/gpu_e2e.sh moe_mixtral        moe_compiled needs the CUDA kbit::moe kernel)
#   bash tools/gpu_e2e.sh moe_compiled
#   bash tools/gpu_e2e.sh tp2_dense tp2_moe  (2 GPUs: TP=2 vs TP=1 of the same checkpoint)
# Logs: $OUT/e2e.log (combined), $OUT/e2e/<run>.log (one per LLM / server).
# Per-check wall-clock limits (s) can be overridden: E2E_T_<check>=SECONDS; the whole run
# stops starting checks at E2E_DEADLINE (default 560 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kbit-out}; mkdir -p "$OUT/e2e"
WORK=${E2E_WORK:-/tmp/kbit_e2e}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
LOG=$OUT/e2e.log; : > "$LOG"
checks=("$@"); [ ${#checks[@]} -eq 0 ] && checks=(prequant_greedy online_k5_vs_fp16 compiled_graphs dummy_online serve_openai)
declare -A T=([prequant_greedy]=330 [online_k5_vs_fp16]=330 [compiled_graphs]=270 [dummy_online]=230 [serve_openai]=230 [lm_head]=400
              [moe_qwen3]=540 [moe_mixtral]=480 [moe_compiled]=480
              [tp2_dense]=540 [tp2_moe]=540)
DEADLINE=${E2E_DEADLINE:-560}  # s for the whole driver (the caller's command has ~600 s)
t_all=$SECONDS
echo "== build checkpoints ($WORK)" | tee -a "$LOG"
# the python writes to the log file, never into a pipe held open by an engine process
timeout -k 10 240 python3 tools/gpu_e2e.py build --work "$WORK" >> "$LOG" 2>&1
rc=$?; tail -n 2 "$LOG"
if [ $rc -ne 0 ]; then
  echo "E2E build FAIL rc=$rc (see $LOG)" | tee -a "$LOG"
else
  for c in "${checks[@]}"; do
    var=E2E_T_$c; lim=${!var:-${T[$c]:-300}}
    left=$((DEADLINE - (SECONDS - t_all)))
    if [ $left -lt 45 ]; then
      echo "E2E $c FAIL skipped: overall deadline ${DEADLINE}s reached" | tee -a "$LOG"; continue
    fi
    [ $lim -gt $left ] && lim=$left
    echo "== $c (limit ${lim}s, elapsed $((SECONDS - t_all))s)" | tee -a "$LOG"
    start=$(wc -l < "$LOG")
    timeout -k 15 "$lim" python3 tools/gpu_e2e.py check "$c" --work "$WORK" --logs "$OUT/e2e" >> "$LOG" 2>&1
    rc=$?
    tail -n +"$((start + 1))" "$LOG" | grep -E '^(E2E|  \[)' || true
    if ! tail -n +"$((start + 1))" "$LOG" | grep -q "^E2E $c "; then
      echo "E2E $c FAIL no result line (rc=$rc; 124 = driver timeout after ${lim}s)" | tee -a "$LOG"
    fi
  done
fi
echo "==== E2E summary ($((SECONDS - t_all)) s; logs $LOG, $OUT/e2e/)" | tee -a "$LOG"
grep '^E2E ' "$LOG" | cut -c1-400
npass=$(grep -c '^E2E .* PASS ' "$LOG"); nfail=$(grep -c '^E2E .* FAIL ' "$LOG")
echo "E2E total: $npass PASS, $nfail FAIL" | tee -a "$LOG"
[ "$nfail" -eq 0 ]
