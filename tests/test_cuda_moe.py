# SPDX-License-Identifier: Apache-2.0
"""torch.ops.kbit.moe (csrc/moe.cu): the grouped MoE kernels against the reference.

Oracle: the same MoE in float32 on the reference-dequantized float32 weights, without the
intermediate roundings. The kernel must be within 2x the error of the reference contract
(reference_moe.moe_tiled: weights, h and act rounded to x.dtype) against that oracle (plus a
one-ulp floor), for every k, fp16/bf16, every activation, E in {8, 16, 128, 512}, top-k in
{1, 2, 8}, T from 1 to 8192, uneven and empty expert loads, expert_map with -1, every kernel
path (in-CTA routing / routing kernel, split-K cluster / workspace, per-slot rows / atomics,
token tiles 8..64, with and without programmatic dependent launch; the GEMV decode path of
csrc/moe_gemv.cu for few slots, including its split-K plans; on sm_90 the grouped wgmma path of
csrc/moe_wgmma.cu for many slots per expert, every token tile), and under CUDA-graph replay.
When vLLM is importable, its bf16 ``fused_experts`` on the dequantized weights is checked the
same way.

With ``KBIT_MOE_REFERENCE=1`` in the environment (csrc/torch_bindings.cpp) the kernel is not
registered, kbit::moe is the reference on CUDA tensors and these tests skip.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from cuda_graph import capture
from error_bound import assert_within_2x

from vllm_kbit import _ops
from vllm_kbit.format import default_codebook

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OPS = torch.ops.kbit
DTYPES = [torch.float16, torch.bfloat16]
ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
}
ENV_VARS = ("KBIT_MOE_TM", "KBIT_MOE_SPLITS", "KBIT_MOE_NO_CLUSTER", "KBIT_MOE_NO_PDL",
            "KBIT_MOE_ROUTE_KERNEL", "KBIT_MOE_ATOMIC", "KBIT_MOE_DETERMINISTIC",
            "KBIT_MOE_GEMV_MAX_SLOTS", "KBIT_MOE_WGMMA", "KBIT_MOE_WG_TN",
            "KBIT_WG_TILE_COPIES")  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if _ops.load() != "compiled":
        pytest.skip("needs the compiled vllm_kbit._C")
    if not hasattr(OPS, "moe") or not torch._C._dispatch_has_kernel_for_dispatch_key(
        "kbit::moe", "CUDA"
    ) or "moe" in getattr(_ops, "_cuda_reference_ops", []):
        pytest.skip("no kbit::moe CUDA kernel (KBIT_MOE_REFERENCE=1, or rebuild the extension)")
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 oracle must really be fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for v in ENV_VARS:
        monkeypatch.delenv(v, raising=False)


# --------------------------------------------------------------------------- inputs


@functools.cache
def _experts(e: int, h: int, i: int, bits: int, seed: int = 0):
    """Random experts quantized + repacked on the GPU by the kbit ops:
    (w13q [E, W13], w13a, w2q [E, W2], w2a, codebook, w13 fp32 [E, 2I, H], w2 fp32 [E, H, I])."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cb = default_codebook(bits).cuda()

    def one(n: int, k: int):
        w = torch.randn(n, k // 32, 32, generator=g, device="cuda")
        s = torch.exp2(torch.rand(n, k // 32, 1, generator=g, device="cuda") * 4 - 7)  # 2^-7..2^-3
        q, a = OPS.quantize((w * s).view(n, k), cb, bits)
        qt, at = OPS.repack(q, a, bits)
        return qt, at, OPS.dequantize_tiled(qt, at, cb, bits, n, k, torch.float32)

    w13 = [one(2 * i, h) for _ in range(e)]
    w2 = [one(h, i) for _ in range(e)]
    st = lambda ws, j: torch.stack([w[j] for w in ws])
    return st(w13, 0), st(w13, 1), st(w2, 0), st(w2, 1), cb, st(w13, 2), st(w2, 2)


def _routing(t: int, e_global: int, topk: int, seed: int, ids_dtype=torch.int32, skew: float = 1.0):
    """Softmax over random router logits, top-k, renormalised: uneven realistic loads
    (skew > 1 makes a few experts popular)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e_global, generator=g, device="cuda")
    logits += skew * torch.linspace(0, 2, e_global, device="cuda")[torch.randperm(
        e_global, generator=g, device="cuda")]  # fmt: skip
    w, ids = torch.softmax(logits, -1).topk(topk, -1)
    w = w / w.sum(-1, keepdim=True)
    return w.float().contiguous(), ids.to(ids_dtype).contiguous()


def _x(t: int, h: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t, h, generator=g, device="cuda").to(dtype)


def _local(ids: torch.Tensor, emap: torch.Tensor | None, e_local: int) -> torch.Tensor:
    ids = ids.long()
    if emap is not None:
        ok = (ids >= 0) & (ids < emap.numel())
        ids = torch.where(ok, emap.long()[ids.clamp(0, emap.numel() - 1)], -1)
    return torch.where((ids >= 0) & (ids < e_local), ids, -1)


def _moe_math(x, w13, w2, tw, local, act, on_input, rounded: bool) -> torch.Tensor:
    """reference_moe.moe_tiled's math on given weights (rounded=True: weights, h and act rounded
    to x.dtype as in the reference; False: all fp32, the oracle). Returns fp32 [T, H]."""
    dt = x.dtype
    i = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in local.unique().tolist():
        if e < 0:
            continue
        tok, slot = (local == e).nonzero(as_tuple=True)
        weight = tw[tok, slot].unsqueeze(1)
        a13 = w13[e].to(dt).float() if rounded else w13[e]
        a2 = w2[e].to(dt).float() if rounded else w2[e]
        gate_up = x[tok].float() @ a13.t()
        if on_input:
            gate_up = gate_up * weight
        if rounded:
            gate_up = gate_up.to(dt).float()
        a = ACTS[act](gate_up[:, :i]) * gate_up[:, i:]
        if rounded:
            a = a.to(dt).float()
        y = a @ a2.t()
        out.index_add_(0, tok, y if on_input else y * weight)
    return out


def _check(y, x, w13, w2, tw, ids, emap, act, on_input, base=None) -> None:
    """y (kernel) vs the fp32 oracle, within 2x the reference's error (+ one-ulp floors)."""
    t, h = x.shape
    assert y.dtype == x.dtype and y.shape == (t, h)
    assert bool(torch.isfinite(y).all())
    local = _local(ids, emap, w13.shape[0])
    oracle = _moe_math(x, w13, w2, tw, local, act, on_input, rounded=False)
    if base is None:
        base = _moe_math(x, w13, w2, tw, local, act, on_input, rounded=True).to(x.dtype)
    assert_within_2x(y, base, oracle, x.dtype, "reference")
    idle = (local < 0).all(1)  # tokens without a local expert: exactly zero
    assert bool((y[idle] == 0).all())


def _moe(x, ex, tw, ids, emap, bits, act="silu", on_input=False):
    w13q, w13a, w2q, w2a, cb = ex[:5]
    return OPS.moe(x, w13q, w13a, w2q, w2a, cb, tw, ids, emap, bits, ex[6].shape[2], act, on_input)


def _run_check(t, e, topk, h, i, bits, dtype, act="silu", seed=0, emap=None, e_global=None,
               ids_dtype=torch.int32, skew=1.0, on_input=False):  # fmt: skip
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(t, e_global or e, topk, seed + t, ids_dtype, skew)
    x = _x(t, h, dtype, seed=t)
    y = _moe(x, ex, tw, ids, emap, bits, act, on_input)
    _check(y, x, ex[5], ex[6], tw, ids, emap, act, on_input)
    return y


# ---------------------------------------------------------------------------- tests

TS = [1, 2, 3, 5, 16, 33, 64, 256, 1024]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_all_t_mixtral_like(bits: int, dtype: torch.dtype) -> None:
    # E=8, top-2; I = 96: 6 tiles per half, a partial column group; H = 160: a partial k-tile
    for t in TS:
        _run_check(t, 8, 2, 160, 96, bits, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 5])
def test_all_t_qwen_like(bits: int, dtype: torch.dtype) -> None:
    # E=128, top-8 (Qwen3-30B-A3B routing) on small hidden sizes
    for t in TS:
        _run_check(t, 128, 8, 256, 128, bits, dtype, skew=2.0)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_e16_top1(act: str, dtype: torch.dtype) -> None:
    for t in [1, 5, 64, 300]:
        _run_check(t, 16, 1, 128, 64, 3, dtype, act=act)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_t(dtype: torch.dtype) -> None:
    # 8192 tokens (routing kernel, TM=64) with few experts; per-slot rows and atomics
    _run_check(8192, 8, 2, 256, 128, 4, dtype)


def test_large_t_atomic(monkeypatch) -> None:
    monkeypatch.setenv("KBIT_MOE_ATOMIC", "1")
    for t in [3, 500, 4096]:
        _run_check(t, 16, 2, 256, 128, 4, torch.bfloat16)


def test_512_experts() -> None:
    for t in [1, 4, 64, 512]:
        _run_check(t, 512, 8, 128, 64, 4, torch.bfloat16, skew=3.0)


def test_int64_ids_and_skew() -> None:
    for t in [2, 40, 700]:
        _run_check(t, 16, 4, 128, 64, 2, torch.float16, ids_dtype=torch.int64, skew=6.0)


@pytest.mark.parametrize("t", [1, 7, 100, 1000])
def test_expert_map(t: int) -> None:
    # EP: 32 global experts, this rank holds the odd ones (local 0..15), the rest map to -1
    e_local, e_global = 16, 32
    emap = torch.full((e_global,), -1, dtype=torch.int32, device="cuda")
    emap[1::2] = torch.arange(e_local, dtype=torch.int32, device="cuda")
    _run_check(t, e_local, 4, 128, 64, 4, torch.bfloat16, emap=emap, e_global=e_global)


def test_empty_and_single_expert_loads() -> None:
    e, h, i, bits = 16, 128, 64, 4
    ex = _experts(e, h, i, bits)
    for t in [1, 9, 300]:
        x = _x(t, h, torch.float16, seed=t)
        tw = torch.rand(t, 2, device="cuda")
        ids = torch.zeros(t, 2, dtype=torch.int32, device="cuda")
        ids[:, 1] = 5  # every token on experts 0 and 5; the other 14 experts are empty
        _check(_moe(x, ex, tw, ids, None, bits), x, ex[5], ex[6], tw, ids, None, "silu", False)
        # no local expert at all: zeros
        emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
        y = _moe(x, ex, tw, ids, emap, bits)
        assert bool((y == 0).all())
    # ids outside [0, E) are skipped (the reference raises; the kernel cannot without a sync)
    x = _x(4, h, torch.float16)
    tw = torch.rand(4, 2, device="cuda")
    ids = torch.tensor([[0, 99], [-1, 3], [2, 3], [16, 1]], dtype=torch.int32, device="cuda")
    _check(_moe(x, ex, tw, ids, None, bits), x, ex[5], ex[6], tw, ids, None, "silu", False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_router_weight_on_input(dtype: torch.dtype) -> None:
    for t in [1, 6, 300]:
        _run_check(t, 8, 1, 128, 64, 4, dtype, on_input=True)


@pytest.mark.parametrize("env", [
    {},
    {"KBIT_MOE_TM": "8"}, {"KBIT_MOE_TM": "16"}, {"KBIT_MOE_TM": "32"}, {"KBIT_MOE_TM": "64"},
    {"KBIT_MOE_ROUTE_KERNEL": "1"},
    {"KBIT_MOE_SPLITS": "1"}, {"KBIT_MOE_SPLITS": "3"}, {"KBIT_MOE_SPLITS": "8"},
    {"KBIT_MOE_SPLITS": "4", "KBIT_MOE_NO_CLUSTER": "1"},
    {"KBIT_MOE_NO_PDL": "1"},
    {"KBIT_MOE_ATOMIC": "1", "KBIT_MOE_SPLITS": "3"},
])  # fmt: skip
def test_kernel_paths(monkeypatch, env: dict[str, str]) -> None:
    monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "0")  # the grouped kernels at every T
    monkeypatch.setenv("KBIT_MOE_WGMMA", "0")  # the mma.sync ones (csrc/moe.cu)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for t in [1, 3, 20, 200, 1100]:  # 1100 x 4 slots: the multi-CTA routing
        _run_check(t, 16, 4, 256, 96, 3, torch.bfloat16, act="gelu")


@pytest.mark.parametrize("t", [1, 16, 300])
def test_split_reductions_agree(monkeypatch, t: int) -> None:
    # cluster (sm_90) and workspace reductions add the splits in the same order: bit-identical;
    # every deterministic path repeats bit for bit
    monkeypatch.setenv("KBIT_MOE_DETERMINISTIC", "1")  # T <= 16 would take atomics
    monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "0")  # the grouped kernels' reductions
    e, h, i, bits = 16, 512, 384, 4
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(t, e, 4, t)
    x = _x(t, h, torch.float16)
    for splits in ["1", "2", "4"]:
        monkeypatch.setenv("KBIT_MOE_SPLITS", splits)
        monkeypatch.delenv("KBIT_MOE_NO_CLUSTER", raising=False)
        y = _moe(x, ex, tw, ids, None, bits)
        _check(y, x, ex[5], ex[6], tw, ids, None, "silu", False)
        assert torch.equal(_moe(x, ex, tw, ids, None, bits), y)
        monkeypatch.setenv("KBIT_MOE_NO_CLUSTER", "1")
        assert torch.equal(_moe(x, ex, tw, ids, None, bits), y)


