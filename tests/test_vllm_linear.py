# SPDX-License-Identifier: Apache-2.0
"""KbitLinearMethod on vLLM's real linear layers (CPU, world size 1; TP=2 simulated by
patching the layers' TP rank/size): weight creation, loading through the layers' own
weight loaders, repacking, online quantization, dummy loading, torch.compile."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("vllm")

import vllm_kbit  # noqa: E402
from vllm_cpu_env import vllm_cpu_env  # noqa: E402
from vllm_kbit import reference as ref  # noqa: E402
from vllm_kbit.format import KbitQuantConfig, default_codebook  # noqa: E402

vllm_kbit.register()

from vllm_kbit.config import KbitConfig  # noqa: E402
from vllm_kbit.linear import KbitDenseHeadMethod, KbitLinearMethod  # noqa: E402

DT = torch.bfloat16
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


vllm_env = pytest.fixture(scope="module", autouse=True)(vllm_cpu_env)


@pytest.fixture
def tp(monkeypatch):
    """tp(rank, size): layers built afterwards believe they are rank/size of a TP group."""
    import vllm.model_executor.layers.linear as linear_mod

    def set_tp(rank: int, size: int) -> None:
        monkeypatch.setattr(linear_mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(linear_mod, "get_tensor_model_parallel_world_size", lambda: size)

    return set_tp


def config(bits=4, online=False) -> KbitConfig:
    d = {"quant_method": "kbit", "bits": bits}
    cfg = KbitConfig.from_config(d if online else KbitQuantConfig(bits=bits).to_dict())
    cfg.packed_modules_mapping = dict(FUSED)
    return cfg


def checkpoint(n: int, k: int, bits: int, seed: int = 0):
    """A bf16 weight and its checkpoint-layout kbit tensors (reference quantizer)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DT)
    q, a = ref.quantize(w, bits, default_codebook(bits))
    return w, q, a


def check_apply(layer, q, a, bits, bias=None, ms=(1, 5)):
    """layer's apply == reference.linear on the full checkpoint-layout weight (+ bias)."""
    k = a.shape[1] * 32
    for m in ms:
        x = torch.randn(m, k).to(DT)
        want = ref.linear(x, q, a, default_codebook(bits), bits)
        if bias is not None:
            want = want + bias
        got = layer.quant_method.apply(layer, x, bias)
        assert got.shape == (m, q.shape[0]) and got.dtype == DT
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    x3 = torch.randn(2, 3, k).to(DT)  # leading dims are kept
    assert layer.quant_method.apply(layer, x3).shape == (2, 3, q.shape[0])


def assert_tiled_equals(layer, q, a, bits):
    n, k = a.shape[0], a.shape[1] * 32
    assert layer.qweight.dim() == 1 and layer.weight_absmax.dim() == 1
    assert type(layer.qweight) is torch.nn.Parameter and not layer.qweight.requires_grad
    assert layer.kbit_n == n and layer.kbit_codebook.dtype == torch.float32
    uq, ua = ref.unrepack(layer.qweight.data, layer.weight_absmax.data, bits, n, k)
    assert torch.equal(uq, q) and torch.equal(ua, a)


# ------------------------------------------------------------------ pre-quantized


