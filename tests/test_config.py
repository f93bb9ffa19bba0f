# SPDX-License-Identifier: Apache-2.0
"""KbitQuantConfig: parsing ``quantization_config``, defaults, validation errors."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_kbit.format import KbitQuantConfig, default_codebook, round_codebook


def test_defaults():
    cfg = KbitQuantConfig.from_dict({"quant_method": "kbit"})
    assert cfg.bits == 4 and cfg.blocksize == 32 and cfg.format_version == 1
    assert cfg.modules_to_not_convert == [] and cfg.module_bits == {}
    assert cfg.quantize_lm_head is False
    assert list(cfg.codebooks) == [4] and torch.equal(cfg.codebook(4), default_codebook(4))


def test_round_trip_through_json():
    cb3 = torch.linspace(-1, 1, 8)
    cfg = KbitQuantConfig(bits=4, codebooks={3: cb3}, modules_to_not_convert=["lm_head", r"gate$"],
                          module_bits={"self_attn": 5, "mlp": 3}, quantize_lm_head=True)  # fmt: skip
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["quant_method"] == "kbit" and set(d["codebooks"]) == {"3", "4", "5"}
    back = KbitQuantConfig.from_dict(d)
    assert back.to_dict() == d
    assert torch.equal(back.codebook(3), round_codebook(cb3))
    assert torch.equal(back.codebook(5), default_codebook(5))


def test_codebooks_are_rounded_to_bf16_and_tiny_values_refused():
    cb = torch.tensor([-0.7, -0.123456789, 0.0, 0.333333333])
    got = KbitQuantConfig(bits=2, codebooks={2: cb}).codebook(2)
    assert torch.equal(got, cb.to(torch.bfloat16).float()) and not torch.equal(got, cb)
    for k in (2, 3, 4, 5):  # the defaults already are bf16-exact
        d = default_codebook(k)
        assert torch.equal(d, d.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="2\\^-18"):
        KbitQuantConfig(bits=2, codebooks={2: [-0.5, 1e-7, 0.2, 0.5]})


def test_module_bits_first_match_wins_and_skips():
    cfg = KbitQuantConfig.from_dict({"bits": 4, "module_bits": {r"layers\.0\.": 5, "mlp": 3},
                                     "modules_to_not_convert": [r"mlp\.gate$"]})  # fmt: skip
    assert cfg.bits_for("model.layers.0.mlp.down_proj") == 5
    assert cfg.bits_for("model.layers.1.mlp.down_proj") == 3
    assert cfg.bits_for("model.layers.1.self_attn.q_proj") == 4
    assert cfg.is_skipped("model.layers.3.mlp.gate")
    assert not cfg.is_skipped("model.layers.3.mlp.gate_proj")
    assert cfg.all_bits() == [3, 4, 5]


def test_quant_method_is_case_insensitive_and_optional():
    assert KbitQuantConfig.from_dict({"quant_method": "KBIT", "bits": 2}).bits == 2
    assert KbitQuantConfig.from_dict({"bits": 3}).bits == 3


@pytest.mark.parametrize("d,match", [
    ({"bits": 4, "group_size": 32}, r"unknown quantization_config keys \['group_size'\]"),
    ({"quant_method": "gptq"}, "quant_method must be 'kbit'"),
    ({"blocksize": 64}, "blocksize must be 32"),
    ({"format_version": 2}, "format_version 2 is not supported"),
    ({"bits": 6}, "bits must be one of"),
    ({"bits": 1}, "bits must be one of"),
    ({"bits": "4"}, "bits must be one of"),
    ({"bits": True}, "bits must be one of"),
    ({"bits": 4.0}, "bits must be one of"),
    ({"module_bits": {"mlp": 7}}, r"module_bits\['mlp'\] must be one of"),
    ({"module_bits": {"(": 4}}, "module_bits pattern '\\(' is not a valid regex"),
    ({"module_bits": [["mlp", 4]]}, "module_bits must be an object"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
    ({"modules_to_not_convert": ["[a-"]}, "modules_to_not_convert pattern .* is not a valid regex"),
    ({"codebooks": [0.0] * 16}, "codebooks must be an object"),
    ({"codebooks": {"x": [0.0] * 16}}, "codebooks keys must be bit widths"),
    ({"codebooks": {"7": [0.0] * 16}}, "codebooks key must be one of"),
    ({"codebooks": {"4": [0.0] * 8}}, r"codebooks\[4\] for bits=4 must have shape \(16,\)"),
    ({"codebooks": {"2": [-1.0, 0.5, 0.0, 1.0]}}, r"codebooks\[2\] must be sorted"),
    ({"codebooks": {"2": [-1.5, 0.0, 0.5, 1.0]}}, r"codebooks\[2\] values must lie in \[-1, 1\]"),
    ({"codebooks": {"2": [-1.0, 0.0, float("nan"), 1.0]}}, "non-finite"),
    ({"codebooks": {"2": [True, True, True, True]}}, "must hold floats"),
    ({"quantize_lm_head": "yes"}, "quantize_lm_head must be true or false"),
])  # fmt: skip
def test_errors_name_the_problem(d, match):
    with pytest.raises(ValueError, match=match):
        KbitQuantConfig.from_dict(d)


def test_not_a_mapping():
    with pytest.raises(ValueError, match="must be a JSON object"):
        KbitQuantConfig.from_dict([("bits", 4)])  # type: ignore[arg-type]


def test_direct_construction_validates_too():
    with pytest.raises(ValueError, match="bits"):
        KbitQuantConfig(bits=8)
    with pytest.raises(ValueError, match="regex"):
        KbitQuantConfig(modules_to_not_convert=["("])


@pytest.mark.parametrize("values", [["a"] * 16, None])
def test_non_numeric_codebook_names_the_key(values):
    with pytest.raises(ValueError, match=r"codebooks\[4\]"):
        KbitQuantConfig.from_dict({"codebooks": {"4": values}})


def test_non_string_skip_pattern_is_refused():
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        KbitQuantConfig.from_dict({"modules_to_not_convert": [1]})
