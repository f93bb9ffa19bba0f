#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Times one MoE layer's routed experts: kbit::moe (k = 2..5) against vLLM's bf16 Triton
``fused_experts`` and ``fused_marlin_moe`` (int4 g128 W4A16), both only when vLLM imports, and a
plain-torch bf16 baseline (per-expert matmuls on the gathered tokens) always.

    python3 benchmarks/bench_moe.py [--shapes qwen3,mixtral,e512] [--bits 2,3,4,5]
        [--m 1,2,4,...] [--baselines torch,vllm,marlin] [--check-only] [--out DIR]

Routing: random router logits -> softmax -> top-k -> renormalised (realistic, uneven loads); one
routing (and x) per call of a rotation. Each rotation of R calls reads >= 3x L2 of weights
(R grows when few experts are active), is captured in one CUDA graph, and replayed; the result is
the median replay time / R (benchmarks/timing.py). TB/s = weight bytes of the experts that received
tokens (averaged over the rotation) / time. Writes bench_moe.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    sys.path.insert(1, str(HERE.parent))

import torch
import torch.nn.functional as F
from timing import l2_cache_bytes, run_metadata, time_calls

# name: (label, E, topk, H, I)
SHAPES = {
    "qwen3": ("Qwen3-30B-A3B", 128, 8, 2048, 768),
    "qwen3tp2": ("Qwen3-30B-A3B TP2", 128, 8, 2048, 384),
    "mixtral": ("Mixtral-8x7B", 8, 2, 4096, 14336),
    "e512": ("512 experts", 512, 8, 2048, 512),
}
ALL_MS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096)
UINT4B8_ID = 1125899907892224  # vllm.scalar_type.scalar_types.uint4b8.id


@dataclass
class Point:
    shape: str
    method: str  # kbit, torch, vllm_bf16, marlin
    bits: int | None
    m: int
    us: float | None = None
    status: str = "ok"
    calls: int = 0
    active_experts: float = 0.0
    weight_bytes: float = 0.0
    tbps: float | None = None
    timing: str = ""
    samples_us: list[float] = field(default_factory=list)


def expert_bytes(method: str, bits: int | None, h: int, i: int) -> float:
    n = 3 * h * i  # gate, up, down
    if method == "kbit":
        return n * (bits + 0.25) / 8
    if method == "marlin":
        return n * (4 + 16 / 128) / 8
    return n * 2.0


