# SPDX-License-Identifier: Apache-2.0
"""KbitMoEMethod on vLLM's real MoE layer (``FusedMoE`` -> ``MoERunner`` + ``RoutedExperts``)
on the CPU: weights load through vLLM's per-expert MoE weight loader (``MoERunner.load_weights``,
what ``AutoWeightsLoader`` calls), the layer's own forward runs the router and the method's
``apply`` (``kbit::moe``, the reference on CPU). TP=2 and EP=2 are simulated by patching the
TP rank that vLLM's MoE parallel config reads (world size stays 1, so the all-reduce is a no-op).

vLLM's built-in top-k softmax router needs the compiled ``_moe_C`` ops, which a CPU-only
install lacks, so the layers get the equivalent pure-PyTorch ``custom_routing_function``.
The last test loads whole tiny Qwen3-MoE / Mixtral models with vLLM's own model loader; for
that, vLLM (a CUDA wheel on a machine without a GPU: no platform) is told it runs on the CPU
and its Attention layers get the CPU backend class (never run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from test_moe_reference import assert_matches, naive_moe  # noqa: E402
from test_vllm_linear import _finish_loading  # noqa: E402
from vllm_cpu_env import vllm_cpu_env  # noqa: E402

import vllm_kbit  # noqa: E402
from vllm_kbit import reference as ref  # noqa: E402
from vllm_kbit.format import KbitQuantConfig, default_codebook  # noqa: E402

vllm_kbit.register()

from vllm_kbit.config import KbitConfig  # noqa: E402
from vllm_kbit.moe import KbitMoEMethod  # noqa: E402

DT = torch.bfloat16
QWEN = ("gate_proj", "down_proj", "up_proj")  # FusedMoE ckpt_names order: gate, down, up
MIXTRAL = ("w1", "w2", "w3")
PREFIX = "model.layers.0.mlp.experts"

vllm_env = pytest.fixture(scope="module", autouse=True)(vllm_cpu_env)


def route(hidden_states, gating_output, topk, renormalize):
    """vLLM's default softmax top-k routing, in plain PyTorch."""
    w, ids = torch.softmax(gating_output.float(), -1).topk(topk, -1)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), ids.to(torch.int32)


@pytest.fixture
def tp_rank(monkeypatch):
    """tp_rank(r): MoE layers built afterwards believe they are TP rank r."""
    import vllm.model_executor.layers.fused_moe.config as moe_config_mod

    def set_rank(rank: int) -> None:
        monkeypatch.setattr(moe_config_mod, "get_tensor_model_parallel_rank", lambda: rank)

    return set_rank


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's unquantized MoE method picks a backend by platform; the CUDA wheel on a machine
    without a GPU reports no platform, so report the CPU one."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)


def config(bits: int = 4, online: bool = False, **kw) -> KbitConfig:
    d = KbitQuantConfig(bits=bits, **kw).to_dict()
    return KbitConfig.from_config({**d, "online": online})


def build(qcfg: KbitConfig | None, e: int = 4, h: int = 64, i: int = 96, topk: int = 2,
          names: tuple[str, str, str] = QWEN, prefix: str = PREFIX, tp: int | None = None,
          ep: bool = False, load_format: str = "auto", **kw):  # fmt: skip
    """A real vLLM MoE layer and the VllmConfig to run it under (a fresh one per layer: vLLM
    registers every MoE layer name in it)."""
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.layers.fused_moe import FusedMoE

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"),
                     parallel_config=ParallelConfig(enable_expert_parallel=ep),
                     load_config=LoadConfig(load_format=load_format))  # fmt: skip
    with set_current_vllm_config(cfg):
        layer = FusedMoE(num_experts=e, top_k=topk, hidden_size=h, intermediate_size=i,
                         params_dtype=DT, quant_config=qcfg, prefix=prefix, tp_size=tp,
                         custom_routing_function=route, ckpt_names=names, **kw)  # fmt: skip
    layer.vllm_config = cfg
    return layer


