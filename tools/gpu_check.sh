#!/usr/bin/env bash
# On the GPU machine: build, an exception-path diagnostic, every test file in its own pytest
# process (a crash in one does not hide the others), then compute-sanitizer on the kernels.
set -uo pipefail
OUT=${OUT:-/tmp/kbit-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
T0=$SECONDS
if ! python3 -c "import vllm_kbit._C" 2>/dev/null; then
  TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 NVCC_THREADS=4 python3 -m pip install --no-build-isolation \
    --no-deps --no-index -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
echo "build done $((SECONDS - T0))s"
python3 -X faulthandler - <<'PY' 2>&1 | tail -12 | tee "$OUT/diag.log"
import torch, vllm_kbit._ops as o
print(o.load())
from vllm_kbit.format import default_codebook
cb = default_codebook(3).cuda(); w = torch.randn(8, 128, device="cuda", dtype=torch.float16)
for name, args in [("bits", (w, cb, 6)), ("cpu-codebook", (w, default_codebook(3), 3)),
                   ("int32", (w.to(torch.int32), cb, 3)), ("k%32", (w[:, :48].contiguous(), cb, 3))]:
    print("calling", name, flush=True)
    try: torch.ops.kbit.quantize(*args)
    except Exception as e: print(name, "->", type(e).__name__, str(e)[:90], flush=True)
PY
for f in tests/test_cuda_*.py tests/test_converter.py tests/test_bench_utils.py; do
  timeout 300 python3 -m pytest -q -rf --tb=short -p no:cacheprovider "$f" > "$OUT/$(basename "$f" .py).log" 2>&1
  echo "$f rc=$? $(grep -E '[0-9]+ (passed|failed)' "$OUT/$(basename "$f" .py).log" | tail -1) $((SECONDS - T0))s"
  grep -E "^FAILED|Fatal Python|line [0-9]+ in test_" "$OUT/$(basename "$f" .py).log" | head -8 | cut -c1-200
done
for tool in memcheck racecheck; do
  args=""; [ $tool = racecheck ] && args=quick
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 tools/sanitize_cases.py $args \
    > "$OUT/sanitize_$tool.log" 2>&1
  echo "sanitizer $tool rc=$? $((SECONDS - T0))s"; tail -3 "$OUT/sanitize_$tool.log" | cut -c1-200
done
