#!/usr/bin/env bash
# Re-splits the vLLM staging folders that ../shared/gpu/stage writes (.gpu/v1, .gpu/v2, .gpu/deps)
# into three that each fit a `run` call next to this checkout: a call carries at most 64 MiB,
# the checkout itself is ~7 MiB, and v1 alone is 58 MiB. Writes .gpu/s1, .gpu/s2 (55 MiB of the
# compressed wheel each) and .gpu/s3 (the rest + the dependency wheels + install-vllm.sh).
# Then, on the GPU machine, three calls back to back (the machine goes back ~30 s after a call):
#   carry .gpu/s1:  mkdir -p /opt/stage && cp .gpu/s1/* /opt/stage/  [&& build the extension]
#   carry .gpu/s2:  cp .gpu/s2/* /opt/stage/
#   carry .gpu/s3:  cp .gpu/s3/part.02 /opt/stage/ && (cd /opt/stage && cat part.0? > vx.00 &&
#                   rm part.0? && : > vx.01) && bash .gpu/s3/install-vllm.sh && . /opt/vsite/env.sh
# (install-vllm.sh reads vx.00 + vx.01; vx.00 holds the whole archive here, vx.01 is empty).
# Keep PYTHONPATH as env.sh sets it (it holds /opt/vsite): prepend, never overwrite.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .gpu/v1 .gpu/v2 .gpu/deps; do
  [ -d "$d" ] || { echo "missing $d: run ../shared/gpu/stage first" >&2; exit 1; }
done
rm -rf .gpu/s1 .gpu/s2 .gpu/s3 .gpu/part.*
mkdir -p .gpu/s1 .gpu/s2 .gpu/s3
cat .gpu/v1/vx.00 .gpu/v2/vx.01 | split -b 55M -d - .gpu/part.
mv .gpu/part.00 .gpu/s1/ && mv .gpu/part.01 .gpu/s2/ && mv .gpu/part.02 .gpu/s3/
if ls .gpu/part.* > /dev/null 2>&1; then echo "unexpected fourth piece" >&2; exit 1; fi
cp .gpu/deps/* .gpu/s3/
du -sh .gpu/s1 .gpu/s2 .gpu/s3