# ------------------------------------------------------------------ GEMV decode path
# csrc/moe_gemv.cu: by default for <= 16 slots when T == 1 or experts >= 4 x slots; with
# KBIT_MOE_GEMV_MAX_SLOTS set, when T * topk <= its value (at most 64 slots and 8 tokens).


@pytest.fixture
def gemv(monkeypatch):
    monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_gemv_all_bits(gemv, bits: int, dtype: torch.dtype) -> None:
    # H = 160: a partial k-tile in gate_up; I = 96: each slot's down K padded from 96 to 128
    for t in range(1, 9):
        _run_check(t, 8, 2, 160, 96, bits, dtype, seed=bits)
    for t in [1, 2, 5, 8]:  # top-8 of 128 experts: 8..64 slots
        _run_check(t, 128, 8, 256, 128, bits, dtype, skew=2.0)


@pytest.mark.parametrize("act", list(ACTS))
def test_gemv_activations_and_weight_on_input(gemv, act: str) -> None:
    for t in [1, 3, 8]:
        _run_check(t, 16, 4, 128, 64, 3, torch.float16, act=act)
        _run_check(t, 8, 1, 128, 64, 4, torch.bfloat16, act=act, on_input=True)


@pytest.mark.parametrize("t", [1, 3, 8])
def test_gemv_expert_map_and_bad_ids(gemv, t: int) -> None:
    e_local, e_global = 16, 32
    emap = torch.full((e_global,), -1, dtype=torch.int32, device="cuda")
    emap[1::2] = torch.arange(e_local, dtype=torch.int32, device="cuda")
    _run_check(t, e_local, 4, 128, 64, 4, torch.bfloat16, emap=emap, e_global=e_global)
    _run_check(t, 16, 4, 128, 64, 2, torch.float16, ids_dtype=torch.int64, skew=6.0)
    ex = _experts(16, 128, 64, 4)
    x = _x(t, 128, torch.float16, seed=t)
    tw = torch.rand(t, 2, device="cuda")
    ids = torch.tensor([[0, 99], [-1, 3], [16, 1]] * 3, dtype=torch.int32, device="cuda")[:t]
    _check(_moe(x, ex, tw, ids, None, 4), x, ex[5], ex[6], tw, ids, None, "silu", False)
    none = torch.full((16,), -1, dtype=torch.int32, device="cuda")  # no local expert: zeros
    assert bool((_moe(x, ex, tw, ids, none, 4) == 0).all())