def forward(layer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(layer.vllm_config), set_forward_context(None, layer.vllm_config):
        return layer(x, logits)


def experts(e: int, h: int, i: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """bf16 (w13 [2I, H] = gate rows then up rows, w2 [H, I]) per expert."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(2 * i, h, generator=g) * 0.05).to(DT),
             (torch.randn(h, i, generator=g) * 0.05).to(DT)) for _ in range(e)]  # fmt: skip


def quantized(ws, bits: int) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    cb = default_codebook(bits)
    return [(ref.quantize(w13, bits, cb), ref.quantize(w2, bits, cb)) for w13, w2 in ws]


def checkpoint(qs, names: tuple[str, str, str] = QWEN) -> list[tuple[str, torch.Tensor]]:
    """Converter-style per-expert 2-D tensors, named relative to the MoE layer (as
    AutoWeightsLoader hands them to MoERunner.load_weights)."""
    gate, down, up = names
    out = []
    for e, ((q13, a13), (q2, a2)) in enumerate(qs):
        i = q13.shape[0] // 2
        for leaf, q, a in ((gate, q13[:i], a13[:i]), (up, q13[i:], a13[i:]), (down, q2, a2)):
            out += [(f"{e}.{leaf}.qweight", q), (f"{e}.{leaf}.weight_absmax", a)]
    return out


def dequantized(qs, bits: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cb = default_codebook(bits)
    return [(ref.dequantize(*c13, cb, bits, DT), ref.dequantize(*c2, cb, bits, DT))
            for c13, c2 in qs]  # fmt: skip


def assert_tiled(re_, qs, bits: int) -> None:
    """The RoutedExperts' tiled parameters are exactly the per-expert repack of ``qs``."""
    assert type(re_.w13_qweight) is torch.nn.Parameter and re_.w13_qweight.dim() == 2
    for e, ((q13, a13), (q2, a2)) in enumerate(qs):
        for name, q, a in (("w13", q13, a13), ("w2", q2, a2)):
            n, k = a.shape[0], a.shape[1] * 32
            got = ref.unrepack(getattr(re_, f"{name}_qweight")[e],
                               getattr(re_, f"{name}_weight_absmax")[e], bits, n, k)  # fmt: skip
            assert torch.equal(got[0], q) and torch.equal(got[1], a), (name, e)


def load(layer, tensors) -> set[str]:
    return set(layer.load_weights(iter(tensors)))


def check_forward(layer, deq, t: int = 9, **naive_kw) -> torch.Tensor:
    h, e = deq[0][1].shape[0], layer.routed_experts.global_num_experts
    x = torch.randn(t, h).to(DT)
    logits = torch.randn(t, e).to(DT)
    got = forward(layer, x, logits)
    tw, ids = route(x, logits, layer.routed_experts.top_k, True)
    assert_matches(got, naive_moe(x, deq, tw, ids, **naive_kw))
    return got


# ------------------------------------------------------------------ pre-quantized


def test_create_weights_and_method_properties():
    layer = build(config(3))
    re_ = layer.routed_experts
    method = re_.quant_method
    assert isinstance(method, KbitMoEMethod) and method.bits == 3
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in re_.named_parameters()}
    assert shapes == {"w13_qweight": ((4, 192, 6), torch.int32),
                      "w2_qweight": ((4, 64, 9), torch.int32),
                      "w13_weight_absmax": ((4, 192, 2), torch.uint8),
                      "w2_weight_absmax": ((4, 64, 3), torch.uint8)}  # fmt: skip
    assert all(p.weight_loader == re_.weight_loader for p in re_.parameters())
    assert not method.uses_meta_device and not method.supports_eplb
    assert not method.is_monolithic and method.moe_kernel is None
    assert method.get_fused_moe_quant_config(re_) is None
    assert method.maybe_make_prepare_finalize() is None  # no all2all: vLLM keeps direct apply


@pytest.mark.parametrize("names,bits", [(QWEN, 4), (MIXTRAL, 2), (QWEN, 5), (MIXTRAL, 3)])
def test_prequantized_load_and_forward(names, bits):
    prefix = PREFIX if names == QWEN else "model.layers.0.block_sparse_moe.experts"
    layer = build(config(bits), names=names, prefix=prefix)
    qs = quantized(experts(4, 64, 96, seed=bits), bits)
    loaded = load(layer, checkpoint(qs, names))
    assert loaded == {"w13_qweight", "w13_weight_absmax", "w2_qweight", "w2_weight_absmax"}
    re_ = layer.routed_experts
    assert torch.equal(re_.w13_qweight.data, torch.stack([q13 for (q13, _), _ in qs]))
    assert torch.equal(re_.w2_weight_absmax.data, torch.stack([a2 for _, (_, a2) in qs]))
    re_.quant_method.process_weights_after_loading(re_)
    assert_tiled(layer.routed_experts, qs, bits)
    ptrs = [p.data_ptr() for p in re_.parameters()]
    re_.quant_method.process_weights_after_loading(re_)  # vLLM may call it twice
    assert ptrs == [p.data_ptr() for p in re_.parameters()]
    assert "kbit_codebook" not in re_.state_dict()
    check_forward(layer, dequantized(qs, bits))
    check_forward(layer, dequantized(qs, bits), t=1)


def test_tp2_shards_each_expert(tp_rank):
    """TP=2, I=128: rank r holds rows [64r, 64r+64) of gate and of up, and columns
    [64r, 64r+64) of down (2 of the 4 absmax blocks, 2*k of the 4*k words)."""
    bits, i = 3, 128
    qs = quantized(experts(4, 64, i, seed=1), bits)
    full = dequantized(qs, bits)
    x, logits = torch.randn(6, 64).to(DT), torch.randn(6, 4).to(DT)
    outs = []
    for rank in range(2):
        tp_rank(rank)
        layer = build(config(bits), i=i, tp=2)
        load(layer, checkpoint(qs))
        rows = torch.cat([torch.arange(64 * rank, 64 * rank + 64),
                          torch.arange(i + 64 * rank, i + 64 * rank + 64)])  # fmt: skip
        cols_q = slice(2 * bits * rank, 2 * bits * (rank + 1))
        cols_a = slice(2 * rank, 2 * rank + 2)
        shard = [((q13[rows], a13[rows]), (q2[:, cols_q], a2[:, cols_a]))
                 for (q13, a13), (q2, a2) in qs]  # fmt: skip
        re_ = layer.routed_experts
        assert re_.w2_qweight.shape == (4, 64, 2 * bits)
        assert torch.equal(re_.w2_qweight.data, torch.stack([s[1][0] for s in shard]))
        assert torch.equal(re_.w13_weight_absmax.data, torch.stack([s[0][1] for s in shard]))
        re_.quant_method.process_weights_after_loading(re_)
        assert_tiled(layer.routed_experts, shard, bits)
        outs.append(forward(layer, x, logits))
        tw, ids = route(x, logits, 2, True)
        assert_matches(outs[-1], naive_moe(x, dequantized(shard, bits), tw, ids))
    # the runner all-reduces the partial sums of the two ranks: together they are the layer
    tw, ids = route(x, logits, 2, True)
    assert_matches(outs[0] + outs[1], naive_moe(x, full, tw, ids))


def test_tp_block_misalignment(tp_rank, cpu_platform):
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    tp_rank(0)  # I = 96 over 2 ranks: 48 per rank, not a multiple of 32
    with pytest.raises(ValueError, match=r"experts\.\*\.down_proj.*\(in_features/32\) % tp == 0"):
        build(config(4), i=96, tp=2)
    layer = build(config(4, online=True), i=96, tp=2)  # online: the layer stays bf16
    assert isinstance(layer.routed_experts.quant_method, UnquantizedFusedMoEMethod)


def test_expert_parallel_loads_and_runs_local_experts(tp_rank):
    """EP=2 (tp=2 + enable_expert_parallel): rank 1 owns global experts 2 and 3."""
    bits = 4
    qs = quantized(experts(4, 64, 64, seed=3), bits)
    tp_rank(1)
    layer = build(config(bits), i=64, tp=2, ep=True)
    re_ = layer.routed_experts
    assert re_.local_num_experts == 2 and re_.w13_qweight.shape[0] == 2
    assert re_.expert_map.tolist() == [-1, -1, 0, 1]
    load(layer, checkpoint(qs))  # every expert offered; the loader keeps the local ones
    re_.quant_method.process_weights_after_loading(re_)
    assert_tiled(layer.routed_experts, qs[2:], bits)
    check_forward(layer, dequantized(qs[2:], bits), t=16, expert_map=re_.expert_map)


@pytest.mark.parametrize("ep", [False, True])
def test_dequant_path_through_the_layer(monkeypatch, tp_rank, ep):
    """KbitMoEMethod.apply -> moe_dispatch.kbit_moe: thresholds at 0 and a grouped GEMM for CPU
    tensors (reference_moe.grouped_experts standing in for vLLM's Triton fused_experts) make
    the layer take the dequant path, one expert per chunk, composed with the layer's
    expert_map under EP (rank 1 of 2: global experts 2, 3)."""
    from vllm_kbit import moe_dispatch
    from vllm_kbit.reference_moe import grouped_experts

    calls = []

    def gemm(*args):
        calls.append(args[1].shape[0])
        return grouped_experts(*args)

    monkeypatch.setitem(moe_dispatch.GROUPED_GEMMS, "cpu", gemm)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_M", 0)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MIN_TPE", 0)
    monkeypatch.setattr(moe_dispatch, "DEQUANT_MAX_BYTES", 1)  # one expert per chunk
    bits = 4
    qs = quantized(experts(4, 64, 64, seed=5), bits)
    if ep:
        tp_rank(1)
    layer = build(config(bits), i=64, tp=2 if ep else None, ep=ep)
    load(layer, checkpoint(qs))
    re_ = layer.routed_experts
    re_.quant_method.process_weights_after_loading(re_)
    local = qs[2:] if ep else qs
    check_forward(layer, dequantized(local, bits), t=16, expert_map=re_.expert_map)
    assert calls == [1] * len(local)


