# SPDX-License-Identifier: Apache-2.0
"""torch.ops.kbit.dense_linear (CUDA): x[M, K] @ W^T for an unquantized fp16/bf16 weight, the
streaming GEMV at M <= 4 and cuBLAS beyond, against float64 on the same fp16/bf16 values.

Tolerance: the GEMV accumulates in fp32 in another order than cuBLAS; its error against float64
must stay within 2x cuBLAS's (F.linear on the same tensors) plus one output rounding step of the
typical output size.

Run: pytest tests/test_cuda_dense_linear.py   (needs a GPU and the compiled vllm_kbit._C)
"""

from __future__ import annotations

import pytest
import torch
from cuda_graph import capture

from vllm_kbit import _ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BACKEND = _ops.load() if torch.cuda.is_available() else "none"
OPS = torch.ops.kbit
DTYPES = (torch.float16, torch.bfloat16)


def _tensors(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).cuda()
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype).cuda()
    return x, w


def _check(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    assert y.shape == exact.shape and y.dtype == x.dtype
    cublas = torch.nn.functional.linear(x, w)
    err = (y.double() - exact).abs().max().item()
    base = (cublas.double() - exact).abs().max().item()
    eps = torch.finfo(x.dtype).eps * exact.abs().mean().item()
    assert err <= 2 * base + eps, f"error {err:.3g} vs cuBLAS {base:.3g} (eps {eps:.3g})"


def test_kernels_are_compiled() -> None:
    assert BACKEND == "compiled", f"vllm_kbit._C not in use (backend {BACKEND})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 33])  # 5, 8, 33: cuBLAS
def test_lm_head_shape(m: int, dtype: torch.dtype) -> None:
    x, w = _tensors(m, 128256, 4096, dtype, seed=m)
    _check(x, w, OPS.dense_linear(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [8, 264, 520, 4104, 5000])  # partial 256- and 512-column chunks
@pytest.mark.parametrize("n", [1, 3, 7, 1000, 32001])  # partial last row group; fewer rows than warps
@pytest.mark.parametrize("m", [1, 2, 3, 4], ids=["m1", "m2", "m3", "m4"])  # each (R, U)
def test_awkward_shapes(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, w = _tensors(m, n, k, dtype, seed=n + k)
    _check(x, w, OPS.dense_linear(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_x_and_fallbacks(dtype: torch.dtype) -> None:
    n, k = 3000, 1024
    x, w = _tensors(4, n, k, dtype)
    wide = torch.zeros(4, k + 64, dtype=dtype, device="cuda")
    wide[:, 32 : 32 + k] = x  # row stride k + 64, data offset 64 B: the GEMV takes it
    _check(x, w, OPS.dense_linear(wide[:, 32 : 32 + k], w))
    _check(x, w, OPS.dense_linear(wide[:, 4 : 4 + k].copy_(x), w))  # 8-byte aligned: cuBLAS
    odd = torch.zeros(3, k + 9, dtype=dtype, device="cuda")  # row stride k + 9 elements (odd)
    odd[0, 8 : 8 + k] = x[0]  # one row, 16-byte aligned: the GEMV (it never uses the row stride)
    _check(x[:1], w, OPS.dense_linear(odd[:1, 8 : 8 + k], w))
    odd[:, 8 : 8 + k] = x[:3]  # three rows, rows 1 and 2 not 16-byte aligned: cuBLAS
    _check(x[:3], w, OPS.dense_linear(odd[:, 8 : 8 + k], w))
    _check(x, w, OPS.dense_linear(x, w.t().contiguous().t()))  # column-major weight: cuBLAS
    x12, w12 = _tensors(2, n, 12, dtype)  # K % 8 != 0: cuBLAS
    _check(x12, w12, OPS.dense_linear(x12, w12))


def test_env_switch_sends_to_cublas(monkeypatch) -> None:
    x, w = _tensors(1, 4096, 4096, torch.float16)
    y = OPS.dense_linear(x, w)
    monkeypatch.setenv("KBIT_DENSE_GEMV", "0")
    assert torch.equal(OPS.dense_linear(x, w), torch.nn.functional.linear(x, w))
    _check(x, w, y)


def test_deterministic() -> None:
    x, w = _tensors(2, 50000, 4096, torch.bfloat16)
    y = OPS.dense_linear(x, w)
    for _ in range(3):
        assert torch.equal(OPS.dense_linear(x, w), y)


def test_cuda_graph_replay_equals_eager() -> None:
    x, w = _tensors(1, 128256, 4096, torch.float16)
    static_x = x.clone()
    graph, static_y = capture(lambda: OPS.dense_linear(static_x, w))
    for seed in (1, 2):
        x2, _ = _tensors(1, 8, 4096, torch.float16, seed=seed)
        static_x.copy_(x2)
        graph.replay()
        assert torch.equal(static_y, OPS.dense_linear(x2, w))


def test_empty_batch() -> None:
    for dtype in DTYPES:
        x, w = _tensors(1, 40, 256, dtype)
        y = OPS.dense_linear(x[:0], w)
        assert y.shape == (0, 40) and y.dtype == dtype


@pytest.mark.cxx_errors
def test_bad_inputs_name_the_problem() -> None:
    x, w = _tensors(2, 40, 256, torch.float16)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        OPS.dense_linear(x.float(), w.float())
    with pytest.raises(RuntimeError, match="one dtype"):
        OPS.dense_linear(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="K=256 columns"):
        OPS.dense_linear(x, w[:, :128])
    with pytest.raises(RuntimeError, match="2-D"):
        OPS.dense_linear(x[0], w)
    with pytest.raises(RuntimeError, match="different devices"):
        OPS.dense_linear(x, w.cpu())
