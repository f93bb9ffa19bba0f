#!/usr/bin/env bash
# On the GPU machine: build if needed, exception diagnostic, then the full kernel benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/kbit-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
T0=$SECONDS
python3 -c "import vllm_kbit._C" 2>/dev/null || TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 NVCC_THREADS=4 \
  python3 -m pip install -v --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build $((SECONDS - T0))s"
timeout 150 python3 -X faulthandler tools/exc_diag.py > "$OUT/exc_diag.log" 2>&1; echo "diag rc=$?"
grep -E "python|version|Build|calling|caught|Fatal|\\[" "$OUT/exc_diag.log" | grep -v "^\[[0-9]/" | head -12 | cut -c1-250
python3 benchmarks/bench_linear.py --out-dir "$OUT" --vllm-ops-lib .vllmlib/vllm_C.so.xz \
  --time-budget-s ${BUDGET:-330} > "$OUT/bench.log" 2>&1; echo "bench rc=$? $((SECONDS - T0))s"
tail -45 "$OUT/bench.log"
