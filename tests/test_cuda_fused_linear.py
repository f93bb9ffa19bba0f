# SPDX-License-Identifier: Apache-2.0
"""torch.ops.kbit.linear_add_rms_norm / linear_silu_mul (CUDA) against the PyTorch reference.

Both paths of each op are checked: the GEMV with the elementwise op folded into its x staging
(M <= 8, 16-byte aligned rows) and the separate elementwise kernel + kbit::linear (larger M,
unaligned rows, KBIT_FUSED_GEMV=0). The oracle is the reference's elementwise result (rounded to
x.dtype, as vLLM rounds it) times the fp32-dequantized weights in float64; the op's error may be
at most 2x that of the reference op plus one-ulp floors (tests/error_bound.py). The rms of the
fused norm sums in another order than the reference, so a few normed inputs may differ by one
ulp; the residual output (x + residual rounded once) must be bit-identical.

Run: pytest tests/test_cuda_fused_linear.py   (needs a GPU and the compiled vllm_kbit._C)
"""

from __future__ import annotations

import functools

import pytest
import torch
from cuda_graph import capture
from error_bound import assert_within_2x

from vllm_kbit import _ops
from vllm_kbit import reference as ref
from vllm_kbit.format import default_codebook

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    _ops.load()
OPS = torch.ops.kbit
DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _weights(n: int, k: int, bits: int):
    g = torch.Generator().manual_seed(7919 * bits + 101 * n + k)
    q, a = ref.quantize(torch.randn(n, k, generator=g) * 0.02, bits, default_codebook(bits))
    qt, at = ref.repack(q, a, bits)
    return qt.cuda(), at.cuda(), default_codebook(bits).cuda()


