#!/bin/bash
# s44 third lease, call 1 (carry .gpu/v1): stage v1, build with the k=5 C2w -> C3 rule; the wgmma tests;
# kernel level, 8B layer, k = 4, 5 at M = 160..1024: default dispatch and C2 / C3 / C2w forced
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda_mma.py -k "ws_ or wgmma" > $OUT/tests_wgmma_h100_s44.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests_wgmma_h100_s44.log | cut -c1-300
timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_linear.py --models 8b --bits 4,5 --m 160,192,256,384,512,1024 --baselines fp16 --wgmma2-config 2,3,5 --out-dir $OUT --tag _s44_c2w 2>&1 | grep -vi warn | tail -3
echo "total $(( $(date +%s) - t0 )) s"
