#!/usr/bin/env bash
# Re-splits the vLLM staging folders that ../shared/gpu/stage writes (.gpu/v1, .gpu/v2, .gpu/deps)
# into pieces .gpu/s1 .. .gpu/sN that each fit a `run` call next to this checkout: a call carries
# at most 64 MiB including the checkout itself (~23 MB of tracked files in session 10), and v1
# alone is 58 MiB. The pieces are one byte stream (the compressed wheel, then the dependency
# wheels' tar) cut every PIECE_MIB MiB (default 34: five pieces); the last one also holds
# install-vllm.sh, the wheel's length and the piece count. On the GPU machine, N calls back to
# back (it goes back ~30 s after a call):
#   carry .gpu/s1:  mkdir -p /opt/stage && cp .gpu/s1/* /opt/stage/   [&& other work]
#   carry .gpu/si:  cp .gpu/si/* /opt/stage/                           (i = 2 .. N-1)
#   carry .gpu/sN:  bash tools/gpu_stage_join.sh && . /opt/vsite/env.sh [&& other work]
# Keep PYTHONPATH as env.sh sets it (it holds /opt/vsite): prepend, never overwrite.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .gpu/v1 .gpu/v2 .gpu/deps; do
  [ -d "$d" ] || { echo "missing $d: run ../shared/gpu/stage first" >&2; exit 1; }
done
rm -rf .gpu/s[0-9]* .gpu/part.*
wheel=$(($(stat -c %s .gpu/v1/vx.00) + $(stat -c %s .gpu/v2/vx.01)))
cat .gpu/v1/vx.00 .gpu/v2/vx.01 .gpu/deps/wheels.tar | split -b "${PIECE_MIB:-34}M" -d -a 2 - .gpu/part.
n=0
for f in .gpu/part.*; do
  n=$((n + 1)); mkdir -p ".gpu/s$n"; mv "$f" ".gpu/s$n/"
done
echo "$wheel" > ".gpu/s$n/wheel_bytes"  # where the compressed wheel ends in the joined stream
echo "$n" > ".gpu/s$n/pieces"
cp .gpu/deps/install-vllm.sh ".gpu/s$n/"
du -sh .gpu/s[0-9]*
