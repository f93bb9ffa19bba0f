# SPDX-License-Identifier: Apache-2.0
"""torch.ops.kbit.gemv (CUDA, decode batches M <= 8) against the PyTorch reference.

Weights are quantized on the CPU with ``reference.quantize`` and repacked with
``reference.repack``. The exact result is x @ W^T in float64 on the fp32-dequantized weights;
the kernel's error must stay within 2x the error of the fp16/bf16 path the plugin would
otherwise take (``reference.linear_tiled``: dequantize to x.dtype, fp32 matmul, round), plus
one x.dtype epsilon of the typical dot-product size (a comparison of a few outputs is otherwise
decided by rounding noise).

Run: pytest tests/test_cuda_gemv.py   (needs a GPU and the compiled vllm_kbit._C)
"""

from __future__ import annotations

import functools

import pytest
import torch
from cuda_graph import assert_pdl_matches_plain, capture

from vllm_kbit import _ops
from vllm_kbit import reference as ref
from vllm_kbit.format import default_codebook

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BACKEND = _ops.load() if torch.cuda.is_available() else "none"
OPS = torch.ops.kbit
DTYPES = (torch.float16, torch.bfloat16)
# Llama-3.1-8B shapes (N, K): qkv, o, down, gate_up.
QKV, O, DOWN, GATE_UP = (6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096)
# Asymmetric, with a repeated entry, not the default's shape.
CUSTOM_CB = {
    2: [-0.8, -0.05, 0.3, 1.0],
    3: [-1.0, -0.6, -0.6, -0.1, 0.0, 0.25, 0.5, 0.9],
    4: [-1.0, -0.75, -0.5, -0.4, -0.3, -0.2, -0.15, -0.1, -0.05, 0, 0.02, 0.1, 0.3, 0.31, 0.6, 1],
    5: [round(-1.0 + 2.0 * (i / 31) ** 1.5, 6) for i in range(32)],
}


@functools.cache
def _weights(n: int, k: int, bits: int, custom_cb: bool = False, scale: float = 0.02):
    """Tiled (qweight, absmax, codebook) of a random W[n, k], on the GPU."""
    g = torch.Generator().manual_seed(1_000_003 * bits + 1009 * n + k)
    w = torch.randn(n, k, generator=g) * scale
    cb = torch.tensor(CUSTOM_CB[bits]) if custom_cb else default_codebook(bits)
    q, a = ref.quantize(w, bits, cb)
    qt, at = ref.repack(q, a, bits)
    return qt.cuda(), at.cuda(), cb.cuda()


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * m + k)
    return torch.randn(m, k, generator=g).to(dtype).cuda()


def _check(x: torch.Tensor, qt, at, cb, bits: int, n: int, what: str = "") -> torch.Tensor:
    y = OPS.gemv(x, qt, at, cb, bits, n)
    m, k = x.shape
    assert y.shape == (m, n) and y.dtype == x.dtype and y.is_contiguous(), what
    w = ref.dequantize_tiled(qt, at, cb, bits, n, k, torch.float32)
    exact = x.double() @ w.double().t()
    base = ref.linear_tiled(x, qt, at, cb, bits, n)
    err = (y.double() - exact).norm().item()
    err_base = (base.double() - exact).norm().item()
    # One x.dtype epsilon of the typical size of a dot product of x and a row of W (not of the
    # outputs, which can be near zero by cancellation): it only matters for a handful of outputs.
    scale = ((x.double() ** 2) @ (w.double() ** 2).t()).mean().sqrt().item()
    floor = torch.finfo(x.dtype).eps * scale
    assert torch.isfinite(y).all(), f"{what}: non-finite outputs"
    assert err <= 2 * err_base + floor, (
        f"{what} M={m} n={n} K={k} bits={bits} {x.dtype}: |err|={err:.3e} > "
        f"2 * {err_base:.3e} (fp16/bf16 dequant + matmul) + {floor:.1e}"
    )
    return y


def test_kernels_are_compiled() -> None:
    assert BACKEND == "compiled", f"vllm_kbit._C is not built (backend: {BACKEND})"


