# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the A/B timing tools: tools/ab_table.py (medians over rounds and ratios from
synthetic benchmark JSON) and the usage errors of tools/ab_base.sh and tools/gpu_ab.sh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import ab_table


def _write(d: Path, name: str, points: list[dict]) -> None:
    (d / name).write_text(json.dumps({"meta": {}, "points": points}))


def test_ab_table(tmp_path: Path, capsys) -> None:
    moe = lambda us, m=1, status="ok": {"shape": "qwen3", "method": "kbit", "bits": 4, "m": m,  # noqa: E731
                                        "us": us, "status": status}  # fmt: skip
    lin = lambda us: {"model": "8b", "shape": "qkv", "method": "gemv", "bits": 2, "m": 1, "us": us}  # noqa: E731
    _write(tmp_path, "bench_moe_ab_base1.json", [moe(20.0), moe(30.0, m=2)])
    _write(tmp_path, "bench_moe_ab_base2.json", [moe(22.0), moe(31.0, m=2)])
    _write(tmp_path, "bench_moe_ab_co1.json", [moe(18.0), moe(1.0, m=2, status="failed")])
    _write(tmp_path, "bench_moe_ab_co2.json", [moe(19.0)])
    _write(tmp_path, "bench_moe_ab_co3.json", [moe(50.0)])
    _write(tmp_path, "bench_linear_h100_ab_base1.json", [lin(10.0)])
    _write(tmp_path, "bench_linear_h100_ab_co1.json", [lin(9.0)])
    _write(tmp_path, "bench_moe_h100_s12.json", [moe(1.0)])  # not an A/B file
    data = ab_table.collect(tmp_path)
    assert data[("bench_moe", "qwen3", "kbit", 4, 1)] == {"base": [20.0, 22.0], "co": [18.0, 19.0, 50.0]}
    assert data[("bench_moe", "qwen3", "kbit", 4, 2)] == {"base": [30.0, 31.0]}  # failed point dropped
    out = tmp_path / "t.md"
    ab_table.main([str(tmp_path), "base", "co", "--out", str(out)])
    lines = out.read_text().splitlines()
    assert "| bench_moe | qwen3 | kbit | 4 | 1 | 21.00 (2) | 19.00 (3) | 0.905 |" in lines
    assert "| bench_linear | 8b qkv | gemv | 2 | 1 | 10.00 (1) | 9.00 (1) | 0.900 |" in lines
    assert not any("| 4 | 2 |" in x for x in lines)  # one variant only: no row
    assert capsys.readouterr().out.strip().endswith(lines[-1])


def test_ab_scripts_usage() -> None:
    for script in ("ab_base.sh", "gpu_ab.sh"):
        r = subprocess.run(["bash", str(REPO / "tools" / script), "nonsense"], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and "usage" in r.stderr, (script, r.stderr)
