# SPDX-License-Identifier: Apache-2.0
"""KbitConfig: parsing, online / pre-quantized rule, registry, pickling, and the
get_quant_method rules on vLLM's real layer classes (CPU, world size 1)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

pytest.importorskip("vllm")

import vllm_kbit  # noqa: E402
from vllm_cpu_env import vllm_cpu_env  # noqa: E402
from vllm_kbit.format import KbitQuantConfig  # noqa: E402

vllm_kbit.register()

from vllm_kbit.config import KbitConfig  # noqa: E402
from vllm_kbit.linear import KbitDenseHeadMethod, KbitLinearMethod  # noqa: E402

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


vllm_env = pytest.fixture(scope="module")(vllm_cpu_env)


def prequantized(**kw) -> KbitConfig:
    cfg = KbitConfig.from_config(KbitQuantConfig(**kw).to_dict())
    cfg.packed_modules_mapping = dict(FUSED)
    return cfg


def online(**kw) -> KbitConfig:
    cfg = KbitConfig.from_config({"quant_method": "kbit", **kw})
    cfg.packed_modules_mapping = dict(FUSED)
    return cfg


# ------------------------------------------------------------------ parsing, registry


def test_registry_and_import_keeps_cuda_uninitialised():
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    assert "kbit" in QUANTIZATION_METHODS
    assert get_quantization_config("kbit") is KbitConfig
    vllm_kbit.register()  # idempotent
    assert get_quantization_config("kbit") is KbitConfig
    assert not torch.cuda.is_initialized()


def test_kbit_logs_reach_vllms_log():
    """register() gives the vllm_kbit loggers vLLM's handlers (vLLM configures only "vllm")."""
    import logging

    vllm_handlers = logging.getLogger("vllm").handlers
    if not vllm_handlers:
        pytest.skip("vLLM's logging is not configured here (VLLM_CONFIGURE_LOGGING=0)")
    vllm_kbit.register()
    kbit = logging.getLogger("vllm_kbit")
    assert kbit.handlers == vllm_handlers and not kbit.propagate
    assert logging.getLogger("vllm_kbit.fusion").getEffectiveLevel() == logging.getLogger("vllm").level


def test_defaults_are_online_k4():
    cfg = KbitConfig()
    assert cfg.online and cfg.quant.bits == 4
    assert cfg.get_name() == "kbit"
    assert cfg.get_supported_act_dtypes() == [torch.bfloat16, torch.float16]
    assert KbitConfig.get_min_capability() == 80
    assert KbitConfig.get_config_filenames() == []
    for attr in ("weight_block_size", "use_deep_gemm", "has_blocked_weights"):
        assert not hasattr(cfg, attr)  # vLLM probes these names


@pytest.mark.parametrize(
    "d, is_online, bits",
    [
        ({"quant_method": "kbit", "bits": 3}, True, 3),  # --hf-overrides for online mode
        (KbitQuantConfig(bits=5).to_dict(), False, 5),  # written by the converter
        ({"quant_method": "kbit", "format_version": 1}, False, 4),
        ({"quant_method": "kbit", "bits": 2, "online": False}, False, 2),
        ({**KbitQuantConfig(bits=3).to_dict(), "online": True}, True, 3),
    ],
)
def test_from_config_mode_rule(d, is_online, bits):
    cfg = KbitConfig.from_config(d)
    assert cfg.online is is_online
    assert cfg.online_explicit is ("online" in d)
    assert cfg.quant.bits == bits


def test_from_config_keeps_schema():
    d = {"quant_method": "KBIT", "bits": 3, "module_bits": {"self_attn": 5},
         "modules_to_not_convert": ["lm_head"], "quantize_lm_head": True,
         "codebooks": {"3": [-1, -0.5, -0.25, 0, 0.1, 0.25, 0.5, 1]}}  # fmt: skip
    q = KbitConfig.from_config(d).quant
    assert q.bits_for("model.layers.0.self_attn.q_proj") == 5
    assert q.bits_for("model.layers.0.mlp.up_proj") == 3
    assert q.is_skipped("lm_head") and q.quantize_lm_head
    assert q.codebook(3)[1].item() == -0.5
    assert sorted(q.codebooks) == [3, 5]


