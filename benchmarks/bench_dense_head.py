# SPDX-License-Identifier: Apache-2.0
"""kbit::dense_linear (the streaming GEMV that serves kbit's unquantized lm_head) against cuBLAS
(torch.nn.functional.linear, what vLLM's UnquantizedEmbeddingMethod runs) on lm_head shapes.

Both paths get the same x and weight, rotate through weight copies >= 3x L2 (one copy for the
large heads), are captured in CUDA graphs and timed interleaved (benchmarks/timing.py); us per
call (median) and the weight bytes read per second. Each point first checks the GEMV against
float64 (error within 2x cuBLAS's, as tests/test_cuda_dense_linear.py).

  python3 benchmarks/bench_dense_head.py --m 1,2,4,8 --dtypes fp16,bf16 --tag _s41
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import (  # noqa: E402
    copies_needed,
    l2_cache_bytes,
    run_metadata,
    time_interleaved,
    write_results,
)

from vllm_kbit import _ops  # noqa: E402

# (name, vocab rows, hidden): lm_heads of real models and their tensor-parallel shards
SHAPES = {
    "llama3_8b": (128256, 4096),
    "llama3_8b_tp2": (64128, 4096),
    "llama3_70b": (128256, 8192),
    "llama3_70b_tp2": (64128, 8192),
    "qwen3_8b": (151936, 4096),
    "qwen3_30b_a3b": (151936, 2048),
    "mistral_7b": (32768, 4096),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _check(x: torch.Tensor, w: torch.Tensor) -> float:
    """GEMV error vs float64 over cuBLAS's (<= 2 + one rounding step passes)."""
    exact = x.double() @ w.double().t()
    err = (torch.ops.kbit.dense_linear(x, w).double() - exact).abs().max().item()
    base = (torch.nn.functional.linear(x, w).double() - exact).abs().max().item()
    eps = torch.finfo(x.dtype).eps * exact.abs().mean().item()
    if err > 2 * base + eps:
        raise AssertionError(f"kbit::dense_linear error {err:.3g} > 2 x cuBLAS {base:.3g} + {eps:.3g}")
    return err / max(base, 1e-30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--m", default="1,2,4,8")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if _ops.load() != "compiled":
        ap.error("needs the compiled vllm_kbit._C and a GPU")
    meta = run_metadata()
    l2 = l2_cache_bytes()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for dn in args.dtypes.split(","):
            dtype = DTYPES[dn]
            nbytes = n * k * 2
            copies = copies_needed(nbytes, l2)
            ws = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype).cuda() for _ in range(copies)]
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, k, generator=gen).to(dtype).cuda()
                err_ratio = _check(x, ws[0])
                fns = {
                    "dense_gemv": [lambda w=w, x=x: torch.ops.kbit.dense_linear(x, w) for w in ws],
                    "cublas": [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws],
                }
                t = time_interleaved(fns, min_reps=20, max_reps=200, target_s=0.3)
                for v in fns:
                    if isinstance(t[v], Exception):
                        raise t[v]
                row = {"shape": name, "n": n, "k": k, "dtype": dn, "m": m, "copies": copies,
                       "err_vs_cublas_err": round(err_ratio, 3)}  # fmt: skip
                for v in fns:
                    row[f"{v}_us"] = round(t[v].us, 2)
                    row[f"{v}_tbps"] = round(nbytes / t[v].us / 1e6, 3)
                    row[f"{v}_method"] = t[v].method
                row["gemv_x_cublas"] = round(row["dense_gemv_us"] / row["cublas_us"], 3)
                rows.append(row)
                print(row, flush=True)
            del ws
            torch.cuda.empty_cache()
    table = ["| shape | n x K | dtype | M | GEMV us | cuBLAS us | GEMV TB/s | cuBLAS TB/s | "
             "GEMV / cuBLAS |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        table.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['dtype']} | {r['m']} | "
                     f"{r['dense_gemv_us']} | {r['cublas_us']} | {r['dense_gemv_tbps']} | "
                     f"{r['cublas_tbps']} | {r['gemv_x_cublas']}x |")  # fmt: skip
    write_results(args.out_dir, f"bench_dense_head_{meta.get('device_short', 'cpu')}{args.tag}",
                  meta, rows, "Unquantized lm_head: kbit::dense_linear vs cuBLAS",
                  ["us per call, median of interleaved CUDA-graph replays; TB/s = weight bytes / time"],
                  table)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
