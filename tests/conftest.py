# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures and skip helpers.

``@requires_cuda`` / ``@requires_kernels`` skip tests that need a GPU / the compiled
``vllm_kbit._C``; tests marked ``gpu`` are skipped automatically without a GPU.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def _has_kernels() -> bool:
    if not HAS_CUDA:
        return False
    from vllm_kbit import _ops

    return _ops.has_cuda_kernels()


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_kernels = pytest.mark.skipif(not _has_kernels(), reason="needs the compiled vllm_kbit._C")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """Seeds torch's global RNG with 0 and returns the seed."""
    torch.manual_seed(0)
    return 0


@pytest.fixture
def gen(seed: int) -> torch.Generator:
    """A CPU torch.Generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)
