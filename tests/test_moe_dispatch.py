# SPDX-License-Identifier: Apache-2.0
"""``moe_dispatch`` on the CPU: the large-T path (experts dequantized in chunks, a grouped
GEMM per chunk restricted to it through an expert_map, chunk outputs summed) against the
reference op ``reference_moe.moe_tiled`` and the independent naive MoE of
test_moe_reference.py. vLLM's Triton ``fused_experts`` cannot run here, so the grouped GEMM is
``reference_moe.grouped_experts`` (same math as moe_tiled: one chunk is bit-identical to it);
tests/test_cuda_moe_dequant.py runs vLLM's on the GPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_moe_reference import (
    BAD_INPUTS,
    _bad,
    assert_matches,
    dequantized_experts,
    make_experts,
    naive_moe,
    op_args,
    routing,
)

from vllm_kbit import _ops, moe_dispatch
from vllm_kbit import reference as ref
from vllm_kbit.format import default_codebook
from vllm_kbit.moe_dispatch import (
    chunk_experts,
    dequant_experts,
    expert_bytes,
    kbit_moe,
    moe_dequant,
    use_dequant,
)
from vllm_kbit.reference_moe import grouped_experts, moe_tiled

_ops.load()


class Spy:
    """A GroupedGemm that records (experts in the chunk, expert_map) of each call and runs
    ``grouped_experts``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor | None]] = []

    def __call__(self, x, w13, w2, tw, ids, emap, act, on_input):
        assert w13.dtype == x.dtype and w2.dtype == x.dtype
        assert w13.shape[0] == w2.shape[0]
        assert emap is None or (emap.dtype == torch.int32 and emap.dim() == 1)
        self.calls.append((w13.shape[0], emap))
        return grouped_experts(x, w13, w2, tw, ids, emap, act, on_input)


