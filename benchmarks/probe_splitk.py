# SPDX-License-Identifier: Apache-2.0
"""Split-K probe of kbit::mma: each kernel (mma.sync, and the warp-specialized wgmma kernel with
configuration C1 / C2 / C3 forced) at its own split choice ("auto") and with KBIT_MMA_SPLITS
forced to 1 / 2 / 4 / 8, each through the cluster (DSMEM) and the workspace reduction
(KBIT_MMA_FORCE_CLUSTER=1 / KBIT_MMA_NO_CLUSTER=1), k=4, fp16, Llama-3.1 8B / 70B shapes.
All variants of one (shape, M, kernel) are timed interleaved (benchmarks/timing.py: CUDA-graph
replays over weight copies > 3x L2, medians). Writes probe_splitk<tag>.{json,md} under --out-dir.

    python3 benchmarks/probe_splitk.py --m 64,128 --out-dir benchmarks/results --tag _h100_s6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import copies_needed, l2_cache_bytes, run_metadata, time_interleaved, with_env

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096),
          "8b.down": (4096, 14336), "70b.qkv": (10240, 8192), "70b.o": (8192, 8192),
          "70b.down": (8192, 28672)}  # fmt: skip
KERNELS = {
    "mma": {"KBIT_MMA_WGMMA": "0"},
    **{f"c{c}": {"KBIT_MMA_WGMMA": "2", "KBIT_WGMMA_CONFIG": str(c)} for c in (1, 2, 3, 5)},
}
VARIANTS = {
    "auto": {},
    "auto_cl": {"KBIT_MMA_FORCE_CLUSTER": "1"},
    "auto_ws": {"KBIT_MMA_NO_CLUSTER": "1"},
}
for _s in (1, 2, 4, 8):
    VARIANTS[f"s{_s}"] = {"KBIT_MMA_SPLITS": str(_s), "KBIT_MMA_FORCE_CLUSTER": "1"}
    if _s > 1:
        VARIANTS[f"s{_s}_ws"] = {"KBIT_MMA_SPLITS": str(_s), "KBIT_MMA_NO_CLUSTER": "1"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--m", default="64,128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--time-budget-s", type=float, default=240.0)
    a = ap.parse_args(argv)
    import vllm_kbit._ops as ops
    from vllm_kbit.format import default_codebook

    if ops.load() != "compiled":
        raise SystemExit("probe_splitk: vllm_kbit._C is not built")
    kops, bits = torch.ops.kbit, 4
    cb = default_codebook(bits).cuda()
    ms = [int(v) for v in a.m.split(",")]
    rows, t0, l2 = [], time.time(), l2_cache_bytes()
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        q0, a0 = kops.repack(*kops.quantize(w, cb, bits), bits)
        del w
        copies = copies_needed(q0.numel() * q0.element_size(), l2, 3.0, 32)
        weights = [(q0.clone(), a0.clone()) for _ in range(copies)]
        for m in ms:
            if time.time() - t0 > a.time_budget_s:
                break
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            for kern, kenv in KERNELS.items():
                groups = {v: [with_env({**kenv, **venv}, lambda q=q, s=s, x=x, n=n: kops.mma(x, q, s, cb, bits, n))
                              for q, s in weights] for v, venv in VARIANTS.items()}  # fmt: skip
                res = time_interleaved(groups)
                row = {"shape": name, "n": n, "k": k, "m": m, "kernel": kern}
                row.update({v: round(t.us, 1) if not isinstance(t, Exception) else None
                            for v, t in res.items()})  # fmt: skip
                rows.append(row)
                print(" ".join(f"{key}={val}" for key, val in row.items()), flush=True)
        del weights
    a.out_dir.mkdir(parents=True, exist_ok=True)
    meta = run_metadata()
    (a.out_dir / f"probe_splitk{a.tag}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    cols = list(VARIANTS)
    md = [f"# kbit::mma split-K probe: {meta.get('device', '?')}", "",
          *[f"- {key}: `{val}`" for key, val in meta.items()], "",
          ("µs per call, k=4 fp16; auto = the op's own split and reduction choice, _cl = cluster "
          "(DSMEM) forced, _ws = workspace; sN = N splits (cluster where the GPU has it)."), "",
          "| shape | M | kernel | " + " | ".join(cols) + " |",
          "|---|---|---|" + "---|" * len(cols)]  # fmt: skip
    for r in rows:
        md.append(
            f"| {r['shape']} | {r['m']} | {r['kernel']} | "
            + " | ".join("-" if r[c] is None else f"{r[c]:.1f}" for c in cols)
            + " |"
        )
    (a.out_dir / f"probe_splitk{a.tag}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