@pytest.mark.parametrize(
    "d, match",
    [
        ({"quant_method": "kbit", "bits": 6}, "bits"),
        ({"quant_method": "kbit", "blocksize": 64}, "blocksize"),
        ({"quant_method": "kbit", "format_version": 2}, "format_version"),
        ({"quant_method": "kbit", "group_size": 32}, "unknown"),
        ({"quant_method": "gptq"}, "quant_method"),
        ({"quant_method": "kbit", "modules_to_not_convert": ["("]}, "modules_to_not_convert"),
        ({"quant_method": "kbit", "module_bits": {"mlp": 7}}, "module_bits"),
        ({"quant_method": "kbit", "codebooks": {"2": [0.5, 0.1, 0.2, 0.3]}}, "sorted"),
        ({"quant_method": "kbit", "online": "yes"}, "online"),
        (["kbit"], "JSON object"),
    ],
)
def test_from_config_errors(d, match):
    with pytest.raises(ValueError, match=match):
        KbitConfig.from_config(d)


def test_override_quantization_method():
    assert KbitConfig.override_quantization_method({"quant_method": "kbit"}, None) == "kbit"
    assert KbitConfig.override_quantization_method({"quant_method": "KBIT"}, "kbit") == "kbit"
    assert KbitConfig.override_quantization_method({"quant_method": "gptq"}, None) is None
    assert KbitConfig.override_quantization_method({}, None) is None


def test_pickle_and_deepcopy_roundtrip():
    cfg = prequantized(bits=3, module_bits={"mlp": 2}, modules_to_not_convert=["lm_head"])
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert type(clone) is KbitConfig
        assert (clone.online, clone.quant.bits, clone.quant.module_bits) == (False, 3, {"mlp": 2})
        assert clone.packed_modules_mapping == FUSED
        assert torch.equal(clone.quant.codebook(2), cfg.quant.codebook(2))


def test_maybe_update_config_reads_local_checkpoint(tmp_path, caplog):
    from safetensors.torch import save_file

    kbit_dir, bf16_dir = tmp_path / "kbit", tmp_path / "bf16"
    kbit_dir.mkdir()
    bf16_dir.mkdir()
    save_file({"m.qweight": torch.zeros(2, 4, dtype=torch.int32),
               "m.weight_absmax": torch.zeros(2, 1, dtype=torch.uint8)},
              str(kbit_dir / "model.safetensors"))  # fmt: skip
    save_file({"m.weight": torch.zeros(2, 32)}, str(bf16_dir / "model.safetensors"))

    cfg = online(bits=3)  # no format_version: guessed online, but the checkpoint is kbit
    cfg.maybe_update_config(str(kbit_dir))
    assert not cfg.online
    cfg = prequantized()  # format_version, but a bf16 checkpoint: quantize online
    cfg.maybe_update_config(str(bf16_dir))
    assert cfg.online
    cfg = prequantized()
    cfg.maybe_update_config(str(kbit_dir))  # agrees: unchanged
    cfg.maybe_update_config("some-org/some-model")  # hub id: no lookup, unchanged
    assert not cfg.online
    with pytest.raises(ValueError, match="online.*has kbit tensors"):
        online(online=True).maybe_update_config(str(kbit_dir))
    with pytest.raises(ValueError, match="without a quantization_config"):
        KbitConfig().maybe_update_config(str(kbit_dir))  # --quantization kbit, no config
    with pytest.raises(ValueError, match="pre-quantized.*has no kbit tensors"):
        online(online=False).maybe_update_config(str(bf16_dir))


def test_apply_vllm_mapper_renames_literal_names_only():
    from vllm.model_executor.models.utils import WeightsMapper

    cfg = online(modules_to_not_convert=["lm_head", r"model\.layers\.0\.mlp\.gate$", r"mlp\.gate$",
                                         r"^model\.layers\.1\.", r"layers\.[0-9]+\.mlp"],
                 module_bits={r"model\.layers\.2\.self_attn": 5})  # fmt: skip
    cfg.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."}))
    assert cfg.quant.modules_to_not_convert == [
        "lm_head", r"language_model\.model\.layers\.0\.mlp\.gate$", r"mlp\.gate$",
        r"^language_model\.model\.layers\.1\.", r"layers\.[0-9]+\.mlp"]  # fmt: skip
    assert cfg.quant.module_bits == {r"language_model\.model\.layers\.2\.self_attn": 5}
    assert cfg.quant.is_skipped("language_model.model.layers.0.mlp.gate")


# ------------------------------------------------------------------ get_quant_method


def _qkv(cfg, prefix="model.layers.0.self_attn.qkv_proj", hidden=128):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    return QKVParallelLinear(hidden, 32, 4, 2, bias=False, params_dtype=torch.bfloat16,
                             quant_config=cfg, prefix=prefix)  # fmt: skip


