#!/usr/bin/env bash
# A/B kernel comparisons on the GPU machine: a second build of the package, from git REF, that
# the project's benchmark scripts import through PYTHONPATH (it comes before the editable
# install of the checkout), so both builds are timed alternately by the same scripts in one call.
#
#   here:  bash tools/ab_base.sh export [REF [NAME]]  # REF (default main) -> .ab/NAME (default
#                                                     # base; git-ignored); one per variant
#   GPU (run with carry [".ab/base", ...]), next to the usual build of the checkout:
#          bash tools/ab_base.sh build [NAME] &      # builds .ab/NAME in place (sm_90a, 8 jobs)
#          <pip install -e . as usual>; wait
#          PYTHONPATH=$PWD/.ab/base${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/... # REF
#          python3 benchmarks/...                                           # checkout
#   Run scripts by path (`python3 benchmarks/x.py`: sys.path[0] is the script's folder); `python3
#   -c` or `-m` in the repo root puts the checkout first. Each run's JSON records the commit it
#   was given (KBIT_GIT_COMMIT); `which` prints the vllm_kbit._C that a PYTHONPATH imports.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    export)
        ref=${2:-main} dir=.ab/${3:-base}
        rm -rf "$dir" && mkdir -p "$dir"
        git archive "$ref" setup.py pyproject.toml csrc vllm_kbit | tar -x -C "$dir"
        git rev-parse "$ref" > "$dir/REF"
        echo "exported $ref ($(cat "$dir/REF")) to $dir: $(du -sh "$dir" | cut -f1)"
        ;;
    build)
        cd ".ab/${2:-base}"
        TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-8} \
            NVCC_THREADS=${NVCC_THREADS:-2} python3 setup.py build_ext --inplace > build.log 2>&1 \
            || { tail -30 build.log; exit 1; }
        ls vllm_kbit/_C*.so
        ;;
    which)  # from /: `python3 -c` in the repo root would import the checkout's vllm_kbit (cwd first)
        (cd / && python3 -c "import torch, vllm_kbit, vllm_kbit._C; print(vllm_kbit._C.__file__)")
        ;;
    *)
        echo "usage: tools/ab_base.sh export [REF [NAME]] | build [NAME] | which" >&2
        exit 2
        ;;
esac
