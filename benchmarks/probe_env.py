# SPDX-License-Identifier: Apache-2.0
"""kbit::mma (or --op gemv / linear) under several settings of its KBIT_* tuning variables, timed
side by side: for each (shape, M, k) every variant's calls are timed interleaved
(benchmarks/timing.py: CUDA-graph replays over weight copies > 3x L2, medians), and every
variant's output is checked against x @ dequantize(W)^T in fp32 (rel err > 1e-2 is flagged).
Variants are named settings:

    --variant nt2:KBIT_MMA_WGMMA=0 --variant nt4:KBIT_MMA_WGMMA=0,KBIT_MMA_NT=4

Shapes: model layers of benchmarks/shapes.py (--models 8b,70b) and/or --shapes name:NxK,...
Writes probe_env<tag>.{json,md} under --out-dir; the first variant is the ratio baseline.

    python3 benchmarks/probe_env.py --models 8b --m 48,64 --bits 2,4 \\
        --variant base: --variant nt4:KBIT_MMA_NT=4 --tag _h100_s21
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import model_shapes, parse_shapes
from timing import copies_needed, l2_cache_bytes, run_metadata, time_interleaved, with_env

REL_ERR_LIMIT = 1e-2


def parse_variant(spec: str, prefixes: tuple[str, ...] = ("KBIT_",)) -> tuple[str, dict[str, str]]:
    """'name:K=V,K=V' -> (name, {K: V}); 'name:' is the environment as it is. Only variables
    starting with one of `prefixes` (this script: the kernels' KBIT_*; bench_e2e.py, whose
    workers are fresh vLLM processes, also VLLM_*)."""
    name, sep, rest = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"--variant {spec!r}: expected NAME:[VAR=VALUE,...]")
    env = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key.startswith(prefixes):
            want = " or ".join(f"{p}VAR=VALUE" for p in prefixes)
            raise ValueError(f"--variant {spec!r}: {item!r} is not {want}")
        env[key] = val
    return name, env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="8b", help="benchmarks/shapes.py models (comma list) or ''")
    ap.add_argument("--shapes", default="", help="extra shapes name:NxK,...")
    ap.add_argument("--m", default="64")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--op", default="mma", choices=["mma", "gemv", "linear"],
                    help="the kbit op timed (gemv: M <= 8; linear: the dispatching op)")
    ap.add_argument("--variant", action="append", required=True, help="NAME:[KBIT_VAR=VALUE,...]")
    ap.add_argument("--pre-kernel", action="store_true",
                    help="precede each call by an elementwise kernel that writes the op's x (as "
                         "vLLM's norms and activations precede every linear layer): times include "
                         "it, so PDL variants are compared behind a predecessor without PDL")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--time-budget-s", type=float, default=300.0)
    a = ap.parse_args(argv)
    ms, bits_list = [int(v) for v in a.m.split(",")], [int(v) for v in a.bits.split(",")]
    if a.op == "gemv" and max(ms) > 8:
        raise SystemExit(f"probe_env: --op gemv takes M <= 8, got --m {a.m}")
    import vllm_kbit._ops as ops
    from vllm_kbit.format import default_codebook

    if ops.load() != "compiled":
        raise SystemExit("probe_env: vllm_kbit._C is not built")
    variants = dict(parse_variant(v) for v in a.variant)
    shapes = model_shapes(a.models.split(",")) if a.models else []
    shapes += parse_shapes(a.shapes) if a.shapes else []
    dt = getattr(torch, a.dtype)
    kops, rows, t0, l2 = torch.ops.kbit, [], time.time(), l2_cache_bytes()
    op = getattr(kops, a.op)
    for sh in shapes:
        for bits in bits_list:
            if time.time() - t0 > a.time_budget_s:
                break
            cb = default_codebook(bits).cuda()
            w = torch.randn(sh.n, sh.k, device="cuda", dtype=dt) * 0.02
            q0, a0 = kops.repack(*kops.quantize(w, cb, bits), bits)
            wdq = kops.dequantize_tiled(q0, a0, cb, bits, sh.n, sh.k, dt).float()
            del w
            copies = copies_needed(q0.numel() * q0.element_size(), l2, 3.0, 32)
            weights = [(q0, a0)] + [(q0.clone(), a0.clone()) for _ in range(copies - 1)]
            for m in ms:
                x = torch.randn(m, sh.k, device="cuda", dtype=dt)
                ref = x.float() @ wdq.t()
                row: dict[str, object] = {"shape": sh.label, "n": sh.n, "k": sh.k, "m": m,
                                          "bits": bits}  # fmt: skip
                for name, env in variants.items():
                    y = with_env(env, lambda x=x, n=sh.n: op(x, q0, a0, cb, bits, n))()
                    err = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                    row[f"{name}_err"] = err
                xb = torch.empty_like(x)

                def call(q, s, x=x, n=sh.n, xb=xb):
                    if not a.pre_kernel:
                        return op(x, q, s, cb, bits, n)
                    torch.mul(x, 1.0, out=xb)
                    return op(xb, q, s, cb, bits, n)

                groups = {name: [with_env(env, lambda q=q, s=s: call(q, s)) for q, s in weights]
                          for name, env in variants.items()}  # fmt: skip
                res = time_interleaved(groups)
                for name, t in res.items():
                    row[name] = round(t.us, 2) if not isinstance(t, Exception) else None
                rows.append(row)
                print(json.dumps(row), flush=True)
            del weights, wdq
    names = list(variants)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    meta = run_metadata()
    meta["variants"] = variants
    meta["op"] = f"kbit::{a.op}" + (" behind an elementwise kernel (--pre-kernel)" if a.pre_kernel else "")
    out = a.out_dir / f"probe_env{a.tag}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# kbit::{a.op} under KBIT_* settings: {meta.get('device', '?')}", "",
          *[f"- {key}: `{val}`" for key, val in meta.items()], "",
          f"µs per call ({a.dtype}, medians of interleaved CUDA-graph replays); in brackets the "
          f"ratio to `{names[0]}`; `!` = rel err vs fp32 x @ dequantized W^T above "
          f"{REL_ERR_LIMIT:g}.", "",
          "| shape | M | k | " + " | ".join(names) + " | max rel err |",
          "|---|---|---|" + "---|" * (len(names) + 1)]  # fmt: skip
    bad = 0
    for r in rows:
        cells = []
        for nm in names:
            t, base = r.get(nm), r.get(names[0])
            flag = "!" if r[f"{nm}_err"] > REL_ERR_LIMIT else ""
            bad += bool(flag)
            ratio = f" ({t / base:.2f}x)" if t is not None and base and nm != names[0] else ""
            cells.append("-" if t is None else f"{t:.1f}{flag}{ratio}")
        worst = max(r[f"{nm}_err"] for nm in names)
        md.append(f"| {r['shape']} | {r['m']} | {r['bits']} | " + " | ".join(cells)
                  + f" | {worst:.1e} |")  # fmt: skip
    md += ["", f"{bad} flagged result(s)."]
    (a.out_dir / f"probe_env{a.tag}.md").write_text("\n".join(md) + "\n")
    print(f"probe_env: {len(rows)} rows, {bad} flagged, {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
