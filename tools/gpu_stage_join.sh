#!/usr/bin/env bash
# On the GPU machine, in the call that carries the last piece .gpu/sN (see
# tools/gpu_stage_split.sh): joins the pieces into the files ../shared/gpu's install-vllm.sh
# expects (/opt/stage/vx.00 + vx.01 and wheels.tar beside the script) and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
last=$(dirname "$(ls .gpu/s*/pieces 2>/dev/null | head -1)")
[ -f "$last/pieces" ] || { echo "carry the last staging piece (.gpu/sN with a 'pieces' file)" >&2; exit 1; }
n=$(cat "$last/pieces")
mkdir -p /opt/stage && cp "$last"/part.* /opt/stage/
for i in $(seq 0 $((n - 1))); do
  f=$(printf "/opt/stage/part.%02d" "$i")
  test -f "$f" || { echo "missing piece $f: carry .gpu/s$((i + 1)) first" >&2; exit 1; }
done
wheel=$(cat "$last/wheel_bytes")
mkdir -p /opt/stage/inst
cat /opt/stage/part.[0-9][0-9] > /opt/stage/all && rm /opt/stage/part.[0-9][0-9]
head -c "$wheel" /opt/stage/all > /opt/stage/vx.00 && : > /opt/stage/vx.01
tail -c +"$((wheel + 1))" /opt/stage/all > /opt/stage/inst/wheels.tar && rm /opt/stage/all
cp "$last/install-vllm.sh" /opt/stage/inst/
bash /opt/stage/inst/install-vllm.sh