def test_gemv_split_k(gemv) -> None:
    # down with few output tiles and a long K' (H = 128, topk 8 x I = 4096) and gate_up with
    # few rows and a long K (topk 1, I = 32, H = 8192): both plans split K over CTAs
    for t in [1, 2]:
        _run_check(t, 16, 8, 128, 4096, 4, torch.bfloat16)
        _run_check(t, 4, 1, 8192, 32, 2, torch.float16)


def test_gemv_equals_grouped_within_tolerance_and_repeats(monkeypatch) -> None:
    # both paths against the oracle on the same call; the GEMV repeats bit for bit
    e, h, i, bits = 128, 2048, 768, 4
    ex = _experts(e, h, i, bits)
    for t in [1, 2]:
        tw, ids = _routing(t, e, 8, t)
        x = _x(t, h, torch.bfloat16)
        monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "64")
        y = _moe(x, ex, tw, ids, None, bits)
        _check(y, x, ex[5], ex[6], tw, ids, None, "silu", False)
        assert torch.equal(_moe(x, ex, tw, ids, None, bits), y)
        monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "0")
        _check(_moe(x, ex, tw, ids, None, bits), x, ex[5], ex[6], tw, ids, None, "silu", False)
    _experts.cache_clear()


def test_gemv_default_rule(monkeypatch) -> None:
    # without KBIT_MOE_GEMV_MAX_SLOTS: the GEMV for <= 16 slots when T == 1 or experts >=
    # 4 x slots, else the grouped kernels (deterministic mode: both paths repeat bit for bit)
    monkeypatch.setenv("KBIT_MOE_DETERMINISTIC", "1")
    for e, topk, t, want in [(128, 8, 1, "gemv"), (128, 8, 2, "gemv"), (128, 8, 3, "grouped"),
                             (8, 2, 1, "gemv"), (8, 2, 2, "grouped"), (16, 1, 4, "gemv")]:
        ex = _experts(e, 128, 64, 4)
        tw, ids = _routing(t, e, topk, t)
        x = _x(t, 128, torch.bfloat16)
        monkeypatch.delenv("KBIT_MOE_GEMV_MAX_SLOTS", raising=False)
        y = _moe(x, ex, tw, ids, None, 4)
        monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "64" if want == "gemv" else "0")
        assert torch.equal(_moe(x, ex, tw, ids, None, 4), y), (e, topk, t, want)


