#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Times one MoE layer's routed experts: kbit (k = 2..5) against vLLM's bf16 Triton
``fused_experts`` and ``fused_marlin_moe`` (int4 g128 W4A16), both only when vLLM imports, and a
plain-torch bf16 baseline (per-expert matmuls on the gathered tokens) always.

kbit series (--kbit-paths): ``kbit`` = ``moe_dispatch.kbit_moe``, exactly what
``KbitMoEMethod.apply`` runs (torch.ops.kbit.moe, or from KBIT_MOE_DEQUANT_MIN_M /
KBIT_MOE_DEQUANT_MIN_TPE on, except on sm_90, the experts dequantized + vLLM's fused_experts;
[D] marks those points); ``kbit_kernel`` = ``torch.ops.kbit.moe`` alone (its GEMV decode path
for few slots, csrc/moe_gemv.cu's moe_gemv_takes; on sm_90 the grouped wgmma GEMMs from 64 slots
per expert, csrc/moe_wgmma.cu; else the grouped MMA kernels); ``kbit_gemv`` / ``kbit_grouped`` /
``kbit_wgmma`` = those paths forced (gemv only where it applies: <= 64 slots, T <= 8);
``kbit_dequant`` = the dequant path forced (for M >= --dequant-series-min-m). Forced series side
by side give the crossover M to set the thresholds to (pass them with --env to time ``kbit``).

    python3 benchmarks/bench_moe.py [--shapes qwen3,mixtral,e512] [--bits 2,3,4,5]
        [--m 1,2,4,...] [--baselines torch,vllm,marlin] [--kbit-paths auto,kernel,dequant]
        [--env KBIT_MOE_DEQUANT_MIN_M=2048,...] [--check-only] [--out DIR]
    python3 benchmarks/bench_moe.py --dry-check   # CPU only: the Marlin call's shapes and the
                                                  # dequant path's chunking on tiny layers

Routing: random router logits -> softmax -> top-k -> renormalised (realistic, uneven loads); one
routing (and x) per call of a rotation. Each rotation of R calls reads >= 3x L2 of weights
(R grows when few experts are active), is captured in one CUDA graph, and replayed; the result is
the median replay time / R (benchmarks/timing.py). TB/s = weight bytes of the experts that received
tokens (averaged over the rotation) / time. Writes bench_moe.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    # the repository's vllm_kbit where none is importable; last, so that a PYTHONPATH build
    # (tools/ab_base.sh: A/B timing of two builds) or the editable install comes first
    sys.path.append(str(HERE.parent))

import torch
import torch.nn.functional as F
from timing import l2_cache_bytes, run_metadata, time_calls, with_env

# name: (label, E, topk, H, I)
SHAPES = {
    "qwen3": ("Qwen3-30B-A3B", 128, 8, 2048, 768),
    "qwen3tp2": ("Qwen3-30B-A3B TP2", 128, 8, 2048, 384),
    "mixtral": ("Mixtral-8x7B", 8, 2, 4096, 14336),
    "e512": ("512 experts", 512, 8, 2048, 512),
}
ALL_MS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096)


@dataclass
class Point:
    shape: str
    method: str  # kbit (moe_dispatch.kbit_moe), kbit_kernel / _gemv / _grouped / _dequant, torch,
    #              vllm_bf16, marlin
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
    path: str = ""  # kbit: the path kbit_moe takes at this M ("kernel" or "dequant")


def expert_bytes(method: str, bits: int | None, h: int, i: int) -> float:
    n = 3 * h * i  # gate, up, down
    if method.startswith("kbit"):
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


KBIT_PATHS = {"auto": "kbit", "kernel": "kbit_kernel", "dequant": "kbit_dequant",
              "gemv": "kbit_gemv", "grouped": "kbit_grouped", "wgmma": "kbit_wgmma"}  # fmt: skip
# kbit::moe's kernel paths forced: KBIT_MOE_GEMV_MAX_SLOTS replaces csrc/moe_gemv.cu's default
# rule by T * topk <= its value (the GEMV path takes at most 64 slots and 8 tokens);
# KBIT_MOE_WGMMA=0/1 keeps the sm_90 grouped wgmma path (csrc/moe_wgmma.cu) off / takes it always.
PATH_ENV = {"gemv": {"KBIT_MOE_GEMV_MAX_SLOTS": "64"},
            "grouped": {"KBIT_MOE_GEMV_MAX_SLOTS": "0", "KBIT_MOE_WGMMA": "0"},
            "wgmma": {"KBIT_MOE_GEMV_MAX_SLOTS": "0", "KBIT_MOE_WGMMA": "1"}}  # fmt: skip
