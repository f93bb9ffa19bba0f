# SPDX-License-Identifier: Apache-2.0
"""Where the GPU time of a vLLM run goes, from a torch.profiler (Kineto) chrome trace: kernel
time per output token by kernel family, the kernels that take the most, and how much of the
traced span the GPU was idle (launch and host gaps; kernels that overlap through programmatic
dependent launch are counted once in the busy time), by gap length and by the pair of kernels
around each gap.

Used by ``bench_e2e.py --profile`` (vLLM's own torch profiler, ``profiler_config``); usable alone:
``python3 benchmarks/trace_summary.py TRACE.json[.gz] OUTPUT_TOKENS``.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# (family, pattern on the demangled kernel name); the first match wins, "other" takes the rest.
FAMILIES: list[tuple[str, re.Pattern]] = [
    (name, re.compile(pat))
    for name, pat in [
        # modes 0 / 3 of gemv.cuh: single n-tiles, paired n-tiles (kDensePair)
        ("kbit GEMV (dense)", r"gemv_kernel<\d, [^,]+, [03]>"),
        ("kbit MoE gate_up GEMV", r"gemv_kernel<\d, [^,]+, 1>"),
        ("kbit MoE down GEMV", r"gemv_kernel<\d, [^,]+, 2>"),
        ("kbit other", r"kbit::"),
        ("attention", r"(?i)flash|fmha|attn|attention|paged"),
        # before the MoE pattern: inductor names the fused residual-add + RMSNorm in front of a
        # MoE block "..._rms_norm_moe_forward_0"
        ("norm", r"(?i)norm"),
        ("MoE routing / unquantized experts", r"(?i)topk|moe|expert|align_block"),
        ("GEMM (cuBLAS / CUTLASS)", r"(?i)gemm|nvjet|cutlass|xmma|cublas|splitk|gemv"),
        ("rotary", r"(?i)rotary|rope"),
        ("sampling", r"(?i)argmax|sampl|softmax|penalt|gumbel"),
        ("triton (inductor fused)", r"^triton_"),
    ]
]
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def family(name: str, cat: str = "kernel") -> str:
    if cat != "kernel":
        return "copy / memset"
    return next((fam for fam, pat in FAMILIES if pat.search(name)), "other")


def load_trace(path: str | Path) -> dict:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        return json.load(f)


# Idle gaps by length (us): inside a CUDA graph consecutive kernels are ~1-2 us apart; longer
# gaps are host time (between graph replays, steps, syncs).
GAP_BUCKETS = ((0.0, 3.0, "< 3 us"), (3.0, 20.0, "3-20 us"), (20.0, float("inf"), ">= 20 us"))


def short_name(name: str) -> str:
    """A kernel's name without return type, template arguments and parameters."""
    n = re.sub(r"^void ", "", name).replace("(anonymous namespace)::", "")
    return re.split(r"[<(]", n, maxsplit=1)[0].strip()[-60:] or name[:60]


def _gaps(ev: list[dict]) -> list[tuple[float, str, str]]:
    """Idle gaps of the GPU timeline: (length us, kernel that ended last, kernel that starts).
    The busy time (the union of the events' intervals) is the span minus their sum."""
    out, end, last = [], None, ""
    for e in sorted(ev, key=lambda e: float(e["ts"])):
        s, f = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if end is not None and s > end:
            out.append((s - end, last, short_name(e["name"])))
        if end is None or f >= end:
            end, last = f, short_name(e["name"])
    return out


