#!/usr/bin/env bash
# Compile one csrc/*.cu (or .cpp) file against the installed torch for sm_80, sm_89 and
# sm_90, without building the whole extension. Usage: tools/nvcc_check.sh csrc/gemv.cu [ARCH...]
# Prints ptxas register/spill info (-Xptxas -v) for the last arch. Extra nvcc flags:
# KBIT_NVCC_EXTRA (e.g. "-DKBIT_SM90A" with arch 90a, as setup.py passes for 9.0a).
set -euo pipefail
f=$1; shift || true
archs=${*:-80 89 90}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
inc=$(python3 -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))")
pyinc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
out=$(mktemp -d)
for a in $archs; do
  v=""; [ "$a" = "${archs##* }" ] && v="-Xptxas=-v"
  "$CUDA_HOME/bin/nvcc" -c "$f" -o "$out/x.o" -std=c++17 -O3 --expt-relaxed-constexpr \
    -Xptxas=--warn-on-spills $v -gencode arch=compute_$a,code=sm_$a -Icsrc $inc -I"$pyinc" \
    -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_EXTENSION_NAME=_C ${KBIT_NVCC_EXTRA:-} 2>&1 | grep -v "^$" || true
  test -f "$out/x.o" || { echo "FAILED: $f for sm_$a"; exit 1; }
  rm -f "$out/x.o"; echo "ok: $f sm_$a"
done
