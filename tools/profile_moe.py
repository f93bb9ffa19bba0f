# SPDX-License-Identifier: Apache-2.0
"""Diagnostic (GPU): per-kernel CUDA times of one kbit::moe call (torch.profiler) on real MoE
shapes, bf16: the default path and a few KBIT_MOE_* settings. Run from the repo root:
``python3 tools/profile_moe.py [--bits 4,5] [--case qwen3:4096 ...] [--env KEY=V ...]``.
``--ncu`` runs each case's call once after warm-up, without the profiler, for
``ncu -k regex:wgmma_gemm`` (hardware counters of the kernels of that one call)."""

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_moe import kbit_weights, routing  # noqa: E402
from timing import with_env  # noqa: E402

from vllm_kbit import _ops  # noqa: E402

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "e512": (512, 8, 2048, 512)}
DEFAULT_CASES = [("qwen3", 4096, {}), ("qwen3", 4096, {"KBIT_MOE_DETERMINISTIC": "1"}),
                 ("qwen3", 4096, {"KBIT_MOE_WG_TN": "128"}), ("mixtral", 1024, {}),
                 ("e512", 4096, {})]
REPS = 5


def run_case(name: str, m: int, bits: int, env: dict, ncu: bool) -> None:
    dev = torch.device("cuda")
    e, topk, h, i = SHAPES[name]
    q13, a13, q2, a2, cb = kbit_weights(e, h, i, bits, dev, seed=4)
    tw, ids = routing(m, e, topk, 1, dev)
    x = torch.randn(m, h, device=dev).to(torch.bfloat16)
    call = with_env(env, lambda: torch.ops.kbit.moe(x, q13, a13, q2, a2, cb, tw, ids, None, bits, i,
                                                    "silu", False))
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    if ncu:
        torch.cuda.nvtx.range_push(f"{name} M={m} k={bits} {env}")
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            call()
        torch.cuda.synchronize()
    print(f"== {name} M={m} k={bits} {env}")
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0) / REPS
        if us > 0:
            print(f"  {us:9.1f} us  {ev.key[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bits", default="4", help="comma-separated k values")
    ap.add_argument("--case", action="append", default=[],
                    help="SHAPE:M (shape in %s); default: the built-in case list" % list(SHAPES))
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE set for every case")
    ap.add_argument("--ncu", action="store_true", help="one call per case, no profiler")
    args = ap.parse_args()
    _ops.load()
    extra = dict(kv.split("=", 1) for kv in args.env)
    cases = [(c.split(":")[0], int(c.split(":")[1]), {}) for c in args.case] or DEFAULT_CASES
    for bits in (int(b) for b in args.bits.split(",")):
        for name, m, env in cases:
            run_case(name, m, bits, {**env, **extra}, args.ncu)
            torch.cuda.empty_cache()  # the case's experts are gone with its frame


if __name__ == "__main__":
    main()
