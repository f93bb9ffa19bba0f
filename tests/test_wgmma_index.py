# SPDX-License-Identifier: Apache-2.0
"""CPU check of the warp-specialized wgmma kernel's index math (tools/wgmma_index_check.cu):
descriptor fields, the 128B-swizzled x tile as TMA writes and wgmma reads it, the producer's
copies and expect_tx byte counts, K-tail boxes, shared-memory plans, the configurations (C1, C2,
C3, C1w, C2w) and their choice by M, split-K coverage and the mbarrier ring protocol under random
interleavings, for every configuration. Needs nvcc, not a GPU."""

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


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc")
def test_wgmma_index_math(tmp_path: Path) -> None:
    exe = tmp_path / "wgmma_index_check"
    src = ROOT / "tools" / "wgmma_index_check.cu"
    cmd = [_nvcc(), "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)]
    build = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "all ok" in run.stdout, run.stdout + run.stderr
    for name in ("C1 ", "C2 ", "C3 ", "C1w", "C2w"):  # a shared-memory plan per configuration and k
        assert sum(line.lstrip().startswith(name) for line in run.stdout.splitlines()) == 4, name
