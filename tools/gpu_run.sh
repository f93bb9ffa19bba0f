#!/usr/bin/env bash
# Runs on the lent GPU machine from the repository root. Usage: tools/gpu_run.sh STEP...
# Steps: build | test | sanitize | bench-quick | bench | stage1 | stage2 | vllm
# Logs go to $OUT (or /tmp/kbit-out); a summary table is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/kbit-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ -f /opt/vsite/env.sh ] && . /opt/vsite/env.sh
status=()
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember pass/fail
  local name=$1; shift; local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  status+=("$name rc=$rc $((SECONDS - t0))s"); tail -n 25 "$OUT/$name.log"; return $rc
}
for step in "$@"; do
  case $step in
    stage1) mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/ && status+=("stage1 ok") ;;
    stage2) cp .gpu/v2/* /opt/stage/ && status+=("stage2 ok") ;;
    vllm) run vllm bash .gpu/deps/install-vllm.sh; . /opt/vsite/env.sh ;;
    build)
      python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
      run build env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 NVCC_THREADS=4 \
        python3 -m pip install --no-build-isolation --no-deps --no-index -e . ;;
    test) run test python3 -m pytest -q -x --timeout=900 tests -p no:cacheprovider ;;
    test-gpu) run test python3 -m pytest -q --timeout=900 tests/test_cuda_*.py -p no:cacheprovider ;;
    sanitize)
      run sanitize bash -c 'for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 python3 tools/sanitize_cases.py || exit 1; done' ;;
    bench-quick) run bench python3 benchmarks/bench_linear.py --quick --out-dir "$OUT" ;;
    bench) run bench python3 benchmarks/bench_linear.py --out-dir "$OUT" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "==== summary"; printf '%s\n' "${status[@]}"
