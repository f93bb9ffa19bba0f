# SPDX-License-Identifier: Apache-2.0
"""The checkpoint converter end to end on tiny checkpoints made with ``transformers``
(Llama and Qwen3-MoE) and on hand-made safetensors files (malformed inputs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_kbit import reference as ref
from vllm_kbit.codebook import sqnr
from vllm_kbit.format import KbitQuantConfig
from vllm_kbit.quantize import format_summary, main, parse_size

transformers = pytest.importorskip("transformers")

MIN_DB = {2: 8.5, 3: 14.5, 4: 20.5, 5: 26.0}  # random-init weights are ~Gaussian per block
TOKENIZER_FILES = {"tokenizer.json": "{}", "tokenizer_config.json": '{"x": 1}',
                   "special_tokens_map.json": "{}", "chat_template.jinja": "{{ messages }}"}  # fmt: skip
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------- helpers


def _llama(path: Path, intermediate: int = 128, **save_kw) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=intermediate,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, **save_kw)
    for name, text in TOKENIZER_FILES.items():
        (path / name).write_text(text)
    return path


def _qwen3_moe(path: Path, moe_intermediate: int = 96) -> transformers.PreTrainedModel:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(path)
    return model


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        part = load_file(f)
        assert not set(part) & set(out)
        out.update(part)
    return out


def _qcfg(out: Path) -> KbitQuantConfig:
    d = json.loads((out / "config.json").read_text())["quantization_config"]
    cfg = KbitQuantConfig.from_dict(d)
    assert cfg.to_dict() == d  # round trip
    return cfg


def _bits(dst: dict[str, torch.Tensor], module: str) -> int | None:
    """Bits of a converted module (from its tensor shapes), None if unquantized."""
    if module + ".qweight" not in dst:
        assert module + ".weight" in dst, module
        return None
    q, a = dst[module + ".qweight"], dst[module + ".weight_absmax"]
    assert q.dtype == torch.int32 and a.dtype == torch.uint8 and q.shape[0] == a.shape[0]
    assert module + ".weight" not in dst
    return q.shape[1] // a.shape[1]


def _check_converted(src_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every quantized tensor is exactly the reference quantization of the original (so it
    dequantizes within the expected error); everything else is byte-identical."""
    src, dst, cfg = _load_dir(src_dir), _load_dir(out), _qcfg(out)
    expect_names = set()
    for name, t in src.items():
        module = name.removesuffix(".weight")
        bits = _bits(dst, module) if name.endswith(".weight") else None
        if bits is None:
            assert dst[name].dtype == t.dtype and torch.equal(dst[name], t), name
            expect_names.add(name)
            if name.endswith(".weight") and t.dim() == 2:
                assert cfg.is_skipped(module), module
            continue
        assert not cfg.is_skipped(module), module
        q, a = ref.quantize(t, bits, cfg.codebook(bits))
        assert torch.equal(dst[module + ".qweight"], q) and torch.equal(
            dst[module + ".weight_absmax"], a
        )
        deq = ref.dequantize(q, a, cfg.codebook(bits), bits, torch.float32)
        assert sqnr(t, deq) > MIN_DB[bits], module
        expect_names |= {module + ".qweight", module + ".weight_absmax"}
    assert set(dst) == expect_names
    return dst


