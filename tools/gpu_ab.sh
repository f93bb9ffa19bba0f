#!/usr/bin/env bash
# On the GPU machine: A/B timing of the checkout against builds of other git refs (.ab/NAME, made
# here by `tools/ab_base.sh export REF NAME` and carried), by the project's benchmark scripts, the
# variants alternating within each round so that drift hits all of them alike.
#
#   bash tools/gpu_ab.sh build NAME...          # .ab/NAME... and the checkout, in parallel
#   ROUNDS=2 bash tools/gpu_ab.sh decode NAME...   # decode paths: MoE layer (Qwen3-30B-A3B, k=2,4,5,
#                                               # M=1..16), dense GEMV (8B, k=2,4, M=1,4,8)
#   ROUNDS=2 bash tools/gpu_ab.sh mid NAME...      # dense mid-size M (mma / wgmma kernels, split-K):
#                                               # 8B + 70B, k=2,4, M = $MID_M, results in $AB-mid
#
# Results in $AB (default /tmp/kbit-ab, kept while the machine stays warm, so rounds of several
# calls add up): bench_moe_ab_<variant><round>.{json,md} and bench_linear_<gpu>_ab_<variant><round>
# .{json,md}, variant "co" = the checkout. The decode phase prints each run's table, then
# tools/ab_table.py's medians over all rounds so far and ratios to the first NAME, and leaves
# $OUT/ab_table.md and $OUT/ab_results.tgz (every file of $AB). KBIT_GIT_COMMIT names the
# checkout's commit.
set -uo pipefail
OUT=${OUT:-/tmp/kbit-out} AB=${AB:-/tmp/kbit-ab}; mkdir -p "$OUT" "$AB"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
T0=$SECONDS
phase=${1:-}; shift || true

# pp / commit: the PYTHONPATH and recorded commit of variant $1 (co = the checkout). Prepended: a
# sourced vLLM env (/opt/vsite/env.sh) keeps its own PYTHONPATH entries.
variant_env() {
    pp=${PYTHONPATH:-} commit=${KBIT_GIT_COMMIT:-checkout}
    if [ "$1" != co ]; then pp=$PWD/.ab/$1${pp:+:$pp} commit=$(cat ".ab/$1/REF"); fi
}
# The round numbers of this call: ROUNDS more after those earlier calls left in $AB (the
# checkout's files matching the glob $1, one per round).
next_rounds() {
    local done_rounds; done_rounds=$(ls $1 2>/dev/null | wc -l)
    seq $((done_rounds + 1)) $((done_rounds + ${ROUNDS:-2}))
}
# All rounds so far (earlier calls' files included): medians and ratios to the first NAME in
# $OUT/$1_table.md, every file of $AB in $OUT/$1_results.tgz.
finish() {
    local name=$1; shift
    python3 tools/ab_table.py "$AB" "$@" co --out "$OUT/${name}_table.md"
    tar czf "$OUT/${name}_results.tgz" -C "$AB" .
}

case "$phase" in
    build)
        # 16 cores: 8 nvcc jobs per build when there are two, fewer with more variants
        jobs=$(( 16 / ($# + 1) )); [ $jobs -lt 2 ] && jobs=2
        for v in "$@"; do MAX_JOBS=$jobs bash tools/ab_base.sh build "$v" > "$AB/build_$v.log" 2>&1 & done
        if ! python3 -c "import vllm_kbit._C" 2>/dev/null; then
            TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=$jobs NVCC_THREADS=2 python3 -m pip install \
                --no-build-isolation --no-deps --no-index -e . > "$AB/build_co.log" 2>&1 \
                || { tail -30 "$AB/build_co.log"; exit 1; }
        fi
        wait
        for v in "$@"; do
            echo "$v: $(PYTHONPATH=$PWD/.ab/$v bash tools/ab_base.sh which 2>&1 | tail -1) ($(cat .ab/$v/REF))"
        done
        echo "co: $(bash tools/ab_base.sh which 2>&1 | tail -1)"
        echo "build done $((SECONDS - T0))s"
        ;;
    decode)
        for r in $(next_rounds "$AB/bench_moe_ab_co*.json"); do
            for v in "$@" co; do
                variant_env "$v"
                PYTHONPATH=$pp KBIT_GIT_COMMIT=$commit timeout 200 python3 benchmarks/bench_moe.py \
                    --shapes qwen3 --bits 2,4,5 --m 1,2,4,8,16 --baselines none \
                    --kbit-paths auto --out "$AB" --tag "ab_$v$r" --time-budget-s 150 \
                    > "$AB/moe_$v$r.log" 2>&1
                echo "== moe $v round $r rc=$? $((SECONDS - T0))s"
                grep -E "^\|" "$AB/bench_moe_ab_$v$r.md" 2>/dev/null | head -20
                PYTHONPATH=$pp KBIT_GIT_COMMIT=$commit timeout 200 python3 benchmarks/bench_linear.py \
                    --models 8b --bits 2,4 --m 1,4,8 --baselines fp16 --out-dir "$AB" \
                    --tag "ab_$v$r" --time-budget-s 150 > "$AB/linear_$v$r.log" 2>&1
                echo "== linear $v round $r rc=$? $((SECONDS - T0))s"
                grep -E "^\|" "$AB"/bench_linear_*_ab_"$v$r".md 2>/dev/null | head -30
            done
        done
        finish ab "$@"
        ;;
    mid)
        AB=$AB-mid; mkdir -p "$AB"
        for r in $(next_rounds "$AB/bench_linear_*_ab_co*.json"); do
            for v in "$@" co; do
                variant_env "$v"
                PYTHONPATH=$pp KBIT_GIT_COMMIT=$commit timeout 250 python3 benchmarks/bench_linear.py \
                    --models 8b,70b --bits 2,4 --m "${MID_M:-16,32,48,64,96,128,256}" --baselines fp16 \
                    --out-dir "$AB" --tag "ab_$v$r" --time-budget-s 200 > "$AB/linear_$v$r.log" 2>&1
                echo "== linear $v round $r rc=$? $((SECONDS - T0))s"
            done
        done
        finish ab_mid "$@"
        ;;
    *)
        echo "usage: tools/gpu_ab.sh build NAME... | decode NAME... | mid NAME..." >&2
        exit 2
        ;;
esac
