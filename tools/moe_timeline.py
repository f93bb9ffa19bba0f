# SPDX-License-Identifier: Apache-2.0
"""Diagnostic (GPU): the kernel timeline of kbit::moe calls as vLLM replays them. R calls with
different routings (and so different experts: cold weights) are captured in one CUDA graph; the
script prints the per-call time of graph replays (benchmarks/timing.py's time_calls), then
profiles three replays (torch.profiler, CUPTI) and prints each kernel's median duration and the
median gap between consecutive kernels (negative: the next kernel started before this one
ended, i.e. PDL overlap).
Run from the repo root: ``python3 tools/moe_timeline.py [SHAPE:M:BITS ...]`` (default: the
decode cases qwen3:1:4 qwen3:1:2 qwen3:1:5 qwen3:2:4 e512:1:4); KBIT_* settings come from the
environment."""

import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, "benchmarks")
from bench_moe import kbit_weights, routing  # noqa: E402
from timing import capture_graph, time_calls  # noqa: E402

sys.path.insert(0, "tools")
from profile_moe import SHAPES  # noqa: E402

from vllm_kbit import _ops  # noqa: E402

CALLS = 32  # calls per graph (different routings)


def _kernel(name: str) -> str:
    """Template arguments of a kbit kernel ("4, __nv_bfloat16, 1>(kbit..."), else the name."""
    return name.split("<")[1][:24] if "<" in name else name[:40]


def run(name: str, m: int, bits: int) -> None:
    dev = torch.device("cuda")
    e, topk, h, i = SHAPES[name]
    q13, a13, q2, a2, cb = kbit_weights(e, h, i, bits, dev, seed=4)
    routes = [routing(m, e, topk, 100 + r, dev) for r in range(CALLS)]
    xs = [torch.randn(m, h, device=dev).to(torch.bfloat16) for _ in range(CALLS)]

    def call(x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor):
        return lambda: torch.ops.kbit.moe(x, q13, a13, q2, a2, cb, tw, ids, None, bits, i, "silu", False)

    fns = [call(x, tw, ids) for (tw, ids), x in zip(routes, xs)]
    per_call = time_calls(fns).us  # the benchmarks' method: graph replays, events, median
    graph = capture_graph(fns)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = sorted((ev for ev in json.load(f)["traceEvents"] if ev.get("cat") == "kernel"),
                        key=lambda ev: ev["ts"])  # fmt: skip
    os.unlink(path)
    durations: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for ev in events:
        durations.setdefault(_kernel(ev["name"]), []).append(ev["dur"])
    for a, b in zip(events, events[1:]):
        key = f"{_kernel(a['name'])} -> {_kernel(b['name'])}"
        gaps.setdefault(key, []).append(b["ts"] - (a["ts"] + a["dur"]))
    print(f"== {name} M={m} k={bits}: {per_call:.2f} us/call (graph, events)")
    for k, v in durations.items():
        print(f"   kernel {k:40s} n={len(v):4d} median {statistics.median(v):7.2f} us")
    for k, v in gaps.items():
        print(f"   gap {k:60s} n={len(v):4d} median {statistics.median(v):7.2f} us")


def main() -> None:
    _ops.load()
    cases = sys.argv[1:] or ["qwen3:1:4", "qwen3:1:2", "qwen3:1:5", "qwen3:2:4", "e512:1:4"]
    for case in cases:
        shape, m, bits = case.split(":")
        run(shape, int(m), int(bits))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