# ------------------------------------------------------------------ online


def test_online_quantizes_experts_when_loaded():
    bits = 4
    ws = experts(4, 64, 96, seed=4)
    layer = build(config(bits, online=True))
    re_ = layer.routed_experts
    method = re_.quant_method
    assert method.uses_meta_device and re_.w13_weight.is_meta and re_.w13_weight.dtype == DT
    assert tuple(re_.w13_weight.shape) == (4, 192, 64) and tuple(re_.w2_weight.shape) == (4, 64, 96)
    tensors = []
    for e, (w13, w2) in enumerate(ws):
        tensors += [(f"{e}.gate_proj.weight", w13[:96]), (f"{e}.up_proj.weight", w13[96:]),
                    (f"{e}.down_proj.weight", w2)]  # fmt: skip
    load(layer, tensors[:-1])
    assert hasattr(re_, "w13_weight") and not hasattr(re_, "w13_qweight")  # waits for the rest
    load(layer, tensors[-1:])
    # vLLM's layer-wise loader materialised the experts and ran process_weights_after_loading
    assert not hasattr(re_, "w13_weight") and not hasattr(re_, "w2_weight")
    qs = quantized(ws, bits)
    assert_tiled(layer.routed_experts, qs, bits)
    ptr = re_.w13_qweight.data_ptr()
    method.process_weights_after_loading(re_)  # the global pass calls it again
    assert re_.w13_qweight.data_ptr() == ptr
    check_forward(layer, dequantized(qs, bits))