# Real layer shapes (quantized on the GPU): Qwen3-30B-A3B (TP1 I=768, TP2 I=384), Mixtral-8x7B
# with 4 of its 8 experts (H=4096, I=14336), a 512-expert layer (H=2048, I=512; 64 experts).
REAL = [
    (128, 8, 2048, 768, 4, torch.bfloat16, [1, 8, 64, 1024]),
    (128, 8, 2048, 384, 2, torch.float16, [1, 33, 512]),
    (4, 2, 4096, 14336, 4, torch.bfloat16, [1, 16, 300]),
    (64, 8, 2048, 512, 5, torch.bfloat16, [2, 128]),
]


@pytest.mark.parametrize("e,topk,h,i,bits,dtype,ts", REAL)
def test_real_shapes(e, topk, h, i, bits, dtype, ts) -> None:
    for t in ts:
        _run_check(t, e, topk, h, i, bits, dtype)
    _experts.cache_clear()  # big tensors: do not keep them around


def test_matches_reference_op() -> None:
    # the local math above is reference_moe.moe_tiled's; the kernel against the op itself
    ref_moe = pytest.importorskip("vllm_kbit.reference_moe")
    e, h, i, bits = 8, 128, 64, 3
    ex = _experts(e, h, i, bits)
    for t, dtype in [(1, torch.float16), (37, torch.bfloat16)]:
        tw, ids = _routing(t, e, 2, t)
        x = _x(t, h, dtype)
        base = ref_moe.moe_tiled(x, *ex[:5], tw, ids, None, bits, i, "silu", False)
        mine = _moe_math(x, ex[5], ex[6], tw, _local(ids, None, e), "silu", False, True)
        torch.testing.assert_close(base.float(), mine.to(dtype).float(), rtol=0, atol=0)
        _check(_moe(x, ex, tw, ids, None, bits), x, ex[5], ex[6], tw, ids, None, "silu", False,
               base=base)  # fmt: skip