def _run(capsys, *args: str | Path) -> tuple[int, str, str]:
    rc = main([str(a) for a in args] + ["--no-progress"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _error(capsys, *args: str | Path) -> str:
    rc, _, err = _run(capsys, *args)
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "\n" not in last
    return last


def _tiny(
    path: Path, tensors: dict[str, torch.Tensor] | None = None, config: object = None
) -> Path:
    """A hand-made one-layer Llama-like checkpoint (no transformers)."""
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(128, 64, generator=g).bfloat16(),
         "model.layers.0.input_layernorm.weight": torch.ones(64).bfloat16(),
         "model.norm.weight": torch.ones(64).bfloat16()}  # fmt: skip
    for leaf, shape in {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64),
                        "o_proj": (64, 64)}.items():  # fmt: skip
        t[f"model.layers.0.self_attn.{leaf}.weight"] = (
            torch.randn(shape, generator=g) * 0.02
        ).bfloat16()
    t.update(tensors or {})
    t = {k: v for k, v in t.items() if v is not None}
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"model_type": "llama", "hidden_size": 64} if config is None else config
    (path / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return path


# ------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    """The same Qwen3-MoE model as save_pretrained writes it (per-expert 2-D tensors) and
    with fused 3-D expert tensors (transformers' in-memory layout, and transposed)."""
    dirs = {k: tmp_path_factory.mktemp(k) for k in ("per_expert", "fused", "fused_t")}
    model = _qwen3_moe(dirs["per_expert"])
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 192, 64)  # [E, 2I, H]
    assert sd["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 96)  # [E, H, I]
    sd_t = {k: (v.transpose(1, 2).contiguous() if v.dim() == 3 else v) for k, v in sd.items()}
    for key, tensors in (("fused", sd), ("fused_t", sd_t)):
        save_file(tensors, str(dirs[key] / "model.safetensors"), metadata={"format": "pt"})
        (dirs[key] / "config.json").write_text((dirs["per_expert"] / "config.json").read_text())
    return dirs


# ---------------------------------------------------------------------- end to end


def test_llama_end_to_end(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, _ = _run(capsys, "--model", llama_dir, "--out", out, "--bits", "4")
    assert rc == 0
    names = {p.name for p in out.iterdir()}
    assert names == {"model.safetensors", "config.json", "generation_config.json",
                     "kbit_quantize_report.json", *TOKENIZER_FILES}  # fmt: skip
    for f in [*TOKENIZER_FILES, "generation_config.json"]:
        assert (out / f).read_bytes() == (llama_dir / f).read_bytes()
    dst = _check_converted(llama_dir, out)
    for layer in range(2):
        for leaf in ATTN + MLP:
            part = "self_attn" if leaf in ATTN else "mlp"
            assert _bits(dst, f"model.layers.{layer}.{part}.{leaf}") == 4
    for m in ("model.embed_tokens", "lm_head"):
        assert _bits(dst, m) is None
    src_cfg = json.loads((llama_dir / "config.json").read_text())
    out_cfg = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in out_cfg.items() if k != "quantization_config"} == src_cfg
    qc = out_cfg["quantization_config"]
    assert qc["bits"] == 4 and qc["quant_method"] == "kbit" and qc["quantize_lm_head"] is False
    assert sorted(qc["modules_to_not_convert"]) == ["lm_head$", r"model\.embed_tokens$"]
    report = json.loads((out / "kbit_quantize_report.json").read_text())
    assert len(report["tensors"]) == 14 and report["totals"]["quantized_tensors"] == 14
    assert all(r["bits_per_weight"] == 4.25 and r["sqnr_db"] > MIN_DB[4] for r in report["tensors"])
    want_device = "cuda" if torch.cuda.is_available() else "cpu"  # --device auto
    assert 0 < report["totals"]["ratio"] < 1 and report["totals"]["device"] == want_device
    assert "SQNR dB" in stdout and "quantized 14 tensors" in stdout


def test_qwen3_moe_end_to_end(moe_dirs, tmp_path, capsys):
    src = moe_dirs["per_expert"]
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in load_file(src / "model.safetensors")
    out = tmp_path / "out"
    rc, _, _ = _run(capsys, "--model", src, "--out", out, "--bits", "3")
    assert rc == 0
    dst = _check_converted(src, out)
    for layer in range(2):
        for e in range(4):
            for leaf in MLP:
                assert _bits(dst, f"model.layers.{layer}.mlp.experts.{e}.{leaf}") == 3
        assert _bits(dst, f"model.layers.{layer}.mlp.gate") is None  # router
        assert dst[f"model.layers.{layer}.mlp.gate.weight"].dtype == torch.float16
    assert r"model\.layers\.1\.mlp\.gate$" in _qcfg(out).modules_to_not_convert


@pytest.mark.parametrize("layout", ["fused", "fused_t"])
def test_fused_expert_tensors_are_split_per_expert(moe_dirs, layout, tmp_path, capsys):
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    assert _run(capsys, "--model", moe_dirs["per_expert"], "--out", ref_out, "--bits", "4")[0] == 0
    assert _run(capsys, "--model", moe_dirs[layout], "--out", out, "--bits", "4")[0] == 0
    a, b = _load_dir(ref_out), _load_dir(out)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert _qcfg(out).to_dict() == _qcfg(ref_out).to_dict()


def test_sharded_input_and_output(tmp_path, capsys):
    src = _llama(tmp_path / "src", max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").exists()
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    assert _run(capsys, "--model", src, "--out", single)[0] == 0
    assert _run(capsys, "--model", src, "--out", sharded, "--max-shard-size", "20KB")[0] == 0
    assert not (single / "model.safetensors.index.json").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files)
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    tensors = {}
    for f in files:
        part = load_file(sharded / f)
        assert all(index["weight_map"][k] == f for k in part)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 20_000 or len(part) == 1
        tensors.update(part)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    ref_tensors = load_file(single / "model.safetensors")
    assert sorted(ref_tensors) == sorted(tensors)
    assert all(torch.equal(ref_tensors[k], tensors[k]) for k in tensors)
    _check_converted(src, sharded)


# --------------------------------------------------------------- selection and bits


def test_odd_dimension_is_left_unquantized_with_a_warning(tmp_path, capsys):
    src = _llama(tmp_path / "src", intermediate=80)  # down_proj in_features 80
    out = tmp_path / "out"
    rc, _, err = _run(capsys, "--model", src, "--out", out)
    assert rc == 0
    warning = next(line for line in err.splitlines() if "not a multiple of 32" in line)
    assert "model.layers.0.mlp.down_proj.weight [64, 80]" in warning
    assert "model.layers.1.mlp.down_proj.weight" in warning
    dst = _check_converted(src, out)
    assert _bits(dst, "model.layers.0.mlp.down_proj") is None
    assert _bits(dst, "model.layers.0.mlp.gate_proj") == 4  # [80, 64]: K = 64 is fine
    assert r"model\.layers\.1\.mlp\.down_proj$" in _qcfg(out).modules_to_not_convert


def test_odd_dimension_takes_its_fused_group_along(tmp_path, capsys):
    g = torch.Generator().manual_seed(1)
    src = _tiny(tmp_path / "src", {"model.layers.0.self_attn.v_proj.weight":
                                   torch.randn(32, 48, generator=g).bfloat16()})  # fmt: skip
    out = tmp_path / "out"
    rc, _, err = _run(capsys, "--model", src, "--out", out)
    assert rc == 0 and "fused by vLLM with model.layers.0.self_attn.v_proj" in err
    dst = _check_converted(src, out)
    assert [_bits(dst, f"model.layers.0.self_attn.{m}") for m in ATTN] == [None, None, None, 4]


def test_odd_moe_dimension_leaves_the_whole_moe_layer_unquantized(tmp_path, capsys):
    src = tmp_path / "src"
    _qwen3_moe(src, moe_intermediate=48)  # down_proj in_features 48
    out = tmp_path / "out"
    rc, _, err = _run(capsys, "--model", src, "--out", out)
    assert rc == 0 and "not a multiple of 32" in err
    dst = _check_converted(src, out)
    for e in range(4):
        for leaf in MLP:
            assert _bits(dst, f"model.layers.0.mlp.experts.{e}.{leaf}") is None
    assert _bits(dst, "model.layers.0.self_attn.q_proj") == 4
    skip = _qcfg(out).modules_to_not_convert
    assert r"model\.layers\.0\.mlp\.experts$" in skip
    assert r"model\.layers\.0\.mlp\.experts\.3\.gate_proj$" in skip


def test_module_bits_and_skip(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, _ = _run(capsys, "--model", llama_dir, "--out", out, "--bits", "3",
                    "--module-bits", r"layers\.0\.self_attn=5", "--module-bits", "self_attn=2",
                    "--module-bits", r"down_proj=4", "--skip", r"layers\.1\.mlp\.")  # fmt: skip
    assert rc == 0
    dst = _check_converted(llama_dir, out)
    assert {_bits(dst, f"model.layers.0.self_attn.{m}") for m in ATTN} == {5}
    assert {_bits(dst, f"model.layers.1.self_attn.{m}") for m in ATTN} == {2}
    assert _bits(dst, "model.layers.0.mlp.down_proj") == 4
    assert (
        _bits(dst, "model.layers.0.mlp.gate_proj") == _bits(dst, "model.layers.0.mlp.up_proj") == 3
    )
    assert {_bits(dst, f"model.layers.1.mlp.{m}") for m in MLP} == {None}
    cfg = _qcfg(out)
    assert cfg.module_bits == {r"layers\.0\.self_attn": 5, "self_attn": 2, "down_proj": 4}
    assert cfg.modules_to_not_convert[0] == r"layers\.1\.mlp\."
    assert not any("layers\\.1\\.mlp\\.down" in p for p in cfg.modules_to_not_convert)  # covered
    assert sorted(cfg.codebooks) == [2, 3, 4, 5]


def test_include_and_lm_head(moe_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, _ = _run(capsys, "--model", moe_dirs["per_expert"], "--out", out,
                    "--include", r"mlp\.gate$", "--quantize-lm-head")  # fmt: skip
    assert rc == 0
    dst = _check_converted(moe_dirs["per_expert"], out)
    assert _bits(dst, "model.layers.0.mlp.gate") == 4 and _bits(dst, "lm_head") == 4
    assert _bits(dst, "model.embed_tokens") is None
    cfg = _qcfg(out)
    assert cfg.quantize_lm_head is True
    assert cfg.modules_to_not_convert == [r"model\.embed_tokens$"]


def test_quantize_lm_head_without_lm_head_warns(tmp_path, capsys):
    src = _tiny(tmp_path / "src")
    rc, _, err = _run(capsys, "--model", src, "--out", tmp_path / "out", "--quantize-lm-head")
    assert rc == 0 and "no lm_head weight" in err
    assert _qcfg(tmp_path / "out").quantize_lm_head is False


@pytest.mark.parametrize("moe,args", [
    (False, ["--module-bits", "q_proj=5"]),
    (False, ["--skip", "up_proj"]),
    (False, ["--module-bits", "k_proj|v_proj=2"]),
    (True, ["--module-bits", r"experts\.1\.=2"]),
    (True, ["--module-bits", "down_proj=5"]),  # one kbit::moe call: one k per MoE layer
    (True, ["--skip", r"experts\.0\."]),
    (True, ["--skip", r"layers\.0\.mlp\.experts\.\d+\.down_proj"]),
])  # fmt: skip
def test_splitting_a_fused_group_is_an_error(moe, args, llama_dir, moe_dirs, tmp_path, capsys):
    src = moe_dirs["per_expert"] if moe else llama_dir
    out = tmp_path / "out"
    msg = _error(capsys, "--model", src, "--out", out, *args)
    assert "vLLM fuses them into one layer" in msg
    assert not out.exists()


# ------------------------------------------------------------------ malformed input


def _bad_index(d: Path, weight_map: object) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _setup(kind: str, d: Path) -> list[str]:
    """Make a broken checkpoint in ``d``; return extra CLI arguments."""
    g = torch.Generator().manual_seed(0)
    q = "model.layers.0.self_attn.q_proj.weight"
    if kind == "missing_dir":
        return []
    if kind == "no_safetensors":
        d.mkdir()
        (d / "config.json").write_text("{}")
    elif kind == "bin_only":
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "pytorch_model.bin").write_bytes(b"x")
    elif kind in ("garbage", "truncated"):
        _tiny(d)
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(
            b"not a safetensors file" if kind == "garbage" else data[:-64]
        )
    elif kind == "index_missing_file":
        _tiny(d)
        _bad_index(
            d, {"model.norm.weight": "model.safetensors", "lm_head.weight": "model-2.safetensors"}
        )
    elif kind == "index_missing_tensor":
        _tiny(d)
        _bad_index(
            d, {"model.norm.weight": "model.safetensors", "lm_head.weight": "model.safetensors"}
        )
    elif kind == "index_bad":
        _tiny(d)
        (d / "model.safetensors.index.json").write_text("[1, 2")
    elif kind == "no_config":
        _tiny(d)
        (d / "config.json").unlink()
    elif kind == "config_not_json":
        _tiny(d, config="{'model_type': llama")
    elif kind == "config_not_object":
        _tiny(d, config=[1, 2])
    elif kind == "already_quantized":
        _tiny(d, config={"hidden_size": 64, "quantization_config": {"quant_method": "gptq"}})
    elif kind == "int_weight":
        _tiny(d, {q: torch.ones(64, 64, dtype=torch.int8)})
    elif kind == "f64_weight":
        _tiny(d, {q: torch.zeros(64, 64, dtype=torch.float64)})
    elif kind == "include_int":
        _tiny(d, {"model.extra.table.weight": torch.ones(4, 64, dtype=torch.int32)})
        return ["--include", "table"]
    elif kind == "weight_1d":
        _tiny(d, {q: torch.zeros(64).bfloat16()})
    elif kind == "fused_bad_shape":
        _tiny(d, {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 50, 40).bfloat16()})
    elif kind in ("nan", "too_big"):
        w = torch.randn(64, 64, generator=g).bfloat16()
        w[5, 40] = float("nan") if kind == "nan" else 100.0
        _tiny(d, {q: w})
    elif kind == "out_is_model":
        _tiny(d)
        return ["--out", str(d)]
    elif kind == "out_not_empty":
        _tiny(d)
        (d.parent / "out").mkdir()
        (d.parent / "out" / "x.txt").write_text("x")
    else:
        _tiny(d)
        return {"bad_bits": ["--bits", "6"], "bad_regex": ["--skip", "("],
                "bad_include_regex": ["--include", "[a-"], "bad_module_bits": ["--module-bits", "mlp"],
                "bad_module_bits_k": ["--module-bits", "mlp=9"],
                "bad_shard_size": ["--max-shard-size", "lots"]}[kind]  # fmt: skip
    return []


@pytest.mark.parametrize("kind,match", [
    ("missing_dir", "is not a directory"),
    ("no_safetensors", r"no \*\.safetensors files"),
    ("bin_only", "pytorch_model.bin: convert to safetensors first"),
    ("garbage", r"model\.safetensors is not a valid safetensors file"),
    ("truncated", r"model\.safetensors is not a valid safetensors file"),
    ("index_missing_file", "references model-2.safetensors, which does not exist"),
    ("index_missing_tensor", r"missing from their files, e\.g\. lm_head\.weight"),
    ("index_bad", "is not a valid index"),
    ("no_config", "no config.json"),
    ("config_not_json", "config.json is not valid JSON"),
    ("config_not_object", "must hold a JSON object"),
    ("already_quantized", "already quantized .*'gptq'"),
    ("int_weight", r"q_proj\.weight has dtype I8"),
    ("f64_weight", r"q_proj\.weight has dtype F64"),
    ("include_int", r"model\.extra\.table\.weight has dtype I32"),
    ("weight_1d", r"q_proj\.weight has shape \[64\], expected a 2-D"),
    ("fused_bad_shape", r"fused expert tensor .*gate_up_proj has shape \(2, 50, 40\)"),
    ("nan", r"q_proj\.weight has non-finite values \(first at row 5, columns 32\.\.63\)"),
    ("too_big", r"q_proj\.weight has 1 block\(s\) with absmax above 31"),
    ("bad_bits", "bits must be one of"),
    ("bad_regex", "--skip '\\(' is not a valid regex"),
    ("bad_include_regex", "--include '\\[a-' is not a valid regex"),
    ("bad_module_bits", "--module-bits expects REGEX=K"),
    ("bad_module_bits_k", "--module-bits 'mlp=9' must be one of"),
    ("bad_shard_size", "bad size 'lots'"),
    ("out_is_model", "--out must differ from --model"),
    ("out_not_empty", r"is not empty \(use --overwrite\)"),
])  # fmt: skip
@pytest.mark.cxx_errors
def test_malformed_input_gives_a_one_line_error(kind, match, tmp_path, capsys):
    d = tmp_path / "model"
    extra = _setup(kind, d)
    args = ["--model", d, "--out", tmp_path / "out", *extra]
    if "--out" in extra:
        args = ["--model", d, *extra]
    msg = _error(capsys, *args)
    assert re.search(match, msg), msg
    if kind != "out_not_empty":
        assert not (tmp_path / "out").exists()  # nothing half-written left behind


def test_overwrite_replaces_stale_shards(tmp_path, capsys):
    src = _tiny(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    (out / "notes.txt").write_text("keep")
    assert _run(capsys, "--model", src, "--out", out, "--overwrite")[0] == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "keep"
    _check_converted(src, out)


def test_module_entry_point(tmp_path):
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "vllm_kbit.quantize", "--model", str(tmp_path / "none"),
                        "--out", str(tmp_path / "out")], check=False, cwd=root, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --model")


# ---------------------------------------------------------------------- small parts


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    assert parse_size("1.5kb") == 1500
    with pytest.raises(ValueError):
        parse_size("5 parsecs")


def test_summary_aggregates_big_models():
    rows = [{"name": f"model.layers.{i}.mlp.experts.{e}.down_proj", "shape": [64, 128], "bits": 4,
             "sqnr_db": 21.0 + (i * 8 + e) / 100, "bits_per_weight": 4.25, "subnormal_blocks": 1}
            for i in range(4) for e in range(16)]  # fmt: skip
    totals = {"quantized_tensors": 64, "quantized_params": 64 * 64 * 128, "original_gb": 2.0,
              "new_gb": 0.6, "ratio": 0.3, "elapsed_s": 1.0, "peak_rss_gb": 1.0, "device": "cpu",
              "unquantized_weights": []}  # fmt: skip
    text = format_summary({"tensors": rows, "totals": totals})
    assert "model.layers.*.mlp.experts.*.down_proj" in text and "worst 10 by SQNR" in text
    assert "model.layers.0.mlp.experts.0.down_proj" in text  # the worst one
    assert len(text.splitlines()) < 20


@pytest.mark.gpu  # skipped without a GPU (conftest)
def test_gpu_conversion_matches_cpu(llama_dir, tmp_path, capsys):
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    assert _run(capsys, "--model", llama_dir, "--out", cpu, "--device", "cpu")[0] == 0
    assert _run(capsys, "--model", llama_dir, "--out", gpu, "--device", "cuda")[0] == 0
    a, b = _load_dir(cpu), _load_dir(gpu)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
