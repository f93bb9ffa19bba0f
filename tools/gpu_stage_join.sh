#!/usr/bin/env bash
# On the GPU machine, in the call that carries .gpu/s4 (see tools/gpu_stage_split.sh): joins the
# four pieces into the files ../shared/gpu's install-vllm.sh expects (/opt/stage/vx.00 + vx.01
# and wheels.tar beside the script) and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p /opt/stage && cp .gpu/s4/part.* /opt/stage/
for i in 0 1 2 3; do
  test -f "/opt/stage/part.0$i" || { echo "missing piece part.0$i: carry .gpu/s$((i + 1)) first" >&2; exit 1; }
done
wheel=$(cat .gpu/s4/wheel_bytes)
mkdir -p /opt/stage/inst
cat /opt/stage/part.0? > /opt/stage/all && rm /opt/stage/part.0?
head -c "$wheel" /opt/stage/all > /opt/stage/vx.00 && : > /opt/stage/vx.01
tail -c +"$((wheel + 1))" /opt/stage/all > /opt/stage/inst/wheels.tar && rm /opt/stage/all
cp .gpu/s4/install-vllm.sh /opt/stage/inst/
bash /opt/stage/inst/install-vllm.sh