def _gate_up(cfg, prefix="model.layers.0.mlp.gate_up_proj", k=128):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    return MergedColumnParallelLinear(k, [64, 64], bias=False, params_dtype=torch.bfloat16,
                                      quant_config=cfg, prefix=prefix)  # fmt: skip


def _row(cfg, k=128, n=64, prefix="model.layers.0.mlp.down_proj"):
    from vllm.model_executor.layers.linear import RowParallelLinear

    return RowParallelLinear(k, n, bias=False, params_dtype=torch.bfloat16, quant_config=cfg,
                             prefix=prefix)  # fmt: skip


def test_quant_method_per_layer_type(vllm_env):
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        ReplicatedLinear,
        UnquantizedLinearMethod,
    )

    cfg = prequantized(bits=3, module_bits={"self_attn": 5})
    qkv, gate_up, down = _qkv(cfg), _gate_up(cfg), _row(cfg)
    col = ColumnParallelLinear(64, 96, bias=False, params_dtype=torch.bfloat16, quant_config=cfg,
                               prefix="model.layers.0.self_attn.o_proj")  # fmt: skip
    rep = ReplicatedLinear(64, 32, bias=False, params_dtype=torch.bfloat16, quant_config=cfg,
                           prefix="model.layers.0.mlp.shared_expert_gate")  # fmt: skip
    bits = {l.prefix: l.quant_method.bits for l in (qkv, gate_up, down, col, rep)}
    assert all(isinstance(l.quant_method, KbitLinearMethod) for l in (qkv, gate_up, down, col, rep))
    assert bits == {qkv.prefix: 5, gate_up.prefix: 3, down.prefix: 3, col.prefix: 5, rep.prefix: 3}
    assert not qkv.quant_method.online and KbitConfig().get_quant_method(rep, rep.prefix).online

    skip = prequantized(modules_to_not_convert=[r"\.(q|k|v)_proj$", "down_proj"])
    assert isinstance(_qkv(skip).quant_method, UnquantizedLinearMethod)
    assert isinstance(_row(skip).quant_method, UnquantizedLinearMethod)
    assert isinstance(_gate_up(skip).quant_method, KbitLinearMethod)


def test_fused_layers_must_agree(vllm_env):
    with pytest.raises(ValueError, match=r"qkv_proj.*k_proj: skipped"):
        _qkv(prequantized(modules_to_not_convert=["k_proj"]))
    with pytest.raises(ValueError, match=r"gate_up_proj.*gate_proj': 2.*up_proj': 4"):
        _gate_up(prequantized(module_bits={"gate_proj": 2}))
    assert _gate_up(prequantized(module_bits={r"mlp\.(gate|up)_proj": 2})).quant_method.bits == 2


def test_k_not_multiple_of_32(vllm_env, caplog):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = _row(online(), k=80)  # online: stays bf16, with a log line
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert layer.weight.shape == (64, 80)
    with pytest.raises(ValueError, match="in_features=80 is not a multiple of 32.*--skip"):
        _row(prequantized(), k=80)


def test_lm_head_and_embeddings(vllm_env):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    def head(cfg, dim=64):
        return ParallelLMHead(100, dim, params_dtype=torch.bfloat16, quant_config=cfg,
                              prefix="lm_head")  # fmt: skip

    assert isinstance(head(prequantized()).quant_method, KbitDenseHeadMethod)
    quantized = head(prequantized(quantize_lm_head=True, module_bits={"lm_head": 5}))
    assert isinstance(quantized.quant_method, KbitLinearMethod) and quantized.quant_method.bits == 5
    assert quantized.qweight.shape == (128, 2 * 5)  # vocab padded to 128 rows
    cfg = prequantized(quantize_lm_head=True, modules_to_not_convert=["lm_head"])
    assert isinstance(head(cfg).quant_method, KbitDenseHeadMethod)
    assert isinstance(head(online(quantize_lm_head=True), dim=48).quant_method,
                      KbitDenseHeadMethod)  # fmt: skip
    emb = VocabParallelEmbedding(100, 64, params_dtype=torch.bfloat16, quant_config=prequantized(),
                                 prefix="model.embed_tokens")  # fmt: skip
    assert type(emb.quant_method) is UnquantizedEmbeddingMethod

    # MoE layers (RoutedExperts): tests/test_vllm_moe.py
