# SPDX-License-Identifier: Apache-2.0
"""The A/B table of tools/gpu_ab.sh: for every timing point (benchmark, shape, method, k, M) the
median over rounds of each variant's time, and each variant's ratio to the first one named.

    python3 tools/ab_table.py DIR base epi co [--out FILE.md]

DIR holds bench_moe_ab_<variant><round>.json and bench_linear_<gpu>_ab_<variant><round>.json
(variant names end in a letter, the round is the trailing number)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

NAME = re.compile(r"^(bench_moe|bench_linear)_(?:.*_)?ab_([A-Za-z_]*[A-Za-z])(\d+)\.json$")


def collect(d: Path) -> dict[tuple, dict[str, list[float]]]:
    """(bench, shape, method, bits, m) -> variant -> times (us) over rounds."""
    out: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(d.glob("*.json")):
        m = NAME.match(f.name)
        if m is None:
            continue
        bench, variant = m.group(1), m.group(2)
        for p in json.loads(f.read_text()).get("points", []):
            if p.get("status", "ok") != "ok" or p.get("us") is None:
                continue
            shape = f"{p['model']} {p['shape']}" if "model" in p else p["shape"]
            out[(bench, shape, p["method"], p.get("bits"), p["m"])][variant].append(float(p["us"]))
    return out


def table(data: dict[tuple, dict[str, list[float]]], variants: list[str]) -> list[str]:
    ref = variants[0]
    lines = ["| bench | shape | method | k | M | " + " | ".join(f"{v} us" for v in variants)
             + " | " + " | ".join(f"{v}/{ref}" for v in variants[1:]) + " |",
             "|---|---|---|---|---|" + "---|" * (2 * len(variants) - 1)]  # fmt: skip
    for key in sorted(data, key=lambda k: tuple(str(x) for x in k[:4]) + (k[4],)):
        med = {v: statistics.median(data[key][v]) for v in variants if data[key].get(v)}
        if len(med) < 2:
            continue
        cells = [f"{med[v]:.2f} ({len(data[key][v])})" if v in med else "-" for v in variants]
        ratios = [f"{med[v] / med[ref]:.3f}" if v in med and ref in med else "-" for v in variants[1:]]
        lines.append("| " + " | ".join(str(x) for x in key) + " | " + " | ".join(cells + ratios) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("variants", nargs="+", help="variant names; ratios are to the first")
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    a = ap.parse_args(argv)
    lines = ["Median over rounds (rounds in parentheses)", ""] + table(collect(a.dir), a.variants)
    print("\n".join(lines))
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
