# SPDX-License-Identifier: Apache-2.0
"""The float-output rule of the GPU kernel tests (tests/test_cuda_mma.py, test_cuda_moe.py): a
kernel's error against an fp32 oracle may be at most 2x the error of the fp16/bf16 reference
computation, plus one-ulp floors (max: of the largest output; mean: of a typical output /
sqrt(count))."""

import torch


def assert_within_2x(y: torch.Tensor, base: torch.Tensor, oracle: torch.Tensor,
                     dtype: torch.dtype, base_name: str) -> None:  # fmt: skip
    err, err_base = (y.float() - oracle).abs(), (base.float() - oracle).abs()
    eps = torch.finfo(dtype).eps
    floor_max = eps * oracle.abs().max().item()
    floor_mean = eps * oracle.abs().mean().item() / oracle.numel() ** 0.5
    assert err.max().item() <= 2 * err_base.max().item() + floor_max, (
        f"max err {err.max().item():.3g} vs {base_name} {err_base.max().item():.3g}"
    )
    assert err.mean().item() <= 2 * err_base.mean().item() + floor_mean, (
        f"mean err {err.mean().item():.3g} vs {base_name} {err_base.mean().item():.3g}"
    )
