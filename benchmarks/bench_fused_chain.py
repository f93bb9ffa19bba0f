# SPDX-License-Identifier: Apache-2.0
"""Decode time of a chain of Llama-style decoder layers' linear parts, with and without the
norm / activation folded into the kbit GEMVs (vllm_kbit/fusion.py, kbit::linear_add_rms_norm /
linear_silu_mul).

Per layer: add + rms norm -> qkv -> attention stand-in (one elementwise kernel) -> o -> add + rms
norm -> gate_up -> silu * up -> down. Variants, each the whole chain in one CUDA graph:
  inductor  the elementwise ops compiled by torch.compile (Triton kernels, as vLLM runs them)
            + kbit::linear
  separate  kbit::linear_add_rms_norm / linear_silu_mul with KBIT_FUSED_GEMV=0 (kbit's own
            elementwise kernel, then kbit::linear)
  fused     the same ops folded into the GEMV (the default at M <= 8)
Diagnostic variants (--variants), to price the folded prologues:
  fused_nosilu  the norms folded as in `fused`, but down is a plain kbit::linear of gu[:, :I]
                (no activation: fused - fused_nosilu = the SiLU prologue's cost)
  bare          the four kbit::linear calls only, no norm and no activation (a lower bound:
                fused_nosilu - bare = the two norm prologues' cost)
A variant may carry environment settings: `--variant d1:KBIT_GEMV_D1_MAX=8` defines `d1`, and
`fused+d1` in --variants is `fused` run with KBIT_GEMV_D1_MAX=8 (as bench_e2e.py's --variant).
Every layer has its own weights (32 layers of Llama-3.1-8B: 2-4 GB, far beyond L2). Timed with
benchmarks/timing.py (graph replays, CUDA events, median; the variants interleaved).

  python benchmarks/bench_fused_chain.py --bits 2,4 --m 1,4 --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_env import parse_variant  # noqa: E402
from timing import run_metadata, time_interleaved, with_env, write_results  # noqa: E402

from vllm_kbit import _ops  # noqa: E402
from vllm_kbit import reference as ref  # noqa: E402
from vllm_kbit.format import default_codebook  # noqa: E402

H, I, QKV = 4096, 14336, 6144  # Llama-3.1-8B
# Variants computing the decoder chain (compared with inductor), then the diagnostic ones (another
# function: timed only).
SAME_FUNCTION = ("inductor", "separate", "fused")
DIAGNOSTIC = ("fused_nosilu", "bare")


def _layer_weights(bits: int, cb: torch.Tensor, gen: torch.Generator) -> dict:
    """Random codes and absmax in the tiled layout (kbit::quantize of random weights is slow at
    this size; the kernels' time does not depend on the values)."""
    w = {}
    for name, (n, k) in {"qkv": (QKV, H), "o": (H, H), "gu": (2 * I, H), "down": (H, I)}.items():
        _, _, words, nbytes = ref.tiled_shape(n, k, bits)
        q = torch.randint(-(2**31), 2**31 - 1, (words,), generator=gen, dtype=torch.int64)
        a = torch.randint(90, 110, (nbytes,), generator=gen, dtype=torch.int64)  # absmax ~ 2^-2
        w[name] = (q.to(torch.int32).cuda(), a.to(torch.uint8).cuda(), n)
    w["nw1"] = (torch.rand(H, generator=gen) + 0.5).half().cuda()
    w["nw2"] = (torch.rand(H, generator=gen) + 0.5).half().cuda()
    return w


def _chain(layers: list[dict], bits: int, cb: torch.Tensor, x: torch.Tensor, variant: str,
           extra_env: dict[str, str]):
    K = torch.ops.kbit
    norm = torch.compile(ref.add_rms_norm, fullgraph=True, dynamic=False)
    silu = torch.compile(ref.silu_mul, fullgraph=True, dynamic=False)

    def lin(t, w):
        return K.linear(t, w[0], w[1], cb, bits, w[2])

    def run() -> torch.Tensor:
        h, res = x, torch.zeros_like(x)
        for w in layers:
            if variant == "inductor":
                hn, res = norm(h, res, w["nw1"], 1e-5)
                qkv = lin(hn, w["qkv"])
            elif variant == "bare":
                qkv = lin(h, w["qkv"])
            else:
                qkv, res = K.linear_add_rms_norm(h, res, w["nw1"], 1e-5, *w["qkv"][:2], cb, bits, QKV)
            attn = qkv[:, :H] * 0.5  # stand-in: one elementwise kernel, as attention is not kbit's
            h = lin(attn, w["o"])
            if variant == "inductor":
                hn, res = norm(h, res, w["nw2"], 1e-5)
                gu = lin(hn, w["gu"])
                h = lin(silu(gu), w["down"])
            elif variant == "bare":
                h = lin(lin(h, w["gu"])[:, :I], w["down"])
            else:
                gu, res = K.linear_add_rms_norm(h, res, w["nw2"], 1e-5, *w["gu"][:2], cb, bits, 2 * I)
                if variant == "fused_nosilu":
                    h = lin(gu[:, :I], w["down"])
                else:
                    h = K.linear_silu_mul(gu, *w["down"][:2], cb, bits, H)
        return h

    env = {"KBIT_FUSED_GEMV": "0" if variant == "separate" else "1", **extra_env}
    return with_env(env, run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--variants", default="inductor,separate,fused",
                    help="comma list; inductor first (the reference of the deviations and ratios)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KBIT_VAR=VAL,...",
                    help="environment settings NAME stands for in --variants entries BASE+NAME")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    variants = tuple(args.variants.split(","))
    known = SAME_FUNCTION + DIAGNOSTIC
    try:
        env_of = dict(parse_variant(v) for v in args.variant)
    except ValueError as e:
        ap.error(str(e))
    base = {v: v.partition("+")[0] for v in variants}
    if (variants[0] != "inductor" or not set(base.values()) <= set(known)
            or any("+" in v and v.partition("+")[2] not in env_of for v in variants)):
        ap.error(f"--variants: inductor first, then any of {known[1:]}, each optionally +NAME of a "
                 f"--variant ({sorted(env_of)}); got {args.variants!r}")
    _ops.load()
    meta = run_metadata()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for bits in (int(b) for b in args.bits.split(",")):
        cb = default_codebook(bits).cuda()
        layers = [_layer_weights(bits, cb, gen) for _ in range(args.layers)]
        for m in (int(v) for v in args.m.split(",")):
            x = (torch.randn(m, H, generator=gen) * 0.5).half().cuda()
            fns = {v: [_chain(layers, bits, cb, x, base[v], env_of.get(v.partition("+")[2], {}))]
                   for v in variants}
            outs = {v: fns[v][0]() for v in variants}
            same = [v for v in variants if base[v] in SAME_FUNCTION]
            dev = max((outs[v].float() - outs["inductor"].float()).abs().max().item() for v in same)
            times = time_interleaved(fns, min_reps=20, max_reps=100, target_s=0.5)
            row = {"bits": bits, "m": m, "layers": args.layers, "max_abs_diff_vs_inductor": dev}
            for v in variants:
                t = times[v]
                if isinstance(t, Exception):
                    raise t
                row[f"{v}_us_per_layer"] = round(t.us / args.layers, 2)
                row[f"{v}_method"] = t.method
            for v in variants[1:]:
                row[f"{v}_x_inductor"] = round(row[f"{v}_us_per_layer"] / row["inductor_us_per_layer"], 3)
            rows.append(row)
            print(row, flush=True)
        del layers
        torch.cuda.empty_cache()
    table = ["| k | M | " + " | ".join(variants) + " | "
             + " | ".join(f"{v} x inductor" for v in variants[1:]) + " |",
             "|---|---|" + "---|" * (2 * len(variants) - 1)]  # fmt: skip
    for r in rows:
        table.append(f"| {r['bits']} | {r['m']} | "
                     + " | ".join(str(r[f"{v}_us_per_layer"]) for v in variants) + " | "
                     + " | ".join(f"{r[f'{v}_x_inductor']}x" for v in variants[1:]) + " |")  # fmt: skip
    write_results(args.out_dir, f"bench_fused_chain_{meta.get('device_short', 'cpu')}{args.tag}",
                  meta, rows, "Decoder-layer chain, norm / activation folded into the GEMV",
                  [f"{args.layers} Llama-3.1-8B layers' linear parts in one CUDA graph, median of "
                   "graph replays (us per layer); see the script's docstring for the variants"],
                  table)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
