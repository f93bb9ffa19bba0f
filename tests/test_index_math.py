# SPDX-License-Identifier: Apache-2.0
"""CPU checks of kernel index math, host programs built with nvcc (no GPU needed):

- tools/wgmma_index_check.cu, the warp-specialized wgmma kernel: descriptor fields, the
  128B-swizzled x tile as TMA writes and wgmma reads it, the producer's copies and expect_tx
  byte counts, K-tail boxes, shared-memory plans, the configurations (C1, C2, C3, C1w, C2w) and
  their choice by M, split-K coverage and the mbarrier ring protocol under random interleavings.
- tools/gemv_runs_check.cu, the GEMV's work split inside a CTA and where its epilogue finds the
  sums, against a model of the kernel's main loop, for every CTA shape up to 48 x 96 tiles.
- tools/stream_k_check.cu, kbit::mma's stream-K split over CTAs (csrc/stream_k.cuh): the load and
  compute loops, the partial tiles and which CTA adds them, for every grid up to 48 groups x 40
  k-tiles on up to 160 CTAs and the Llama layers on 132 / 264."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = Path(home) / "bin" / "nvcc"
    return str(cand) if cand.exists() else shutil.which("nvcc")


def _build_and_run(tmp_path: Path, name: str) -> str:
    exe = tmp_path / name
    src = ROOT / "tools" / f"{name}.cu"
    cmd = [_nvcc(), "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)]
    build = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "all ok" in run.stdout, run.stdout + run.stderr
    return run.stdout


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc")
def test_wgmma_index_math(tmp_path: Path) -> None:
    out = _build_and_run(tmp_path, "wgmma_index_check")
    for name in ("C1 ", "C2 ", "C3 ", "C1w", "C2w"):  # a shared-memory plan per configuration and k
        assert sum(line.lstrip().startswith(name) for line in out.splitlines()) == 4, name


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc")
def test_gemv_runs(tmp_path: Path) -> None:
    out = _build_and_run(tmp_path, "gemv_runs_check")
    assert "4615 CTA shapes" in out, out  # 48 x 96 + 7 large ones: the loops ran


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc")
def test_stream_k_split(tmp_path: Path) -> None:
    out = _build_and_run(tmp_path, "stream_k_check")
    assert "262832 grids checked" in out, out  # the loops ran
