# SPDX-License-Identifier: Apache-2.0
"""vllm_kbit/fusion.py on the CPU: the graph pass that folds vLLM's fused_add_rms_norm and
SiluAndMul into the kbit linear layer after them, run inside torch.compile (inductor) on a
decoder-layer-shaped function, with the fused ops' reference implementations; and that the
references keep vLLM 0.26's rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

vllm = pytest.importorskip("vllm")

from vllm_kbit import _ops, fusion  # noqa: E402
from vllm_kbit import reference as ref  # noqa: E402
from vllm_kbit.format import default_codebook  # noqa: E402

_ops.load()
ir = pytest.importorskip("vllm.ir")
if fusion._ir_norm_op() is None:
    pytest.skip("this vLLM has no vllm_ir.fused_add_rms_norm", allow_module_level=True)

H, I, BITS = 128, 192, 3


def _w(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, a = ref.quantize(torch.randn(n, k, generator=g) * 0.05, BITS, default_codebook(BITS))
    return ref.repack(q, a, BITS)


CB = default_codebook(BITS)
QKV, GU, DOWN = _w(3 * H, H, 1), _w(2 * I, H, 2), _w(H, I, 3)
NW1 = torch.rand(H, generator=torch.Generator().manual_seed(4)).half() + 0.5
NW2 = torch.rand(H, generator=torch.Generator().manual_seed(5)).half() + 0.5


def _lin(x, w, n):
    return torch.ops.kbit.linear(x.reshape(-1, x.shape[-1]).contiguous(), w[0], w[1], CB, BITS, n)


def _layer(x: torch.Tensor, res: torch.Tensor):
    """A Llama decoder layer's linear part, written as vLLM 0.26 traces it."""
    h, res = ir.ops.fused_add_rms_norm(x, res, NW1, 1e-5, None)
    qkv = _lin(h, QKV, 3 * H)
    h = qkv[:, :H] * 0.5  # attention stand-in
    h, res = ir.ops.fused_add_rms_norm(h, res, NW2, 1e-6, None)
    gu = _lin(h, GU, 2 * I)
    a = F.silu(gu[..., :I]) * gu[..., I:]
    return _lin(a, DOWN, H), res


def _compile(fn, counts: dict):
    def post_pass(graph):
        counts.update(fusion.fuse_graph(graph))

    torch._dynamo.reset()
    return torch.compile(fn, backend="inductor", fullgraph=True,
                         options={"post_grad_custom_post_pass": post_pass})  # fmt: skip


def _inputs(m: int):
    g = torch.Generator().manual_seed(m)
    return (torch.randn(m, H, generator=g).half(), torch.randn(m, H, generator=g).half())


def test_reference_rounds_as_vllm() -> None:
    """The fused ops' references are bit-identical to vLLM's own native implementations."""
    from vllm.model_executor.layers.activation import SiluAndMul

    x, r = _inputs(5)
    for dtype in (torch.float16, torch.bfloat16):
        xx, rr, w = x.to(dtype), r.to(dtype), NW1.to(dtype)
        got = ref.add_rms_norm(xx, rr, w, 1e-5)
        want = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(xx, rr, w, 1e-5)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        h = torch.randn(5, 2 * H).to(dtype)
        assert torch.equal(ref.silu_mul(h), SiluAndMul.forward_native(h))


def test_pass_fuses_a_decoder_layer() -> None:
    counts: dict = {}
    compiled = _compile(_layer, counts)
    for m in (1, 3, 17):
        x, r = _inputs(m)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
        got, want = compiled(x, r), _layer(x, r)
        assert counts == {"add_rms_norm": 2, "silu_mul": 1}
        assert torch.equal(got[1], want[1])  # the residual stream
        # inductor keeps the unfused graph's elementwise math in fp32 (one rounding, where eager
        # rounds silu before the product), so the outputs are close, not equal
        assert (got[0].float() - want[0].float()).abs().max() <= 2e-2 * want[0].float().abs().max()


def test_fused_graph_matches_the_unfused_graph() -> None:
    """Same inputs through the compiled graph with and without the pass."""
    x, r = _inputs(4)
    plain = torch.compile(_layer, backend="inductor", fullgraph=True)
    torch._dynamo.reset()
    want = plain(x, r)
    got = _compile(_layer, {})(x, r)
    assert torch.equal(got[1], want[1])
    assert (got[0].float() - want[0].float()).abs().max() <= 2e-2 * want[0].float().abs().max()