@pytest.mark.parametrize(
    "shape, bits_list, ms, dtypes",
    [
        (QKV, (2, 3, 4, 5), (1, 4), DTYPES),
        (O, (3, 5), (2, 5), (torch.float16,)),
        (DOWN, (2, 4), (1, 3, 8), (torch.float16,)),  # M=8: x too big for one CTA -> split-K
        (GATE_UP, (4,), (1, 4), DTYPES),  # 14 n-tiles per CTA, warp runs cross n-tiles
    ],
    ids=["qkv", "o", "down", "gate_up"],
)
def test_llama_shapes(shape, bits_list, ms, dtypes) -> None:
    n, k = shape
    for bits in bits_list:
        qt, at, cb = _weights(n, k, bits)
        for dtype in dtypes:
            for m in ms:
                _check(_x(m, k, dtype), qt, at, cb, bits, n, "llama")


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("k", [32, 96, 4128])  # one block; a partial k-tile; 32 full + 1 block
@pytest.mark.parametrize("n", [1, 8, 17, 1000])  # padding rows in the last 16-row tile
def test_awkward_shapes(n: int, k: int, bits: int) -> None:
    qt, at, cb = _weights(n, k, bits)
    for dtype in DTYPES:
        for m in (1, 2, 3, 4, 5, 8):
            _check(_x(m, k, dtype), qt, at, cb, bits, n, "awkward")


@pytest.mark.parametrize("pair", ["0", "1"], ids=["single", "paired"])
@pytest.mark.parametrize(
    "n, k, bits",
    [
        (17, 4128, 2),  # 2 n-tiles (one pair), 33 k-tiles: every warp's run is a partial segment
        (96, 4128, 3),  # 3 pairs: split-K
        (1040, 4128, 4),  # 65 n-tiles: odd, single n-tiles whatever KBIT_GEMV_PAIR says
        (8, 96, 5),  # 1 n-tile, a partial k-tile
        (DOWN[0], DOWN[1], 2),  # M=8: x too big for one CTA -> split-K
        (GATE_UP[0], GATE_UP[1], 5),  # 7 pairs per CTA: runs cross pairs, whole pairs in acc_s
    ],
)
def test_single_and_paired_n_tiles(monkeypatch, pair: str, n: int, k: int, bits: int) -> None:
    """KBIT_GEMV_PAIR=1: units of two n-tiles (gemv.cuh, kDensePair) wherever n_tiles is even,
    =0: single n-tiles; the default picks by a cost model, so both are forced here."""
    monkeypatch.setenv("KBIT_GEMV_PAIR", pair)
    qt, at, cb = _weights(n, k, bits)
    for dtype in DTYPES:
        for m in (1, 3, 8):
            _check(_x(m, k, dtype), qt, at, cb, bits, n, f"KBIT_GEMV_PAIR={pair}")


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_custom_codebook(bits: int) -> None:
    n, k = 200, 1152
    qt, at, cb = _weights(n, k, bits, custom_cb=True)
    for dtype in DTYPES:
        for m in (1, 4):
            _check(_x(m, k, dtype), qt, at, cb, bits, n, "custom codebook")


@pytest.mark.parametrize("bits", [2, 5])
def test_small_weights_subnormal_absmax(bits: int) -> None:
    # absmax < 2^-10 uses E4M4 subnormals (m * 2^-14)
    n, k = 64, 512
    qt, at, cb = _weights(n, k, bits, scale=1e-4)
    assert (ref.unrepack(qt.cpu(), at.cpu(), bits, n, k)[1] < 16).any()  # e = 0 codes present
    for dtype in DTYPES:
        _check(_x(2, k, dtype), qt, at, cb, bits, n, "subnormal absmax")


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_x(dtype: torch.dtype) -> None:
    n, k, bits = 96, 4128, 3
    qt, at, cb = _weights(n, k, bits)
    for m in (1, 3, 8):
        wide = _x(m, k + 40, dtype)
        _check(wide[:, :k], qt, at, cb, bits, n, "row stride k+40 (16-byte aligned rows)")
        odd = _x(m, k + 3, dtype)
        _check(odd[:, 1 : k + 1], qt, at, cb, bits, n, "row stride k+3, offset 1 (unaligned)")
        _check(odd[:, :k], qt, at, cb, bits, n, "row stride k+3")