def test_create_weights_shapes():
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter

    layer = ColumnParallelLinear(128, 48, bias=False, params_dtype=DT, quant_config=config(3),
                                 prefix="m.o_proj")  # fmt: skip
    assert type(layer.qweight) is ModelWeightParameter
    assert type(layer.weight_absmax) is GroupQuantScaleParameter
    assert (layer.qweight.shape, layer.qweight.dtype) == ((48, 12), torch.int32)
    assert (layer.weight_absmax.shape, layer.weight_absmax.dtype) == ((48, 4), torch.uint8)
    for p in (layer.qweight, layer.weight_absmax):
        assert (p.output_dim, p.input_dim) == (0, 1)
    assert layer.kbit_n == 48 and not hasattr(layer, "weight")


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_merged_gate_up_load_and_apply(bits):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(256, [64, 96], bias=True, params_dtype=DT,
                                       quant_config=config(bits), prefix="m.mlp.gate_up_proj")  # fmt: skip
    shards = [checkpoint(64, 256, bits, 1), checkpoint(96, 256, bits, 2)]
    for shard_id, (_, q, a) in enumerate(shards):
        layer.qweight.weight_loader(layer.qweight, q, shard_id)
        layer.weight_absmax.weight_loader(layer.weight_absmax, a, shard_id)
    bias = torch.randn(160).to(DT)
    layer.bias.data.copy_(bias)
    q = torch.cat([s[1] for s in shards])
    a = torch.cat([s[2] for s in shards])
    assert torch.equal(layer.qweight.data, q) and torch.equal(layer.weight_absmax.data, a)
    layer.quant_method.process_weights_after_loading(layer)
    assert_tiled_equals(layer, q, a, bits)
    check_apply(layer, q, a, bits, bias=layer.bias)
    out, _ = layer(torch.randn(3, 256).to(DT))  # the layer's own forward
    assert out.shape == (3, 160)


