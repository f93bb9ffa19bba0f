# SPDX-License-Identifier: Apache-2.0
"""The large-T MoE path on the GPU (``moe_dispatch.moe_dequant``: experts dequantized with the
kbit::dequantize_tiled kernel, vLLM's Triton ``fused_experts`` per chunk of experts) against

- vLLM's ``fused_experts`` on the same experts dequantized by the PyTorch reference: one chunk
  is the very same call on bit-identical weights, so the outputs are equal; chunked (and under
  expert parallelism) the chunk outputs are summed in fp32, so they are close;
- the grouped kbit kernel ``kbit::moe`` (the small-T path) and the fp32 oracle of
  test_cuda_moe.py,

on Qwen3-like (128 experts, top-8) and Mixtral-like (8 experts, top-2) layers of small hidden
sizes at T = 1024 and 3000, at small T with the thresholds forced to 0, on the real Qwen3-30B-A3B
and Mixtral shapes, under CUDA-graph replay, and through ``kbit_moe``'s dispatch.
"""

from __future__ import annotations

import pytest
import torch
from cuda_graph import capture
from test_cuda_moe import _experts, _local, _moe, _moe_math, _routing, _x

from vllm_kbit import _ops, moe_dispatch
from vllm_kbit import reference as ref
from vllm_kbit.moe_dispatch import kbit_moe, moe_dequant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.bfloat16, torch.float16]
# name: (E, top-k, H, I)
SHAPES = {"qwen3_like": (128, 8, 256, 128), "mixtral_like": (8, 2, 512, 448)}


@pytest.fixture(scope="module", autouse=True)
def _needs():
    if _ops.load() != "compiled":
        pytest.skip("needs the compiled vllm_kbit._C")
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM's fused_experts not importable: {type(e).__name__}: {e}")
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 oracle must really be fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def _args(x, ex, tw, ids, emap, bits, act="silu", on_input=False) -> tuple:
    w13q, w13a, w2q, w2a, cb = ex[:5]
    return (x, w13q, w13a, w2q, w2a, cb, tw, ids, emap, bits, ex[6].shape[2], act, on_input)


def _vllm_on_reference_weights(x, ex, tw, ids, emap, bits, act="silu", on_input=False):
    """vLLM's fused_experts on the experts dequantized, expert by expert, by the PyTorch
    reference (reference.dequantize_tiled) to x.dtype."""
    w13q, w13a, w2q, w2a, cb = ex[:5]
    e, h, i = w13q.shape[0], x.shape[1], ex[6].shape[2]
    w13 = torch.stack([ref.dequantize_tiled(w13q[j], w13a[j], cb, bits, 2 * i, h, x.dtype)
                       for j in range(e)])  # fmt: skip
    w2 = torch.stack([ref.dequantize_tiled(w2q[j], w2a[j], cb, bits, h, i, x.dtype)
                      for j in range(e)])  # fmt: skip
    return moe_dispatch.vllm_fused_experts(x, w13, w2, tw, ids, emap, act, on_input)


