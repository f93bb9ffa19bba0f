# SPDX-License-Identifier: Apache-2.0
"""torch.ops.kbit.mma (csrc/mma.cu): y[M, n] = x[M, K] @ W^T on tensor cores, W in the tiled layout.

Oracle: x @ W^T in float32 on the reference-dequantized weights. The kernel must be within 2x the
error of "dequantize to x.dtype, then matmul" against that oracle (plus a one-ulp floor), for every
k, fp16/bf16, M from 1 to 256, real Llama-3.1-8B shapes and awkward ones (tails in n, K and M),
all split-K paths, strided x, and under CUDA-graph replay.
"""

from __future__ import annotations

import functools

import pytest
import torch
from cuda_graph import assert_pdl_matches_plain, capture
from error_bound import assert_within_2x

from vllm_kbit import _ops
from vllm_kbit import reference as ref
from vllm_kbit.format import check_codebook, default_codebook

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OPS = torch.ops.kbit
DTYPES = [torch.float16, torch.bfloat16]
MS = [1, 2, 3, 4, 5, 8, 13, 16, 17, 31, 64, 127, 256]


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if _ops.load() != "compiled":
        pytest.skip("needs the compiled vllm_kbit._C")
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 oracle must really be fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def _random_weight(n: int, k: int, device: str, seed: int, scale_exp=(-8.0, 2.0)) -> torch.Tensor:
    """N(0, 1) weights times a log-uniform scale per block of 32, so absmax codes vary widely."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k // 32, 32, generator=g, device=device)
    lo, hi = scale_exp
    s = torch.exp2(torch.rand(n, k // 32, 1, generator=g, device=device) * (hi - lo) + lo)
    return (w * s).view(n, k)


@functools.cache
def _quantized(n: int, k: int, bits: int, device: str = "cpu", seed: int = 0,
               codebook: tuple[float, ...] | None = None, scale_exp=(-8.0, 2.0)):  # fmt: skip
    """(qweight tiled, absmax tiled, codebook, W dequantized fp32) on the GPU. Quantized and
    repacked by the reference on `device` (the CPU for small shapes, the GPU for big ones)."""
    cb = default_codebook(bits) if codebook is None else torch.tensor(codebook)
    w = _random_weight(n, k, device, seed, scale_exp)
    q, a = ref.quantize(w, bits, cb)
    qt, at = ref.repack(q, a, bits)
    w32 = ref.dequantize(q, a, cb, bits, torch.float32)
    return qt.cuda(), at.cuda(), cb.cuda(), w32.cuda()


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").to(dtype)


def _check(y: torch.Tensor, x: torch.Tensor, w32: torch.Tensor) -> None:
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w32.shape[0])
    assert bool(torch.isfinite(y).all())
    oracle = x.float() @ w32.t()
    base = (x.float() @ w32.to(x.dtype).float().t()).to(x.dtype).float()
    assert_within_2x(y, base, oracle, x.dtype, "dequant+matmul")


def _mma(x, qt, at, cb, bits, n):
    return OPS.mma(x, qt, at, cb, bits, n)


# The wgmma variant of kbit::mma (KBIT_MMA_WGMMA=1, M > 32) exists in sm_90a builds only.


def _wgmma_available() -> bool:
    import vllm_kbit._C as C  # the _kernels fixture has loaded it

    return getattr(C, "sm90a", 0) == 1 and torch.cuda.get_device_capability() == (9, 0)


wgmma = pytest.mark.skipif(
    not torch.cuda.is_available() or _ops.load() != "compiled" or not _wgmma_available(),
    reason="needs a build with sm_90a code (TORCH_CUDA_ARCH_LIST with 9.0a) on an sm_90 GPU",
)
WG_MS = [33, 64, 65, 100, 128, 129, 256, 1024]


# Tails everywhere: n = 1, 8, 17 (partial n-tile), 300 (partial CTA group of 16 tiles), 1000;
# K = 32, 96 (one partial k-tile), 640, 4128 (33 k-tiles, the last holding one block).
AWKWARD = [(8, 32), (1000, 96), (1, 4128), (17, 4128), (300, 640)]


def _wgmma_env(monkeypatch, wg: str) -> None:
    """KBIT_MMA_WGMMA=wg with the default split-K and, for "2", the configuration chosen by M."""
    monkeypatch.setenv("KBIT_MMA_WGMMA", wg)
    for var in (
        "KBIT_WGMMA_CONFIG",
        "KBIT_WGMMA_C1W",
        "KBIT_MMA_SPLITS",
        "KBIT_MMA_NO_CLUSTER",
        "KBIT_MMA_FORCE_CLUSTER",
        "KBIT_MMA_CLUSTER_SPLITS",
        "KBIT_MMA_STREAMK",
        "KBIT_MMA_NT",
        "KBIT_MMA_NO_PDL",
        "KBIT_PDL",
        "KBIT_WG_ABUFS",
        "KBIT_WG_C2W_MIN_STAGES",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("n,k", AWKWARD)
def test_awkward_shapes_all_m(n: int, k: int, bits: int, dtype: torch.dtype) -> None:
    qt, at, cb, w32 = _quantized(n, k, bits)
    for m in MS:
        x = _x(m, k, dtype, seed=m)
        _check(_mma(x, qt, at, cb, bits, n), x, w32)


# Llama-3.1-8B layers (N, K): o, qkv, down, gate_up; quantized on the GPU for speed.
REAL = [
    (4096, 4096, [2, 3, 4, 5], torch.float16, [1, 5, 16, 64]),
    (4096, 4096, [3, 5], torch.bfloat16, [8, 31]),
    (6144, 4096, [4], torch.float16, [16, 64]),
    (6144, 4096, [2], torch.bfloat16, [13]),
    (4096, 14336, [4], torch.float16, [16, 64]),
    (4096, 14336, [5], torch.bfloat16, [17]),
    (28672, 4096, [4], torch.float16, [16, 64]),
    (28672, 4096, [3], torch.bfloat16, [8]),
]


@pytest.mark.parametrize("n,k,bits_list,dtype,ms", REAL)
def test_real_shapes(n, k, bits_list, dtype, ms) -> None:
    for bits in bits_list:
        qt, at, cb, w32 = _quantized(n, k, bits, device="cuda")
        for m in ms:
            x = _x(m, k, dtype, seed=m)
            _check(_mma(x, qt, at, cb, bits, n), x, w32)
        _quantized.cache_clear()  # big tensors: do not keep them around


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_custom_asymmetric_codebook(bits: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(bits)
    cb = torch.sort(torch.rand(2**bits, generator=g) * 1.25 - 0.25).values
    cb[1] = cb[0]  # duplicates are allowed
    cb[-1] = 1.0
    cb = check_codebook(cb, bits)  # bf16-exact, as every codebook the plugin passes
    n, k = 272, 640
    qt, at, cb, w32 = _quantized(n, k, bits, codebook=tuple(cb.tolist()))
    for m in [5, 16, 40, 64]:
        x = _x(m, k, dtype, seed=m)
        _check(_mma(x, qt, at, cb, bits, n), x, w32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_subnormal_and_zero_absmax(dtype: torch.dtype) -> None:
    # absmax < 2^-10 (E4M4 subnormals) and all-zero blocks (absmax code 0)
    n, k, bits = 128, 512, 4
    qt, at, cb, w32 = _quantized(n, k, bits, seed=3, scale_exp=(-18.0, -13.0))
    qt0, at0, _, _ = _quantized(n, k, bits, seed=3, scale_exp=(-60.0, -60.0))
    assert int(at.max()) < 16 and int(at0.max()) == 0  # subnormal codes / all zero
    for m in [8, 16]:
        x = _x(m, k, dtype)
        _check(_mma(x, qt, at, cb, bits, n), x, w32)
        assert bool((_mma(x, qt0, at0, cb, bits, n) == 0).all())


# "2": the warp-specialized wgmma kernel, whose TMA needs 16-byte aligned rows: odd strides and
# shifted rows go through mma.cu's copy
@pytest.mark.parametrize("wg,m", [("0", 24), pytest.param("2", 100, marks=wgmma)])
def test_strided_and_misaligned_x(monkeypatch, wg: str, m: int) -> None:
    _wgmma_env(monkeypatch, wg)
    n, k, bits = 200, 384, 4
    qt, at, cb, w32 = _quantized(n, k, bits)
    x = _x(m, k, torch.float16)
    y = _mma(x, qt, at, cb, bits, n)
    _check(y, x, w32)
    wide = torch.zeros(m, k + 64, dtype=x.dtype, device="cuda")  # aligned row stride > K
    wide[:, :k] = x
    odd = torch.zeros(m, k + 3, dtype=x.dtype, device="cuda")  # stride not a multiple of 8
    odd[:, :k] = x
    shifted = torch.zeros(m, k + 1, dtype=x.dtype, device="cuda")  # rows not 16-byte aligned
    shifted[:, 1:] = x
    for view in [wide[:, :k], odd[:, :k], shifted[:, 1:]]:
        assert view.stride(0) > k
        assert torch.equal(_mma(view, qt, at, cb, bits, n), y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [5, 16, 64])
def test_split_k_paths(monkeypatch, m: int, dtype: torch.dtype) -> None:
    # Forced split counts, cluster (sm_90) and workspace reductions: all correct, and the two
    # reductions add the partials in the same order, so they agree bit for bit.
    n, k, bits = 512, 4096, 3
    qt, at, cb, w32 = _quantized(n, k, bits)
    x = _x(m, k, dtype)
    for splits in [1, 2, 3, 8]:
        monkeypatch.setenv("KBIT_MMA_SPLITS", str(splits))
        monkeypatch.delenv("KBIT_MMA_NO_CLUSTER", raising=False)
        y = _mma(x, qt, at, cb, bits, n)  # by cluster packing: cluster or workspace
        _check(y, x, w32)
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)  # deterministic
        monkeypatch.setenv("KBIT_MMA_FORCE_CLUSTER", "1")  # cluster wherever the GPU has them
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)
        monkeypatch.delenv("KBIT_MMA_FORCE_CLUSTER")
        monkeypatch.setenv("KBIT_MMA_CLUSTER_SPLITS", "8")  # clusters of any size where they fit
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)
        monkeypatch.delenv("KBIT_MMA_CLUSTER_SPLITS")
        monkeypatch.setenv("KBIT_MMA_NO_CLUSTER", "1")
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)


# Stream-K (KBIT_MMA_STREAMK=1: wherever it applies, M = 17..64): n-tile groups and k-tiles shared
# out evenly over CTAs, across group boundaries. (300, 640): 10 units, one per CTA, chains of 5
# CTAs per group; (4144, 1024): 17 groups (the last 3 n-tiles) x 8 k-tiles, CTAs of 1-2 units;
# (12304, 1024): 392 units, runs of ~3 units crossing groups; (1000, 4128): a K tail.
STREAM_SHAPES = [(300, 640), (4144, 1024), (12304, 1024), (1000, 4128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_stream_k(monkeypatch, bits: int, dtype: torch.dtype) -> None:
    monkeypatch.setenv("KBIT_MMA_STREAMK", "1")
    for n, k in STREAM_SHAPES:
        qt, at, cb, w32 = _quantized(n, k, bits)
        for m in [17, 32, 33, 64]:
            x = _x(m, k, dtype, seed=m + bits)
            y = _mma(x, qt, at, cb, bits, n)
            _check(y, x, w32)
            assert torch.equal(_mma(x, qt, at, cb, bits, n), y), f"{n}x{k} M={m}: not deterministic"
        # One-hot tokens (token t = column c_t, spread over all k-tiles): y = W[:, c_t] exactly,
        # one product per output, whatever CTA holds which k-tile: any wrong row, token, k-tile
        # or partial shows as a wrong value.
        for m in [20, 64]:
            cols = (torch.arange(m, device="cuda") * 997) % k
            x = torch.zeros(m, k, dtype=dtype, device="cuda")
            x[torch.arange(m, device="cuda"), cols] = 1
            y = _mma(x, qt, at, cb, bits, n)
            want = w32.to(dtype)[:, cols].t()
            bad = (y != want).nonzero()
            where = f"{n}x{k} M={m}: {bad.shape[0]} wrong, first (token, row) {bad[:4].tolist()}"
            assert bad.numel() == 0, where


# The 64-token mma.sync kernel with 4 n-tiles per warp (KBIT_MMA_NT=4: 512-row CTAs; by default
# on big layers, mma.cu's mma_tiles_per_warp): partial 512-row groups (n = 520, 1040, 1000),
# partial tiles and k-tiles, every reduction; one-hot tokens must give W's columns exactly.
NT4_SHAPES = [(1000, 96), (17, 4128), (520, 1056), (1040, 2080)]
NT4_MODES = {
    "auto": {},
    "stream": {"KBIT_MMA_STREAMK": "1"},
    "workspace3": {"KBIT_MMA_SPLITS": "3", "KBIT_MMA_NO_CLUSTER": "1", "KBIT_MMA_STREAMK": "0"},
    "cluster2": {"KBIT_MMA_SPLITS": "2", "KBIT_MMA_FORCE_CLUSTER": "1", "KBIT_MMA_STREAMK": "0"},
    "direct": {"KBIT_MMA_SPLITS": "1", "KBIT_MMA_STREAMK": "0"},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_nt4_paths(monkeypatch, bits: int, dtype: torch.dtype) -> None:
    for n, k in NT4_SHAPES:
        qt, at, cb, w32 = _quantized(n, k, bits)
        for mode, env in NT4_MODES.items():
            _wgmma_env(monkeypatch, "0")  # mma.sync, every other KBIT_MMA_* setting cleared
            monkeypatch.setenv("KBIT_MMA_NT", "4")
            for var, val in env.items():
                monkeypatch.setenv(var, val)
            for m in [33, 50, 64]:
                x = _x(m, k, dtype, seed=m + bits)
                y = _mma(x, qt, at, cb, bits, n)
                _check(y, x, w32)
                assert torch.equal(_mma(x, qt, at, cb, bits, n), y), f"{n}x{k} {mode} M={m}"
            cols = (torch.arange(64, device="cuda") * 997) % k
            x = torch.zeros(64, k, dtype=dtype, device="cuda")
            x[torch.arange(64, device="cuda"), cols] = 1
            bad = (_mma(x, qt, at, cb, bits, n) != w32.to(dtype)[:, cols].t()).nonzero()
            where = f"{n}x{k} {mode}: {bad.shape[0]} wrong, first (token, row) {bad[:4].tolist()}"
            assert bad.numel() == 0, where


@pytest.mark.parametrize("nt", ["2", "4"])
def test_nt_graph_replay_equals_eager(monkeypatch, nt: str) -> None:
    _wgmma_env(monkeypatch, "0")
    monkeypatch.setenv("KBIT_MMA_NT", nt)
    n, k, bits = 1040, 2080, 4
    qt, at, cb, _ = _quantized(n, k, bits)
    static_x = _x(64, k, torch.float16)
    graph, static_y = capture(lambda: _mma(static_x, qt, at, cb, bits, n))
    for seed in [5, 6]:
        x = _x(64, k, torch.float16, seed=seed)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, _mma(x, qt, at, cb, bits, n))


@pytest.mark.parametrize(
    "wg", ["0", pytest.param("1", marks=wgmma), pytest.param("2", marks=wgmma)]
)
@pytest.mark.parametrize("reduction", ["cluster", "workspace", "stream"])
@pytest.mark.parametrize("m", [16, 64, 100, 200])
def test_cuda_graph_replay_equals_eager(monkeypatch, m: int, reduction: str, wg: str) -> None:
    # "1": the first wgmma variant for M > 32; "2": the warp-specialized kernel (any M)
    _wgmma_env(monkeypatch, wg)
    # split-K: cluster (wherever the GPU has them), workspace or (M = 17..64) stream-K
    monkeypatch.setenv("KBIT_MMA_STREAMK", "1" if reduction == "stream" else "0")
    monkeypatch.setenv(
        "KBIT_MMA_FORCE_CLUSTER" if reduction == "cluster" else "KBIT_MMA_NO_CLUSTER", "1"
    )
    n, k, bits = 1024, 2048, 4
    qt, at, cb, _ = _quantized(n, k, bits)
    static_x = _x(m, k, torch.float16)
    graph, static_y = capture(lambda: _mma(static_x, qt, at, cb, bits, n))
    for seed in [5, 6, 7]:
        x = _x(m, k, torch.float16, seed=seed)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, _mma(x, qt, at, cb, bits, n))


@pytest.mark.parametrize("wg", ["0", pytest.param("2", marks=wgmma)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, m", [(17, 4128, 5), (1000, 2080, 33), (4096, 4096, 64)])
def test_workspace_reduce_pdl(
    monkeypatch, n: int, k: int, m: int, dtype: torch.dtype, wg: str
) -> None:
    # Split-K through the fp32 workspace: the reduce kernel, launched with PDL while the GEMM drains
    # (sm_90) or in plain stream order (KBIT_MMA_NO_PDL=1), with float4 units (M * n % 4 == 0) or
    # a scalar tail (17 x 5): correct, the same bits either way, and the same under graph replay.
    _wgmma_env(monkeypatch, wg)
    split_env = {"KBIT_MMA_SPLITS": "5", "KBIT_MMA_NO_CLUSTER": "1", "KBIT_MMA_STREAMK": "0"}
    for var, val in split_env.items():
        monkeypatch.setenv(var, val)
    bits = 4
    qt, at, cb, w32 = _quantized(n, k, bits)
    x = _x(m, k, dtype, seed=n + m)
    y = _mma(x, qt, at, cb, bits, n)
    _check(y, x, w32)
    monkeypatch.setenv("KBIT_MMA_NO_PDL", "1")
    assert torch.equal(_mma(x, qt, at, cb, bits, n), y)
    monkeypatch.delenv("KBIT_MMA_NO_PDL")
    static_x = x.clone()
    graph, static_y = capture(lambda: _mma(static_x, qt, at, cb, bits, n))
    for seed in [1, 2]:
        x2 = _x(m, k, dtype, seed=seed)
        static_x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, _mma(x2, qt, at, cb, bits, n))


_PDL_REDUCTIONS = {
    "direct": {"KBIT_MMA_SPLITS": "1"},
    "cluster": {"KBIT_MMA_SPLITS": "4", "KBIT_MMA_FORCE_CLUSTER": "1", "KBIT_MMA_STREAMK": "0"},
    "workspace": {"KBIT_MMA_SPLITS": "4", "KBIT_MMA_NO_CLUSTER": "1", "KBIT_MMA_STREAMK": "0"},
    "stream": {"KBIT_MMA_STREAMK": "1"},
}


@pytest.mark.parametrize("wg", ["0", pytest.param("2", marks=wgmma)])
@pytest.mark.parametrize("reduction", sorted(_PDL_REDUCTIONS))
@pytest.mark.parametrize("m", [16, 64, 100])
def test_pdl_chain(monkeypatch, m: int, reduction: str, wg: str) -> None:
    # KBIT_PDL=1: each GEMM of a chain x <- mma(x) may start while the one before drains and reads
    # its x only after griddepcontrol.wait: the same bits as plain stream order, eagerly and under
    # graph replay (where the launches become programmatic graph edges). Weights of ~2^-5.5 keep
    # the chain's values in range. (Stream-K runs for M = 17..64 only; M=100 falls back.)
    _wgmma_env(monkeypatch, wg)
    for var, val in _PDL_REDUCTIONS[reduction].items():
        monkeypatch.setenv(var, val)
    n = k = 2048
    bits = 4
    qt, at, cb, _ = _quantized(n, k, bits, scale_exp=(-6.0, -5.0))

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = _mma(x, qt, at, cb, bits, n)
        return x

    xs = [_x(m, k, torch.float16, seed=seed) for seed in (m, 1, 2)]
    assert_pdl_matches_plain(monkeypatch, chain, xs)


@pytest.mark.cxx_errors
def test_bad_inputs() -> None:
    n, k, bits = 64, 256, 4
    qt, at, cb, _ = _quantized(n, k, bits)
    x = _x(4, k, torch.float16)
    errors = (RuntimeError, ValueError, TypeError)
    with pytest.raises(errors, match="float16 or bfloat16"):
        _mma(x.float(), qt, at, cb, bits, n)
    with pytest.raises(errors, match="unit stride"):
        _mma(_x(k, 4, torch.float16).t(), qt, at, cb, bits, n)
    with pytest.raises(errors, match="2-D"):
        _mma(x[0], qt, at, cb, bits, n)
    with pytest.raises(errors, match="qweight"):
        _mma(x, qt[:-1], at, cb, bits, n)
    with pytest.raises(errors, match="qweight"):
        _mma(x, qt, at, cb, bits, n + 16)  # n does not match the tensors
    with pytest.raises(errors, match="weight_absmax"):
        _mma(x, qt, at.to(torch.int32), cb, bits, n)
    with pytest.raises(errors, match="codebook"):
        _mma(x, qt, at, cb[:-1], bits, n)
    with pytest.raises(errors, match="bits"):
        _mma(x, qt, at, cb, 6, n)
    with pytest.raises(errors, match="multiple of 32"):
        _mma(_x(4, 100, torch.float16), qt, at, cb, bits, n)
    with pytest.raises(errors, match="CUDA"):
        _mma(x.cpu(), qt, at, cb, bits, n)


def test_empty_m() -> None:
    n, k, bits = 64, 256, 2
    qt, at, cb, _ = _quantized(n, k, bits)
    y = _mma(torch.empty(0, k, dtype=torch.bfloat16, device="cuda"), qt, at, cb, bits, n)
    assert y.shape == (0, n) and y.dtype == torch.bfloat16


# --------------------------------------------------------------- wgmma path (sm_90a builds)


@wgmma
@pytest.mark.parametrize("wg", ["1", "2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("n,k", AWKWARD)
def test_wgmma_awkward_shapes(monkeypatch, n: int, k: int, bits: int, dtype: torch.dtype,
                              wg: str) -> None:  # fmt: skip
    # "1": the first wgmma variant (M > 32: 64 / 128 tokens per tile); "2": the warp-specialized
    # kernel (any M), its configuration chosen by M
    _wgmma_env(monkeypatch, wg)
    qt, at, cb, w32 = _quantized(n, k, bits)
    for m in WG_MS if wg == "1" else WS_MS:
        x = _x(m, k, dtype, seed=m)
        _check(_mma(x, qt, at, cb, bits, n), x, w32)


@wgmma
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgmma_one_hot_layout(monkeypatch, dtype: torch.dtype) -> None:
    # x = one-hot rows: y[t, :] must equal column c(t) of the dequantized W exactly (one product
    # per output, no rounding). A descriptor, fragment or token mapping error shows up as the
    # exact (token, column) that is wrong.
    monkeypatch.setenv("KBIT_MMA_WGMMA", "1")
    n, k, bits = 256, 256, 4
    qt, at, cb, w32 = _quantized(n, k, bits)
    m = 128
    cols = (torch.arange(m, device="cuda") * 37 + 5) % k
    x = torch.zeros(m, k, dtype=dtype, device="cuda")
    x[torch.arange(m, device="cuda"), cols] = 1.0
    y = _mma(x, qt, at, cb, bits, n).float()
    want = w32.to(dtype).float().t()[cols]
    bad = (y != want).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} wrong outputs, first (token, row): {bad[:4].tolist()}"


@wgmma
@pytest.mark.parametrize("n,m,want", [(16384, 100, "1"), (16384, 64, "2"), (16384, 200, "0"),
                                      (32768, 200, "1"), (1024, 100, "0")])  # fmt: skip
def test_wgmma_chosen_by_shape(monkeypatch, n: int, m: int, want: str) -> None:
    # KBIT_MMA_WGMMA unset: the wgmma variant for 64 < M <= 128 at n >= 16384 and M <= 256 at
    # n >= 32768 (mma.cu, use_wgmma). Both variants accumulate each k16 step in fp32 in the same
    # order, so with the same split-K they agree bit for bit (H100, ddb3e5f: 4 of these 5 cases);
    # where the splits differ (n = 16384, M = 100) the unset result must equal the wgmma one.
    # M = 64 on these layers (<= 16M weights) is the warp-specialized kernel's (KBIT_MMA_WGMMA=2).
    k, bits = 256, 4
    qt, at, cb, w32 = _quantized(n, k, bits)
    x = _x(m, k, torch.float16, seed=n + m)
    forced = {}
    for flag in ("0", "1", "2"):
        monkeypatch.setenv("KBIT_MMA_WGMMA", flag)
        forced[flag] = _mma(x, qt, at, cb, bits, n)
        _check(forced[flag], x, w32)
    monkeypatch.delenv("KBIT_MMA_WGMMA")
    assert torch.equal(_mma(x, qt, at, cb, bits, n), forced[want])


@wgmma
@pytest.mark.parametrize("m", [64, 256])
def test_wgmma_real_shapes_and_splits(monkeypatch, m: int) -> None:
    monkeypatch.setenv("KBIT_MMA_WGMMA", "1")
    for n, k, bits in [(28672, 4096, 4), (4096, 14336, 2)]:
        qt, at, cb, w32 = _quantized(n, k, bits, device="cuda")
        x = _x(m, k, torch.bfloat16, seed=m)
        y = _mma(x, qt, at, cb, bits, n)
        _check(y, x, w32)
        for splits in ["2", "3"]:
            monkeypatch.setenv("KBIT_MMA_SPLITS", splits)
            _check(_mma(x, qt, at, cb, bits, n), x, w32)
        monkeypatch.delenv("KBIT_MMA_SPLITS")
        monkeypatch.setenv("KBIT_MMA_WGMMA", "0")
        _check(_mma(x, qt, at, cb, bits, n), x, w32)  # the mma.sync path on the same data
        monkeypatch.setenv("KBIT_MMA_WGMMA", "1")
        _quantized.cache_clear()


# ------------------------------------- warp-specialized wgmma kernel (KBIT_MMA_WGMMA=2, sm_90a)
# csrc/wgmma_gemm.cu: producer warpgroup (bulk copies + TMA), two consumer warpgroups (register
# A, wgmma), mbarrier ring. Configurations (KBIT_WGMMA_CONFIG): 1 = 128 rows x 64 tokens,
# 2 = 128 x 128, 3 = 256 x 128, 4 = C1w 256 x 64, 5 = C2w 128 x 256; unset = by M (C1w for
# M <= 64 on layers of > 16M weights or with KBIT_WGMMA_C1W=1). First on a new build:
# test_ws_smoke (a protocol bug traps after 20 s instead of hanging; the process's CUDA context is
# then lost).

WS_CONFIGS = ["1", "2", "3", "4", "5"]
WS_MS = [1, 17, 64, 65, 100, 127, 128, 129, 200, 256, 300, 1000]


@pytest.fixture
def ws(monkeypatch):
    """KBIT_MMA_WGMMA=2 with the default split-K and configuration."""
    _wgmma_env(monkeypatch, "2")
    return monkeypatch


@wgmma
def test_ws_smoke(ws) -> None:
    n, k, bits = 256, 256, 4
    qt, at, cb, w32 = _quantized(n, k, bits)
    x = _x(128, k, torch.float16)
    y = _mma(x, qt, at, cb, bits, n)
    torch.cuda.synchronize()
    _check(y, x, w32)


@wgmma
@pytest.mark.parametrize("n,k,cases", [
    # a small layer (<= 16M weights): the warp-specialized kernel for 32 < M <= 256
    (1000, 4128, [(32, "0"), (33, "2"), (64, "2"), (65, "2"), (200, "2"), (256, "2"), (257, None)]),
    # 6144 x 4096 = 24M weights (8B qkv): mma.sync up to M = 32, then the warp-specialized kernel
    # (C1w up to M = 64)
    (6144, 4096, [(32, "0"), (33, "2"), (64, "2"), (65, "2"), (257, None)]),
    # 20480 x 8192: 80 blocks of 256 rows (more than half the SMs of any sm_90 GPU) of 64 k-tiles
    # each: mma.sync (stream-K) up to M = 64
    (20480, 8192, [(33, "0"), (64, "0"), (65, "2")]),
    # 8192 x 4096 = 32M weights: also up to M = 1024
    (8192, 4096, [(257, "2"), (600, "2"), (1024, "2"), (1025, None)]),
])  # fmt: skip
def test_ws_is_the_default_by_m_and_layer_size(monkeypatch, n: int, k: int, cases: list) -> None:
    # unset KBIT_MMA_WGMMA: the warp-specialized kernel for 64 < M <= 256, on layers of >= 32M
    # weights up to M = 1024, and from M = 33 on layers of <= 16M weights or where C1w beats
    # mma.sync (kbit_format.cuh's c1w_beats_sync); mma.sync elsewhere
    # (bitwise equal to the forced kernels: same configuration, deterministic reductions)
    _wgmma_env(monkeypatch, "0")
    bits = 4
    qt, at, cb, w32 = _quantized(n, k, bits, device="cuda" if n * k > 1 << 24 else "cpu")
    for m, kernel in cases:
        x = _x(m, k, torch.float16, seed=m)
        monkeypatch.delenv("KBIT_MMA_WGMMA", raising=False)
        y = _mma(x, qt, at, cb, bits, n)
        _check(y, x, w32)
        if kernel is None:  # mma.sync or its first wgmma variant, by shape: only check the result
            continue
        monkeypatch.setenv("KBIT_MMA_WGMMA", kernel)
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y), f"M={m}: not KBIT_MMA_WGMMA={kernel}"
        if kernel == "2":  # and kbit::linear takes kbit::mma there
            monkeypatch.delenv("KBIT_MMA_WGMMA")
            assert torch.equal(OPS.linear(x, qt, at, cb, bits, n), y), f"M={m}: linear"
    _quantized.cache_clear()


def _one_hot_all_columns(k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.eye(k, dtype=dtype, device="cuda")  # token t = column t


@wgmma
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", WS_CONFIGS)
@pytest.mark.parametrize("splits", ["1", "3"])
def test_ws_one_hot_layout(ws, config: str, dtype: torch.dtype, splits: str) -> None:
    # x = identity (token t = one-hot column t) => y = W^T exactly, one product per output and no
    # rounding, whatever the split-K. Catches, one element at a time, any error in the A
    # fragments, the B descriptor / 128B swizzle / k16 advance, the TMA boxes (incl. the K tail:
    # K = 416 ends 32 columns into its 4th k-tile), the token/row mapping and the epilogue.
    # n = 300: a partial row block and a partial tile; M = 416: a partial token tile.
    ws.setenv("KBIT_WGMMA_CONFIG", config)
    ws.setenv("KBIT_MMA_SPLITS", splits)
    n, k = 300, 416
    for bits in (2, 3, 4, 5):
        qt, at, cb, w32 = _quantized(n, k, bits)
        y = _mma(_one_hot_all_columns(k, dtype), qt, at, cb, bits, n).float()
        want = w32.to(dtype).float().t()
        bad = (y != want).nonzero()
        assert bad.numel() == 0, (f"bits={bits}: {bad.shape[0]} wrong outputs, first (token=column,"
                                  f" row): {bad[:4].tolist()}")  # fmt: skip


@wgmma
@pytest.mark.parametrize("config", WS_CONFIGS)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_ws_configs_forced(ws, config: str, bits: int) -> None:
    ws.setenv("KBIT_WGMMA_CONFIG", config)
    shapes = [(300, 640, torch.float16), (1000, 4128, torch.bfloat16), (17, 160, torch.float16)]
    for n, k, dtype in shapes:
        qt, at, cb, w32 = _quantized(n, k, bits)
        for m in [1, 65, 127, 300]:
            x = _x(m, k, dtype, seed=m + bits)
            _check(_mma(x, qt, at, cb, bits, n), x, w32)


@wgmma
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", WS_CONFIGS)
@pytest.mark.parametrize("m", [65, 300])
def test_ws_split_k_paths(ws, m: int, config: str, dtype: torch.dtype) -> None:
    # forced split counts, cluster (DSMEM) and workspace reductions: correct, deterministic, and
    # the two reductions add the partials in the same order, so they agree bit for bit
    ws.setenv("KBIT_WGMMA_CONFIG", config)
    n, k, bits = 512, 4096, 3
    qt, at, cb, w32 = _quantized(n, k, bits)
    x = _x(m, k, dtype)
    for splits in ["1", "2", "3", "8"]:
        ws.setenv("KBIT_MMA_SPLITS", splits)
        ws.delenv("KBIT_MMA_NO_CLUSTER", raising=False)
        y = _mma(x, qt, at, cb, bits, n)
        _check(y, x, w32)
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)  # deterministic
        ws.setenv("KBIT_MMA_FORCE_CLUSTER", "1")
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)
        ws.delenv("KBIT_MMA_FORCE_CLUSTER")
        ws.setenv("KBIT_MMA_NO_CLUSTER", "1")
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)


@wgmma
@pytest.mark.parametrize("m", [64, 128, 256, 1000])
def test_ws_real_shapes(ws, m: int) -> None:
    # Llama-3.1-8B gate_up and down, 70B o; the default configuration and split-K for each M
    for n, k, bits, dtype in [(28672, 4096, 4, torch.float16), (4096, 14336, 2, torch.bfloat16),
                              (8192, 8192, 5, torch.float16)]:  # fmt: skip
        qt, at, cb, w32 = _quantized(n, k, bits, device="cuda")
        x = _x(m, k, dtype, seed=m)
        _check(_mma(x, qt, at, cb, bits, n), x, w32)
        _quantized.cache_clear()


@wgmma
def test_ws_subnormal_and_zero_absmax(ws) -> None:
    n, k, bits = 128, 512, 4
    qt, at, cb, w32 = _quantized(n, k, bits, seed=3, scale_exp=(-18.0, -13.0))
    qt0, at0, _, _ = _quantized(n, k, bits, seed=3, scale_exp=(-60.0, -60.0))
    for m, dtype in [(65, torch.float16), (200, torch.bfloat16)]:
        x = _x(m, k, dtype)
        _check(_mma(x, qt, at, cb, bits, n), x, w32)
        assert bool((_mma(x, qt0, at0, cb, bits, n) == 0).all())


@wgmma
@pytest.mark.parametrize("config", ["1", "4"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_ws_abufs4(ws, config: str, bits: int) -> None:
    # KBIT_WG_ABUFS=4 (64-token tiles C1 / C1w: 4 A-register sets, 2 wgmma groups in flight):
    # the same wgmmas in the same order as 2 sets, so the same bits; tails in n, K and M, direct
    # and workspace split-K, fp16 and bf16.
    ws.setenv("KBIT_WGMMA_CONFIG", config)
    for n, k in [(300, 416), (17, 4128), (1040, 2080)]:
        qt, at, cb, w32 = _quantized(n, k, bits)
        for dtype in DTYPES:
            for m in [5, 33, 64]:
                x = _x(m, k, dtype, seed=m + bits)
                for splits in ["1", "3"]:
                    ws.setenv("KBIT_MMA_SPLITS", splits)
                    ws.setenv("KBIT_MMA_NO_CLUSTER", "1")
                    ws.delenv("KBIT_WG_ABUFS", raising=False)
                    y2 = _mma(x, qt, at, cb, bits, n)
                    ws.setenv("KBIT_WG_ABUFS", "4")
                    y4 = _mma(x, qt, at, cb, bits, n)
                    _check(y4, x, w32)
                    assert torch.equal(y4, y2), f"{n}x{k} M={m} splits={splits} {dtype}"


@wgmma
@pytest.mark.parametrize("dtype", DTYPES)
def test_ws_c1w_real_shapes(ws, dtype: torch.dtype) -> None:
    # C1w (256 rows x 64 tokens) where it is meant to run, M <= 64: 8B gate_up (112 row blocks),
    # qkv, down (16 row blocks: split-K through a cluster) and 70B o; default and forced split-K,
    # cluster and workspace reductions bitwise equal
    ws.setenv("KBIT_WGMMA_CONFIG", "4")
    for n, k, bits in [(28672, 4096, 4), (6144, 4096, 3), (4096, 14336, 2), (8192, 8192, 5)]:
        qt, at, cb, w32 = _quantized(n, k, bits, device="cuda")
        for m in [1, 33, 64]:
            x = _x(m, k, dtype, seed=m + bits)
            _check(_mma(x, qt, at, cb, bits, n), x, w32)
            ws.setenv("KBIT_MMA_SPLITS", "4")
            ws.setenv("KBIT_MMA_FORCE_CLUSTER", "1")
            y4 = _mma(x, qt, at, cb, bits, n)
            _check(y4, x, w32)
            ws.delenv("KBIT_MMA_FORCE_CLUSTER")
            ws.setenv("KBIT_MMA_NO_CLUSTER", "1")
            assert torch.equal(_mma(x, qt, at, cb, bits, n), y4)  # same partials, same order
            ws.delenv("KBIT_MMA_SPLITS")
            ws.delenv("KBIT_MMA_NO_CLUSTER")
        _quantized.cache_clear()


@wgmma
@pytest.mark.parametrize("m,c1w,want", [(1, "1", "4"), (64, "1", "4"), (64, "0", "1"),
                                        (64, None, "1"), (65, "1", None), (200, "1", None)])  # fmt: skip
def test_ws_c1w_switch(ws, m: int, c1w: str | None, want: str | None) -> None:
    # KBIT_WGMMA_CONFIG unset: M <= 64 takes C1 on this 16M-weight layer, C1w with
    # KBIT_WGMMA_C1W=1 (and by default on larger layers); above 64 tokens the switch changes
    # nothing. Same configuration => same kernel and split-K => bitwise equal outputs (C1 and C1w split the n dimension differently
    # and pick different split-K counts here, so they need not agree bit for bit).
    n, k, bits = 4096, 4096, 4
    qt, at, cb, w32 = _quantized(n, k, bits, device="cuda")
    x = _x(m, k, torch.float16, seed=m)
    if c1w is not None:
        ws.setenv("KBIT_WGMMA_C1W", c1w)
    y = _mma(x, qt, at, cb, bits, n)
    _check(y, x, w32)
    if want is None:  # compare with the switch off
        ws.delenv("KBIT_WGMMA_C1W")
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)
    else:
        ws.delenv("KBIT_WGMMA_C1W", raising=False)
        ws.setenv("KBIT_WGMMA_CONFIG", want)
        assert torch.equal(_mma(x, qt, at, cb, bits, n), y)
    _quantized.cache_clear()


@wgmma
@pytest.mark.parametrize("bits,min_stages,want", [(5, None, "3"), (5, "2", "5"), (4, None, "5"),
                                                  (3, None, "5")])  # fmt: skip
def test_ws_c2w_needs_a_deep_ring(ws, bits: int, min_stages: str | None, want: str) -> None:
    # Above 128 tokens (here 160) the planner takes C2w (128 rows x 256 tokens), whose stages fit
    # shared memory three times at k <= 4 but only twice at k=5: there it runs C3 (256 x 128)
    # instead, unless KBIT_WG_C2W_MIN_STAGES=2. Same configuration => same kernel and split-K
    # => bitwise equal outputs.
    n, k, m = 4096, 4096, 160
    qt, at, cb, w32 = _quantized(n, k, bits, device="cuda")
    x = _x(m, k, torch.float16, seed=bits)
    if min_stages is not None:
        ws.setenv("KBIT_WG_C2W_MIN_STAGES", min_stages)
    y = _mma(x, qt, at, cb, bits, n)
    _check(y, x, w32)
    ws.delenv("KBIT_WG_C2W_MIN_STAGES", raising=False)
    ws.setenv("KBIT_WGMMA_CONFIG", want)
    assert torch.equal(_mma(x, qt, at, cb, bits, n), y)
    _quantized.cache_clear()


@wgmma
@pytest.mark.cxx_errors
def test_ws_bad_config_is_a_clear_error(ws) -> None:
    n, k, bits = 64, 256, 4
    qt, at, cb, _ = _quantized(n, k, bits)
    ws.setenv("KBIT_WGMMA_CONFIG", "6")
    with pytest.raises(RuntimeError, match="KBIT_WGMMA_CONFIG must be 1, 2, 3, 4 or 5"):
        _mma(_x(64, k, torch.float16), qt, at, cb, bits, n)


@pytest.mark.cxx_errors
def test_ws_unavailable_is_a_clear_error(ws) -> None:
    if _wgmma_available():
        pytest.skip("this build and GPU run the kernel")
    n, k, bits = 64, 256, 4
    qt, at, cb, _ = _quantized(n, k, bits)
    with pytest.raises(RuntimeError, match="KBIT_MMA_WGMMA=2"):
        _mma(_x(100, k, torch.float16), qt, at, cb, bits, n)