def test_fused_on_disk_checkpoints():
    """gate_up / qkv already fused in the checkpoint (shard id None, e.g. Phi-3)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    mlp = MergedColumnParallelLinear(128, [64, 96], bias=False, params_dtype=DT,
                                     quant_config=config(4), prefix="m.mlp.gate_up_proj")  # fmt: skip
    attn = QKVParallelLinear(128, 32, 4, 2, bias=False, params_dtype=DT, quant_config=config(4),
                             prefix="m.self_attn.qkv_proj")  # fmt: skip
    for layer, n in ((mlp, 160), (attn, 256)):
        _, q, a = checkpoint(n, 128, 4)
        layer.weight_loader_v2(layer.qweight, q, None)
        layer.weight_loader_v2(layer.weight_absmax, a, None)
        layer.quant_method.process_weights_after_loading(layer)
        assert_tiled_equals(layer, q, a, 4)


def test_qkv_load_and_apply():
    from vllm.model_executor.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(128, 32, 4, 2, bias=True, params_dtype=DT, quant_config=config(3),
                              prefix="m.self_attn.qkv_proj")  # fmt: skip
    parts = {"q": checkpoint(128, 128, 3, 1), "k": checkpoint(64, 128, 3, 2),
             "v": checkpoint(64, 128, 3, 3)}  # fmt: skip
    for sid, (_, q, a) in parts.items():
        layer.weight_loader_v2(layer.qweight, q, sid)
        layer.weight_loader_v2(layer.weight_absmax, a, sid)
    q = torch.cat([parts[s][1] for s in "qkv"])
    a = torch.cat([parts[s][2] for s in "qkv"])
    layer.bias.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    assert_tiled_equals(layer, q, a, 3)
    check_apply(layer, q, a, 3, bias=layer.bias)


def test_row_column_replicated_load_and_apply():
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    for cls, bits in ((ColumnParallelLinear, 2), (RowParallelLinear, 5), (ReplicatedLinear, 4)):
        layer = cls(160, 40, bias=True, params_dtype=DT, quant_config=config(bits), prefix="m.proj")
        _, q, a = checkpoint(40, 160, bits)
        layer.qweight.weight_loader(layer.qweight, q)
        layer.weight_absmax.weight_loader(layer.weight_absmax, a)
        layer.bias.data.normal_()
        layer.quant_method.process_weights_after_loading(layer)
        assert_tiled_equals(layer, q, a, bits)
        check_apply(layer, q, a, bits, bias=layer.bias)


def test_process_twice_is_harmless():
    from vllm.model_executor.layers.linear import RowParallelLinear

    layer = RowParallelLinear(128, 32, bias=False, params_dtype=DT, quant_config=config(4),
                              prefix="m.down_proj")  # fmt: skip
    _, q, a = checkpoint(32, 128, 4)
    layer.weight_loader_v2(layer.qweight, q)
    layer.weight_loader_v2(layer.weight_absmax, a)
    layer.quant_method.process_weights_after_loading(layer)
    ptrs = (layer.qweight.data_ptr(), layer.weight_absmax.data_ptr(), layer.kbit_codebook.data_ptr())
    layer.quant_method.process_weights_after_loading(layer)
    assert ptrs == (layer.qweight.data_ptr(), layer.weight_absmax.data_ptr(),
                    layer.kbit_codebook.data_ptr())  # fmt: skip
    assert_tiled_equals(layer, q, a, 4)
    assert "kbit_codebook" not in layer.state_dict()  # non-persistent


# ------------------------------------------------------------------ simulated TP = 2


def test_tp2_row_parallel_shards_blocks(tp):
    from vllm.model_executor.layers.linear import RowParallelLinear

    bits, k, n = 3, 256, 48
    _, q, a = checkpoint(n, k, bits)
    x = torch.randn(4, k).to(DT)
    for rank in range(2):
        tp(rank, 2)
        layer = RowParallelLinear(k, n, bias=False, params_dtype=DT, quant_config=config(bits),
                                  prefix="m.down_proj")  # fmt: skip
        assert layer.qweight.shape == (n, 4 * bits)  # K/2 = 128 columns = 4 blocks
        layer.weight_loader_v2(layer.qweight, q)
        layer.weight_loader_v2(layer.weight_absmax, a)
        q_r, a_r = q[:, rank * 4 * bits : (rank + 1) * 4 * bits], a[:, rank * 4 : (rank + 1) * 4]
        assert torch.equal(layer.qweight.data, q_r) and torch.equal(layer.weight_absmax.data, a_r)
        layer.quant_method.process_weights_after_loading(layer)
        x_r = x[:, rank * 128 : (rank + 1) * 128]
        want = ref.linear(x_r, q_r, a_r, default_codebook(bits), bits)
        torch.testing.assert_close(layer.quant_method.apply(layer, x_r), want, rtol=0, atol=0)


def test_tp2_online_row_parallel_quantizes_its_shard(tp):
    from vllm.model_executor.layers.linear import RowParallelLinear

    w = checkpoint(32, 256, 4)[0]
    for rank in range(2):
        tp(rank, 2)
        layer = RowParallelLinear(256, 32, bias=False, params_dtype=DT,
                                  quant_config=config(4, online=True), prefix="m.down_proj")  # fmt: skip
        assert layer.weight.shape == (32, 128) and layer.weight.is_meta
        layer.weight.weight_loader(layer.weight, w)
        w_r = w[:, rank * 128 : (rank + 1) * 128]
        assert_tiled_equals(layer, *ref.quantize(w_r, 4, default_codebook(4)), 4)


def test_tp2_row_parallel_block_misalignment(tp):
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod

    tp(0, 2)  # K = 96: K/32 = 3 blocks do not split over 2 ranks
    with pytest.raises(ValueError, match=r"tensor-parallel.*\(in_features/32\) % tp == 0"):
        RowParallelLinear(96, 32, bias=False, params_dtype=DT, quant_config=config(4),
                          prefix="m.down_proj")  # fmt: skip
    layer = RowParallelLinear(96, 32, bias=False, params_dtype=DT, quant_config=config(4, True),
                              prefix="m.down_proj")  # fmt: skip
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)  # online: stays bf16


def test_tp2_merged_and_qkv_shard_rows(tp):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    bits, k = 4, 128
    gate, up = checkpoint(64, k, bits, 1), checkpoint(64, k, bits, 2)
    # 4 query heads, 1 kv head over 2 ranks: each rank holds 2 q heads and a replica of k/v
    qkv = {"q": checkpoint(128, k, bits, 3), "k": checkpoint(32, k, bits, 4),
           "v": checkpoint(32, k, bits, 5)}  # fmt: skip
    for rank in range(2):
        tp(rank, 2)
        mlp = MergedColumnParallelLinear(k, [64, 64], bias=False, params_dtype=DT,
                                         quant_config=config(bits), prefix="m.mlp.gate_up_proj")  # fmt: skip
        attn = QKVParallelLinear(k, 32, 4, 1, bias=False, params_dtype=DT,
                                 quant_config=config(bits), prefix="m.self_attn.qkv_proj")  # fmt: skip
        for sid, (_, q, a) in enumerate((gate, up)):
            mlp.weight_loader_v2(mlp.qweight, q, sid)
            mlp.weight_loader_v2(mlp.weight_absmax, a, sid)
        for sid, (_, q, a) in qkv.items():
            attn.weight_loader_v2(attn.qweight, q, sid)
            attn.weight_loader_v2(attn.weight_absmax, a, sid)
        rows = slice(rank * 32, (rank + 1) * 32)
        mq = torch.cat([gate[1][rows], up[1][rows]])
        ma = torch.cat([gate[2][rows], up[2][rows]])
        q_rows = slice(rank * 64, (rank + 1) * 64)
        aq = torch.cat([qkv["q"][1][q_rows], qkv["k"][1], qkv["v"][1]])
        aa = torch.cat([qkv["q"][2][q_rows], qkv["k"][2], qkv["v"][2]])
        for layer, q, a in ((mlp, mq, ma), (attn, aq, aa)):
            assert torch.equal(layer.qweight.data, q) and torch.equal(layer.weight_absmax.data, a)
            layer.quant_method.process_weights_after_loading(layer)
            check_apply(layer, q, a, bits, ms=(3,))


# ------------------------------------------------------------------ online


def test_online_quantizes_on_load_bit_exact():
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    cfg = config(3, online=True)
    layer = MergedColumnParallelLinear(128, [32, 48], bias=True, params_dtype=DT, quant_config=cfg,
                                       prefix="m.mlp.gate_up_proj")  # fmt: skip
    method = layer.quant_method
    assert method.uses_meta_device and layer.weight.is_meta and layer.weight.dtype == DT
    assert layer.weight.shape == (80, 128)
    gate, up = checkpoint(32, 128, 3, 1)[0], checkpoint(48, 128, 3, 2)[0]
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    assert hasattr(layer, "weight") and not hasattr(layer, "qweight")  # waits for the bias
    bias = torch.randn(80).to(DT)
    layer.bias.weight_loader(layer.bias, bias)
    # vLLM's layer-wise loader materialised the layer and called process_weights_after_loading
    assert not hasattr(layer, "weight") and "weight" not in dict(layer.named_parameters())
    w = torch.cat([gate, up])
    q, a = ref.quantize(w, 3, default_codebook(3))
    assert_tiled_equals(layer, q, a, 3)
    assert torch.equal(layer.bias.data, bias)
    ptr = layer.qweight.data_ptr()
    method.process_weights_after_loading(layer)  # vLLM's global pass calls it again
    assert layer.qweight.data_ptr() == ptr
    check_apply(layer, q, a, 3, bias=layer.bias)


def test_online_out_of_range_weight_names_layer():
    from vllm.model_executor.layers.linear import RowParallelLinear

    layer = RowParallelLinear(64, 16, bias=False, params_dtype=DT, quant_config=config(4, True),
                              prefix="model.layers.3.mlp.down_proj")  # fmt: skip
    w = torch.zeros(16, 64, dtype=DT)
    w[2, 5] = 100.0
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.down_proj.*modules_to_not_convert"):
        layer.weight.weight_loader(layer.weight, w)


# ------------------------------------------------------------------ dummy loading


def test_dummy_load_synthesises_valid_codes():
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    dummy = VllmConfig(device_config=DeviceConfig(device="cpu"),
                       load_config=LoadConfig(load_format="dummy"))  # fmt: skip
    with set_current_vllm_config(dummy):
        layer = ColumnParallelLinear(256, 64, bias=False, params_dtype=DT, quant_config=config(4),
                                     prefix="m.o_proj")  # fmt: skip
    assert layer.quant_method.dummy
    layer.qweight.data.fill_(-1)  # what garbage may look like: absmax byte 255 = 31.0
    layer.weight_absmax.data.fill_(255)
    layer.quant_method.process_weights_after_loading(layer)
    assert not layer.quant_method.dummy
    w = ref.dequantize_tiled(layer.qweight.data, layer.weight_absmax.data,
                             layer.kbit_codebook, 4, 64, 256, torch.float32)  # fmt: skip
    assert torch.isfinite(w).all() and 0.015 < w.std().item() < 0.025
    y = layer.quant_method.apply(layer, torch.randn(2, 256).to(DT))
    assert torch.isfinite(y).all()


def _tiny_model(cfg: KbitConfig) -> torch.nn.Module:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = torch.nn.Module()
    model.gate_up_proj = MergedColumnParallelLinear(64, [32, 32], bias=False, params_dtype=DT,
                                                    quant_config=cfg, prefix="mlp.gate_up_proj")  # fmt: skip
    model.down_proj = RowParallelLinear(32, 64, bias=True, params_dtype=DT, quant_config=cfg,
                                        prefix="mlp.down_proj")  # fmt: skip
    model.lm_head = ParallelLMHead(100, 64, params_dtype=DT, quant_config=cfg, prefix="lm_head")
    return model


def _finish_loading(model: torch.nn.Module) -> None:
    """What BaseModelLoader.load_model does after load_weights (vLLM 0.26)."""
    from types import SimpleNamespace

    from vllm.model_executor.model_loader.base_loader import _has_online_quant
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model_config = SimpleNamespace(dtype=DT, quantization="kbit")
    if _has_online_quant(model):
        finalize_layerwise_processing(model, model_config)
    process_weights_after_loading(model, model_config, torch.device("cpu"))


@pytest.mark.parametrize("online", [False, True])
def test_dummy_loader_flow(online):
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    load_config = LoadConfig(load_format="dummy")
    cfg = KbitConfig.from_config({"quant_method": "kbit", "bits": 3, "quantize_lm_head": True,
                                  **({} if online else {"format_version": 1})})  # fmt: skip
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"),
                                            load_config=load_config)):  # fmt: skip
        model = _tiny_model(cfg)
        DummyModelLoader(load_config).load_weights(model, None)
        _finish_loading(model)
    h = torch.randn(4, 64).to(DT)
    for layer, n in ((model.gate_up_proj, 64), (model.down_proj, 64), (model.lm_head, 128)):
        assert layer.qweight.dim() == 1 and not hasattr(layer, "weight")
        w = ref.dequantize_tiled(layer.qweight.data, layer.weight_absmax.data, layer.kbit_codebook,
                                 3, n, layer.weight_absmax.numel() * 32 // n, torch.float32)  # fmt: skip
        assert torch.isfinite(w).all() and w.abs().max() > 0
    assert torch.isfinite(model.lm_head.quant_method.apply(model.lm_head, h)).all()


def test_online_loader_flow_with_padded_lm_head():
    """lm_head rows are padded (100 -> 128): never 'fully' loaded, so vLLM quantizes it in
    finalize_layerwise_processing; the other layers are quantized as soon as they load."""
    cfg = KbitConfig.from_config({"quant_method": "kbit", "bits": 4, "quantize_lm_head": True})
    model = _tiny_model(cfg)
    w_gu, w_down, w_head = (checkpoint(n, k, 4, i)[0] for i, (n, k) in
                            enumerate(((64, 64), (64, 32), (100, 64))))  # fmt: skip
    gu, down, head = model.gate_up_proj, model.down_proj, model.lm_head
    gu.weight.weight_loader(gu.weight, w_gu[:32], 0)
    gu.weight.weight_loader(gu.weight, w_gu[32:], 1)
    down.weight.weight_loader(down.weight, w_down)
    down.bias.weight_loader(down.bias, torch.zeros(64, dtype=DT))
    head.weight.weight_loader(head.weight, w_head)
    assert hasattr(gu, "qweight") and hasattr(down, "qweight") and head.weight.is_meta
    _finish_loading(model)
    cb = default_codebook(4)
    assert_tiled_equals(gu, *ref.quantize(w_gu, 4, cb), 4)
    assert_tiled_equals(down, *ref.quantize(w_down, 4, cb), 4)
    padded = torch.cat([w_head, torch.zeros(28, 64, dtype=DT)])
    assert_tiled_equals(head, *ref.quantize(padded, 4, cb), 4)


# ------------------------------------------------------------------ lm_head


def test_quantized_lm_head_through_logits_processor():
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    cfg = KbitConfig.from_config(KbitQuantConfig(bits=4, quantize_lm_head=True).to_dict())
    head = ParallelLMHead(100, 64, params_dtype=DT, quant_config=cfg, prefix="lm_head")
    _, q, a = checkpoint(100, 64, 4)
    head.weight_loader(head.qweight, q)  # vocab rows 100..127 are padding, zero-filled
    head.weight_loader(head.weight_absmax, a)
    head.quant_method.process_weights_after_loading(head)
    h = torch.randn(3, 64).to(DT)
    logits = LogitsProcessor(100)._get_logits(h, head, None)
    want = ref.linear(h, q, a, default_codebook(4), 4)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    full = head.quant_method.apply(head, h)
    assert full.shape == (3, 128) and not full[:, 100:].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unquantized_lm_head_through_logits_processor(dtype):
    """The default (lm_head not quantized): vLLM's weight and loading, kbit::dense_linear."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    cfg = KbitConfig.from_config(KbitQuantConfig(bits=4).to_dict())
    head = ParallelLMHead(100, 64, bias=True, params_dtype=dtype, quant_config=cfg,
                          prefix="lm_head")  # fmt: skip
    assert isinstance(head.quant_method, KbitDenseHeadMethod)
    w = torch.randn(100, 64).to(dtype)
    head.weight_loader(head.weight, w)  # vocab rows 100..127 are padding
    head.weight_loader(head.bias, torch.randn(100).to(dtype))
    head.quant_method.process_weights_after_loading(head)
    h = torch.randn(3, 64).to(dtype)
    logits = LogitsProcessor(100)._get_logits(h, head, head.bias)
    want = (h.float() @ w.float().t()).to(dtype) + head.bias[:100]
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    # dtypes the op does not take go to vLLM's own GEMM
    h32, w32 = h.float(), head.weight.float()
    head.weight.data = w32
    torch.testing.assert_close(head.quant_method.apply(head, h32), h32 @ w32.t())