def summarize(trace: dict, tokens: int, top: int = 12) -> dict:
    """Per output token (us): traced GPU span, GPU busy time, kernel time by family, the `top`
    kernels by time. `tokens` = output tokens generated while the trace was recorded."""
    if tokens <= 0:
        raise ValueError(f"trace_summary: tokens must be positive, got {tokens}")
    ev = [e for e in trace.get("traceEvents", [])
          if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]  # fmt: skip
    if not ev:
        raise ValueError("trace_summary: the trace has no GPU kernel events")
    iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev]
    span = max(b for _, b in iv) - min(a for a, _ in iv)
    fam_us: dict[str, float] = defaultdict(float)
    fam_n: dict[str, int] = defaultdict(int)
    ker_us: dict[str, float] = defaultdict(float)
    ker_n: dict[str, int] = defaultdict(int)
    for e in ev:
        f = family(e["name"], e["cat"])
        fam_us[f] += float(e["dur"])
        fam_n[f] += 1
        ker_us[e["name"]] += float(e["dur"])
        ker_n[e["name"]] += 1
    gaps = _gaps(ev)
    busy = span - sum(g for g, _, _ in gaps)
    pair_us: dict[str, float] = defaultdict(float)
    pair_n: dict[str, int] = defaultdict(int)
    for g, a, b in gaps:
        pair_us[f"{a} -> {b}"] += g
        pair_n[f"{a} -> {b}"] += 1
    return {
        "tokens": tokens,
        "kernels": len(ev),
        "span_us_per_token": span / tokens,
        "busy_us_per_token": busy / tokens,
        "kernel_us_per_token": sum(fam_us.values()) / tokens,
        "idle_fraction": 1.0 - busy / span if span > 0 else 0.0,
        "families": {f: {"us_per_token": fam_us[f] / tokens, "launches_per_token": fam_n[f] / tokens}
                     for f in sorted(fam_us, key=fam_us.get, reverse=True)},  # fmt: skip
        "top_kernels": [{"name": k[:160], "us_per_token": ker_us[k] / tokens,
                         "launches_per_token": ker_n[k] / tokens}
                        for k in sorted(ker_us, key=ker_us.get, reverse=True)[:top]],  # fmt: skip
        # idle time by gap length, and the kernel pairs with the most idle time between them
        "gaps": {label: {"us_per_token": sum(g for g, _, _ in gaps if lo <= g < hi) / tokens,
                         "per_token": sum(1 for g, _, _ in gaps if lo <= g < hi) / tokens}
                 for lo, hi, label in GAP_BUCKETS},  # fmt: skip
        "gap_pairs": [{"pair": k, "us_per_token": pair_us[k] / tokens, "per_token": pair_n[k] / tokens}
                      for k in sorted(pair_us, key=pair_us.get, reverse=True)[:top]],  # fmt: skip
    }


def table(profiles: dict[str, dict]) -> list[str]:
    """Markdown: one column per method (us per output token), then each method's top kernels."""
    methods = list(profiles)
    fams = list(dict.fromkeys(f for m in methods for f in profiles[m]["families"]))
    lines = ["| us per output token | " + " | ".join(methods) + " |",
             "|---|" + "---|" * len(methods)]  # fmt: skip
    for key, label in [("span_us_per_token", "traced GPU span"),
                       ("busy_us_per_token", "GPU busy (overlaps counted once)"),
                       ("kernel_us_per_token", "sum of kernel times")]:  # fmt: skip
        lines.append(f"| {label} | " + " | ".join(f"{profiles[m][key]:.1f}" for m in methods) + " |")
    lines.append("| GPU idle share of the span | "
                 + " | ".join(f"{100 * profiles[m]['idle_fraction']:.1f}%" for m in methods) + " |")  # fmt: skip
    for lo, hi, label in GAP_BUCKETS:
        cells = [profiles[m].get("gaps", {}).get(label) for m in methods]
        lines.append(f"| idle in gaps {label} (gaps per token) | " + " | ".join(
            f"{c['us_per_token']:.1f} ({c['per_token']:.0f})" if c else "-" for c in cells) + " |")  # fmt: skip
    for f in fams:
        cells = []
        for m in methods:
            v = profiles[m]["families"].get(f)
            cells.append(f"{v['us_per_token']:.1f} ({v['launches_per_token']:.0f})" if v else "-")
        lines.append(f"| {f} (launches) | " + " | ".join(cells) + " |")
    for m in methods:
        lines += ["", f"Top kernels, {m} (us per output token, launches per token):", ""]
        lines += [f"- {k['us_per_token']:.1f} us, {k['launches_per_token']:.0f}x: `{k['name']}`"
                  for k in profiles[m]["top_kernels"]]  # fmt: skip
        if profiles[m].get("gap_pairs"):
            lines += ["", f"Most idle time between two kernels, {m} (us per output token, gaps per "
                      "token: kernel that ended last -> kernel that starts):", ""]  # fmt: skip
            lines += [f"- {g['us_per_token']:.1f} us, {g['per_token']:.1f}x: `{g['pair']}`"
                      for g in profiles[m]["gap_pairs"][:8]]  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: trace_summary.py TRACE.json[.gz] OUTPUT_TOKENS")
    s = summarize(load_trace(args[0]), int(args[1]))
    print("\n".join(table({Path(args[0]).name: s})))


if __name__ == "__main__":
    main()