def test_online_out_of_range_expert_names_it():
    layer = build(config(4, online=True), prefix="model.layers.7.mlp.experts")
    tensors = []
    for e, (w13, w2) in enumerate(experts(4, 64, 96)):
        if e == 2:
            w2 = w2.clone()
            w2[3, 5] = 100.0
        tensors += [(f"{e}.gate_proj.weight", w13[:96]), (f"{e}.up_proj.weight", w13[96:]),
                    (f"{e}.down_proj.weight", w2)]  # fmt: skip
    msg = r"layers\.7\.mlp\.experts \(expert 2, down\).*modules_to_not_convert"
    with pytest.raises(ValueError, match=msg):
        load(layer, tensors)


@pytest.mark.parametrize("online", [False, True])
def test_dummy_loader_flow(online):
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    layer = build(config(3, online=online), load_format="dummy")
    re_ = layer.routed_experts
    assert re_.quant_method.dummy != online  # pre-quantized: integer params are garbage
    if not online:
        for p in re_.parameters():
            p.data.fill_(-1)  # what garbage may look like: absmax byte 255 = 31.0
    model = torch.nn.Module()
    model.experts = layer
    with set_current_vllm_config(layer.vllm_config):
        DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(model, None)
        _finish_loading(model)
    cb = re_.kbit_codebook
    for e in (0, 3):
        w13 = ref.dequantize_tiled(re_.w13_qweight[e], re_.w13_weight_absmax[e], cb, 3, 192, 64,
                                   torch.float32)  # fmt: skip
        w2 = ref.dequantize_tiled(re_.w2_qweight[e], re_.w2_weight_absmax[e], cb, 3, 64, 96,
                                  torch.float32)  # fmt: skip
        for w in (w13, w2):  # online: vLLM's uniform(+-1e-3); pre-quantized: N(0, 0.02)
            assert torch.isfinite(w).all() and w.abs().max() > 0
            if not online:
                assert 0.015 < w.std().item() < 0.025
    out = forward(layer, torch.randn(5, 64).to(DT), torch.randn(5, 4).to(DT))
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------ config rules