def _vllm_fused_experts():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM not importable: {type(e).__name__}: {e}")
    return fused_experts, MoEActivation


@pytest.mark.parametrize("t", [1, 8, 64, 1024])
def test_vs_vllm_fused_experts(t: int) -> None:
    fused_experts, MoEActivation = _vllm_fused_experts()
    e, topk, h, i, bits, dtype = 128, 8, 2048, 768, 4, torch.bfloat16
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(t, e, topk, t)
    x = _x(t, h, dtype)
    base = fused_experts(x, ex[5].to(dtype), ex[6].to(dtype), tw, ids,
                         activation=MoEActivation.SILU, global_num_experts=e)  # fmt: skip
    _check(_moe(x, ex, tw, ids, None, bits), x, ex[5], ex[6], tw, ids, None, "silu", False,
           base=base)  # fmt: skip


GEMV = {"KBIT_MOE_GEMV_MAX_SLOTS": "64"}


@pytest.mark.parametrize("t,env", [(1, {}), (1, {"KBIT_MOE_DETERMINISTIC": "1"}),
                                   (4, {"KBIT_MOE_NO_CLUSTER": "1"}), (64, {}),
                                   (600, {}), (600, {"KBIT_MOE_ATOMIC": "1"}),
                                   (1, GEMV), (1, {**GEMV, "KBIT_MOE_NO_PDL": "1"}),
                                   (4, GEMV)])  # fmt: skip
def test_cuda_graph_replay_equals_eager(monkeypatch, t: int, env: dict[str, str]) -> None:
    monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "0")  # the grouped kernels unless env says
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    e, h, i, bits = 32, 512, 256, 4
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(t, e, 4, 0)
    x = _x(t, h, torch.bfloat16)
    # the grouped kernels' fp32 atomics (T <= 16 by default): the order of the adds varies;
    # the GEMV path is deterministic
    gemv = env.get("KBIT_MOE_GEMV_MAX_SLOTS") == "64"
    atomic = "KBIT_MOE_ATOMIC" in env or (t <= 16 and "KBIT_MOE_DETERMINISTIC" not in env)
    _replay_vs_eager(x, ex, tw, ids, bits, exact=gemv or not atomic)


