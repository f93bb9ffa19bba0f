# SPDX-License-Identifier: Apache-2.0
"""kbit::linear (the dispatcher: gemv / mma / dequantize_tiled + cuBLAS) on the GPU.

Accuracy rule: against an exact (float64) product with the dequantized weight, the error of
linear is at most 2x that of the plain fp16/bf16 path (dequantize to x.dtype, then x @ W^T
with cuBLAS), plus a tiny floor; checked as RMS error and, with one output ulp of slack, as
max error. Every path forced by KBIT_FORCE_KERNEL must pass the same rule.

Run: pytest tests/test_cuda_linear_dispatch.py
"""

import zlib

import pytest
import torch
from cuda_graph import capture

from vllm_kbit import _ops
from vllm_kbit import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

OPS = torch.ops.kbit
BITS = [2, 3, 4, 5]
DTYPES = [torch.float16, torch.bfloat16]
MS = [1, 2, 3, 4, 5, 8, 13, 16, 17, 31, 64, 127, 256, 1024]
SHAPES = [(4096, 4096), (1000, 4128), (17, 96)]  # (n, K)


def _name(v) -> str:  # test ids: "float16", "4096x4096"
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v).replace("torch.", "")


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernels():
    assert _ops.load() == "compiled", "vllm_kbit._C is not built: these tests need the kernels"


def _gen(*key) -> torch.Generator:
    return torch.Generator("cuda").manual_seed(zlib.crc32(repr(key).encode()))


class Layer:
    """A quantized weight in the runtime layout, plus its dequantized copies (reference)."""

    def __init__(self, n: int, k: int, bits: int):
        g = _gen("layer", n, k, bits)
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02
        self.n, self.k, self.bits = n, k, bits
        self.cb = ref.default_codebook(bits).cuda()
        q, a = OPS.quantize(w, self.cb, bits)
        self.qt, self.at = OPS.repack(q, a, bits)
        # The reference dequantization (PyTorch ops, on the GPU): exact fp32 values.
        self.w32 = ref.dequantize(q, a, self.cb, bits, torch.float32)
        self.w64 = self.w32.double()
        self.wd = {dt: ref.dequantize(q, a, self.cb, bits, dt) for dt in DTYPES}

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return OPS.linear(x, self.qt, self.at, self.cb, self.bits, self.n)

    def check(self, x: torch.Tensor, y: torch.Tensor, what: str) -> None:
        assert y.shape == (x.shape[0], self.n) and y.dtype == x.dtype, what
        exact = x.double() @ self.w64.t()
        base = (x @ self.wd[x.dtype].t()).double()  # the plain fp16/bf16 path
        err, err_base = (y.double() - exact), (base - exact)
        scale = exact.abs().max().item()
        floor = 1e-6 * scale + 1e-9
        rms, rms_base = err.pow(2).mean().sqrt().item(), err_base.pow(2).mean().sqrt().item()
        assert rms <= 2 * rms_base + floor, f"{what}: rms error {rms:.3g} vs fp path {rms_base:.3g}"
        mx, mx_base = err.abs().max().item(), err_base.abs().max().item()
        ulp = torch.finfo(x.dtype).eps * scale
        assert mx <= 2 * mx_base + ulp + floor, (
            f"{what}: max error {mx:.3g} vs fp path {mx_base:.3g}"
        )


_LAYERS: dict = {}


def _layer(n: int, k: int, bits: int) -> Layer:
    if (n, k, bits) not in _LAYERS:
        _LAYERS.clear()  # keep one layer alive at a time (parametrize order groups them)
        _LAYERS[n, k, bits] = Layer(n, k, bits)
    return _LAYERS[n, k, bits]


def _x(m: int, k: int, dtype: torch.dtype, *key) -> torch.Tensor:
    return torch.randn(m, k, generator=_gen("x", m, k, dtype, *key), device="cuda").to(dtype)


@pytest.fixture
def force(monkeypatch):
    """force(path) sets KBIT_FORCE_KERNEL for this test (None = unset: automatic)."""

    def set_path(path):
        if path is None:
            monkeypatch.delenv("KBIT_FORCE_KERNEL", raising=False)
        else:
            monkeypatch.setenv("KBIT_FORCE_KERNEL", path)

    set_path(None)
    return set_path


# The first decorator varies fastest: tests sharing a layer (shape, bits) run back to back.
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_linear_auto(shape, bits, dtype, force):
    layer = _layer(*shape, bits)
    for m in MS:
        x = _x(m, layer.k, dtype, "auto", bits, shape)
        layer.check(x, layer.linear(x), f"M={m}")


