# SPDX-License-Identifier: Apache-2.0
"""Diagnostic (GPU): per-kernel CUDA times of one kbit::moe call (torch.profiler) on real MoE
shapes, k = 4, bf16: the default path and a few KBIT_MOE_* settings. Run from the repo root:
``python3 tools/profile_moe.py``."""

import os
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_moe import kbit_weights, routing  # noqa: E402

from vllm_kbit import _ops  # noqa: E402

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "e512": (512, 8, 2048, 512)}
CASES = [("qwen3", 4096, {}), ("qwen3", 4096, {"KBIT_MOE_DETERMINISTIC": "1"}),
         ("qwen3", 4096, {"KBIT_MOE_WG_TN": "128"}), ("mixtral", 1024, {}), ("e512", 4096, {})]
REPS = 5


def main() -> None:
    _ops.load()
    dev = torch.device("cuda")
    for name, m, env in CASES:
        e, topk, h, i = SHAPES[name]
        q13, a13, q2, a2, cb = kbit_weights(e, h, i, 4, dev, seed=4)
        tw, ids = routing(m, e, topk, 1, dev)
        x = torch.randn(m, h, device=dev).to(torch.bfloat16)
        os.environ.update(env)

        def call():
            return torch.ops.kbit.moe(x, q13, a13, q2, a2, cb, tw, ids, None, 4, i, "silu", False)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS):
                call()
            torch.cuda.synchronize()
        print(f"== {name} M={m} {env}")
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", 0) / REPS
            if us > 0:
                print(f"  {us:9.1f} us  {ev.key[:110]}")
        for k in env:
            os.environ.pop(k)
        del q13, a13, q2, a2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