def _replay_vs_eager(x, ex, tw, ids, bits: int, exact: bool) -> None:
    """Captures kbit::moe on these buffers, then replays it on new tokens and new routings
    written into them: equal to eager calls (bit-exact if `exact`) and within the bound."""
    t, h = x.shape
    e, topk = ex[0].shape[0], ids.shape[1]
    graph, y_static = capture(lambda: _moe(x, ex, tw, ids, None, bits))
    for seed in [5, 6, 7]:  # new tokens and new routing in the same buffers
        tw2, ids2 = _routing(t, e, topk, seed, skew=float(seed - 4))
        x.copy_(_x(t, h, torch.bfloat16, seed=seed))
        tw.copy_(tw2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        eager = _moe(x, ex, tw, ids, None, bits)
        if exact:
            assert torch.equal(y_static, eager)
        else:
            torch.testing.assert_close(y_static, eager, rtol=1e-2, atol=1e-2)
        _check(y_static, x, ex[5], ex[6], tw, ids, None, "silu", False)


def test_empty_t() -> None:
    e, h, i, bits = 8, 128, 64, 2
    ex = _experts(e, h, i, bits)
    x = torch.empty(0, h, dtype=torch.bfloat16, device="cuda")
    tw = torch.empty(0, 2, device="cuda")
    ids = torch.empty(0, 2, dtype=torch.int32, device="cuda")
    y = _moe(x, ex, tw, ids, None, bits)
    assert y.shape == (0, h) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("t,path", [(24, "grouped"), (3, "gemv"), (200, "wgmma")])
def test_strided_and_misaligned_x(monkeypatch, t: int, path: str) -> None:
    # T = 24: the grouped kernels (T > 16: per-slot rows, bit-reproducible); T = 3: the GEMV;
    # T = 200: the sm_90 wgmma path (x gathered into a contiguous buffer; per-slot rows)
    if path == "wgmma" and not _wgmma_moe():
        pytest.skip("needs a build with sm_90a code on an sm_90 GPU")
    monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "64" if path == "gemv" else "0")
    monkeypatch.setenv("KBIT_MOE_WGMMA", "1" if path == "wgmma" else "0")
    e, h, i, bits = 8, 128, 64, 4
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(t, e, 2, 3)
    x = _x(t, h, torch.float16)
    y = _moe(x, ex, tw, ids, None, bits)
    _check(y, x, ex[5], ex[6], tw, ids, None, "silu", False)
    wide = torch.zeros(t, h + 64, dtype=x.dtype, device="cuda")
    wide[:, :h] = x
    shifted = torch.zeros(t, h + 1, dtype=x.dtype, device="cuda")
    shifted[:, 1:] = x
    for view in [wide[:, :h], shifted[:, 1:]]:
        assert torch.equal(_moe(view, ex, tw, ids, None, bits), y)


@pytest.mark.cxx_errors
def test_bad_inputs() -> None:
    e, h, i, bits = 8, 128, 64, 4
    ex = _experts(e, h, i, bits)
    w13q, w13a, w2q, w2a, cb = ex[:5]
    tw, ids = _routing(4, e, 2, 0)
    x = _x(4, h, torch.float16)
    errors = (RuntimeError, ValueError, TypeError)

    def call(x=x, w13q=w13q, w13a=w13a, w2q=w2q, w2a=w2a, cb=cb, tw=tw, ids=ids, emap=None,
             bits=bits, i=i, act="silu", on_input=False):  # fmt: skip
        return OPS.moe(x, w13q, w13a, w2q, w2a, cb, tw, ids, emap, bits, i, act, on_input)

    with pytest.raises(errors, match="float16 or bfloat16"):
        call(x=x.float())
    with pytest.raises(errors, match="w13_qweight"):
        call(w13q=w13q[:, :-1])
    with pytest.raises(errors, match="w2_absmax"):
        call(w2a=w2a[:-1])
    with pytest.raises(errors, match="inter_size|w13"):
        call(i=48)
    with pytest.raises(errors, match="codebook"):
        call(cb=cb[:-1])
    with pytest.raises(errors, match="bits"):
        call(bits=6)
    with pytest.raises(errors, match="activation"):
        call(act="relu")
    with pytest.raises(errors, match="topk_ids"):
        call(ids=ids[:, :1])
    with pytest.raises(errors, match="topk_weights"):
        call(tw=tw.half())
    with pytest.raises(errors, match="expert_map"):
        call(emap=torch.zeros(e, dtype=torch.int64, device="cuda"))
    with pytest.raises(errors, match="apply_router_weight_on_input"):
        call(on_input=True)
    with pytest.raises(errors, match="CUDA|device"):
        call(x=x.cpu())


