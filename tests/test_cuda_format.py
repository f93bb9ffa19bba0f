# SPDX-License-Identifier: Apache-2.0
"""CUDA format kernels (quantize, dequantize, repack, dequantize_tiled) against the
reference run on the CPU: integer outputs and floats bit for bit.

Real layer shapes are quantized whole on the GPU; the CPU reference (slow) checks sampled
rows, which is exact because every op is row-local (tile-row-local for the tiled layout).
dequantize_tiled is also compared whole against the GPU dequantize of the same weight.

Run: pytest tests/test_cuda_format.py
"""

import zlib

import pytest
import torch

from vllm_kbit import _ops
from vllm_kbit import reference as ref
from vllm_kbit.format import default_codebook

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

OPS = torch.ops.kbit
BITS = [2, 3, 4, 5]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SMALL = [(1, 32), (8, 4128), (17, 96), (1000, 256), (1, 4128), (33, 160)]
SMALL_TILED = SMALL + [(16, 128), (48, 4096)]  # + exact tiles, several K tiles
REAL = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]
INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _name(v) -> str:  # test ids: "float16", "4096x4096"
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v).replace("torch.", "")


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernels():
    assert _ops.load() == "compiled", "vllm_kbit._C is not built: these tests need the kernels"


def _gen(*key, device: str = "cpu") -> torch.Generator:
    """A generator seeded from the test case: fresh data for every case, reproducible."""
    return torch.Generator(device).manual_seed(zlib.crc32(repr(key).encode()))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def _codebook(bits: int, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "default":
        return default_codebook(bits)
    # Asymmetric, with a duplicated entry (equal neighbours: a zero-width interval).
    cb = (torch.rand(2**bits, generator=g) * 1.7 - 0.7).sort().values
    cb[2] = cb[1]
    cb[-1] = 1.0
    return cb


def _weight(n: int, k: int, dtype: torch.dtype, *key) -> torch.Tensor:
    """N(0,1) rows scaled by 1e-5..2 (E4M4 subnormal to normal absmax), an all-zero block and
    a block at exactly the E4M4 maximum 31; generated on the GPU."""
    g = _gen(*key, device="cuda")
    scale = 10 ** (torch.rand(n, 1, generator=g, device="cuda") * 5.3 - 5)
    w = torch.randn(n, k, generator=g, device="cuda") * scale
    w[0, :32] = 0
    w[-1, k - 32] = -31.0
    return w.clamp(-31, 31).to(dtype)


def _sample_rows(n: int, count: int = 32) -> torch.Tensor:
    """The first and last `count` rows and `count` rows from the middle (GPU indices)."""
    starts = {0, (n // 2) // 16 * 16, max(0, n - count)}
    rows = torch.cat([torch.arange(s, min(n, s + count)) for s in sorted(starts)]).unique()
    return rows.cuda()


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("cb_kind", ["default", "custom"])
@pytest.mark.parametrize("shape", SMALL, ids=_name)
def test_quantize_small(bits, dtype, cb_kind, shape):
    key = ("quantize", bits, dtype, cb_kind, shape)
    cb = _codebook(bits, cb_kind, _gen(*key))
    w = _weight(*shape, dtype, *key)
    q, a = OPS.quantize(w, cb.cuda(), bits)
    q_ref, a_ref = ref.quantize(w.cpu(), bits, cb)
    assert q.dtype == torch.int32 and a.dtype == torch.uint8
    assert torch.equal(a.cpu(), a_ref)
    assert torch.equal(q.cpu(), q_ref)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("shape", REAL, ids=_name)
def test_quantize_real_shapes(bits, dtype, shape):
    cb = default_codebook(bits)
    w = _weight(*shape, dtype, "quantize-real", bits, dtype, shape)
    q, a = OPS.quantize(w, cb.cuda(), bits)
    rows = _sample_rows(shape[0])
    q_ref, a_ref = ref.quantize(w[rows].cpu(), bits, cb)
    assert torch.equal(a[rows].cpu(), a_ref)
    assert torch.equal(q[rows].cpu(), q_ref)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_ties(bits):
    """Exact ties: absmax on every E4M4 midpoint (ties go to the larger code) and weights on
    every codebook midpoint (ties go to the lower entry), plus their float neighbours."""
    table = ref.e4m4_values()
    e4_mids = (table[:-1] + table[1:]) * 0.5
    up = torch.nextafter(e4_mids, torch.tensor(100.0))
    down = torch.nextafter(e4_mids, torch.tensor(0.0))
    amaxes = torch.cat([table, e4_mids, up, down]).clamp(max=31.0)
    g = _gen("ties", bits)
    blocks = torch.rand(amaxes.numel(), 32, generator=g) * 2 - 1
    blocks = blocks * amaxes[:, None] * 0.99
    blocks[:, 0] = amaxes

    # A dyadic codebook (multiples of 1/64, with a duplicate): its midpoints are exact, and
    # with a power-of-two scale q, w = mid * q gives w / q == mid exactly.
    cb = ((torch.rand(2**bits, generator=g) * 128 - 64).round() / 64).sort().values
    cb[1] = cb[2]
    cb[-1] = 1.0
    mids = (cb[:-1] + cb[1:]) * 0.5
    ties = []
    for e in range(1, 16):  # q = 2^(e - 11): the normal E4M4 codes with mantissa 0
        q = 2.0 ** (e - 11)
        blk = torch.zeros(32)
        blk[0] = q
        blk[1 : 1 + mids.numel()] = mids * q
        ties.append(blk)
        blk = blk.clone()
        blk[1 : 1 + mids.numel()] = torch.nextafter(mids * q, torch.tensor(100.0))
        ties.append(blk)
    w = torch.cat([blocks, torch.stack(ties)])  # one block per row: W[blocks, 32]
    q, a = OPS.quantize(w.cuda(), cb.cuda(), bits)
    q_ref, a_ref = ref.quantize(w, bits, cb)
    assert torch.equal(a.cpu(), a_ref)
    assert torch.equal(q.cpu(), q_ref)


def test_quantize_noncontiguous_input():
    w = _weight(256, 96, torch.float16, "noncontig").t().contiguous().t()  # column-major
    cb = default_codebook(4)
    q, a = OPS.quantize(w, cb.cuda(), 4)
    q_ref, a_ref = ref.quantize(w.cpu(), 4, cb)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(a.cpu(), a_ref)


def test_quantize_empty():
    q, a = OPS.quantize(torch.empty(0, 64, device="cuda"), default_codebook(3).cuda(), 3)
    assert q.shape == (0, 6) and a.shape == (0, 2)


# --------------------------------------------------------------------------- dequantize


def _random_checkpoint(n: int, k: int, bits: int, *key):
    """Random codes and every absmax code (0..255), generated on the GPU."""
    g = _gen(*key, device="cuda")
    q = torch.randint(-(2**31), 2**31 - 1, (n, k // 32 * bits), dtype=torch.int32,
                      generator=g, device="cuda")  # fmt: skip
    a = torch.randint(0, 256, (n, k // 32), dtype=torch.uint8, generator=g, device="cuda")
    return q, a


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("cb_kind", ["default", "custom"])
@pytest.mark.parametrize("shape", SMALL, ids=_name)
def test_dequantize_small(bits, dtype, cb_kind, shape):
    key = ("dequantize", bits, dtype, cb_kind, shape)
    cb = _codebook(bits, cb_kind, _gen(*key))
    q, a = _random_checkpoint(*shape, bits, *key)
    out = OPS.dequantize(q, a, cb.cuda(), bits, dtype)
    assert out.shape == shape
    assert _bitwise_equal(out.cpu(), ref.dequantize(q.cpu(), a.cpu(), cb, bits, dtype))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("shape", REAL, ids=_name)
def test_dequantize_real_shapes(bits, dtype, shape):
    key = ("dequantize-real", bits, dtype, shape)
    cb = _codebook(bits, "custom", _gen(*key))
    q, a = _random_checkpoint(*shape, bits, *key)
    out = OPS.dequantize(q, a, cb.cuda(), bits, dtype)
    rows = _sample_rows(shape[0])
    want = ref.dequantize(q[rows].cpu(), a[rows].cpu(), cb, bits, dtype)
    assert _bitwise_equal(out[rows].cpu(), want)


# ------------------------------------------------------------------------------- repack


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", SMALL_TILED, ids=_name)
def test_repack_small(bits, shape):
    q, a = _random_checkpoint(*shape, bits, "repack", bits, shape)
    qt, at = OPS.repack(q, a, bits)
    qt_ref, at_ref = ref.repack(q.cpu(), a.cpu(), bits)
    assert qt.dtype == torch.int32 and at.dtype == torch.uint8
    assert torch.equal(qt.cpu(), qt_ref)
    assert torch.equal(at.cpu(), at_ref)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", REAL + [(28672, 8192)], ids=_name)
def test_repack_real_shapes(bits, shape):
    """Whole layer on the GPU; the reference repacks tile rows (16 rows) at the start, middle
    and end, which are contiguous ranges of the tiled tensors."""
    n, k = shape
    q, a = _random_checkpoint(n, k, bits, "repack-real", bits, shape)
    qt, at = OPS.repack(q, a, bits)
    _, kp, words, nbytes = ref.tiled_shape(n, k, bits)
    assert qt.numel() == words and at.numel() == nbytes
    words_per_ntile, bytes_per_ntile = 16 * kp * bits // 32, 16 * kp // 32
    n_tiles = -(-n // 16)
    for t0 in sorted({0, n_tiles // 2, n_tiles - 2}):
        r0, r1 = 16 * t0, min(n, 16 * t0 + 32)
        qt_ref, at_ref = ref.repack(q[r0:r1].cpu(), a[r0:r1].cpu(), bits)
        w0, b0 = t0 * words_per_ntile, t0 * bytes_per_ntile
        assert torch.equal(qt[w0 : w0 + qt_ref.numel()].cpu(), qt_ref), f"tile row {t0}"
        assert torch.equal(at[b0 : b0 + at_ref.numel()].cpu(), at_ref), f"tile row {t0}"


# --------------------------------------------------------------------- dequantize_tiled


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("cb_kind", ["default", "custom"])
@pytest.mark.parametrize("shape", SMALL_TILED, ids=_name)
def test_dequantize_tiled_small(bits, dtype, cb_kind, shape):
    """Random tiled tensors, padding included: the kernel must ignore the padding."""
    n, k = shape
    g = _gen("dequantize-tiled", bits, dtype, cb_kind, shape)
    cb = _codebook(bits, cb_kind, g)
    _, _, words, nbytes = ref.tiled_shape(n, k, bits)
    qt = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=g)
    at = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)  # all E4M4 codes
    out = OPS.dequantize_tiled(qt.cuda(), at.cuda(), cb.cuda(), bits, n, k, dtype)
    assert out.shape == shape and out.dtype == dtype
    assert _bitwise_equal(out.cpu(), ref.dequantize_tiled(qt, at, cb, bits, n, k, dtype))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("shape", REAL, ids=_name)
def test_dequantize_tiled_real_shapes(bits, dtype, shape):
    """Whole layer: repack + dequantize_tiled == dequantize (both GPU, bit for bit); sampled
    rows against the CPU reference."""
    n, k = shape
    key = ("dequantize-tiled-real", bits, dtype, shape)
    cb = _codebook(bits, "custom", _gen(*key)).cuda()
    q, a = _random_checkpoint(n, k, bits, *key)
    qt, at = OPS.repack(q, a, bits)
    out = OPS.dequantize_tiled(qt, at, cb, bits, n, k, dtype)
    assert _bitwise_equal(out, OPS.dequantize(q, a, cb, bits, dtype))
    rows = _sample_rows(n)
    want = ref.dequantize(q[rows].cpu(), a[rows].cpu(), cb.cpu(), bits, dtype)
    assert _bitwise_equal(out[rows].cpu(), want)


@pytest.mark.parametrize("bits", BITS)
def test_roundtrip_quantize_repack_dequantize_tiled(bits):
    """The load-time chain on real data equals the reference chain."""
    w = _weight(1000, 4128, torch.bfloat16, "roundtrip", bits)
    cb = default_codebook(bits)
    q, a = OPS.quantize(w, cb.cuda(), bits)
    qt, at = OPS.repack(q, a, bits)
    out = OPS.dequantize_tiled(qt, at, cb.cuda(), bits, 1000, 4128, torch.bfloat16)
    q_ref, a_ref = ref.quantize(w.cpu(), bits, cb)
    assert _bitwise_equal(out.cpu(), ref.dequantize(q_ref, a_ref, cb, bits, torch.bfloat16))


# ------------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("bits", BITS)
def test_opcheck_cuda(bits):
    """Schemas, fakes and real CUDA outputs agree (shapes, dtypes, devices), incl. linear."""
    n, k = 24, 160
    cb = default_codebook(bits).cuda()
    w = _weight(n, k, torch.float16, "opcheck", bits)
    q, a = OPS.quantize(w, cb, bits)
    qt, at = OPS.repack(q, a, bits)
    x = torch.randn(3, k, dtype=torch.float16, device="cuda")
    cases = [
        (OPS.quantize, (w, cb, bits)),
        (OPS.dequantize, (q, a, cb, bits, torch.bfloat16)),
        (OPS.repack, (q, a, bits)),
        (OPS.dequantize_tiled, (qt, at, cb, bits, n, k, torch.float16)),
        (OPS.linear, (x, qt, at, cb, bits, n)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


# ------------------------------------------------------------------------------- errors


def _raises(match: str):
    return pytest.raises((RuntimeError, ValueError, TypeError), match=match)


@pytest.mark.cxx_errors
def test_quantize_errors():
    cb3 = default_codebook(3).cuda()
    w = torch.randn(8, 128, device="cuda", dtype=torch.float16)
    with _raises("float16, bfloat16 or float32"):
        OPS.quantize(w.to(torch.int32), cb3, 3)
    with _raises("multiple of 32"):
        OPS.quantize(w[:, :48].contiguous(), cb3, 3)
    with _raises("bits must be"):
        OPS.quantize(w, cb3, 6)
    with _raises("codebook"):
        OPS.quantize(w, default_codebook(4).cuda(), 3)
    with _raises("codebook must be a CUDA tensor"):
        OPS.quantize(w, default_codebook(3), 3)
    with _raises("2-D"):
        OPS.quantize(w.view(8, 4, 32), cb3, 3)

    bad = w.clone()
    bad[3, 40] = 40.0
    bad[6, 100] = -33.0
    with _raises(r"2 block\(s\) with absmax above 31.*row 3, columns 32\.\.63"):
        OPS.quantize(bad, cb3, 3)
    for value in (float("inf"), float("-inf"), float("nan")):
        bad = w.clone()
        bad[5, 70] = value
        bad[7, 0] = value
        with _raises(r"non-finite values \(first at row 5, columns 64\.\.95\)"):
            OPS.quantize(bad, cb3, 3)
    # Just inside the range is fine, and matches the reference.
    ok = w.float()
    ok[2, 5] = 31.0
    q, a = OPS.quantize(ok, cb3, 3)
    assert int(a[2, 0]) == 255
    assert torch.equal(q.cpu(), ref.quantize(ok.cpu(), 3, cb3.cpu())[0])


@pytest.mark.cxx_errors
def test_dequantize_errors():
    cb = default_codebook(4).cuda()
    q, a = _random_checkpoint(16, 128, 4, "deq-errors")
    with _raises("dtype must be"):
        OPS.dequantize(q, a, cb, 4, torch.int32)
    with _raises("qweight must be"):
        OPS.dequantize(q[:, :-1], a, cb, 4, torch.float16)
    with _raises("weight_absmax must be"):
        OPS.dequantize(q, a.int(), cb, 4, torch.float16)
    with _raises("qweight must be"):
        OPS.repack(q, a, 3)
    qt, at = OPS.repack(q, a, 4)
    with _raises("qweight must be contiguous CUDA int32"):
        OPS.dequantize_tiled(qt, at, cb, 4, 16, 256, torch.float16)
    with _raises("bad weight size"):
        OPS.dequantize_tiled(qt, at, cb, 4, 16, 120, torch.float16)
    with _raises("dtype must be"):
        OPS.dequantize_tiled(qt, at, cb, 4, 16, 128, torch.int8)
    with _raises("codebook"):
        OPS.dequantize_tiled(qt, at, cb[:8].contiguous(), 4, 16, 128, torch.float16)
