#!/bin/bash
# s44 fifth lease (carry nothing): build with the k=5 wgmma limit (big layers up to M = 512); the
# dispatch and wgmma tests; kernel level, k=5 at M = 512 / 768 interleaved: linear vs its paths
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 280 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda_linear_dispatch.py tests/test_cuda_mma.py -k "linear or ws_" > $OUT/tests_dispatch_h100_s44.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests_dispatch_h100_s44.log | cut -c1-300
timeout $(( 580 - $(date +%s) + t0 )) python3 benchmarks/bench_linear.py --models 8b --bits 4,5 --m 512,768,1024 --baselines fp16 --wgmma2-config 3,5 --interleave --out-dir $OUT --tag _s44_k5lim 2>&1 | grep -vi warn | tail -2
echo "total $(( $(date +%s) - t0 )) s"
