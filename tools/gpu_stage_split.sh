#!/usr/bin/env bash
# Re-splits the vLLM staging folders that ../shared/gpu/stage writes (.gpu/v1, .gpu/v2, .gpu/deps)
# into four, .gpu/s1 .. .gpu/s4, that each fit a `run` call next to this checkout: a call carries
# at most 64 MiB, the checkout itself is ~9 MiB, and v1 alone is 58 MiB. The four pieces are one
# byte stream (the compressed wheel, then the dependency wheels' tar) cut at 42 MiB; s4 also holds
# install-vllm.sh. On the GPU machine, four calls back to back (it goes back ~30 s after a call):
#   carry .gpu/s1:  mkdir -p /opt/stage && cp .gpu/s1/* /opt/stage/   [&& other work, e.g.
#                   tools/gpu_check.sh, which also pays the first-pinned-allocation stall]
#   carry .gpu/s2:  cp .gpu/s2/* /opt/stage/                           [&& other work]
#   carry .gpu/s3:  cp .gpu/s3/* /opt/stage/                           [&& other work]
#   carry .gpu/s4:  bash tools/gpu_stage_join.sh && . /opt/vsite/env.sh [&& other work]
# Keep PYTHONPATH as env.sh sets it (it holds /opt/vsite): prepend, never overwrite.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .gpu/v1 .gpu/v2 .gpu/deps; do
  [ -d "$d" ] || { echo "missing $d: run ../shared/gpu/stage first" >&2; exit 1; }
done
rm -rf .gpu/s1 .gpu/s2 .gpu/s3 .gpu/s4 .gpu/part.*
mkdir -p .gpu/s1 .gpu/s2 .gpu/s3 .gpu/s4
wheel=$(($(stat -c %s .gpu/v1/vx.00) + $(stat -c %s .gpu/v2/vx.01)))
echo "$wheel" > .gpu/s4/wheel_bytes  # where the compressed wheel ends in the joined stream
cat .gpu/v1/vx.00 .gpu/v2/vx.01 .gpu/deps/wheels.tar | split -b 42M -d - .gpu/part.
for i in 0 1 2 3; do mv ".gpu/part.0$i" ".gpu/s$((i + 1))/"; done
if ls .gpu/part.* > /dev/null 2>&1; then echo "unexpected fifth piece" >&2; exit 1; fi
cp .gpu/deps/install-vllm.sh .gpu/s4/
du -sh .gpu/s1 .gpu/s2 .gpu/s3 .gpu/s4