def _rand(shape, dtype, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()


def _check_y(y, xin, qt, at, cb, bits, n, what) -> None:
    """y against xin (the reference's elementwise output) @ W^T."""
    w = ref.dequantize_tiled(qt, at, cb, bits, n, xin.shape[1], torch.float32)
    oracle = (xin.double() @ w.double().t()).float()
    base = ref.linear_tiled(xin, qt, at, cb, bits, n)
    assert y.shape == base.shape and y.dtype == base.dtype, what
    assert torch.isfinite(y).all(), what
    assert_within_2x(y, base, oracle, xin.dtype, f"reference ({what})")


def _norm_case(m, k, n, bits, dtype, seed=0, x_stride=None):
    qt, at, cb = _weights(n, k, bits)
    x = _rand((m, x_stride or k), dtype, seed)[:, :k]
    res = _rand((m, k), dtype, seed + 1, 2.0)
    nw = _rand((k,), dtype, seed + 2, 0.5) + 1.0
    y, r = OPS.linear_add_rms_norm(x, res, nw, 1e-5, qt, at, cb, bits, n)
    xn, r_ref = ref.add_rms_norm(x, res, nw, 1e-5)
    what = f"add_rms_norm M={m} K={k} n={n} bits={bits} {dtype} stride={x.stride(0)}"
    assert torch.equal(r, r_ref), f"{what}: residual output differs"
    _check_y(y, xn, qt, at, cb, bits, n, what)
    return y


def _silu_case(m, k, n, bits, dtype, seed=0, h_stride=None):
    qt, at, cb = _weights(n, k, bits)
    h = _rand((m, h_stride or 2 * k), dtype, seed, 2.0)[:, : 2 * k]
    y = OPS.linear_silu_mul(h, qt, at, cb, bits, n)
    _check_y(y, ref.silu_mul(h), qt, at, cb, bits, n,
             f"silu_mul M={m} K={k} n={n} bits={bits} {dtype}")  # fmt: skip
    return y


@pytest.mark.parametrize("fused", ["1", "0"], ids=["gemv_fused", "separate"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_llama_shapes(monkeypatch, fused: str, bits: int) -> None:
    monkeypatch.setenv("KBIT_FUSED_GEMV", fused)
    for dtype in DTYPES:
        for m in (1, 3, 8, 9, 33):  # 9, 33: the separate kernel whatever KBIT_FUSED_GEMV says
            _norm_case(m, 4096, 6144, bits, dtype, seed=m)  # 8B qkv
            _silu_case(m, 14336, 4096, bits, dtype, seed=m)  # 8B down (M=8: split-K)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("k", [32, 96, 4128])  # one block; a partial k-tile; 33 k-tiles
@pytest.mark.parametrize("n", [8, 17, 1000])
def test_awkward_shapes(n: int, k: int, bits: int) -> None:
    for dtype in DTYPES:
        for m in (1, 2, 5, 8):
            _norm_case(m, k, n, bits, dtype, seed=m + k)
            _silu_case(m, k, n, bits, dtype, seed=m + k)


@pytest.mark.parametrize("kb1", ["1", "0"], ids=["single_job", "four_jobs"])
@pytest.mark.parametrize("bits", [2, 4])
def test_prologue_job_forms(monkeypatch, kb1: str, bits: int) -> None:
    """Where no thread has more than one prologue job (M x the CTA's K columns / 8 <= 512) the
    GEMV stages x one job per batch, else (and with KBIT_GEMV_XPRO_KB1=0) four: both forms."""
    monkeypatch.setenv("KBIT_GEMV_XPRO_KB1", kb1)
    for dtype in DTYPES:
        # 512 jobs at M = 1 and 2; split-K (7 K ranges of 16 k-tiles: 256 jobs); 48 jobs (a
        # partial k-tile); 528 jobs (33 k-tiles: four-job batches in both runs)
        for m, k, n in ((1, 4096, 6144), (2, 2048, 4096), (1, 14336, 16), (3, 96, 17),
                        (1, 4128, 8)):
            _norm_case(m, k, n, bits, dtype, seed=m + k)
            _silu_case(m, k, n, bits, dtype, seed=m + k)


@pytest.mark.parametrize("m", [1, 4, 12])
def test_unaligned_rows_take_the_separate_kernel(m: int) -> None:
    # row strides that are not a multiple of 8 elements: not 16-byte aligned rows
    _norm_case(m, 96, 40, 4, torch.float16, x_stride=101)
    _silu_case(m, 96, 40, 4, torch.bfloat16, h_stride=197)


def test_paths_agree(monkeypatch) -> None:
    """The folded GEMV and the separate kernels give the same residual and close outputs."""
    outs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("KBIT_FUSED_GEMV", fused)
        outs[fused] = (_norm_case(4, 4096, 4096, 4, torch.float16), _silu_case(4, 4096, 4096, 4, torch.float16))
    for a, b in zip(outs["1"], outs["0"]):
        assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max()


def test_decode_chain_in_a_cuda_graph(monkeypatch) -> None:
    """norm -> qkv-like linear, silu -> down-like linear, chained as in a decoder layer, replayed
    from a CUDA graph captured with programmatic dependent launch: bit-identical to eager without
    PDL, for new inputs."""
    k, i = 1024, 1536
    qa, aa, cb = _weights(k, k, 3)
    qg, ag, _ = _weights(2 * i, k, 3)
    qd, ad, _ = _weights(k, i, 3)
    nw = _rand((k,), torch.float16, 5, 0.5) + 1.0

    def layer(x: torch.Tensor) -> torch.Tensor:
        res = x
        h, res = OPS.linear_add_rms_norm(x, res, nw, 1e-6, qa, aa, cb, 3, k)
        g, res = OPS.linear_add_rms_norm(h, res, nw, 1e-6, qg, ag, cb, 3, 2 * i)
        return OPS.linear_silu_mul(g, qd, ad, cb, 3, k) + res

    xs = [_rand((2, k), torch.float16, s) for s in range(3)]
    monkeypatch.setenv("KBIT_PDL", "0")
    want = [layer(x) for x in xs]
    monkeypatch.setenv("KBIT_PDL", "1")
    static_x = xs[0].clone()
    graph, static_y = capture(lambda: layer(static_x))
    for x, w in zip(xs, want):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, w)


@pytest.mark.cxx_errors
def test_bad_input_names_the_problem() -> None:
    qt, at, cb = _weights(40, 96, 4)
    x = _rand((2, 96), torch.float16, 0)
    nw = _rand((96,), torch.float16, 1)
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        OPS.linear_add_rms_norm(x, x[:1], nw, 1e-5, qt, at, cb, 4, 40)
    with pytest.raises(RuntimeError, match="norm_weight must have x's dtype"):
        OPS.linear_add_rms_norm(x, x, nw.float(), 1e-5, qt, at, cb, 4, 40)
    with pytest.raises(RuntimeError, match=r"h must be a 2-D CUDA tensor \[M, 2K\]"):
        OPS.linear_silu_mul(x[:, :95], qt, at, cb, 4, 40)
