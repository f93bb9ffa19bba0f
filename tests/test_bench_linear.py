# SPDX-License-Identifier: Apache-2.0
"""CPU tests of bench_linear.py's --wgmma2-config option: the warp-specialized wgmma kernel timed
once per forced tile configuration (KBIT_MMA_WGMMA=2, KBIT_WGMMA_CONFIG=N) as path mma_wg2_c<N>.
On the CPU kbit::mma is the reference op, so the paths run (and must agree with it) but the
configuration itself only matters on an sm_90a GPU; what is checked here is the plan, the
environment each call sees, the checks, the tables and that the environment is restored."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_linear as bl

BASE = ["--device", "cpu", "--shapes", "t.a:16x256", "--bits", "4", "--baselines", "none",
        "--min-reps", "1", "--max-reps", "1", "--warmup", "0"]  # fmt: skip


def test_parse_wgmma2_config() -> None:
    cfg = bl.parse_args(["--wgmma2-config", "4,1,4"])
    assert cfg.wgmma2_configs == [1, 4] and cfg.wgmma and not cfg.wgmma2
    assert bl.kbit_paths(cfg) == ["gemv", "mma", "mma_wg", "mma_wg2_c1", "mma_wg2_c4", "dequant",
                                  "linear"]  # fmt: skip
    assert bl.kbit_paths(cfg, 32) == ["mma", "dequant", "linear"]  # wgmma paths above M = 32
    assert bl.kbit_paths(cfg, 33) == ["mma", "mma_wg", "mma_wg2_c1", "mma_wg2_c4", "dequant",
                                      "linear"]  # fmt: skip
    both = bl.parse_args(["--wgmma2", "--wgmma2-config", "1,2,3,4"])
    assert bl.kbit_paths(both)[1:8] == ["mma", "mma_wg", "mma_wg2", "mma_wg2_c1", "mma_wg2_c2",
                                        "mma_wg2_c3", "mma_wg2_c4"]  # fmt: skip
    plain = bl.parse_args([])
    assert plain.wgmma2_configs == [] and not plain.wgmma
    assert bl.kbit_paths(plain) == list(bl.KBIT_PATHS)
    for bad in ("6", "0", "1,x", ""):
        with pytest.raises(SystemExit):
            bl.parse_args(["--wgmma2-config", bad])


def test_parse_paths() -> None:
    cfg = bl.parse_args(["--paths", "linear,gemv", "--m", "1,64", "--shapes", "t.a:64x256",
                         "--bits", "4", "--baselines", "none"])  # fmt: skip
    assert bl.kbit_paths(cfg) == ["gemv", "linear"]  # run order stays KBIT_PATHS order
    assert bl.kbit_paths(cfg, 64) == ["linear"]  # gemv only up to --gemv-max-m
    assert [(meth, m) for _, meth, _, m in bl.plan(cfg)] == [("gemv", 1), ("linear", 1), ("linear", 64)]
    # wgmma paths go after mma, or at the end when mma is not timed
    assert bl.kbit_paths(bl.parse_args(["--paths", "gemv", "--wgmma"]), 64) == ["mma_wg"]
    assert bl.kbit_paths(bl.parse_args(["--paths", "mma,linear", "--wgmma"]), 64) == ["mma", "mma_wg", "linear"]
    for bad in ("foo", "gemv,bar", "", ","):
        with pytest.raises(SystemExit):
            bl.parse_args(["--paths", bad])


def test_wg2_path_names() -> None:
    for c in bl.WG2_CONFIGS:
        path = bl.wg2_config_path(c)
        assert bl.wg2_config_of(path) == c and bl.is_wg_path(path)
        assert bl.check_ms(path) == bl.CHECK_MS["mma_wg2"]
    for other in ("mma", "mma_wg2", "mma_wg2_c", "mma_wg2_c6", "mma_wg2_cx", "gemv"):
        assert bl.wg2_config_of(other) is None
    assert bl.is_wg_path("mma_wg") and bl.is_wg_path("mma_wg2") and not bl.is_wg_path("mma")
    assert bl.check_ms("gemv") == bl.CHECK_MS["gemv"]
    # the plan / estimate take the new paths like the others (kbit weight bytes)
    cfg = bl.parse_args(["--shapes", "t.a:64x256", "--bits", "4", "--m", "16,64",
                         "--baselines", "none", "--wgmma2-config", "1,4"])  # fmt: skip
    pts = [(meth, m) for _, meth, _, m in bl.plan(cfg)]
    assert ("mma_wg2_c4", 64) in pts and ("mma_wg2_c4", 16) not in pts
    assert bl.estimate_seconds(cfg) > 0


def test_kbit_fn_sets_and_restores_env(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str | None, str | None]] = []

    def fake_mma(*args: object) -> torch.Tensor:
        seen.append((os.environ.get("KBIT_MMA_WGMMA"), os.environ.get("KBIT_WGMMA_CONFIG")))
        return torch.zeros(1)

    monkeypatch.setattr(torch.ops.kbit, "mma", fake_mma, raising=False)  # ops may be unloaded
    monkeypatch.delenv("KBIT_MMA_WGMMA", raising=False)
    monkeypatch.delenv("KBIT_WGMMA_CONFIG", raising=False)
    x = torch.zeros(64, 256)
    for path in ("mma_wg2_c1", "mma_wg2_c4", "mma_wg2", "mma_wg"):
        bl.kbit_fn(path, x, x, x, x, 4, 16, True)()
    bl.kbit_fn("mma", x, x, x, x, 4, 16, True)()
    assert seen == [("2", "1"), ("2", "4"), ("2", None), ("1", None), ("0", None)]
    assert "KBIT_MMA_WGMMA" not in os.environ and "KBIT_WGMMA_CONFIG" not in os.environ
    # a value set for the whole run is restored after the call (and wins for mma_wg2)
    monkeypatch.setenv("KBIT_WGMMA_CONFIG", "3")
    seen.clear()
    bl.kbit_fn("mma_wg2_c4", x, x, x, x, 4, 16, True)()
    bl.kbit_fn("mma_wg2", x, x, x, x, 4, 16, True)()
    assert seen == [("2", "4"), ("2", "3")] and os.environ["KBIT_WGMMA_CONFIG"] == "3"


def test_main_cpu_wgmma2_configs(tmp_path: Path) -> None:
    # every forced configuration is checked at CHECK_MS["mma_wg2"] and timed above M = 32 as its
    # own column, beside mma (mma.sync) and mma_wg
    argv = [*BASE, "--m", "16,64", "--wgmma2-config", "1,2,3,4,5", "--out-dir", str(tmp_path)]
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu.json").read_text())
    by = {(p["method"], p["m"]): p for p in doc["points"]}
    for c in bl.WG2_CONFIGS:
        path = f"mma_wg2_c{c}"
        assert by[(path, 64)]["status"] == "ok" and by[(path, 64)]["us"] > 0
        assert (path, 16) not in by
        checks = [ch for ch in doc["checks"] if ch["method"] == path]
        assert [ch["m"] for ch in checks] == list(bl.CHECK_MS["mma_wg2"])
        assert all(ch["ok"] for ch in checks)
    assert ("mma_wg2", 64) not in by and by[("mma_wg", 64)]["status"] == "ok"
    md = (tmp_path / "bench_linear_cpu.md").read_text()
    assert "mma_wg2_c1" in md and "mma_wg2_c4" in md
    assert doc["config"]["wgmma2_configs"] == [1, 2, 3, 4, 5]
    assert "KBIT_MMA_WGMMA" not in os.environ and "KBIT_WGMMA_CONFIG" not in os.environ


def test_main_cpu_wgmma2_configs_interleaved(tmp_path: Path) -> None:
    argv = [*BASE, "--m", "64", "--wgmma2", "--wgmma2-config", "1,4", "--interleave",
            "--out-dir", str(tmp_path)]  # fmt: skip
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu.json").read_text())
    got = [p["method"] for p in doc["points"] if p["m"] == 64]
    assert got == ["mma", "mma_wg", "mma_wg2", "mma_wg2_c1", "mma_wg2_c4", "dequant", "linear"]
    assert all(p["status"] == "ok" for p in doc["points"])
