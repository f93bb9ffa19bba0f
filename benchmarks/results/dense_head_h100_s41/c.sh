#!/bin/bash
# s41 call C (carry .gpu/deps): install vLLM, rebuild in place, dense tests, vLLM e2e checks
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
bash .gpu/deps/install-vllm.sh > /tmp/inst.log 2>&1; tail -1 /tmp/inst.log
. /opt/vsite/env.sh
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 setup.py build_ext --inplace > /tmp/b3.log 2>&1 || { tail -20 /tmp/b3.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m pytest -q -x tests/test_cuda_dense_linear.py -k "lm_head or m1 or m3 or graph or switch" > $OUT/tests_dense_final_h100_s41.log 2>&1; echo "tests rc=$?"; tail -1 $OUT/tests_dense_final_h100_s41.log
E2E_DEADLINE=$(( 585 - $(date +%s) + t0 )) bash tools/gpu_e2e.sh prequant_greedy compiled_graphs dummy_online 2>&1 | grep -E "^E2E|==" | cut -c1-600
echo "total $(( $(date +%s) - t0 )) s"
