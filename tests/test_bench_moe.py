# SPDX-License-Identifier: Apache-2.0
"""CPU tests of benchmarks/bench_moe.py's pure-Python parts: the kbit series (kbit_moe as
vLLM runs it, the kernel alone, the dequant path forced) on the CPU reference ops, the
markdown of those series, and ``--dry-check``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_moe as bm

from vllm_kbit import _ops, moe_dispatch, reference_moe

_ops.load()


def test_kbit_fn_paths_agree_on_cpu(monkeypatch) -> None:
    e, topk, h, i, bits = 8, 2, 64, 32, 3
    w = bm.kbit_weights(e, h, i, bits, "cpu")
    tw, ids = bm.routing(24, e, topk, 0, "cpu")
    x = torch.randn(24, h).to(torch.bfloat16)
    want = reference_moe.moe_tiled(x, *w, tw, ids, None, bits, i, "silu", False)
    assert torch.equal(bm.kbit_fn(x, w, tw, ids, bits, i, "kernel")(), want)
    assert torch.equal(bm.kbit_fn(x, w, tw, ids, bits, i)(), want)  # auto: CPU -> the kernel op
    gemm = reference_moe.grouped_experts
    got = bm.kbit_fn(x, w, tw, ids, bits, i, "dequant", grouped_gemm=gemm)()
    assert torch.equal(got, want)  # one chunk: the same math
    got = bm.kbit_fn(x, w, tw, ids, bits, i, "dequant", grouped_gemm=gemm, max_bytes=1)()
    assert bm.rel_err(got, want) < 1e-2  # one expert per chunk
    monkeypatch.setitem(moe_dispatch.GROUPED_GEMMS, "cpu", gemm)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_M", 0)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_TPE", 0)
    assert torch.equal(bm.kbit_fn(x, w, tw, ids, bits, i)(), want)  # auto: now the dequant path


def test_markdown_kbit_series() -> None:
    pts = []
    for m, (us_auto, path, us_kernel, us_deq, us_bf16) in {
        1: (30.0, "kernel", 30.0, None, 40.0),
        4096: (1000.0, "dequant", 1800.0, 1000.0, 900.0),
    }.items():
        pts.append(bm.Point("qwen3", "kbit", 4, m, us=us_auto, tbps=1.0, path=path))
        pts.append(bm.Point("qwen3", "kbit_kernel", 4, m, us=us_kernel, tbps=1.0, path="kernel"))
        if us_deq:
            pts.append(bm.Point("qwen3", "kbit_dequant", 4, m, us=us_deq, tbps=1.0,
                                path="dequant"))  # fmt: skip
        pts.append(bm.Point("qwen3", "vllm_bf16", None, m, us=us_bf16, tbps=2.0))
    meta = {"kbit_dispatch": {"DEQUANT_MIN_M": 1024}}
    md = bm.markdown(pts, meta, [], [], ["qwen3"])
    rows = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| ")}
    assert list(rows)[1:] == ["| kbit k=4", "| kbit_dequant k=4", "| kbit_kernel k=4",
                              "| vllm_bf16"]  # fmt: skip
    assert "1000.0 [D] (1.00 TB/s, 0.90x bf16)" in rows["| kbit k=4"]
    assert "30.0 (1.00 TB/s, 1.33x bf16)" in rows["| kbit k=4"]
    assert "| n/a | 1000.0 (1.00 TB/s, 0.90x bf16) |" in rows["| kbit_dequant k=4"]
    assert "[D]" not in rows["| kbit_dequant k=4"] + rows["| kbit_kernel k=4"]
    assert "'DEQUANT_MIN_M': 1024" in md


def test_dispatch_dry_check(capsys: pytest.CaptureFixture) -> None:
    bm.dispatch_dry_check(["qwen3", "mixtral"], torch.bfloat16)
    out = capsys.readouterr().out
    assert "qwen3 (Qwen3-30B-A3B): dequant path from M=4096" in out
    assert "1 chunk(s) of [128] experts" in out
    assert "mixtral (Mixtral-8x7B): dequant path from M=1024" in out
    assert "2 chunk(s) of [4, 4] experts" in out


def test_main_dry_check_and_bad_paths(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("vllm")
    assert bm.main(["--dry-check", "--shapes", "mixtral", "--m", "1,4096"]) == 0
    out = capsys.readouterr().out
    assert "dequant path from M=1024" in out and "GEMM calls for M=[1, 4096] pass" in out
    with pytest.raises(SystemExit):
        bm.main(["--kbit-paths", "auto,fast"])
