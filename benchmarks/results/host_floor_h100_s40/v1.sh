#!/bin/bash
# s40 call 1 (carry .gpu/v1): stage v1, build the extension, print the host's topology
. /opt/torch/.venv/bin/activate
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KBIT_SKIP_CXX_ERROR_TESTS=1
t0=$(date +%s)
mkdir -p /opt/stage && cp .gpu/v1/* /opt/stage/
(lscpu; echo; for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$(basename $c) siblings $(cat $c/topology/thread_siblings_list 2>/dev/null) core $(cat $c/topology/core_id 2>/dev/null) pkg $(cat $c/topology/physical_package_id 2>/dev/null) gov $(cat $c/cpufreq/scaling_governor 2>/dev/null) mhz $(cat $c/cpufreq/scaling_cur_freq 2>/dev/null)"; done; echo; nvidia-smi topo -m; nvidia-smi -q -d CLOCK,PERFORMANCE | head -60; uname -a; cat /proc/cmdline) > $OUT/host_s40.txt 2>&1
grep -E "Model name|^CPU\(s\)|Thread|NUMA|MHz" $OUT/host_s40.txt | head
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 NVCC_THREADS=2 python3 -m pip install --no-build-isolation --no-deps --no-index -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"; ls vllm_kbit/*.so
echo "total $(( $(date +%s) - t0 )) s"
