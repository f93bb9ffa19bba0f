# SPDX-License-Identifier: Apache-2.0
# Diagnostic (GPU): per-kernel CUDA times of one kbit::moe call (torch.profiler) on real MoE
# shapes, k = 4, bf16, the default path and a few KBIT_MOE_* settings. Run from the repo root.
import os
import sys
sys.path.insert(0, "benchmarks")
import torch
import vllm_kbit  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit import _ops
_ops.load()
from bench_moe import kbit_weights, routing
SH = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "e512": (512, 8, 2048, 512)}
dev = torch.device("cuda")
for name, m, env in [("qwen3", 4096, {}), ("qwen3", 4096, {"KBIT_MOE_DETERMINISTIC": "1"}),
                     ("qwen3", 4096, {"KBIT_MOE_WG_WIDE": "1", "KBIT_MOE_WG_TN": "128"}),
                     ("mixtral", 1024, {}), ("e512", 4096, {"KBIT_MOE_WG_WIDE": "1", "KBIT_MOE_WG_TN": "128"})]:
    e, topk, h, i = SH[name]
    q13, a13, q2, a2, cb = kbit_weights(e, h, i, 4, dev, seed=4)
    tw, ids = routing(m, e, topk, 1, dev)
    x = torch.randn(m, h, device=dev).to(torch.bfloat16)
    os.environ.update(env)
    f = lambda: torch.ops.kbit.moe(x, q13, a13, q2, a2, cb, tw, ids, None, 4, i, "silu", False)
    for _ in range(3): f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5): f()
        torch.cuda.synchronize()
    print(f"== {name} M={m} {env}")
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA or getattr(ev, "device_time_total", 0) > 0:
            t = getattr(ev, "device_time_total", 0) / 5
            if t > 0: print(f"  {t:9.1f} us  {ev.key[:110]}")
    for k in env: os.environ.pop(k)
    del q13, a13, q2, a2
    torch.cuda.empty_cache()