# M values each forced path must serve (gemv: small M only; mma: up to the largest
# threshold; dequant: any).
FORCED = {"gemv": [1, 2, 3, 4], "mma": [1, 5, 8, 13, 16, 17, 31, 64], "dequant": [1, 5, 64, 256]}


@pytest.mark.parametrize("path", sorted(FORCED))
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_linear_forced(shape, bits, dtype, path, force):
    layer = _layer(*shape, bits)
    for m in FORCED[path]:
        x = _x(m, layer.k, dtype, "forced", bits, shape)
        force(path)
        y = layer.linear(x)
        layer.check(x, y, f"KBIT_FORCE_KERNEL={path} M={m}")
        if path == "dequant":  # exactly the dequantize_tiled + cuBLAS composition
            w = OPS.dequantize_tiled(layer.qt, layer.at, layer.cb, bits, layer.n, layer.k, dtype)
            assert torch.equal(y, x @ w.t())


@pytest.mark.parametrize("bits", [3, 4])
def test_linear_auto_large_m_is_dequant_path(bits, force):
    layer = _layer(1000, 4128, bits)
    x = _x(1024, layer.k, torch.float16, "large", bits)
    y_auto = layer.linear(x)
    force("dequant")
    assert torch.equal(y_auto, layer.linear(x))


@pytest.mark.parametrize("m", [768, 1024])
def test_linear_auto_k5_big_layer_above_512_is_dequant_path(m, force):
    # layers of >= 32M weights keep the wgmma kernel up to M = 1024 at k <= 4 on sm_90, but at
    # k=5 only up to 512 (mma.cu, wgmma2_by_default); other GPUs take dequant from M = 257
    layer = _layer(8192, 4096, 5)
    x = _x(m, layer.k, torch.float16, "big", m)
    y_auto = layer.linear(x)
    force("dequant")
    assert torch.equal(y_auto, layer.linear(x))


def test_linear_m0(force):
    layer = _layer(1000, 4128, 4)
    for path in (None, "gemv", "mma", "dequant"):
        force(path)
        for dtype in DTYPES:
            y = layer.linear(torch.empty(0, layer.k, dtype=dtype, device="cuda"))
            assert y.shape == (0, layer.n) and y.dtype == dtype and y.is_cuda


@pytest.mark.parametrize("m", [1, 3, 8, 64, 256])
def test_linear_strided_x(m, force):
    """x with a row stride > K (a slice of a wider activation) and a transposed x."""
    layer = _layer(1000, 4128, 3)
    wide = _x(m, layer.k + 64, torch.bfloat16, "wide")
    x = wide[:, 32 : 32 + layer.k]
    assert x.stride(0) == layer.k + 64 and x.stride(1) == 1
    layer.check(x, layer.linear(x), f"row-strided M={m}")
    xt = x.contiguous().t().contiguous().t()  # stride(1) == M: copied by linear
    layer.check(xt, layer.linear(xt), f"column-major M={m}")
    xo = wide[:, 1 : 1 + layer.k]  # rows not 16-byte aligned
    layer.check(xo, layer.linear(xo), f"misaligned M={m}")


@pytest.mark.cxx_errors
def test_linear_invalid_force(force):
    layer = _layer(17, 96, 2)
    force("cublas")
    with pytest.raises(RuntimeError, match="KBIT_FORCE_KERNEL='cublas'"):
        layer.linear(_x(2, layer.k, torch.float16, "bad-force"))


@pytest.mark.cxx_errors
def test_linear_errors(force):
    layer = _layer(17, 96, 2)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        layer.linear(_x(2, layer.k, torch.float16, "err").float())
    with pytest.raises(RuntimeError, match="elements"):  # K does not match the weight
        layer.linear(_x(2, 128, torch.float16, "err"))


@pytest.mark.parametrize("m", [1, 4, 8, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("bits", [3, 4])
def test_linear_cuda_graph(bits, dtype, m, force):
    """Capture torch.ops.kbit.linear in a CUDA graph; replay on new x equals eager."""
    layer = _layer(4096, 4096, bits)
    x_static = _x(m, layer.k, dtype, "graph-warmup", bits)
    graph, y_static = capture(lambda: layer.linear(x_static))
    for step in range(2):
        x_new = _x(m, layer.k, dtype, "graph", bits, step)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        y_eager = layer.linear(x_new)
        layer.check(x_new, y_static, f"graph replay M={m}")
        # Same kernels on the same data: equal, up to the summation order of split-K atomics.
        tol = torch.finfo(dtype).eps * y_eager.abs().max().item()
        assert (y_static.float() - y_eager.float()).abs().max().item() <= tol
        if m > 64:  # the dequantize + cuBLAS path is deterministic
            assert torch.equal(y_static, y_eager)