def routing(t: int, e: int, topk: int, seed: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.randn(t, e, generator=g, device=dev)
    w, ids = torch.softmax(logits, -1).topk(topk, -1)
    return (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


# ------------------------------------------------------------------------- methods


def kbit_weights(e: int, h: int, i: int, bits: int, dev, seed: int = 0):
    """Random kbit tensors in the tiled layout (every bit pattern is a valid code; absmax codes
    0x40..0x5f = 2^-7 .. 2^-5.1), as the op takes them."""
    from vllm_kbit.format import default_codebook
    from vllm_kbit.reference import tiled_shape

    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for n, k in ((2 * i, h), (h, i)):
        _, _, words, nbytes = tiled_shape(n, k, bits)
        q = torch.randint(-(2**31), 2**31 - 1, (e, words), generator=g, device=dev,
                          dtype=torch.int64).to(torch.int32)  # fmt: skip
        a = torch.randint(0x40, 0x60, (e, nbytes), generator=g, device=dev, dtype=torch.int32)
        out += [q, a.to(torch.uint8)]
    return (*out, default_codebook(bits).to(dev))


def dequant_experts(w, bits, h, i, dtype):
    """kbit tensors -> (w13 [E, 2I, H], w2 [E, H, I]) in dtype (the CUDA dequantize op)."""
    q13, a13, q2, a2, cb = w
    d = torch.ops.kbit.dequantize_tiled
    w13 = torch.stack([d(q13[e], a13[e], cb, bits, 2 * i, h, dtype) for e in range(q13.shape[0])])
    w2 = torch.stack([d(q2[e], a2[e], cb, bits, h, i, dtype) for e in range(q2.shape[0])])
    return w13, w2


def kbit_fn(x, w, tw, ids, bits, i):
    q13, a13, q2, a2, cb = w
    return lambda: torch.ops.kbit.moe(x, q13, a13, q2, a2, cb, tw, ids, None, bits, i, "silu",
                                      False)  # fmt: skip


def torch_fn(x, w13, w2, tw, ids):
    """bf16 per-expert matmuls on the gathered tokens; the gather lists are computed here, on
    the host, so that the timed calls are graph-capturable."""
    i = w2.shape[2]
    plan = []
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        plan.append((e, tok, tw[tok, slot].unsqueeze(1)))

    def call():
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, tok, wt in plan:
            h = x[tok] @ w13[e].t()
            a = F.silu(h[:, :i]) * h[:, i:]
            out.index_add_(0, tok, (a @ w2[e].t()).float() * wt)
        return out.to(x.dtype)

    return call


def vllm_fused_experts():
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    def make(x, w13, w2, tw, ids):
        e = w13.shape[0]
        return lambda: fused_experts(x, w13, w2, tw, ids, activation=MoEActivation.SILU,
                                     global_num_experts=e)  # fmt: skip

    return make


def vllm_marlin():
    """fused_marlin_moe on random int4 g128 weights in Marlin's layout (values do not change the
    timing), with a preallocated workspace, as vLLM's Marlin MoE method calls it."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_make_workspace_new,
    )

    def weights(e, h, i, dev, dtype):
        g = torch.Generator(device=dev).manual_seed(1)
        ri = lambda *s: torch.randint(-(2**31), 2**31 - 1, s, generator=g, device=dev,
                                      dtype=torch.int64).to(torch.int32)  # fmt: skip
        w1 = ri(e, h // 16, 2 * i * 2)
        w2 = ri(e, i // 16, h * 2)
        s1 = (torch.rand(e, h // 128, 2 * i, generator=g, device=dev) * 0.01).to(dtype)
        s2 = (torch.rand(e, i // 128, h, generator=g, device=dev) * 0.01).to(dtype)
        return w1, w2, s1, s2, marlin_make_workspace_new(torch.device(dev), 4)

    def make(x, mw, tw, ids):
        w1, w2, s1, s2, ws = mw
        return lambda: fused_marlin_moe(x, w1, w2, None, None, s1, s2, tw, ids, UINT4B8_ID,
                                        global_num_experts=w1.shape[0],
                                        activation=MoEActivation.SILU, workspace=ws)  # fmt: skip

    return weights, make


# ----------------------------------------------------------------------------- run


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,mixtral,e512", help=",".join(SHAPES))
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--m", default=",".join(map(str, ALL_MS)))
    ap.add_argument("--baselines", default="torch,vllm,marlin")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--l2-factor", type=float, default=3.0)
    ap.add_argument("--max-calls", type=int, default=16)
    ap.add_argument("--torch-max-m", type=int, default=1024, help="torch baseline up to this M")
    ap.add_argument("--time-budget-s", type=float, default=600.0)
    ap.add_argument("--env", default="", help="KEY=VAL,... set for the kbit calls (e.g. KBIT_MOE_TM=32)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    import os

    for kv in filter(None, a.env.split(",")):
        k, _, v = kv.partition("=")
        os.environ[k] = v
    from vllm_kbit import _ops

    backend = _ops.load()
    if "moe" in getattr(_ops, "_cuda_reference_ops", []):
        print("WARNING: kbit::moe has no CUDA kernel here: timing the PyTorch reference", flush=True)
    dev = "cuda"
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bits_list = [int(b) for b in a.bits.split(",") if b.strip()]
    ms = [int(m) for m in a.m.split(",") if m.strip()]
    base = {b.strip() for b in a.baselines.split(",") if b.strip()}
    meta = run_metadata(["benchmarks/bench_moe.py", *(sys.argv[1:] if argv is None else argv)])
    meta["kbit_backend"] = backend
    meta["env"] = a.env
    meta["complete"] = False  # set when every shape ran (files are rewritten as the run goes)
    l2 = l2_cache_bytes()
    notes: list[str] = []
    vllm_make = marlin = None
    if "vllm" in base:
        try:
            vllm_make = vllm_fused_experts()
        except Exception as e:  # noqa: BLE001
            notes.append(f"vLLM fused_experts n/a: {type(e).__name__}: {e}")
    if "marlin" in base:
        try:
            marlin = vllm_marlin()
        except Exception as e:  # noqa: BLE001
            notes.append(f"vLLM fused_marlin_moe n/a: {type(e).__name__}: {e}")
    points: list[Point] = []
    checks: list[dict] = []
    print(f"device {meta.get('device')}, torch {torch.__version__}, kbit {backend}, vllm "
          f"{meta.get('vllm')}; " + "; ".join(notes), flush=True)  # fmt: skip

    name = f"bench_moe{('_' + a.tag) if a.tag else ''}"

    def write_results() -> str:
        """(Re)writes the JSON and markdown with everything measured so far: a run cut short by
        the caller's timeout still leaves its files."""
        meta["elapsed_s"] = round(time.monotonic() - t0, 1)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{name}.json").write_text(json.dumps(
            {"meta": meta, "notes": notes, "checks": checks, "points": [asdict(p) for p in points]},
            indent=1))  # fmt: skip
        md = markdown(points, meta, notes, checks, shapes)
        (a.out / f"{name}.md").write_text(md)
        return md

    def measure(sh, method, bits, m, fns, active, ebytes):
        p = Point(sh, method, bits, m, calls=len(fns), active_experts=active,
                  weight_bytes=active * ebytes)  # fmt: skip
        if time.monotonic() - t0 > a.time_budget_s:
            p.status = "skipped (time budget)"
            points.append(p)
            return
        try:
            t = time_calls(fns, warmup=3, min_reps=10, max_reps=100, target_s=0.02)
            p.us, p.timing, p.samples_us = t.us, t.method, t.samples_us
            p.tbps = p.weight_bytes / (t.us * 1e-6) / 1e12
        except Exception as e:  # noqa: BLE001
            p.status = f"n/a: {type(e).__name__}: {str(e)[:160]}"
            torch.cuda.synchronize()
        points.append(p)
        us = f"{p.us:9.1f}" if p.us else p.status
        print(f"[{time.monotonic() - t0:6.1f}s] {sh:<9} {method:<9} k={bits or '-'} M={m:<5} "
              f"{us} us  {p.tbps or 0:.2f} TB/s  (R={len(fns)}, active {active:.1f})", flush=True)

    for sh in shapes:
        _, e, topk, h, i = SHAPES[sh]
        if time.monotonic() - t0 > a.time_budget_s:
            notes.append(f"{sh}: skipped (time budget)")
            continue
        # routings and activations per M: R calls, R chosen from the active kbit k=4 bytes
        cases = {}
        for m in ms:
            _, ids0 = routing(m, e, topk, 0, dev)
            active0 = len(ids0.unique())
            act_bytes = active0 * expert_bytes("kbit", 4, h, i)
            r = max(1, min(a.max_calls, math.ceil(a.l2_factor * l2 / act_bytes)))
            rs = [routing(m, e, topk, s, dev) for s in range(r)]
            xs = [torch.randn(m, h, device=dev).to(dtype) for _ in range(r)]
            active = statistics.mean(len(ids.unique()) for _, ids in rs)
            cases[m] = (rs, xs, active)
        ref_w = None
        for bits in bits_list:
            w = kbit_weights(e, h, i, bits, dev, seed=bits)
            if bits == bits_list[0] or a.check_only:  # correctness vs the reference
                from vllm_kbit import reference_moe

                for m in [1, 37]:
                    tw, ids = routing(m, e, topk, 99, dev)
                    x = torch.randn(m, h, device=dev).to(dtype)
                    y = kbit_fn(x, w, tw, ids, bits, i)()
                    want = reference_moe.moe_tiled(x, *w, tw, ids, None, bits, i, "silu", False)
                    err = rel_err(y, want)
                    checks.append({"shape": sh, "bits": bits, "m": m, "rel_err_vs_reference": err,
                                   "ok": err < 2e-2})  # fmt: skip
                    print(f"check {sh} k={bits} M={m}: rel err vs reference {err:.2e}", flush=True)
                if bits == bits_list[0] and (vllm_make or "torch" in base):
                    ref_w = (dequant_experts(w, bits, h, i, dtype), w)
            if a.check_only:
                continue
            eb = expert_bytes("kbit", bits, h, i)
            for m in ms:
                rs, xs, active = cases[m]
                fns = [kbit_fn(x, w, tw, ids, bits, i) for x, (tw, ids) in zip(xs, rs)]
                measure(sh, "kbit", bits, m, fns, active, eb)
            del w
            torch.cuda.empty_cache()
            write_results()
        if ref_w is not None:
            (w13, w2), wk = ref_w
            if vllm_make is not None:  # vLLM bf16 vs kbit on the same (dequantized) weights
                tw, ids = routing(37, e, topk, 99, dev)
                x = torch.randn(37, h, device=dev).to(dtype)
                try:
                    err = rel_err(kbit_fn(x, wk, tw, ids, bits_list[0], i)(),
                                  vllm_make(x, w13, w2, tw, ids)())  # fmt: skip
                    checks.append({"shape": sh, "bits": bits_list[0], "m": 37,
                                   "rel_err_vs_vllm_bf16": err, "ok": err < 2e-2})  # fmt: skip
                    print(f"check {sh} M=37: kbit vs vLLM bf16 rel err {err:.2e}", flush=True)
                except Exception as ex:  # noqa: BLE001
                    notes.append(f"vLLM check failed: {type(ex).__name__}: {ex}")
            if not a.check_only:
                eb = expert_bytes("bf16", None, h, i)
                for m in ms:
                    rs, xs, active = cases[m]
                    if vllm_make is not None:
                        fns = [vllm_make(x, w13, w2, tw, ids) for x, (tw, ids) in zip(xs, rs)]
                        measure(sh, "vllm_bf16", None, m, fns, active, eb)
                    if "torch" in base and m <= a.torch_max_m:
                        fns = [torch_fn(x, w13, w2, tw, ids) for x, (tw, ids) in zip(xs, rs)]
                        measure(sh, "torch", None, m, fns, active, eb)
            del ref_w, w13, w2
            torch.cuda.empty_cache()
            write_results()
        if marlin is not None and not a.check_only:
            weights, make = marlin
            print(f"[{time.monotonic() - t0:6.1f}s] {sh}: Marlin MoE weights and first calls",
                  flush=True)  # fmt: skip
            try:
                mw = weights(e, h, i, dev, dtype)
                eb = expert_bytes("marlin", None, h, i)
                for m in ms:
                    rs, xs, active = cases[m]
                    fns = [make(x, mw, tw, ids) for x, (tw, ids) in zip(xs, rs)]
                    measure(sh, "marlin", None, m, fns, active, eb)
                del mw
            except Exception as ex:  # noqa: BLE001
                traceback.print_exc()
                notes.append(f"{sh}: Marlin setup failed: {type(ex).__name__}: {ex}")
            torch.cuda.empty_cache()
            write_results()

    meta["complete"] = True
    print(write_results())
    return 0 if all(c["ok"] for c in checks) else 1