def _rel(y: torch.Tensor, want: torch.Tensor) -> float:
    return float((y.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _close(y: torch.Tensor, want: torch.Tensor, what: str, tol: float = 2e-2) -> None:
    """The same MoE up to rounding: elementwise within tol of the output scale, and a relative
    (Frobenius) difference below tol / 2 (bench_moe.py measured 4e-3 between kbit::moe and
    vLLM's bf16 fused_experts on the Qwen3-30B-A3B shape)."""
    assert y.shape == want.shape and y.dtype == want.dtype
    assert bool(torch.isfinite(y).all())
    scale = want.float().abs().max().item()
    torch.testing.assert_close(y.float(), want.float(), rtol=tol, atol=tol * scale + 1e-6,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip
    assert _rel(y, want) < tol / 2, f"{what}: rel err {_rel(y, want):.2e}"


def _vs_kernel_and_oracle(y, x, ex, tw, ids, emap, bits, act="silu", on_input=False) -> None:
    """y (dequant path) vs kbit::moe on the same routing, and both vs the fp32 oracle: the
    dequant path's error is at most 2x the kernel's (plus an ulp-sized floor)."""
    yk = _moe(x, ex, tw, ids, emap, bits, act, on_input)
    _close(y, yk, "dequant path vs kbit::moe")
    local = _local(ids, emap, ex[0].shape[0])
    oracle = _moe_math(x, ex[5], ex[6], tw, local, act, on_input, rounded=False)
    floor = torch.finfo(x.dtype).eps / 4
    assert _rel(y, oracle) <= 2 * _rel(yk, oracle) + floor, (_rel(y, oracle), _rel(yk, oracle))
    idle = (local < 0).all(1)  # tokens without a local expert: exactly zero
    assert bool((y[idle] == 0).all())


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1024, 3000])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_large_t_vs_vllm_and_kernel(shape: str, t: int, dtype: torch.dtype) -> None:
    e, topk, h, i = SHAPES[shape]
    bits = 4 if shape == "qwen3_like" else 3
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(t, e, topk, seed=t, skew=2.0)
    x = _x(t, h, dtype, seed=t)
    y = moe_dequant(*_args(x, ex, tw, ids, None, bits))
    assert torch.equal(y, _vllm_on_reference_weights(x, ex, tw, ids, None, bits))
    _vs_kernel_and_oracle(y, x, ex, tw, ids, None, bits)


@pytest.mark.parametrize("per_chunk", [1, 3])  # one expert per chunk; uneven last chunk
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunks_and_expert_map(shape: str, per_chunk: int) -> None:
    """EP: this rank holds the odd global experts (E/2 local, the rest map to -1), dequantized
    per_chunk experts at a time."""
    e_global, topk, h, i = SHAPES[shape]
    e, bits, t = e_global // 2, 4, 1024
    ex = _experts(e, h, i, bits, seed=1)
    emap = torch.full((e_global,), -1, dtype=torch.int32, device="cuda")
    emap[1::2] = torch.arange(e, dtype=torch.int32, device="cuda")
    max_bytes = per_chunk * 3 * h * i * 2
    for emap_, ids_global in ((emap, e_global), (None, e)):
        tw, ids = _routing(t, ids_global, topk, seed=per_chunk)
        x = _x(t, h, torch.bfloat16, seed=per_chunk)
        y = moe_dequant(*_args(x, ex, tw, ids, emap_, bits), max_bytes=max_bytes)
        want = _vllm_on_reference_weights(x, ex, tw, ids, emap_, bits)
        _close(y, want, f"{per_chunk} experts per chunk vs one vLLM call")
        _vs_kernel_and_oracle(y, x, ex, tw, ids, emap_, bits)
        # and the same routing in one chunk: vLLM's own call with the layer's map
        y1 = moe_dequant(*_args(x, ex, tw, ids, emap_, bits))
        assert torch.equal(y1, want)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_forced_threshold_small_t(monkeypatch, shape: str) -> None:
    """kbit_moe with the thresholds at 0 takes the dequant path at every T, also T = 1."""
    e, topk, h, i = SHAPES[shape]
    bits = 2
    ex = _experts(e, h, i, bits, seed=2)
    calls = []

    def counting(*args):
        calls.append(args[1].shape[0])
        return moe_dispatch.vllm_fused_experts(*args)

    monkeypatch.setitem(moe_dispatch.GROUPED_GEMMS, "cuda", counting)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_M", 0)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_TPE", 0)
    monkeypatch.setenv("KBIT_MOE_WGMMA", "0")  # as on GPUs without kbit::moe's wgmma path
    for t in [1, 5, 64]:
        tw, ids = _routing(t, e, topk, seed=t)
        x = _x(t, h, torch.float16, seed=t)
        calls.clear()
        y = kbit_moe(*_args(x, ex, tw, ids, None, bits))
        assert calls == [e]
        assert torch.equal(y, _vllm_on_reference_weights(x, ex, tw, ids, None, bits))
        _vs_kernel_and_oracle(y, x, ex, tw, ids, None, bits)