GEMV_MAX_SLOTS, GEMV_MAX_T = 64, 8


def kbit_fn(x, w, tw, ids, bits, i, path="auto", **kw):
    """One kbit MoE call: path "auto" = moe_dispatch.kbit_moe (what KbitMoEMethod.apply runs),
    "kernel" = torch.ops.kbit.moe, "gemv" / "grouped" = torch.ops.kbit.moe with its GEMV /
    grouped-MMA path forced (PATH_ENV, set around each call: a CUDA graph captures the path
    taken), "dequant" = moe_dispatch.moe_dequant (kw: max_bytes)."""
    from vllm_kbit import moe_dispatch

    fn = {"auto": moe_dispatch.kbit_moe, "kernel": torch.ops.kbit.moe, "gemv": torch.ops.kbit.moe,
          "grouped": torch.ops.kbit.moe, "wgmma": torch.ops.kbit.moe,
          "dequant": moe_dispatch.moe_dequant}[path]  # fmt: skip
    q13, a13, q2, a2, cb = w
    return with_env(PATH_ENV.get(path, {}),
                    lambda: fn(x, q13, a13, q2, a2, cb, tw, ids, None, bits, i, "silu", False, **kw))


def gemv_ok(m: int, topk: int) -> bool:
    """Can kbit::moe's GEMV path take M tokens of top-k (csrc/moe_gemv.cu's caps)?"""
    return m * topk <= GEMV_MAX_SLOTS and m <= GEMV_MAX_T


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