def test_modules_to_not_convert_and_module_bits(cpu_platform):
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    def method(prefix: str = PREFIX, names=QWEN, **kw):
        return build(config(4, **kw), prefix=prefix, names=names).routed_experts.quant_method

    unquantized = (
        dict(modules_to_not_convert=[r"layers\.0\.mlp\.experts$"]),  # the converter writes this
        dict(modules_to_not_convert=[r"layers\.0\.mlp\.experts\.\d+\."]),  # every expert weight
        dict(modules_to_not_convert=["block_sparse_moe"], names=MIXTRAL,
             prefix="model.layers.0.block_sparse_moe.experts"),
    )  # fmt: skip
    for kw in unquantized:
        assert isinstance(method(**kw), UnquantizedFusedMoEMethod), kw
    assert isinstance(method(modules_to_not_convert=[r"layers\.1\."]), KbitMoEMethod)
    with pytest.raises(ValueError, match=r"skips 3 of the 12 expert weights .*layers\.0\.mlp"):
        method(modules_to_not_convert=[r"experts\.0\."])
    assert method(module_bits={r"layers\.0\.": 2}).bits == 2
    assert method(module_bits={r"layers\.1\.": 2}).bits == 4
    with pytest.raises(ValueError, match=r"different bit widths .*down_proj: 5"):
        method(module_bits={"down_proj": 5})
    with pytest.raises(ValueError, match=r"different bit widths .*experts\.3\.w3: 2"):
        method(module_bits={r"experts\.3\.w3": 2}, names=MIXTRAL,
               prefix="model.layers.0.block_sparse_moe.experts")  # fmt: skip


def test_unsupported_layers_raise():
    with pytest.raises(NotImplementedError, match=r"activation 'swigluoai'.*gelu_tanh"):
        build(config(4), activation="swigluoai")
    with pytest.raises(NotImplementedError, match="expert biases"):
        build(config(4), has_bias=True)


def test_online_router_gate_stays_unquantized():
    """Online mode leaves the router (``mlp.gate``) in bf16, as the converter does; with a
    pre-quantized checkpoint its modules_to_not_convert decides (the converter lists it)."""
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    from vllm_kbit.linear import KbitLinearMethod

    def gate(qcfg):
        return ReplicatedLinear(64, 128, bias=False, params_dtype=DT, quant_config=qcfg,
                                prefix="model.layers.0.mlp.gate").quant_method  # fmt: skip

    assert isinstance(gate(config(4, online=True)), UnquantizedLinearMethod)
    assert isinstance(gate(config(4)), KbitLinearMethod)
    skip = config(4, modules_to_not_convert=[r"model\.layers\.0\.mlp\.gate$"])
    assert isinstance(gate(skip), UnquantizedLinearMethod)


