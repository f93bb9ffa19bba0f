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
        done_rounds=$(ls "$AB"/bench_moe_ab_co*.json 2>/dev/null | wc -l)  # earlier calls' rounds
        for r in $(seq $((done_rounds + 1)) $((done_rounds + ${ROUNDS:-2}))); do
            for v in "$@" co; do
                # prepended: a sourced vLLM env (/opt/vsite/env.sh) keeps its own PYTHONPATH entries
                pp=${PYTHONPATH:-}; [ "$v" != co ] && pp=$PWD/.ab/$v${pp:+:$pp}
                commit=${KBIT_GIT_COMMIT:-checkout}; [ "$v" != co ] && commit=$(cat .ab/$v/REF)
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
        # all rounds so far (earlier calls' files included): medians and ratios to the first NAME
        python3 tools/ab_table.py "$AB" "$@" co --out "$OUT/ab_table.md"
        tar czf "$OUT/ab_results.tgz" -C "$AB" .
        ;;
    mid)
        AB=$AB-mid; mkdir -p "$AB"
        done_rounds=$(ls "$AB"/bench_linear_*_ab_co*.json 2>/dev/null | wc -l)
        for r in $(seq $((done_rounds + 1)) $((done_rounds + ${ROUNDS:-2}))); do
            for v in "$@" co; do
                pp=${PYTHONPATH:-}; [ "$v" != co ] && pp=$PWD/.ab/$v${pp:+:$pp}
                commit=${KBIT_GIT_COMMIT:-checkout}; [ "$v" != co ] && commit=$(cat .ab/$v/REF)
                PYTHONPATH=$pp KBIT_GIT_COMMIT=$commit timeout 250 python3 benchmarks/bench_linear.py \
                    --models 8b,70b --bits 2,4 --m "${MID_M:-16,32,48,64,96,128,256}" --baselines fp16 \
                    --out-dir "$AB" --tag "ab_$v$r" --time-budget-s 200 > "$AB/linear_$v$r.log" 2>&1
                echo "== linear $v round $r rc=$? $((SECONDS - T0))s"
            done
        done
        python3 tools/ab_table.py "$AB" "$@" co --out "$OUT/ab_mid_table.md"
        tar czf "$OUT/ab_mid_results.tgz" -C "$AB" .
        ;;
    *)
        echo "usage: tools/gpu_ab.sh build NAME... | decode NAME... | mid NAME..." >&2
        exit 2
        ;;
esac