@pytest.mark.parametrize("online", [False, True])
def test_tied_lm_head_falls_back_to_embeddings(online):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    cfg = KbitConfig.from_config({**KbitQuantConfig(bits=4, quantize_lm_head=True).to_dict(),
                                  "online": online})  # fmt: skip
    model = torch.nn.Module()
    model.embed_tokens = VocabParallelEmbedding(100, 64, params_dtype=DT, quant_config=cfg,
                                                prefix="embed_tokens")  # fmt: skip
    model.lm_head = ParallelLMHead(100, 64, params_dtype=DT, quant_config=cfg, prefix="lm_head")
    assert isinstance(model.lm_head.quant_method, KbitLinearMethod)
    model.lm_head = model.lm_head.tie_weights(model.embed_tokens)
    emb = checkpoint(100, 64, 4)[0]
    model.embed_tokens.weight_loader(model.embed_tokens.weight, emb)
    _finish_loading(model)
    head = model.lm_head
    assert isinstance(head.quant_method, KbitDenseHeadMethod)
    assert head.weight is model.embed_tokens.weight and not hasattr(head, "qweight")
    assert torch.equal(head.weight[:100], emb)


# ------------------------------------------------------------------ torch.compile


def test_compile_dynamic_m_no_recompiles():
    from torch._dynamo.utils import counters
    from vllm.model_executor.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(128, 32, 4, 2, bias=True, params_dtype=DT, quant_config=config(3),
                              prefix="m.self_attn.qkv_proj")  # fmt: skip
    parts = [checkpoint(128, 128, 3, 1), checkpoint(64, 128, 3, 2), checkpoint(64, 128, 3, 3)]
    for sid, (_, q, a) in zip("qkv", parts):
        layer.weight_loader_v2(layer.qweight, q, sid)
        layer.weight_loader_v2(layer.weight_absmax, a, sid)
    layer.bias.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)

    def f(x):
        return layer.quant_method.apply(layer, x, layer.bias)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (2, 3, 7, 16, 33):
        x = torch.randn(m, 128).to(DT)
        torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["aot_autograd"]["total"] == 1  # traced once, for every M