# ------------------------------------------------------------------ grouped wgmma path (sm_90)
# csrc/moe_wgmma.cu: taken by default from 64 slots per local expert on sm_90a builds on sm_90
# GPUs (so the large-T tests above run it there); KBIT_MOE_WGMMA=1 forces it at any T.


def _wgmma_moe() -> bool:
    from vllm_kbit.moe_dispatch import has_wgmma_moe  # (KBIT_MOE_WGMMA is cleared by _clean_env)

    return has_wgmma_moe(torch.device("cuda"))


@pytest.fixture
def wgmma(monkeypatch):
    if not _wgmma_moe():
        pytest.skip("needs a build with sm_90a code on an sm_90 GPU")
    monkeypatch.setenv("KBIT_MOE_WGMMA", "1")
    monkeypatch.setenv("KBIT_MOE_GEMV_MAX_SLOTS", "0")


WG_TNS = ["128", "256"]  # KBIT_MOE_WG_TN: 128 slots x 256 weight rows, or the wide tile of
# 256 slots (224 at k=5) x 128 rows


def _set_tile(monkeypatch, tn: str) -> None:
    monkeypatch.setenv("KBIT_MOE_WG_TN", tn)


@pytest.mark.parametrize("tn", WG_TNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_wgmma_all_bits(wgmma, monkeypatch, bits: int, dtype: torch.dtype, tn: str) -> None:
    # I = 96: 6 gate tiles, a CTA takes 4 (+ the 4 matching up tiles): a partial row group;
    # H = 160: a partial k-tile in both GEMMs' K (gate_up K = H, down n = H)
    _set_tile(monkeypatch, tn)
    for t in [1, 37, 300, 1000]:
        _run_check(t, 8, 2, 160, 96, bits, dtype)


# Per-expert slot counts around every narrowed width (wg::narrow_tn: an expert's last tile of
# count mod TN rows runs at TN / 4, TN / 2 or TN tokens) for TN = 128, 224 (k=5) and 256.
NARROW_COUNTS = [1, 31, 32, 33, 56, 57, 63, 64, 65, 112, 113, 127, 128, 129, 191, 192, 193, 224,
                 225, 255, 256, 257, 300, 384, 385, 513]


@pytest.mark.parametrize("tn", WG_TNS)
@pytest.mark.parametrize("bits,dtype", [(3, torch.float16), (5, torch.bfloat16)])
def test_wgmma_narrow_tiles(wgmma, monkeypatch, tn: str, bits: int, dtype: torch.dtype) -> None:
    _set_tile(monkeypatch, tn)
    e, h, i = len(NARROW_COUNTS), 192, 96
    counts = torch.tensor(NARROW_COUNTS, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.repeat_interleave(torch.arange(e, device="cuda"), counts)
    ids = ids[torch.randperm(ids.numel(), generator=g, device="cuda")].view(-1, 1)
    t = ids.shape[0]
    tw = torch.rand(t, 1, generator=g, device="cuda") + 0.5
    ex = _experts(e, h, i, bits)
    x = _x(t, h, dtype)
    y = _moe(x, ex, tw, ids.to(torch.int32), None, bits)
    _check(y, x, ex[5], ex[6], tw, ids, None, "silu", False)


@pytest.mark.parametrize("det", ["0", "1"])
def test_wgmma_qwen_like_skewed(wgmma, monkeypatch, det: str) -> None:
    # 128 experts top-8 with a skewed router: experts with 0, 1 and several tiles of slots;
    # per-slot rows (deterministic) and the atomic accumulator
    monkeypatch.setenv("KBIT_MOE_DETERMINISTIC", det)
    monkeypatch.setenv("KBIT_MOE_ATOMIC", "0" if det == "1" else "1")
    for t in [5, 200, 2048]:
        _run_check(t, 128, 8, 256, 128, 4, torch.bfloat16, skew=4.0)


@pytest.mark.parametrize("act", list(ACTS))
def test_wgmma_activations_and_weight_on_input(wgmma, act: str) -> None:
    for t in [3, 300]:
        _run_check(t, 16, 1, 128, 64, 3, torch.float16, act=act)
        _run_check(t, 8, 1, 128, 64, 4, torch.bfloat16, act=act, on_input=True)


@pytest.mark.parametrize("tn", WG_TNS)
def test_wgmma_expert_map_bad_ids_and_int64(wgmma, monkeypatch, tn: str) -> None:
    # EP: half the slots belong to other ranks (rows past the routed count are zero-filled);
    # ids outside the map and int64 ids
    _set_tile(monkeypatch, tn)
    e_local, e_global = 16, 32
    emap = torch.full((e_global,), -1, dtype=torch.int32, device="cuda")
    emap[1::2] = torch.arange(e_local, dtype=torch.int32, device="cuda")
    for t in [7, 1000, 1500]:  # 1500 x 4 slots: the multi-CTA routing (> 4096 slots)
        _run_check(t, e_local, 4, 128, 64, 4, torch.bfloat16, emap=emap, e_global=e_global)
    _run_check(700, 16, 4, 128, 64, 2, torch.float16, ids_dtype=torch.int64, skew=6.0)
    ex = _experts(16, 128, 64, 4)
    x = _x(4, 128, torch.float16)
    tw = torch.rand(4, 2, device="cuda")
    ids = torch.tensor([[0, 99], [-1, 3], [2, 3], [16, 1]], dtype=torch.int32, device="cuda")
    _check(_moe(x, ex, tw, ids, None, 4), x, ex[5], ex[6], tw, ids, None, "silu", False)
    y = _moe(x, ex, tw, ids, torch.full((16,), -1, dtype=torch.int32, device="cuda"), 4)
    assert bool((y == 0).all())  # no local expert at all


@pytest.mark.parametrize("e,topk,h,i,bits,ts", [
    (128, 8, 2048, 768, 4, [64, 1024, 4096]),   # Qwen3-30B-A3B
    (8, 2, 4096, 14336, 4, [512]),             # Mixtral-8x7B
    (512, 8, 2048, 512, 2, [4096]),            # the 512-expert shape
])  # fmt: skip
def test_wgmma_real_shapes_default_rule(monkeypatch, e, topk, h, i, bits, ts) -> None:
    # the default rule (no forcing): these take the wgmma path on sm_90 (>= 64 slots per expert)
    if not _wgmma_moe():
        pytest.skip("needs a build with sm_90a code on an sm_90 GPU")
    for t in ts:
        _run_check(t, e, topk, h, i, bits, torch.bfloat16)
    _experts.cache_clear()


def test_wgmma_agrees_with_grouped_and_repeats(wgmma, monkeypatch) -> None:
    monkeypatch.setenv("KBIT_MOE_DETERMINISTIC", "1")
    e, h, i, bits = 16, 512, 256, 4
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(600, e, 2, 11)
    x = _x(600, h, torch.bfloat16)
    y = _moe(x, ex, tw, ids, None, bits)
    assert torch.equal(_moe(x, ex, tw, ids, None, bits), y)  # per-slot rows: bit-reproducible
    monkeypatch.setenv("KBIT_MOE_WGMMA", "0")
    y_grouped = _moe(x, ex, tw, ids, None, bits)
    torch.testing.assert_close(y, y_grouped, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tn", WG_TNS)
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_wgmma_weight_boxes_equal_tile_copies(wgmma, monkeypatch, tn: str, bits: int) -> None:
    # The weights as two TMA boxes per stage of one expert (wgmma_gemm.cuh's expert_tile_map,
    # the default) or as one bulk copy per tile (KBIT_WG_TILE_COPIES=1): the same bytes of every
    # live tile in the stage, so the same bits (per-slot rows). I = 96: 6 gate tiles, a partial
    # row group whose zero-filled box tiles must stay out of the up half and the next expert;
    # H = 160: a K tail. Every expert holds slots.
    _set_tile(monkeypatch, tn)
    monkeypatch.setenv("KBIT_MOE_DETERMINISTIC", "1")
    e, h, i = 8, 160, 96
    ex = _experts(e, h, i, bits)
    for t in (300, 1000):
        tw, ids = _routing(t, e, 2, 3)
        x = _x(t, h, torch.bfloat16)
        y = _moe(x, ex, tw, ids, None, bits)
        _check(y, x, ex[5], ex[6], tw, ids, None, "silu", False)
        monkeypatch.setenv("KBIT_WG_TILE_COPIES", "1")
        assert torch.equal(_moe(x, ex, tw, ids, None, bits), y), f"T={t}"
        monkeypatch.delenv("KBIT_WG_TILE_COPIES")


@pytest.mark.parametrize("det", ["0", "1"])
def test_wgmma_cuda_graph_replay(wgmma, monkeypatch, det: str) -> None:
    monkeypatch.setenv("KBIT_MOE_DETERMINISTIC", det)
    monkeypatch.setenv("KBIT_MOE_ATOMIC", "0" if det == "1" else "1")
    e, h, i, bits, t = 32, 512, 256, 4, 300
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(t, e, 4, 0)
    x = _x(t, h, torch.bfloat16)
    _replay_vs_eager(x, ex, tw, ids, bits, exact=det == "1")  # new routings: other tile lists