# ----------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("n,cap_experts,want", [
    (8, 8, [(0, 8)]),
    (8, 100, [(0, 8)]),
    (8, 3, [(0, 3), (3, 6), (6, 8)]),  # 3 chunks, balanced: 3, 3, 2
    (5, 2, [(0, 2), (2, 4), (4, 5)]),  # uneven last chunk
    (8, 1, [(j, j + 1) for j in range(8)]),
    (8, 0, [(j, j + 1) for j in range(8)]),  # cap below one expert: one expert per chunk
    (128, 56, [(0, 43), (43, 86), (86, 128)]),  # Qwen3-30B-A3B at a 512 MiB cap: 3 x ~43
    (1, 1, [(0, 1)]),
])  # fmt: skip
def test_chunk_experts(n, cap_experts, want):
    per = 1000
    chunks = chunk_experts(n, per, cap_experts * per + per // 2)
    assert chunks == want
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))  # contiguous, disjoint
    assert all((e - s) * per <= max(cap_experts, 1) * per + per // 2 for s, e in chunks)


def test_chunk_experts_real_layers_at_default_cap():
    cap = moe_dispatch.DEQUANT_MAX_BYTES
    assert cap == 1536 << 20
    qwen3 = expert_bytes(2048, 768, torch.bfloat16)
    mixtral = expert_bytes(4096, 14336, torch.bfloat16)
    assert chunk_experts(128, qwen3, cap) == [(0, 128)]
    assert chunk_experts(8, mixtral, cap) == [(0, 4), (4, 8)]
    assert chunk_experts(512, expert_bytes(2048, 512, torch.bfloat16), cap) == [(0, 256), (256, 512)]


def test_use_dequant_thresholds():
    assert moe_dispatch.DEQUANT_MIN_M == 1024 and moe_dispatch.DEQUANT_MIN_TPE == 256
    # Qwen3-30B-A3B routing (128 experts, top-8): 256 tokens per expert from T = 4096
    assert not use_dequant(1024, 8, 128)
    assert not use_dequant(4095, 8, 128)
    assert use_dequant(4096, 8, 128)
    # Mixtral (8 experts, top-2): the T floor decides
    assert not use_dequant(1023, 2, 8) and use_dequant(1024, 2, 8)
    # explicit thresholds; expert parallelism: tokens per expert counts global experts
    assert use_dequant(1, 1, 1, min_m=0, min_tpe=0) and not use_dequant(0, 8, 8, 0, 0)
    assert use_dequant(32, 2, 8, min_m=0, min_tpe=8) and not use_dequant(32, 2, 8, 0, 9)


def test_env_settings(monkeypatch):
    monkeypatch.setenv("KBIT_MOE_DEQUANT_MIN_M", " 64 ")
    assert moe_dispatch._env_int("KBIT_MOE_DEQUANT_MIN_M", 1024) == 64
    monkeypatch.setenv("KBIT_MOE_DEQUANT_MIN_M", "")
    assert moe_dispatch._env_int("KBIT_MOE_DEQUANT_MIN_M", 1024) == 1024
    for bad in ("1e3", "-1", "lots"):
        monkeypatch.setenv("KBIT_MOE_DEQUANT_MAX_MIB", bad)
        with pytest.raises(ValueError, match=r"KBIT_MOE_DEQUANT_MAX_MIB must be a non-negative"):
            moe_dispatch._env_int("KBIT_MOE_DEQUANT_MAX_MIB", 1536)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("h,i", [(64, 32), (160, 96)])  # H=160: K padded to 256 in the tiles
def test_dequant_experts_is_per_expert_dequant(bits, h, i):
    ex = make_experts(3, h, i, bits, seed=bits)
    cb = ex["codebook"]
    for name, n, k in (("13", 2 * i, h), ("2", h, i)):
        q, a = ex["q" + name], ex["a" + name]
        got = dequant_experts(q[1:], a[1:], cb, bits, n, k, torch.bfloat16)
        assert got.shape == (2, n, k) and got.dtype == torch.bfloat16
        for j in range(2):
            want = ref.dequantize_tiled(q[1 + j], a[1 + j], cb, bits, n, k, torch.bfloat16)
            assert torch.equal(got[j], want)


# ------------------------------------------------------------------------ correctness

EMAP = torch.tensor([-1, 2, -1, 0, -1, 3, 1, -1, -1, -1], dtype=torch.int32)  # 10 global, 4 here


@pytest.mark.parametrize("e,topk,t,per_chunk,emap", [
    (6, 2, 40, 6, None),   # one chunk: one call, no map
    (6, 2, 40, 1, None),   # one expert per chunk
    (5, 2, 33, 2, None),   # chunks 2, 2, 1
    (8, 4, 17, 3, None),   # chunks 3, 3, 2
    (4, 3, 25, 4, EMAP),   # EP, one chunk: the layer's own map
    (4, 3, 25, 3, EMAP),   # EP, chunks 2, 2 composed with the layer's map
    (4, 3, 25, 1, EMAP),   # EP, one expert per chunk
    (3, 1, 9, 2, None),    # top-1
    (6, 2, 0, 2, None),    # no tokens
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_dequant_matches_reference(e, topk, t, per_chunk, emap, dtype):
    h, i, bits = 64, 32, 4
    ex = make_experts(e, h, i, bits, seed=e + t)
    x = torch.randn(t, h).to(dtype)
    n_global = e if emap is None else emap.numel()
    tw, ids = routing(t, n_global, topk, seed=t)
    spy = Spy()
    got = moe_dequant(*op_args(x, ex, tw, ids, expert_map=emap), grouped_gemm=spy,
                      max_bytes=per_chunk * expert_bytes(h, i, dtype))  # fmt: skip
    want = moe_tiled(*op_args(x, ex, tw, ids, expert_map=emap))
    n_chunks = len(chunk_experts(e, 1, per_chunk))
    assert len(spy.calls) == n_chunks
    if n_chunks == 1:  # the same math on the same weights: bit-identical
        assert spy.calls[0][1] is emap
        assert torch.equal(got, want)
    else:  # each chunk's output is rounded to x.dtype before the fp32 sum
        assert_matches(got, want)
    assert_matches(got, naive_moe(x, dequantized_experts(ex, dtype), tw, ids, expert_map=emap))
    if t:
        assert got.abs().max() > 0


def test_chunk_maps_compose_with_the_layer_map():
    """Chunk [s, e) gets the map global g -> local(g) - s when s <= local(g) < e, else -1."""
    h, i, bits = 64, 32, 3
    ex = make_experts(4, h, i, bits, seed=1)
    x = torch.randn(6, h).to(torch.bfloat16)
    tw, ids = routing(6, 10, 2, seed=2)
    per = expert_bytes(h, i, x.dtype)
    spy = Spy()
    moe_dequant(*op_args(x, ex, tw, ids, expert_map=EMAP), grouped_gemm=spy, max_bytes=3 * per)
    assert [(c, m.tolist()) for c, m in spy.calls] == [
        (2, [-1, -1, -1, 0, -1, -1, 1, -1, -1, -1]),  # local 0, 1 = global 3, 6
        (2, [-1, 0, -1, -1, -1, 1, -1, -1, -1, -1]),  # local 2, 3 = global 1, 5
    ]
    spy = Spy()
    moe_dequant(*op_args(x, ex, tw, ids % 4), grouped_gemm=spy, max_bytes=3 * per)
    assert [(c, m.tolist()) for c, m in spy.calls] == [(2, [0, 1, -1, -1]), (2, [-1, -1, 0, 1])]


def test_experts_without_tokens_and_chunks_without_tokens():
    """Only experts 0 and 3 (of 6) get tokens: chunk [4, 6) has none, chunk [2, 4) one."""
    h, i, bits = 64, 32, 2
    ex = make_experts(6, h, i, bits, seed=3)
    x = torch.randn(12, h).to(torch.float16)
    tw = torch.rand(12, 2) + 0.1
    ids = torch.tensor([[0, 3]] * 12, dtype=torch.int32)
    spy = Spy()
    got = moe_dequant(*op_args(x, ex, tw, ids), grouped_gemm=spy,
                      max_bytes=2 * expert_bytes(h, i, x.dtype))  # fmt: skip
    assert len(spy.calls) == 3
    assert_matches(got, moe_tiled(*op_args(x, ex, tw, ids)))
    # no local expert at all: exactly zero
    emap = torch.full((6,), -1, dtype=torch.int32)
    got = moe_dequant(*op_args(x, ex, tw, ids, expert_map=emap), grouped_gemm=spy, max_bytes=1)
    assert got.dtype == x.dtype and not got.any()


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_activations_and_router_weight_on_input(activation):
    h, i, bits = 64, 32, 5
    ex = make_experts(4, h, i, bits, seed=4)
    x = torch.randn(10, h).to(torch.bfloat16)
    tw, ids = routing(10, 4, 1, seed=5)
    tw = tw * torch.rand(10, 1)  # top-1 weights are 1 after renormalising: make them vary
    for on_input in (False, True):
        args = op_args(x, ex, tw, ids, activation=activation, on_input=on_input)
        got = moe_dequant(*args, grouped_gemm=grouped_experts,
                          max_bytes=expert_bytes(h, i, x.dtype))  # fmt: skip
        assert_matches(got, moe_tiled(*args))


def test_no_data_dependent_host_work():
    """On meta tensors (no values: .item(), .tolist(), nonzero(), bool() of a tensor raise)
    the whole path runs, chunked and with an expert_map: it only depends on shapes."""
    h, i, bits = 64, 32, 4
    ex = make_experts(5, h, i, bits)
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in ex.items()}
    x = torch.empty(7, h, dtype=torch.bfloat16, device="meta")
    tw = torch.empty(7, 2, device="meta")
    ids = torch.empty(7, 2, dtype=torch.int32, device="meta")
    calls = []

    def gemm(x, w13, w2, tw, ids, emap, act, on_input):
        assert w13.shape[1:] == (2 * i, h) and w2.shape[1:] == (h, i)
        calls.append(w13.shape[0])
        return torch.empty_like(x)

    for emap in (None, torch.empty(9, dtype=torch.int32, device="meta")):
        calls.clear()
        y = moe_dequant(*op_args(x, meta, tw, ids, expert_map=emap), grouped_gemm=gemm,
                        max_bytes=2 * expert_bytes(h, i, x.dtype))  # fmt: skip
        assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == "meta"
        assert calls == [2, 2, 1]


# --------------------------------------------------------------------------- dispatch


def test_kbit_moe_picks_the_path_from_shapes(monkeypatch):
    h, i, bits = 64, 32, 4
    ex = make_experts(8, h, i, bits, seed=6)
    spy = Spy()
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_M", 16)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_TPE", 4)
    for t, topk, dequant in [(8, 2, False), (15, 4, False), (16, 2, True), (16, 1, False),
                             (40, 1, True)]:  # fmt: skip
        spy.calls.clear()
        x = torch.randn(t, h).to(torch.bfloat16)
        tw, ids = routing(t, 8, topk, seed=t)
        args = op_args(x, ex, tw, ids)
        got = kbit_moe(*args, grouped_gemm=spy)
        assert bool(spy.calls) == dequant, (t, topk)
        assert torch.equal(got, moe_tiled(*args))  # one chunk: identical either way
    # without a grouped GEMM for the device (the CPU by default): always kbit::moe
    assert "cpu" not in moe_dispatch.GROUPED_GEMMS
    x = torch.randn(64, h).to(torch.bfloat16)
    tw, ids = routing(64, 8, 2, seed=1)
    assert torch.equal(kbit_moe(*op_args(x, ex, tw, ids)), moe_tiled(*op_args(x, ex, tw, ids)))
    # with one registered for the device, kbit_moe uses it, and DEQUANT_MAX_BYTES
    monkeypatch.setitem(moe_dispatch.GROUPED_GEMMS, "cpu", spy)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MAX_BYTES", 3 * expert_bytes(h, i, x.dtype))
    spy.calls.clear()
    assert_matches(kbit_moe(*op_args(x, ex, tw, ids)), moe_tiled(*op_args(x, ex, tw, ids)))
    assert [c for c, _ in spy.calls] == [3, 3, 2]


# ----------------------------------------------------------------------------- errors

_DATA_DEPENDENT = ("ids_out_of_range", "expert_map_target")  # need the values: no sync here


@pytest.mark.parametrize("kind,msg", [c for c in BAD_INPUTS if c[0] not in _DATA_DEPENDENT])
def test_bad_input_names_the_tensor(monkeypatch, kind, msg):
    assert kind not in _DATA_DEPENDENT
    ex = make_experts(3, 64, 32, 4)
    x = torch.randn(4, 64).to(torch.bfloat16)
    args = _bad(kind, list(op_args(x, ex, *routing(4, 3, 2))))
    with pytest.raises(ValueError, match=msg):
        moe_dequant(*args, grouped_gemm=grouped_experts)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_M", 0)  # kbit_moe: the dequant path too
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_TPE", 0)
    with pytest.raises(ValueError, match=msg):
        kbit_moe(*args, grouped_gemm=grouped_experts)


def test_no_grouped_gemm_for_the_device_is_an_error():
    ex = make_experts(2, 64, 32, 4)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"no grouped GEMM for cpu tensors"):
        moe_dequant(*op_args(x, ex, *routing(3, 2, 1)))


def test_codebook_is_used():
    """Sanity: the dequantized weights follow the layer's codebook (a scaled codebook scales
    the output), so the path really dequantizes with the given tensors."""
    ex = make_experts(2, 64, 32, 4, seed=8)
    x = torch.randn(5, 64).to(torch.float32).to(torch.bfloat16)
    tw, ids = routing(5, 2, 1, seed=9)
    a = moe_dequant(*op_args(x, ex, tw, ids), grouped_gemm=grouped_experts)
    ex2 = dict(ex, codebook=default_codebook(4) * 0.5)
    b = moe_dequant(*op_args(x, ex2, tw, ids), grouped_gemm=grouped_experts)
    assert not torch.equal(a, b)
    assert_matches(b, moe_tiled(*op_args(x, ex2, tw, ids)))