def test_pass_leaves_other_uses_alone() -> None:
    def normed_used_twice(x, res):
        h, res = ir.ops.fused_add_rms_norm(x, res, NW1, 1e-5, None)
        return _lin(h, QKV, 3 * H), h + 1, res

    def variance_size(x, res):
        h, res = ir.ops.fused_add_rms_norm(x, res, NW1, 1e-5, 64)
        return _lin(h, QKV, 3 * H), res

    def up_times_silu_of_up(x, res):  # not SiluAndMul: silu of the second half
        gu = _lin(x, GU, 2 * I)
        return _lin(F.silu(gu[..., I:]) * gu[..., :I], DOWN, H)

    def gelu_and_mul(x, res):
        gu = _lin(x, GU, 2 * I)
        return _lin(F.gelu(gu[..., :I]) * gu[..., I:], DOWN, H)

    x, r = _inputs(2)
    for fn in (normed_used_twice, variance_size, up_times_silu_of_up, gelu_and_mul):
        counts: dict = {}
        got, want = _compile(fn, counts)(x, r), fn(x, r)
        assert counts == {"add_rms_norm": 0, "silu_mul": 0}, fn.__name__
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for a, b in zip(got, want):
            assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max().clamp_min(1)


def test_fake_shapes() -> None:
    x, r = _inputs(3)
    y, res = torch.ops.kbit.linear_add_rms_norm(x, r, NW1, 1e-5, *QKV, CB, BITS, 3 * H)
    assert y.shape == (3, 3 * H) and res.shape == (3, H) and y.dtype == torch.float16
    h = torch.randn(3, 2 * I).half()
    assert torch.ops.kbit.linear_silu_mul(h, *DOWN, CB, BITS, H).shape == (3, H)
    with pytest.raises(RuntimeError, match="residual must match x"):
        torch.ops.kbit.linear_add_rms_norm(x, r[:1], NW1, 1e-5, *QKV, CB, BITS, 3 * H)
    with pytest.raises(RuntimeError, match=r"norm_weight must be \[128\]"):
        torch.ops.kbit.linear_add_rms_norm(x, r, NW1.float(), 1e-5, *QKV, CB, BITS, 3 * H)


def _vllm_config(mode):
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"),
                      compilation_config=CompilationConfig(mode=mode))  # fmt: skip


def test_install(monkeypatch) -> None:
    from vllm.config import CompilationMode, set_current_vllm_config

    cfg = _vllm_config(CompilationMode.VLLM_COMPILE)
    with set_current_vllm_config(cfg):
        assert fusion.install() and fusion.install()  # idempotent
    p = cfg.compilation_config.inductor_compile_config[fusion._PASS_KEY]
    assert type(p).__name__ == "KbitFusionPass" and isinstance(p.uuid(), str)
    # its own compile range for the GEMV batch sizes, and only that range is rewritten
    ranges = cfg.compilation_config.get_compile_ranges()
    assert any(r.start == 1 and r.end == fusion.FUSE_MAX_M for r in ranges), ranges
    assert [p.is_applicable_for_range(r) for r in ranges] == [r.end <= fusion.FUSE_MAX_M for r in ranges]
    assert len(ranges) >= 2

    monkeypatch.setenv("VLLM_KBIT_FUSION", "0")
    cfg = _vllm_config(CompilationMode.VLLM_COMPILE)
    with set_current_vllm_config(cfg):
        assert not fusion.install()
    assert fusion._PASS_KEY not in cfg.compilation_config.inductor_compile_config
    monkeypatch.delenv("VLLM_KBIT_FUSION")

    cfg = _vllm_config(CompilationMode.NONE)  # --enforce-eager: nothing is compiled
    with set_current_vllm_config(cfg):
        assert not fusion.install()

    cfg = _vllm_config(CompilationMode.VLLM_COMPILE)
    other = object()
    cfg.compilation_config.inductor_compile_config[fusion._PASS_KEY] = other
    with set_current_vllm_config(cfg):
        assert not fusion.install()  # a user's own pass is kept
    assert cfg.compilation_config.inductor_compile_config[fusion._PASS_KEY] is other
