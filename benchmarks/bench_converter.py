# SPDX-License-Identifier: Apache-2.0
"""Time and peak memory of the checkpoint converter on random-weight checkpoints made with
transformers: the tiny Llama and Qwen3-MoE of the tests and a bigger Llama-style model.
Each conversion runs in its own process (`python -m vllm_kbit.quantize`); the peak RSS is
the one that process reports for itself. Writes a JSON and a markdown table.

    python benchmarks/bench_converter.py --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODELS = {
    "llama-tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128)),
    "qwen3moe-tiny": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        num_experts=4, num_experts_per_tok=2, vocab_size=128,
                                        head_dim=16)),
    "llama-311m": ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                 num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)),
}  # fmt: skip


def build(kind: str, cfg: dict, path: Path) -> int:
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg))
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def convert(src: Path, dst: Path, bits: int, device: str) -> dict:
    cmd = [sys.executable, "-m", "vllm_kbit.quantize", "--model", str(src), "--out", str(dst),
           "--bits", str(bits), "--device", device]  # fmt: skip
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if out.returncode:
        raise RuntimeError(f"converter failed: {out.stderr[-2000:]}")
    report = json.loads((dst / "kbit_quantize_report.json").read_text())
    # peak RSS as the converter process itself measured it (resource.getrusage at its end)
    return {"wall_s": wall, "peak_rss_gb": report["totals"]["peak_rss_gb"], "report_totals": report["totals"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            kind, cfg = MODELS[name]
            src, dst = Path(tmp) / name, Path(tmp) / f"{name}-kbit{args.bits}"
            n = build(kind, cfg, src)
            r = convert(src, dst, args.bits, args.device) | {"model": name, "params": n}
            print(json.dumps(r), flush=True)
            rows.append(r)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["benchmarks/bench_converter.py"] + sys.argv[1:]),
            "host_cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available()}  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_converter.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Converter time and peak memory (k={args.bits})", ""] + [f"- {k}: `{v}`" for k, v in meta.items()]
    lines += ["", "| model | params | device | wall s (whole process) | peak RSS GB | in GB | out GB | ratio |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        t = r["report_totals"]
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {t.get('device')} | {r['wall_s']:.1f} | "
                     f"{r['peak_rss_gb']:.2f} | {t.get('original_gb', float('nan')):.3f} | "
                     f"{t.get('new_gb', float('nan')):.3f} | {t.get('ratio', float('nan')):.3f} |")  # fmt: skip
    (out / "bench_converter.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