# ------------------------------------------------------------------ whole model, real loader


def _mixtral(path: Path) -> None:
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).to(DT).save_pretrained(path)


@pytest.fixture
def cpu_attention(monkeypatch, cpu_platform):
    """vLLM's Attention layer picks a backend by platform at construction; give it the CPU
    one (never run here: these tests only load weights and call the MoE method)."""
    import vllm.model_executor.layers.attention.attention as attention_mod
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    monkeypatch.setattr(attention_mod, "get_attn_backend", lambda *a, **k: CPUAttentionBackend)


@pytest.mark.parametrize("online", [False, True])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_model_loader_end_to_end(arch, online, tmp_path, cpu_attention):
    """A tiny HF checkpoint (transformers' save_pretrained), pre-quantized by the converter or
    quantized online, loaded by vLLM's own model loader into vLLM's model class (names through
    AutoWeightsLoader, the model's hf_to_vllm_mapper and the per-expert MoE loader; online
    layer-wise processing). Each MoE layer then holds exactly the quantization of the HF
    experts and computes their MoE."""
    from safetensors.torch import load_file
    from test_converter import _qwen3_moe
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.model_loader import get_model_loader

    from vllm_kbit.linear import KbitLinearMethod
    from vllm_kbit.quantize import convert

    src, out, bits = tmp_path / "src", tmp_path / "kbit", 3
    _qwen3_moe(src) if arch == "qwen3_moe" else _mixtral(src)
    if not online:
        convert(src, out, bits, progress=False)
    online_kw = dict(quantization="kbit", hf_overrides={"quantization_config": {
        "quant_method": "kbit", "bits": bits}}) if online else {}  # fmt: skip
    model_config = ModelConfig(model=str(src if online else out), dtype="bfloat16",
                               skip_tokenizer_init=True, **online_kw)  # fmt: skip
    cfg = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                     load_config=LoadConfig())  # fmt: skip
    with set_current_vllm_config(cfg):
        model = get_model_loader(cfg.load_config).load_model(vllm_config=cfg,
                                                             model_config=model_config)  # fmt: skip

    block = "mlp" if arch == "qwen3_moe" else "block_sparse_moe"
    gate, down, up = QWEN if arch == "qwen3_moe" else MIXTRAL
    hf = load_file(src / "model.safetensors")
    for layer in range(2):
        mod = model.model.layers[layer]
        moe, router = getattr(mod, block).experts.routed_experts, getattr(mod, block).gate
        assert isinstance(moe.quant_method, KbitMoEMethod) and moe.quant_method.bits == bits
        assert isinstance(router.quant_method, UnquantizedLinearMethod)  # the router stays bf16
        assert isinstance(mod.self_attn.qkv_proj.quant_method, KbitLinearMethod)
        p = f"model.layers.{layer}.{block}.experts"
        w = [(torch.cat([hf[f"{p}.{e}.{gate}.weight"], hf[f"{p}.{e}.{up}.weight"]]),
              hf[f"{p}.{e}.{down}.weight"]) for e in range(4)]  # fmt: skip
        # the converter quantizes the checkpoint's dtype (fp16 for the Qwen3 model), the online
        # path what vLLM loaded (the model dtype, bf16); otherwise they quantize the same way
        qs = quantized([(a.to(DT), b.to(DT)) for a, b in w] if online else w, bits)
        assert_tiled(moe, qs, bits)
        x = torch.randn(12, 64).to(DT)
        tw, ids = route(x, x @ router.weight.t(), 2, True)
        got = moe.quant_method.apply(moe, x, tw, ids, None, None)
        assert_matches(got, naive_moe(x, dequantized(qs, bits), tw, ids))
        # close to the HF checkpoint's unquantized experts (3-bit weights: ~15.5 dB SQNR each)
        want = naive_moe(x, [(a.to(DT), b.to(DT)) for a, b in w], tw, ids)
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 0.4, rel