@pytest.mark.parametrize("wgmma", ["0", "default"])
def test_default_dispatch(monkeypatch, wgmma: str) -> None:
    """Default thresholds (T >= 1024 and >= 256 tokens per expert): Qwen3-like routing takes
    the kernel at T = 3000 (187 per expert) and the dequant path at 4096; Mixtral-like takes
    it at 1024 (256 per expert), not at 1023. Where kbit::moe has its sm_90 wgmma path
    (has_wgmma_moe, unless KBIT_MOE_WGMMA=0) the dequant path is never taken."""
    if wgmma == "0":
        monkeypatch.setenv("KBIT_MOE_WGMMA", "0")
    else:
        monkeypatch.delenv("KBIT_MOE_WGMMA", raising=False)
    never = moe_dispatch.has_wgmma_moe(torch.device("cuda"))
    calls = []

    def counting(*args):
        calls.append(args[1].shape[0])
        return moe_dispatch.vllm_fused_experts(*args)

    monkeypatch.setitem(moe_dispatch.GROUPED_GEMMS, "cuda", counting)
    for shape, t, dequant in [("qwen3_like", 3000, False), ("qwen3_like", 4096, True),
                              ("mixtral_like", 1023, False), ("mixtral_like", 1024, True)]:  # fmt: skip
        e, topk, h, i = SHAPES[shape]
        ex = _experts(e, h, i, 4)
        tw, ids = _routing(t, e, topk, seed=3)
        x = _x(t, h, torch.bfloat16)
        calls.clear()
        y = kbit_moe(*_args(x, ex, tw, ids, None, 4))
        dequant = dequant and not never
        assert bool(calls) == dequant, (shape, t)
        other = moe_dequant if not dequant else torch.ops.kbit.moe
        _close(y, other(*_args(x, ex, tw, ids, None, 4)), f"{shape} T={t}")


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_router_weight_on_input_and_activations(act: str) -> None:
    e, h, i, bits, t = 16, 256, 128, 5, 1024
    ex = _experts(e, h, i, bits, seed=4)
    tw, ids = _routing(t, e, 1, seed=4)
    tw = tw * torch.rand(t, 1, device="cuda")  # top-1 weights are 1: make them vary
    x = _x(t, h, torch.bfloat16)
    for on_input in (False, True):
        y = moe_dequant(*_args(x, ex, tw, ids, None, bits, act, on_input))
        assert torch.equal(y, _vllm_on_reference_weights(x, ex, tw, ids, None, bits, act,
                                                         on_input))  # fmt: skip
        _vs_kernel_and_oracle(y, x, ex, tw, ids, None, bits, act, on_input)


def test_cuda_graph_replay() -> None:
    """Captured (chunked, with an expert_map) and replayed on new tokens and routing in the
    same buffers: equal to eager calls (no host sync, no value-dependent host work)."""
    e_global, topk, h, i = SHAPES["qwen3_like"]
    e, bits, t = e_global // 2, 4, 1024
    ex = _experts(e, h, i, bits, seed=1)
    emap = torch.full((e_global,), -1, dtype=torch.int32, device="cuda")
    emap[::2] = torch.arange(e, dtype=torch.int32, device="cuda")
    tw, ids = _routing(t, e_global, topk, seed=0)
    x = _x(t, h, torch.bfloat16)
    max_bytes = 20 * 3 * h * i * 2  # chunks of 16 experts (balanced from at most 20)

    def call():
        return moe_dequant(*_args(x, ex, tw, ids, emap, bits), max_bytes=max_bytes)

    graph, y_static = capture(call)
    for seed in [5, 6]:
        tw2, ids2 = _routing(t, e_global, topk, seed, skew=float(seed - 4))
        x.copy_(_x(t, h, torch.bfloat16, seed=seed))
        tw.copy_(tw2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, call())
        _vs_kernel_and_oracle(y_static, x, ex, tw, ids, emap, bits)


# Real layer shapes: Qwen3-30B-A3B (128 experts, H=2048, I=768; one chunk at the default cap)
# and Mixtral-8x7B with 4 of its 8 experts (H=4096, I=14336; two chunks at the default cap).
@pytest.mark.parametrize("e,topk,h,i,t", [(128, 8, 2048, 768, 4096), (4, 2, 4096, 14336, 1024)])
def test_real_shapes(e: int, topk: int, h: int, i: int, t: int) -> None:
    bits = 4
    ex = _experts(e, h, i, bits)
    tw, ids = _routing(t, e, topk, seed=7)
    x = _x(t, h, torch.bfloat16)
    y = moe_dequant(*_args(x, ex, tw, ids, None, bits), max_bytes=moe_dispatch.DEQUANT_MAX_BYTES
                    if e > 4 else 2 * 3 * h * i * 2)  # fmt: skip
    want = _vllm_on_reference_weights(x, ex, tw, ids, None, bits)
    if e > 4:
        assert torch.equal(y, want)
    else:
        _close(y, want, "two chunks vs one vLLM call")
    _close(y, _moe(x, ex, tw, ids, None, bits), "dequant path vs kbit::moe")
    _experts.cache_clear()  # big tensors: do not keep them around


def test_input_on_the_wrong_device_names_it() -> None:
    e, topk, h, i = SHAPES["mixtral_like"]
    ex = _experts(e, h, i, 4)
    tw, ids = _routing(8, e, topk, seed=1)
    with pytest.raises(ValueError, match=r"topk_ids is on cpu"):
        moe_dequant(*_args(_x(8, h, torch.bfloat16), ex, tw, ids.cpu(), None, 4))