def test_deterministic() -> None:
    for n, k, bits, m in [(4096, 4096, 4, 1), (100, 4128, 3, 5), (8, 14336, 2, 8)]:
        qt, at, cb = _weights(n, k, bits)
        x = _x(m, k, torch.float16)
        y = OPS.gemv(x, qt, at, cb, bits, n)
        for _ in range(3):
            assert torch.equal(OPS.gemv(x, qt, at, cb, bits, n), y)


@pytest.mark.parametrize("case", [(4096, 4096, 4, 1), (8, 14336, 2, 8)], ids=["direct", "split_k"])
def test_cuda_graph_replay_equals_eager(case) -> None:
    n, k, bits, m = case
    qt, at, cb = _weights(n, k, bits)
    x = _x(m, k, torch.bfloat16)
    graph, y = capture(lambda: OPS.gemv(x, qt, at, cb, bits, n), warmups=1)
    for seed in (1, 2):
        x.copy_(_x(m, k, torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, OPS.gemv(x, qt, at, cb, bits, n))


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("pair", ["0", "1"])
def test_pdl_chain(monkeypatch, m: int, pair: str) -> None:
    # KBIT_PDL=1 (sm_90): each GEMV of a chain x <- gemv(x) may start its table fill and first
    # weight loads while the one before drains, reading x only after griddepcontrol.wait: the same
    # bits as plain stream order, eagerly and under graph replay. M=8: split-K (atomics + arrival
    # counters). Weights of 2^-6 keep the chain's values in range.
    monkeypatch.setenv("KBIT_GEMV_PAIR", pair)
    n = k = 4096
    qt, at, cb = _weights(n, k, 2, scale=2**-6)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = OPS.gemv(x, qt, at, cb, 2, n)
        return x

    xs = [_x(m, k, torch.float16, seed=seed) for seed in (0, 1, 2)]
    assert_pdl_matches_plain(monkeypatch, chain, xs, warmups=1)


def test_empty_batch() -> None:
    qt, at, cb = _weights(40, 256, 4)
    for dtype in DTYPES:
        y = OPS.gemv(torch.empty(0, 256, dtype=dtype, device="cuda"), qt, at, cb, 4, 40)
        assert y.shape == (0, 40) and y.dtype == dtype


@pytest.mark.cxx_errors
def test_bad_inputs_name_the_problem(monkeypatch) -> None:
    n, k, bits = 40, 256, 4
    qt, at, cb = _weights(n, k, bits)
    x = _x(2, k, torch.float16)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        OPS.gemv(x.float(), qt, at, cb, bits, n)
    with pytest.raises(RuntimeError, match="at most 8"):
        OPS.gemv(_x(9, k, torch.float16), qt, at, cb, bits, n)
    with pytest.raises(RuntimeError, match="qweight must be contiguous CUDA int32 with"):
        OPS.gemv(x, qt[:-1], at, cb, bits, n)
    with pytest.raises(RuntimeError, match="weight_absmax"):
        OPS.gemv(x, qt, at[:-1], cb, bits, n)
    with pytest.raises(RuntimeError, match="codebook must be"):
        OPS.gemv(x, qt, at, cb[:-1], bits, n)
    with pytest.raises(RuntimeError, match="bits must be"):
        OPS.gemv(x, qt, at, cb, 6, n)
    with pytest.raises(RuntimeError, match="unit stride"):
        OPS.gemv(_x(k, 2, torch.float16).t(), qt, at, cb, bits, n)
    monkeypatch.setenv("KBIT_GEMV_PAIR", "2")
    with pytest.raises(RuntimeError, match="KBIT_GEMV_PAIR must be 0 or 1"):
        OPS.gemv(x, qt, at, cb, bits, n)
