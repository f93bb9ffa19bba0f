#!/bin/bash
# s44 call B (carry .gpu/v2): stage v2; MoE decode GEMV tests (stage_act uses the merged unpack2)
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
cp .gpu/v2/* /opt/stage/
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda_moe.py -k "gemv or activations" > $OUT/tests_moe_gemv_h100_s44.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests_moe_gemv_h100_s44.log | cut -c1-300
echo "total $(( $(date +%s) - t0 )) s"