def markdown(points, meta, notes, checks, shapes) -> str:
    lines = [f"# kbit MoE benchmark: {meta.get('device')}", ""]
    for k in ("device", "capability", "sm_count", "torch", "cuda_runtime", "vllm", "kbit_backend",
              "date_utc", "command", "git_commit", "git_dirty", "env", "elapsed_s", "complete"):  # fmt: skip
        lines.append(f"- {k}: `{meta.get(k)}`")
    legend = ("µs per MoE layer call (routed experts only: routing, gate_up + activation, down, "
              "top-k sum), median of CUDA-graph replays over a rotation of calls with different "
              "routings reading >= 3x L2 of weights. TB/s = bytes of the experts that received "
              "tokens / time. `x bf16` = vLLM bf16 fused_experts time / this time (torch baseline "
              "when vLLM is absent); `x Marlin` = fused_marlin_moe W4A16 time / this time.")
    lines += ["", legend, ""]
    for n in notes:
        lines.append(f"- note: {n}")
    for c in checks:
        lines.append(f"- check: {c}")
    get = {(p.shape, p.method, p.bits, p.m): p for p in points if p.us}
    for sh in shapes:
        label = SHAPES[sh][0]
        rows = [p for p in points if p.shape == sh]
        if not rows:
            continue
        ms = sorted({p.m for p in rows})
        series = sorted({(p.method, p.bits) for p in rows}, key=lambda s: (s[0] != "kbit", s))
        title = (f"## {label} (E={SHAPES[sh][1]}, top-{SHAPES[sh][2]}, H={SHAPES[sh][3]}, "
                 f"I={SHAPES[sh][4]})")
        lines += ["", title, "", "| series | " + " | ".join(f"M={m}" for m in ms) + " |",
                  "|---|" + "---|" * len(ms)]
        for meth, b in series:
            name = f"kbit k={b}" if meth == "kbit" else meth
            cells = []
            for m in ms:
                p = get.get((sh, meth, b, m))
                if p is None:
                    cells.append("n/a")
                    continue
                ref = get.get((sh, "vllm_bf16", None, m)) or get.get((sh, "torch", None, m))
                mar = get.get((sh, "marlin", None, m))
                cell = f"{p.us:.1f}"
                if meth == "kbit":
                    cell += f" ({p.tbps:.2f} TB/s"
                    if ref:
                        cell += f", {ref.us / p.us:.2f}x bf16"
                    if mar:
                        cell += f", {mar.us / p.us:.2f}x Marlin"
                    cell += ")"
                elif p.tbps:
                    cell += f" ({p.tbps:.2f} TB/s)"
                cells.append(cell)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