def marlin_shapes(e: int, h: int, i: int, group: int = 128) -> dict[str, tuple[int, ...]]:
    """Shapes of vLLM 0.26's Marlin MoE tensors for an int4 g128 GPTQ checkpoint without act-order,
    after its weight processing (fused_moe/oracle/int_wna16.py, _process_weights_marlin):
    gptq_marlin_moe_repack gives int32 [E, size_k / 16, size_n * 4 / 2] (_custom_ops.py:1148),
    marlin_moe_permute_scales keeps [E, size_k / group, size_n] in the activation dtype, and the
    act-order tensors (g_idx, sort indices) are int32 [E, 0]. w13: (size_k, size_n) = (H, 2I);
    w2: (I, H)."""
    # vLLM zero-pads I to a multiple of lcm(64, group) (marlin_moe_padded_intermediate); the
    # shapes here need no padding, so the weights are exactly the checkpoint's size.
    assert i % math.lcm(64, group) == 0 and h % group == 0, f"H={h}, I={i} would be padded"
    return {"w1": (e, h // 16, 2 * i * 2), "w2": (e, i // 16, h * 2),
            "s1": (e, h // group, 2 * i), "s2": (e, i // group, h), "g_idx": (e, 0)}  # fmt: skip


def vllm_marlin():
    """fused_marlin_moe called as vLLM 0.26's MarlinExperts.apply calls it
    (fused_moe/experts/marlin_moe.py:775), on random weights in Marlin's layout (values do not
    change the timing). Returns (weights, make)."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.scalar_type import scalar_types

    def weights(e, h, i, dev, dtype) -> dict[str, torch.Tensor]:
        t = {k: torch.empty(s, dtype=dtype if k[0] == "s" else torch.int32, device=dev)
             for k, s in marlin_shapes(e, h, i).items()}  # fmt: skip
        if t["w1"].device.type != "meta":  # meta: --dry-check, shapes only
            g = torch.Generator(device=dev).manual_seed(1)
            for k in ("w1", "w2"):  # every bit pattern is a valid int4 code
                t[k].random_(-(2**31), 2**31 - 1, generator=g)
            for k in ("s1", "s2"):
                t[k].uniform_(0.0, 0.01, generator=g)
        return t

    def moe_sum(y, out, topk_ids, expert_map):  # MarlinExperts.moe_sum, no expert map
        ops.moe_sum(y, out)
        return out

    def make(x, mw, tw, ids):
        # As vLLM: no workspace argument, so fused_marlin_moe allocates
        # marlin_make_workspace_new(device, 4) (SMs x 4 int32 locks, zeroed) on every call;
        # input_dtype None (VLLM_MARLIN_INPUT_DTYPE unset); the intermediate caches and the output
        # (vLLM's come from the modular kernel's workspace) are allocated inside, which is free
        # in a CUDA graph replay.
        return lambda: fused_marlin_moe(
            hidden_states=x, w1=mw["w1"], w2=mw["w2"], bias1=None, bias2=None,
            w1_scale=mw["s1"], w2_scale=mw["s2"], topk_weights=tw, topk_ids=ids,
            quant_type_id=scalar_types.uint4b8.id, apply_router_weight_on_input=False,
            global_num_experts=mw["w1"].shape[0], activation=MoEActivation.SILU,
            moe_sum=moe_sum, expert_map=None, g_idx1=mw["g_idx"], g_idx2=mw["g_idx"],
            sort_indices1=mw["g_idx"], sort_indices2=mw["g_idx"], is_k_full=True,
        )  # fmt: skip

    return weights, make


def dispatch_dry_check(shapes: list[str], dtype) -> None:
    """CPU only: moe_dispatch's dequant path, chunked as on the GPU at each shape's real size
    (chunk_experts at DEQUANT_MAX_BYTES), on tiny layers of the shape's E and top-k (H=64,
    I=32; vLLM's Triton fused_experts replaced by reference_moe.grouped_experts) against the
    reference op; prints the dispatch decision per M and the chunks."""
    from vllm_kbit import _ops, moe_dispatch, reference_moe

    _ops.load()
    for sh in shapes:
        label, e, topk, h, i = SHAPES[sh]
        per = moe_dispatch.expert_bytes(h, i, dtype)
        chunks = moe_dispatch.chunk_experts(e, per, moe_dispatch.DEQUANT_MAX_BYTES)
        w = kbit_weights(e, 64, 32, 4, "cpu")
        tw, ids = routing(40, e, topk, 0, "cpu")
        x = torch.randn(40, 64).to(dtype)
        want = reference_moe.moe_tiled(x, *w, tw, ids, None, 4, 32, "silu", False)
        tiny_chunk = max(c1 - c0 for c0, c1 in chunks) * moe_dispatch.expert_bytes(64, 32, dtype)
        got = kbit_fn(x, w, tw, ids, 4, 32, "dequant", grouped_gemm=reference_moe.grouped_experts,
                      max_bytes=tiny_chunk)()  # fmt: skip
        err = rel_err(got, want)
        assert err < 1e-2, f"{sh}: dequant path vs reference rel err {err:.2e}"
        first = next((m for m in sorted({*ALL_MS, 2048, 8192, 16384})
                      if moe_dispatch.use_dequant(m, topk, e)), None)  # fmt: skip
        print(f"dry-check {sh} ({label}): dequant path from M={first} (MIN_M "
              f"{moe_dispatch.DEQUANT_MIN_M}, MIN_TPE {moe_dispatch.DEQUANT_MIN_TPE}); "
              f"{len(chunks)} chunk(s) of {[c1 - c0 for c0, c1 in chunks]} experts, "
              f"{max(c1 - c0 for c0, c1 in chunks) * per / 2**20:.0f} MiB of {dtype} "
              f"weights at most; tiny-layer rel err vs reference {err:.1e}", flush=True)


def marlin_dry_check(shapes: list[str], ms: list[int], dtype, sms: int = 132) -> None:
    """CPU only: runs vLLM's own fused_marlin_moe Python code (its asserts, block-size choice,
    moe_align_block_size sizing, cache views, activation asserts) on meta tensors from
    vllm_marlin(), with the CUDA ops replaced by stand-ins; the GEMM stand-in applies
    moe_wna16_marlin_gemm's TORCH_CHECKs (csrc/moe/marlin_moe_wna16/ops.cu). sms: H100 SXM."""
    import inspect
    from unittest import mock

    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe as mm

    sig = inspect.signature(ops.moe_wna16_marlin_gemm)
    calls = []

    def gemm(*args, **kw):
        a = sig.bind(*args, **kw).arguments  # names the arguments as the wrapper declares them
        x, b, s, ws = a["input"], a["b_qweight"], a["b_scales"], a["workspace"]
        m, n, k, bm = a["size_m"], a["size_n"], a["size_k"], a["moe_block_size"]
        blocks = a["sorted_token_ids"].numel() // bm
        checks = {
            "a [size_m, size_k]": tuple(x.shape) == (m, k),
            "b.size(1) == size_k/16": k % 16 == 0 and b.shape[1] == k // 16,
            "size_n == b.size(2)/16*8": b.shape[2] % 16 == 0 and b.shape[2] // 16 * 8 == n,
            "scales [E, K/128, N]": s.dim() == 3 and (s.shape[1] * 128, s.shape[2]) == (k, n),
            "scales in a's dtype": x.dtype == s.dtype,
            "int32, contiguous": b.dtype == torch.int32 and b.is_contiguous() and s.is_contiguous(),
            "a thread tile fits (n % 128, k % 64)": n % 128 == 0 and k % 64 == 0,
            "workspace >= min(n/64 * blocks, SMs*4)": ws.numel() >= min(n // 64 * blocks, sms * 4),
            "moe_block_size in 8..64": bm in (8, 16, 32, 48, 64),
            "no act-order (g_idx [E, 0])": a["g_idx"] is None or a["g_idx"].shape[-1] == 0,
        }  # fmt: skip
        bad = [c for c, ok in checks.items() if not ok]
        assert not bad, f"moe_wna16_marlin_gemm M={m} N={n} K={k}: fails {bad}"
        calls.append((m, n, k, bm))
        return x.new_empty(m * a["top_k"], n) if a["output"] is None else a["output"]

    def workspace(dev, per_sm):  # marlin_make_workspace_new with `sms` SMs
        return torch.zeros(sms * per_sm, dtype=torch.int32, device=dev)

    nop = lambda *a: None
    with (
        mock.patch.object(ops, "moe_wna16_marlin_gemm", gemm),
        mock.patch.object(ops, "moe_align_block_size", nop),
        mock.patch.object(ops, "moe_sum", nop),
        mock.patch.object(mm, "marlin_make_workspace_new", workspace),
        mock.patch.object(torch.ops._C, "silu_and_mul", nop, create=True),
    ):
        weights, make = vllm_marlin()
        for sh in shapes:
            label, e, topk, h, i = SHAPES[sh]
            mw = weights(e, h, i, "meta", dtype)
            assert mm.marlin_moe_intermediate_size(mw["w1"], mw["w2"]) == i, "w2: [E, I/16, 2H]"
            calls.clear()
            for m in ms:
                tw = torch.empty(m, topk, dtype=torch.float32, device="meta")
                ids = torch.empty(m, topk, dtype=torch.int32, device="meta")
                y = make(torch.empty(m, h, dtype=dtype, device="meta"), mw, tw, ids)()
                assert tuple(y.shape) == (m, h), (sh, m, tuple(y.shape))
            print(f"dry-check {sh} ({label}): " + ", ".join(
                f"{k} {list(v.shape)} {str(v.dtype)[6:]}" for k, v in mw.items())
                + f"; {len(calls)} GEMM calls for M={ms} pass, block sizes "
                + f"{sorted({c[3] for c in calls})}", flush=True)  # fmt: skip


# ----------------------------------------------------------------------------- run


class Watchdog:
    """A CUDA call that does not return (a driver PTX JIT, a hung kernel) cannot be interrupted
    from Python, but ops release the GIL, so a thread still runs: while a step is inside
    ``running(what)`` it prints what is running every ``every_s``, and past ``deadline_s`` (from
    t0) it calls ``on_timeout(what)`` (which writes the results) and ends the process, exit
    status 3, so that no step outlives the time budget silently."""

    def __init__(self, t0: float, deadline_s: float, on_timeout, every_s: float = 15.0):
        self.t0, self.deadline_s, self.on_timeout = t0, deadline_s, on_timeout
        self.every_s, self.what, self.since = every_s, None, 0.0
        threading.Thread(target=self._loop, daemon=True).start()

    @contextlib.contextmanager
    def running(self, what: str):
        self.what, self.since = what, time.monotonic()
        try:
            yield
        finally:
            self.what = None

    def _loop(self) -> None:
        while True:
            time.sleep(self.every_s)
            what, now = self.what, time.monotonic()
            if what is None or now - self.since < self.every_s:
                continue
            print(f"[{now - self.t0:6.1f}s] ... {what}: {now - self.since:.0f} s so far",
                  flush=True)  # fmt: skip
            if now - self.t0 > self.deadline_s:
                self.on_timeout(what)
                os._exit(3)


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,mixtral,e512", help=",".join(SHAPES))
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--m", default=",".join(map(str, ALL_MS)))
    ap.add_argument("--baselines", default="torch,vllm,marlin")
    ap.add_argument("--kbit-paths", default="auto,kernel,dequant",
                    help="kbit series: auto (kbit_moe, as vLLM runs it), kernel (kbit::moe\n"
                         "alone), gemv / grouped / wgmma (kbit::moe with its GEMV decode path,\n"
                         "its grouped mma.sync kernels or its sm_90 grouped wgmma path forced;\n"
                         "gemv only where it applies),\n"
                         "dequant (dequantize + vLLM fused_experts, forced)")  # fmt: skip
    ap.add_argument("--dequant-series-min-m", type=int, default=256,
                    help="time the forced dequant series from this M on")  # fmt: skip
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--dry-check", action="store_true",
                    help="CPU only: run vLLM's fused_marlin_moe Python code on meta tensors,\n"
                         "the CUDA ops replaced by checks of their shape requirements")  # fmt: skip
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--l2-factor", type=float, default=3.0)
    ap.add_argument("--max-calls", type=int, default=16)
    ap.add_argument("--torch-max-m", type=int, default=1024, help="torch baseline up to this M")
    ap.add_argument("--time-budget-s", type=float, default=600.0)
    ap.add_argument("--env", default="", help="KEY=VAL,... set for the kbit calls (e.g. KBIT_MOE_TM=32)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    ms = [int(m) for m in a.m.split(",") if m.strip()]
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    kbit_paths = [pth.strip() for pth in a.kbit_paths.split(",") if pth.strip()]
    if bad := [pth for pth in kbit_paths if pth not in KBIT_PATHS]:
        ap.error(f"--kbit-paths: unknown {bad}; choose from {list(KBIT_PATHS)}")
    for kv in filter(None, a.env.split(",")):  # before vllm_kbit reads its settings
        k, _, v = kv.partition("=")
        os.environ[k] = v
    if a.dry_check:
        dispatch_dry_check(shapes, dtype)
        marlin_dry_check(shapes, ms, dtype)
        return 0
    from vllm_kbit import _ops, moe_dispatch

    backend = _ops.load()
    if "moe" in getattr(_ops, "_cuda_reference_ops", []):
        print("WARNING: kbit::moe has no CUDA kernel here: timing the PyTorch reference", flush=True)
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    bits_list = [int(b) for b in a.bits.split(",") if b.strip()]
    base = {b.strip() for b in a.baselines.split(",") if b.strip()}
    meta = run_metadata(["benchmarks/bench_moe.py", *(sys.argv[1:] if argv is None else argv)])
    meta["kbit_backend"] = backend
    meta["env"] = a.env
    meta["kbit_dispatch"] = {"DEQUANT_MIN_M": moe_dispatch.DEQUANT_MIN_M,
                             "DEQUANT_MIN_TPE": moe_dispatch.DEQUANT_MIN_TPE,
                             "DEQUANT_MAX_MIB": moe_dispatch.DEQUANT_MAX_BYTES >> 20}  # fmt: skip
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

    out_stem = f"bench_moe{('_' + a.tag) if a.tag else ''}"

    def write_results() -> str:
        """(Re)writes the JSON and markdown with everything measured so far: a run cut short by
        the caller's timeout still leaves its files."""
        meta["elapsed_s"] = round(time.monotonic() - t0, 1)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{out_stem}.json").write_text(json.dumps(
            {"meta": meta, "notes": notes, "checks": checks, "points": [asdict(p) for p in points]},
            indent=1))  # fmt: skip
        md = markdown(points, meta, notes, checks, shapes)
        (a.out / f"{out_stem}.md").write_text(md)
        return md

    def stop(what: str) -> None:
        notes.append(f"{what}: still running after the time budget (+60 s); run stopped")
        print(f"[{time.monotonic() - t0:6.1f}s] {notes[-1]}", flush=True)
        write_results()

    dog = Watchdog(t0, a.time_budget_s + 60, stop)

    def measure(sh, method, bits, m, fns, active, ebytes, path=""):
        p = Point(sh, method, bits, m, calls=len(fns), active_experts=active,
                  weight_bytes=active * ebytes, path=path)  # fmt: skip
        if time.monotonic() - t0 > a.time_budget_s:
            p.status = "skipped (time budget)"
            points.append(p)
            return
        try:
            with dog.running(f"{sh} {method} k={bits or '-'} M={m}"):
                t = time_calls(fns, warmup=3, min_reps=10, max_reps=100, target_s=0.02)
            p.us, p.samples_us = t.us, t.samples_us
            p.timing = t.method + (f" ({t.note})" if t.note else "")  # e.g. why no graph
            p.tbps = p.weight_bytes / (t.us * 1e-6) / 1e12
        except Exception as e:  # noqa: BLE001
            p.status = f"n/a: {type(e).__name__}: {str(e)[:160]}"
            torch.cuda.synchronize()
        points.append(p)
        us = f"{p.us:9.1f}" if p.us else p.status
        print(f"[{time.monotonic() - t0:6.1f}s] {sh:<9} {method:<12} k={bits or '-'} M={m:<5} "
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

                # the kernel; the dequant path in one chunk and in three (chunking and the
                # chunk expert_maps on the GPU)
                third = -(-e // 3) * moe_dispatch.expert_bytes(h, i, dtype)
                variants = [("kernel", {}), ("gemv", {}), ("grouped", {}), ("wgmma", {}),
                            ("dequant", {}), ("dequant", {"max_bytes": third})]  # fmt: skip
                for m in [1, 37]:
                    tw, ids = routing(m, e, topk, 99, dev)
                    x = torch.randn(m, h, device=dev).to(dtype)
                    want = reference_moe.moe_tiled(x, *w, tw, ids, None, bits, i, "silu", False)
                    for pth, kw in variants:
                        if pth == "gemv" and not gemv_ok(m, topk):
                            continue
                        label = pth + (" (3 chunks)" if kw else "")
                        try:
                            err = rel_err(kbit_fn(x, w, tw, ids, bits, i, pth, **kw)(), want)
                        except Exception as ex:  # noqa: BLE001  (e.g. vLLM absent: dequant n/a)
                            notes.append(f"check {sh} k={bits} M={m} {label}: {type(ex).__name__}: "
                                         f"{str(ex)[:160]}")  # fmt: skip
                            continue
                        checks.append({"shape": sh, "bits": bits, "m": m, "path": label,
                                       "rel_err_vs_reference": err, "ok": err < 2e-2})  # fmt: skip
                        print(f"check {sh} k={bits} M={m} {label}: rel err vs reference {err:.2e}",
                              flush=True)  # fmt: skip
                if bits == bits_list[0] and (vllm_make or "torch" in base):
                    ref_w = (dequant_experts(w, bits, h, i, dtype), w)
            if a.check_only:
                continue
            eb = expert_bytes("kbit", bits, h, i)
            for m in ms:
                rs, xs, active = cases[m]
                for pth in kbit_paths:
                    if pth == "dequant" and m < a.dequant_series_min_m:
                        continue
                    if pth == "gemv" and not gemv_ok(m, topk):
                        continue
                    fns = [kbit_fn(x, w, tw, ids, bits, i, pth) for x, (tw, ids) in zip(xs, rs)]
                    auto = "dequant" if moe_dispatch.takes_dequant(xs[0], topk, e) else "kernel"
                    taken = {"auto": auto, "kernel": "kernel", "dequant": "dequant", "gemv": "gemv",
                             "grouped": "grouped", "wgmma": "wgmma"}[pth]  # fmt: skip
                    measure(sh, KBIT_PATHS[pth], bits, m, fns, active, eb, taken)
            del w
            torch.cuda.empty_cache()
            write_results()
        if ref_w is not None:
            (w13, w2), wk = ref_w
            if vllm_make is not None:  # vLLM bf16 vs kbit on the same (dequantized) weights
                tw, ids = routing(37, e, topk, 99, dev)
                x = torch.randn(37, h, device=dev).to(dtype)
                try:
                    want = vllm_make(x, w13, w2, tw, ids)()
                    for pth in ("kernel", "dequant"):  # dequant: the same call, so bit-identical
                        err = rel_err(kbit_fn(x, wk, tw, ids, bits_list[0], i, pth)(), want)
                        checks.append({"shape": sh, "bits": bits_list[0], "m": 37, "path": pth,
                                       "rel_err_vs_vllm_bf16": err, "ok": err < 2e-2})  # fmt: skip
                        print(f"check {sh} M=37 {pth}: kbit vs vLLM bf16 rel err {err:.2e}",
                              flush=True)  # fmt: skip
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
        if marlin is not None and not a.check_only and time.monotonic() - t0 > a.time_budget_s:
            notes.append(f"{sh}: Marlin skipped (time budget)")
        elif marlin is not None and not a.check_only:
            weights, make = marlin
            # vLLM 0.26's wheel has the Marlin MoE kernels as sm_75/80/89/120 code and sm_80 PTX
            # only (CMake MARLIN_MOE_ARCHS "8.0+PTX;12.0f"): on sm_90/sm_100 the first call waits
            # for the driver to JIT-compile the bf16 x uint4b8 module (75 kernels, 16 MiB of PTX;
            # 46 s in ptxas -O3 on one core), once per machine (the driver caches the result).
            jit = torch.cuda.get_device_capability()[0] in (9, 10)
            print(f"[{time.monotonic() - t0:6.1f}s] {sh}: Marlin MoE weights and first call"
                  + (" (a PTX JIT on this GPU: about a minute)" if jit else ""),
                  flush=True)  # fmt: skip
            try:
                mw = weights(e, h, i, dev, dtype)
                (tw, ids), x = cases[ms[0]][0][0], cases[ms[0]][1][0]
                t1 = time.monotonic()
                with dog.running(f"{sh} marlin first call"):
                    make(x, mw, tw, ids)()
                    torch.cuda.synchronize()
                meta.setdefault("marlin_first_call_s", {})[sh] = round(time.monotonic() - t1, 1)
                print(f"[{time.monotonic() - t0:6.1f}s] {sh}: Marlin first call took "
                      f"{time.monotonic() - t1:.1f} s", flush=True)  # fmt: skip
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
              "when vLLM is absent); `x Marlin` = fused_marlin_moe W4A16 time / this time. "
              "`kbit` = moe_dispatch.kbit_moe (what KbitMoEMethod.apply runs; [D]: it took the "
              "dequant + fused_experts path at that M), `kbit_kernel` = kbit::moe alone (its "
              "GEMV decode path for <= 16 slots when T = 1 or experts >= 4 x slots; on sm_90 "
              "the grouped wgmma GEMMs from 64 slots per expert; else the grouped mma.sync "
              "kernels), `kbit_gemv` / `kbit_grouped` / `kbit_wgmma` = those paths forced, "
              "`kbit_dequant` = the dequant path forced. Dispatch settings: "
              f"`{meta.get('kbit_dispatch')}`.")
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
        series = sorted({(p.method, p.bits) for p in rows},
                        key=lambda s: (not s[0].startswith("kbit"), s[1] or 0, s[0]))  # fmt: skip
        title = (f"## {label} (E={SHAPES[sh][1]}, top-{SHAPES[sh][2]}, H={SHAPES[sh][3]}, "
                 f"I={SHAPES[sh][4]})")
        lines += ["", title, "", "| series | " + " | ".join(f"M={m}" for m in ms) + " |",
                  "|---|" + "---|" * len(ms)]
        for meth, b in series:
            name = f"{meth} k={b}" if meth.startswith("kbit") else meth
            cells = []
            for m in ms:
                p = get.get((sh, meth, b, m))
                if p is None:
                    cells.append("n/a")
                    continue
                ref = get.get((sh, "vllm_bf16", None, m)) or get.get((sh, "torch", None, m))
                mar = get.get((sh, "marlin", None, m))
                cell = f"{p.us:.1f}" + (" [D]" if meth == "kbit" and p.path == "dequant" else "")
                if meth.startswith("kbit"):
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
