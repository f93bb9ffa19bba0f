# SPDX-License-Identifier: Apache-2.0
"""CPU tests of benchmarks/serving.py (the serving benchmark suite) and of the YAML files in
serving_configs/: command lines parsed by vLLM 0.26's own CLI parser, server-log parsing and
load verification, result classification, resumability, summary / plots from fixture JSON,
the GPTQ dummy-model config, the offline tokenizer with vLLM's random dataset, and whole
sweeps driven through a fake ``vllm`` launcher (no GPU, no vLLM engine)."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import serving as sv
from bench_e2e import LLAMA_8B

CONFIG_DIR = REPO / "serving_configs"
TINY = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)  # fmt: skip


# ------------------------------------------------------------------ vLLM's CLI parser


@pytest.fixture(scope="module")
def vllm_cli():
    """vLLM's `vllm` parser with the serve and bench subcommands, as
    vllm/entrypoints/cli/main.py builds it (CPU platform, as vLLM's main does for bench)."""
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    saved, saved_argv = platforms._current_platform, sys.argv
    platforms._current_platform = CpuPlatform()
    sys.argv = ["vllm", "bench"]  # vLLM adds the bench subparsers only when argv asks for them
    try:
        import vllm.entrypoints.cli.benchmark.main as bench_main
        import vllm.entrypoints.cli.serve as serve_main
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser(description="vLLM CLI")
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        for mod in (serve_main, bench_main):
            for cmd in mod.cmd_init():
                cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
        sys.argv = saved_argv
        yield parser
    finally:
        platforms._current_platform, sys.argv = saved, saved_argv


def _tail(cmd: list[str], s: sv.Settings) -> list[str]:
    head = s.launcher_argv()
    assert cmd[: len(head)] == head
    return cmd[len(head) :]


def settings(**kw) -> sv.Settings:
    return sv.Settings(model_cfg=dict(LLAMA_8B), **kw)


def test_server_commands_parse_with_vllm(vllm_cli, tmp_path: Path) -> None:
    s = settings()
    seen = {}
    for name, m in sv.METHODS.items():
        if m.kind == "dense" and m.dtype != s.dtype:
            continue
        cmd = sv.server_cmd(s, m, tmp_path / "model", 8123)
        assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.cli.main"]
        a = vllm_cli.parse_args(_tail(cmd, s))
        assert a.subparser == "serve" and a.model_tag == str(tmp_path / "model")
        assert a.load_format == "dummy" and a.dtype == "float16" and a.port == 8123
        assert a.enable_prefix_caching is False and a.max_num_seqs == 256
        assert a.max_model_len == 1024 + 256 + 64 and a.gpu_memory_utilization == 0.9
        seen[name] = a
    assert seen["fp16"].quantization is None and seen["fp16"].hf_overrides in (None, {})
    for k in (2, 3, 4, 5):
        a = seen[f"kbit{k}"]
        assert a.quantization == "kbit"
        assert a.hf_overrides == {"quantization_config": {"quant_method": "kbit", "bits": k}}
        assert a.linear_backend == "auto"
    assert seen["gptq_machete"].quantization is None  # from the model dir's config.json
    assert seen["gptq_machete"].linear_backend == "auto"  # vLLM's choice: Machete on sm90
    assert seen["gptq_marlin"].linear_backend == "marlin"


def test_bench_serve_command_parses_with_vllm(vllm_cli, tmp_path: Path) -> None:
    s = settings(input_len=1024, output_len=256)
    cmd = sv.bench_serve_cmd(s, tmp_path / "m", 8123, "kbit4", 64, tmp_path / "raw", "x.json")
    a = vllm_cli.parse_args(_tail(cmd, s))
    assert a.subparser == "bench" and a.bench_type == "serve"
    assert (a.max_concurrency, a.num_prompts) == (64, 256)
    assert (a.random_input_len, a.random_output_len, float(a.random_range_ratio)) == (1024, 256, 0)
    assert a.dataset_name == "random" and a.ignore_eos and a.temperature == 0.0
    assert a.save_result and a.result_dir == str(tmp_path / "raw") and a.result_filename == "x.json"
    assert a.percentile_metrics == "ttft,tpot,itl,e2el" and a.metric_percentiles == "50,90,99"
    assert a.num_warmups == 16 and a.request_rate == float("inf") and a.port == 8123
    assert a.model == a.tokenizer == str(tmp_path / "m")
    assert a.metadata == ["kbit_method=kbit4", "kbit_concurrency=64"]


def test_offline_commands_parse_with_vllm(vllm_cli, tmp_path: Path) -> None:
    s = settings(input_len=512, output_len=64)
    m = sv.METHODS["kbit3"]
    a = vllm_cli.parse_args(_tail(sv.throughput_cmd(s, m, tmp_path, 100, tmp_path / "t.json"), s))
    assert a.bench_type == "throughput" and a.num_prompts == 100 and a.dataset_name == "random"
    assert (a.input_len, a.output_len, a.output_json) == (512, 64, str(tmp_path / "t.json"))
    assert a.quantization == "kbit" and a.hf_overrides["quantization_config"]["bits"] == 3
    a = vllm_cli.parse_args(
        _tail(
            sv.latency_cmd(s, sv.METHODS["gptq_marlin"], tmp_path, 4, 2, 5, tmp_path / "l.json"), s
        )
    )
    assert a.bench_type == "latency" and (a.batch_size, a.num_iters_warmup, a.num_iters) == (
        4,
        2,
        5,
    )
    assert a.linear_backend == "marlin" and a.load_format == "dummy"


# ------------------------------------------------------------------ pure pieces


def test_methods_and_prompt_counts() -> None:
    assert sv.parse_methods("all", "float16") == ["fp16", "kbit2", "kbit3", "kbit4", "kbit5",
                                                  "gptq_machete", "gptq_marlin"]  # fmt: skip
    assert sv.parse_methods("all", "bfloat16")[0] == "bf16"
    with pytest.raises(SystemExit):
        sv.parse_methods("bf16", "float16")
    with pytest.raises(SystemExit):
        sv.parse_methods("kbit7", "float16")
    got = [sv.num_prompts_for(c, 4, 8, 512) for c in (1, 2, 4, 8, 64, 128, 256, 1024)]
    assert got == [8, 8, 16, 32, 256, 512, 512, 1024]


def test_expected_memory_matches_h100_measurements() -> None:
    # benchmarks/results/e2e_checks_h100.log: online kbit4 of the dummy 8B loads in 5.41 GiB
    assert sv.expected_gib(sv.METHODS["kbit4"], LLAMA_8B) == pytest.approx(5.41, abs=0.01)
    assert sv.expected_gib(sv.METHODS["fp16"], LLAMA_8B) == pytest.approx(14.96, abs=0.01)
    assert sv.expected_gib(sv.METHODS["gptq_marlin"], LLAMA_8B) == pytest.approx(5.31, abs=0.01)
    assert sv.expected_gib(sv.METHODS["kbit2"], LLAMA_8B) < sv.expected_gib(
        sv.METHODS["kbit5"], LLAMA_8B
    )
    assert sv.expected_gib(sv.METHODS["kbit4"], dict(LLAMA_8B, num_experts=128)) is None


SERVER_LOG = textwrap.dedent("""\
    INFO 11-22 06:00:01 [utils.py:1] non-default args: {'model_tag': '/tmp/m'}
    (EngineCore pid=4242) INFO 11-22 06:00:20 [auto_gptq.py:357] Using MacheteLinearKernel for AutoGPTQLinearMethod
    (EngineCore pid=4242) INFO 11-22 06:00:31 [gpu_model_runner.py:5348] Model loading took 5.33 GiB memory and 11.250000 seconds
    (EngineCore pid=4242) INFO 11-22 06:00:58 [kv_cache_utils.py:1] GPU KV cache size: 412,000 tokens
    (APIServer pid=4200) INFO:     Application startup complete.
""")  # fmt: skip


def test_parse_server_log() -> None:
    info = sv.parse_server_log(SERVER_LOG)
    assert info["load_gib"] == 5.33 and info["load_s"] == 11.25
    assert info["kernels"] == ["MacheteLinearKernel for AutoGPTQLinearMethod"]
    assert info["startup_complete"] and not info["kbit_reference_fallback"]
    # V2 model runner wording, two TP ranks, kbit without its CUDA extension
    v2 = ("(Worker_TP0 pid=1) INFO [model_runner.py:306] Model loading took 2.71 GiB and 9.5 seconds\n"
          "(Worker_TP1 pid=2) INFO [model_runner.py:306] Model loading took 2.70 GiB and 9.6 seconds\n"
          "WARNING [_ops.py:134] vllm_kbit._C is not built (No module named 'vllm_kbit._C'); CUDA")  # fmt: skip
    info = sv.parse_server_log(v2)
    assert info["load_gib"] == 2.71 and info["load_gib_all_ranks"] == [2.71, 2.70]
    assert info["kbit_reference_fallback"] and not info["startup_complete"]
    assert sv.parse_server_log("nothing here")["load_gib"] is None


def test_verify_load() -> None:
    M = sv.METHODS
    ok = sv.verify_load(M["kbit4"], {"load_gib": 5.41}, 14.96)
    assert ok["status"] == "ok"
    assert sv.verify_load(M["fp16"], {"load_gib": 14.96}, None)["status"] == "ok"
    bad = sv.verify_load(M["kbit4"], {"load_gib": 14.95}, 14.96)
    assert bad["status"] == "failed" and "not quantized" in bad["reason"]
    bad = sv.verify_load(M["gptq_marlin"], {"load_gib": 5.3, "kernels": [
        "MacheteLinearKernel for AutoGPTQLinearMethod"]}, 14.96)  # fmt: skip
    assert bad["status"] == "failed" and "MarlinLinearKernel" in bad["reason"]
    good = sv.verify_load(M["gptq_marlin"], {"load_gib": 5.3, "kernels": [
        "MarlinLinearKernel for AutoGPTQLinearMethod"]}, 14.96)  # fmt: skip
    assert good["status"] == "ok"
    ref = sv.verify_load(M["kbit2"], {"load_gib": 3.8, "kbit_reference_fallback": True}, 14.96)
    assert ref["status"] == "failed" and "reference" in ref["reason"]
    assert sv.verify_load(M["kbit2"], {"load_gib": 3.8}, None)["status"] == "unknown"
    assert sv.verify_load(M["kbit2"], {"load_gib": None}, 14.96)["status"] == "failed"


def bench_result(c: int, n: int, tput: float, **kw) -> dict:
    """The keys vLLM 0.26's `bench serve --save-result` writes (benchmarks/serve.py)."""
    r = {"date": "20261122-060000", "backend": "openai", "model_id": "/tmp/m", "num_prompts": n,
         "request_rate": "inf", "max_concurrency": c, "duration": 10.0, "completed": n,
         "failed": 0, "total_input_tokens": n * 1024, "total_output_tokens": n * 256,
         "request_throughput": n / 10.0, "output_throughput": tput,
         "total_token_throughput": tput * 5, "mean_ttft_ms": 50.0, "median_ttft_ms": 45.0,
         "std_ttft_ms": 3.0, "p50_ttft_ms": 45.0, "p99_ttft_ms": 90.0, "mean_tpot_ms": 8.0,
         "median_tpot_ms": 7.5, "p50_tpot_ms": 7.5, "p99_tpot_ms": 9.5, "median_itl_ms": 7.4,
         "p99_itl_ms": 12.0, "median_e2el_ms": 2000.0, "p99_e2el_ms": 2500.0}  # fmt: skip
    r.update(kw)
    return r


def test_classify_serve_result() -> None:
    assert sv.classify_serve_result(bench_result(4, 16, 1000.0), 16, 0, False) == ("ok", None)
    st, why = sv.classify_serve_result(
        bench_result(4, 16, 1.0, completed=14, failed=2), 16, 0, False
    )
    assert st == "failed" and "14/16" in why and "2 failed" in why
    st, why = sv.classify_serve_result(None, 16, None, True, "after 300 s")
    assert st == "failed" and "timed out" in why and "300" in why
    st, why = sv.classify_serve_result(None, 16, 1, False, "RuntimeError: x")
    assert st == "failed" and "rc=1" in why and "RuntimeError" in why
    r = bench_result(4, 16, 1000.0)
    del r["p99_tpot_ms"]
    assert sv.classify_serve_result(r, 16, 0, False)[0] == "failed"
    assert sv.classify_serve_result(bench_result(4, 16, 9.0), 16, 3, False)[0] == "failed"


# ------------------------------------------------------------------ fixture results dir


def run_json(method: str, c: int, status: str = "ok", tput: float = 0.0, load: float = 5.4,
             kernels: list[str] | None = None, session: str = "S1", **kw) -> dict:  # fmt: skip
    n = sv.num_prompts_for(c, 4, 8, 512)
    rec = {"schema": sv.SCHEMA, "kind": "serve", "method": method, "concurrency": c,
           "num_prompts": n, "dtype": "float16", "input_len": 1024, "output_len": 256,
           "session": session, "device": "NVIDIA H100 80GB HBM3", "status": status,
           "reason": None if status == "ok" else "client rc=1: RuntimeError: boom",
           "complete": status == "ok", "elapsed_s": 12.0,
           "server": {"session": session, "load_gib": load, "kernels": kernels or [],
                      "startup_s": 41.0, "status": "up"},
           "result": bench_result(c, n, tput) if status == "ok" else None}  # fmt: skip
    rec.update(kw)
    return rec


def make_fixture_dir(out: Path) -> None:
    sv.write_json(out / "sweep.json", sv.sweep_identity(settings()))
    sv.write_json(out / "sessions" / "S1.json", {
        "schema": sv.SCHEMA, "id": "S1", "date": "2026-11-22T06:00:00+00:00",
        "device": "NVIDIA H100 80GB HBM3", "versions": {"vllm": "0.26.0", "torch": "2.11.0"},
        "command": "python3 benchmarks/serving.py serve --methods fp16,kbit4,gptq_marlin",
        "plan": {"mode": "serve", "methods": ["fp16", "kbit4", "gptq_marlin"],
                 "concurrency": [1, 2, 4]}})  # fmt: skip
    runs = [run_json("fp16", 1, tput=150.0, load=14.96), run_json("fp16", 2, tput=290.0, load=14.96),
            run_json("fp16", 4, tput=560.0, load=14.96),
            run_json("kbit4", 1, tput=300.0, load=5.41), run_json("kbit4", 2, status="failed", load=5.41),
            run_json("gptq_marlin", 1, tput=280.0, load=14.95,
                     kernels=["MarlinLinearKernel for AutoGPTQLinearMethod"])]  # fmt: skip
    for r in runs:
        sv.write_json(sv.serve_path(out, r["method"], r["concurrency"]), r)


def test_summary_from_fixture_json(tmp_path: Path) -> None:
    make_fixture_dir(tmp_path)
    md = sv.summarize(tmp_path)
    rows = {ln.split(" | ")[0].strip("| "): ln for ln in md.splitlines() if ln.startswith("| ")}
    pivot = [ln for ln in md.splitlines() if ln.startswith("| kbit4 |")]
    assert pivot[0] == "| kbit4 | 5.41 | 5.41 | 0.36 | - | 41 | ok |"  # methods table
    assert pivot[1] == "| kbit4 | 300 (2.00x) | FAILED | not run |"  # throughput pivot
    assert "| fp16 | 150 | 290 | 560 |" in md
    gptq = [ln for ln in md.splitlines() if ln.startswith("| gptq_marlin")]
    assert "FAILED-verification" in gptq[0] and "not quantized" in gptq[0]
    assert gptq[1].startswith("| gptq_marlin (FAILED-verification) | 280 (1.87x) |")
    assert "| kbit4 | 2 | 8 | FAILED |" in md and "RuntimeError: boom" in md
    assert "| kbit4 | 1 | 8 | 300 | 2.00 | 45.0 | 90.0 | 7.50 | 9.50 | 12 | ok |" in md
    assert "## Not run yet" in md and "kbit4 c=4" in md and "gptq_marlin c=2" in md
    assert "0.26.0" in rows["S1"] and "--methods fp16,kbit4,gptq_marlin" in rows["S1"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["serve"]["kbit4@2"]["status"] == "failed"
    assert summary["serve"]["fp16@4"]["output_throughput"] == 560.0
    assert summary["loads"]["gptq_marlin"]["verification"]["status"] == "failed"
    plots = importlib.util.find_spec("matplotlib") is not None  # optional: no plots without it
    for png in ("serving_throughput.png", "serving_tpot.png"):
        if plots:
            assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
        else:
            assert not (tmp_path / png).exists()
    assert (tmp_path / "summary.md").read_text() == md


def test_summary_numbers_change_with_the_json(tmp_path: Path) -> None:
    make_fixture_dir(tmp_path)
    p = sv.serve_path(tmp_path, "fp16", 1)
    rec = json.loads(p.read_text())
    rec["result"]["output_throughput"] = 100.0
    sv.write_json(p, rec)
    assert "| kbit4 | 300 (3.00x) | FAILED | not run |" in sv.summarize(tmp_path, write=False)


def test_resumability(tmp_path: Path) -> None:
    make_fixture_dir(tmp_path)
    (sv.serve_path(tmp_path, "fp16", 8)).write_text('{"schema": "kbit-serving/1", "stat')  # torn
    inc = run_json("kbit4", 4, tput=1.0)
    inc["complete"] = False  # e.g. written by an older, interrupted version
    sv.write_json(sv.serve_path(tmp_path, "kbit4", 4), inc)
    todo = sv.pending_serve_runs(tmp_path, ["fp16", "kbit4", "kbit2"], [1, 2, 4, 8])
    assert todo == {"fp16": [8], "kbit4": [2, 4, 8], "kbit2": [1, 2, 4, 8]}
    todo = sv.pending_serve_runs(tmp_path, ["fp16", "kbit4"], [1, 2, 4, 8], retry_failed=False)
    # the failed c=2 and the incomplete c=4 stay as they are; a torn file is no record
    assert todo == {"fp16": [8], "kbit4": [8]}
    assert sv.is_complete(sv.serve_path(tmp_path, "fp16", 1))
    assert not sv.is_complete(sv.serve_path(tmp_path, "kbit4", 2))


def test_check_sweep_refuses_other_settings(tmp_path: Path) -> None:
    sv.check_sweep(tmp_path, settings())
    sv.check_sweep(tmp_path, settings())
    with pytest.raises(SystemExit, match="output_len"):
        sv.check_sweep(tmp_path, settings(output_len=128))


def test_merge_keeps_complete_runs(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_fixture_dir(a)
    sv.write_json(b / "sweep.json", sv.sweep_identity(settings()))
    sv.write_json(sv.serve_path(b, "kbit4", 2), run_json("kbit4", 2, tput=555.0, session="S2"))
    sv.write_json(sv.serve_path(b, "kbit4", 1), run_json("kbit4", 1, status="failed", session="S2"))
    assert sv.merge_dirs(a, [b]) == 1
    assert (
        json.loads(sv.serve_path(a, "kbit4", 2).read_text())["result"]["output_throughput"] == 555
    )
    assert json.loads(sv.serve_path(a, "kbit4", 1).read_text())["status"] == "ok"
    c = tmp_path / "c"
    sv.write_json(c / "sweep.json", dict(sv.sweep_identity(settings()), input_len=2048))
    with pytest.raises(SystemExit):
        sv.merge_dirs(a, [c])


def test_split_plan_fits_commands(tmp_path: Path) -> None:
    s = settings()
    args = sv.argparse.Namespace(est_server_start_s=75.0, est_stop_s=15.0, est_client_s=12.0)
    todo = {m: [1, 2, 4, 8, 16, 32, 64, 128, 256] for m in sv.default_methods("float16")}
    plan = sv.split_plan(s, todo, args, 540.0, 1200.0)
    cmds = [cmd for sess in plan for cmd in sess]
    assert all(sum(t for _, _, t in cmd) <= 540.0 for cmd in cmds)
    got = {(m, c) for cmd in cmds for m, cs, _ in cmd for c in cs}
    assert got == {(m, c) for m, cs in todo.items() for c in cs}
    assert all(sum(t for cmd in sess for _, _, t in cmd) <= 1200.0 for sess in plan)
    # the client start-up is paid once per method (part), or every run with --client-per-run
    once, per_run = sv.method_estimate(s, "fp16", [1, 2, 4], args)[0], sv.method_estimate(
        s, "fp16", [1, 2, 4], sv.argparse.Namespace(**vars(args), client_per_run=True))[0]  # fmt: skip
    assert per_run - once == pytest.approx(2 * 12.0 - 3 * sv.RUN_OVERHEAD_S)
    short = sv.split_plan(s, {"fp16": [1, 2, 4, 8, 16, 32, 64, 128, 256]}, args, 200.0, 1e9)
    assert len([c for sess in short for c in sess]) >= 2  # a long method is split
    for c in (1, 64, 256):  # estimates grow with work and stay positive
        assert 0 < sv.estimate_run_s(sv.METHODS["kbit4"], LLAMA_8B, c, 4 * c, 1024, 256, 1, 12)


# ------------------------------------------------------------------ model dirs / tokenizer


def test_gptq_dummy_config_quantizes_every_linear(tmp_path: Path) -> None:
    """vLLM 0.26's AutoGPTQ path on a dummy model dir (config.json, no safetensors) quantizes
    the Llama linears only because the config lists modules_in_block_to_quantize."""
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.utils.gptq_utils import is_layer_gptq_quantized

    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    prefixes = [f"model.layers.3.{p}" for p in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                "mlp.gate_up_proj", "mlp.down_proj")]  # fmt: skip
    d = tmp_path / "m"
    d.mkdir()
    qc = sv.gptq_config(LLAMA_8B)["quantization_config"]
    (d / "config.json").write_text(json.dumps(sv.gptq_config(LLAMA_8B)))
    assert AutoGPTQConfig.override_quantization_method(qc, None) == "auto_gptq"

    def quantized(qcfg: dict) -> list[bool]:
        cfg = AutoGPTQConfig.from_config(qcfg)
        cfg.maybe_update_config(str(d))
        assert cfg.weight_bits == 4 and cfg.group_size == 128 and not cfg.desc_act
        return [is_layer_gptq_quantized(p, cfg.modules_in_block_to_quantize, packed)
                for p in prefixes]  # fmt: skip

    assert quantized(qc) == [True] * 4
    bare = {k: v for k, v in qc.items() if k != "modules_in_block_to_quantize"}
    assert quantized(bare) == [False] * 4  # the trap the explicit list avoids
    assert "lm_head" not in " ".join(qc["modules_in_block_to_quantize"])


def test_tokenizer_with_vllm_random_dataset(vllm_cli, tmp_path: Path) -> None:
    from vllm.benchmarks.datasets import RandomDataset, get_samples
    from vllm.tokenizers import get_tokenizer

    dirs = sv.build_model_dirs(tmp_path, dict(TINY), {"dense", "kbit", "gptq"})
    assert dirs["kbit"] == dirs["dense"]
    cfg = json.loads((dirs["gptq"] / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "gptq"
    assert "quantization_config" not in json.loads((dirs["dense"] / "config.json").read_text())
    tok = get_tokenizer(str(dirs["gptq"]))
    assert tok.vocab_size == TINY["vocab_size"] and tok.num_special_tokens_to_add() == 0
    reqs = RandomDataset(random_seed=0).sample(tokenizer=tok, num_requests=3, input_len=64,
                                                output_len=8, range_ratio=0.0)  # fmt: skip
    assert [r.prompt_len for r in reqs] == [64] * 3
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == 64 for r in reqs)
    # the exact client command line -> vLLM's own sampling of the random dataset
    st = settings(input_len=128, output_len=16)
    cmd = sv.bench_serve_cmd(st, dirs["dense"], 8123, "fp16", 4, tmp_path, "r.json")
    reqs = get_samples(vllm_cli.parse_args(_tail(cmd, st)), tok)
    assert len(reqs) == st.num_prompts(4) == 16
    assert {(r.prompt_len, r.expected_output_len) for r in reqs} == {(128, 16)}


# ------------------------------------------------------------------ whole sweeps, fake vLLM

FAKE_VLLM = r"""
import hashlib, json, os, runpy, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
a = sys.argv[1:]

class Completions(BaseHTTPRequestHandler):  # just enough OpenAI API for vllm bench serve
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            return self.send_error(404)
        if os.environ.get("FAKE_PROMPTS") and self.headers.get("x-request-id"):
            with open(os.environ["FAKE_PROMPTS"], "a") as f:
                f.write(json.dumps([self.headers["x-request-id"], body["max_tokens"],
                                    hashlib.sha1(body["prompt"].encode()).hexdigest()]) + "\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": " w7"}]}\n\n')
        self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\n'
                         b"data: [DONE]\n\n" % body["max_tokens"])
    def do_GET(self):
        self.send_error(404)
    def log_message(self, *args):
        pass

def opt(name):
    return a[a.index(name) + 1] if name in a else None
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(" ".join(a[:2]) + " " + str(opt("--max-concurrency")) + "\n")
if opt("--quantization") == "kbit" and os.environ.get("KBIT_REQUIRE_CUDA_EXT") != "1":
    sys.exit("kbit started without KBIT_REQUIRE_CUDA_EXT=1")
if a[0] == "serve":
    cfg = json.loads((Path(a[1]) / "config.json").read_text())
    marlin = opt("--linear-backend") == "marlin"
    if cfg.get("quantization_config"):
        gib = 14.9 if marlin and os.environ.get("FAKE_MARLIN_UNQUANTIZED") else 5.31
        print("(EngineCore pid=7) INFO [auto_gptq.py:357] Using %s for AutoGPTQLinearMethod"
              % ("MarlinLinearKernel" if marlin else "MacheteLinearKernel"))
    else:
        gib = 5.41 if opt("--quantization") == "kbit" else 14.96
    print("(EngineCore pid=7) INFO [gpu_model_runner.py:5348] Model loading took %.2f GiB "
          "memory and 3.1 seconds" % gib, flush=True)
    if os.environ.get("FAKE_SERVER_CRASH") == opt("--dtype") + str(gib):
        print("RuntimeError: CUDA out of memory (fake)", flush=True)
        sys.exit(3)
    print("(APIServer pid=6) INFO:     Application startup complete.", flush=True)
    signal.signal(signal.SIGTERM, lambda *x: os._exit(0))
    ThreadingHTTPServer((opt("--host"), int(opt("--port"))), Completions).serve_forever()
elif a[:2] == ["bench", "serve"] and os.environ.get("FAKE_REAL_BENCH"):
    sys.argv = ["vllm"] + a  # vLLM's own `vllm bench serve` against the server above
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
elif a[:2] == ["bench", "serve"]:
    c, n = int(opt("--max-concurrency")), int(opt("--num-prompts"))
    if str(c) in os.environ.get("FAKE_FAIL_C", "").split(","):
        print("Traceback (most recent call last):\nRuntimeError: boom (fake)", flush=True)
        sys.exit(1)
    meth = [x.split("=", 1)[1] for x in a if x.startswith("kbit_method=")][0]
    t = 100.0 * c * (2.0 if meth != "fp16" else 1.0)
    res = {"completed": n, "failed": 0, "num_prompts": n, "max_concurrency": c,
           "output_throughput": t, "median_ttft_ms": 40.0, "p99_ttft_ms": 80.0,
           "median_tpot_ms": 1000.0 / t * c, "p99_tpot_ms": 2000.0 / t * c}
    d = Path(opt("--result-dir"))
    d.mkdir(parents=True, exist_ok=True)
    (d / opt("--result-filename")).write_text(json.dumps(res))
elif a[0] == "bench":  # throughput / latency: an LLM in-process, may hang at exit
    cfg = json.loads((Path(opt("--model")) / "config.json").read_text())
    gib = 5.31 if cfg.get("quantization_config") else (5.41 if opt("--quantization") else 14.96)
    print("INFO Model loading took %.2f GiB memory and 2.0 seconds" % gib, flush=True)
    if a[1] == "throughput":
        t = 2560.0 if gib > 10 else 3000.0
        print("Throughput: 10.00 requests/s, 12800.00 total tokens/s, %.2f output tokens/s" % t)
        res = {"elapsed_time": 1.0, "num_requests": int(opt("--num-prompts")),
               "total_num_tokens": 12800, "requests_per_second": 10.0,
               "tokens_per_second": 12800.0}
    else:
        res = {"avg_latency": 1.5, "latencies": [1.4, 1.5, 1.6],
               "percentiles": {"10": 1.4, "50": 1.5, "99": 1.6}}
    Path(opt("--output-json")).write_text(json.dumps(res))
    sys.stdout.flush()
    if a[1] == "throughput":
        time.sleep(120)  # the engine process keeps the script alive
"""

# sv.BENCH_FN in the bench client (serving.py _client): gets vLLM's parsed Namespace
FAKE_BENCH = r"""
import json, os, time
from pathlib import Path
KEYS = ("seed", "num_prompts", "num_warmups", "max_concurrency", "result_dir", "result_filename",
        "metadata", "random_input_len", "random_output_len", "port", "request_id_prefix")

def main(args):
    c, n = args.max_concurrency, args.num_prompts
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write("bench serve %d\n" % c)
    print("fake bench serve c=%d" % c, flush=True)
    if str(c) in os.environ.get("FAKE_FAIL_C", "").split(","):
        raise RuntimeError("boom (fake)")
    if str(c) in os.environ.get("FAKE_HANG_C", "").split(","):
        time.sleep(600)
    meth = dict(m.split("=", 1) for m in args.metadata)["kbit_method"]
    t = 100.0 * c * (2.0 if meth != "fp16" else 1.0)
    res = {"completed": n, "failed": 0, "num_prompts": n, "max_concurrency": c,
           "output_throughput": t, "median_ttft_ms": 40.0, "p99_ttft_ms": 80.0,
           "median_tpot_ms": 1000.0 / t * c, "p99_tpot_ms": 2000.0 / t * c,
           "pid": os.getpid(), "args": {k: getattr(args, k) for k in KEYS}}
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.result_dir) / args.result_filename).write_text(json.dumps(res))
    return res
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for the bench client
    monkeypatch.setattr(sv, "BENCH_FN", "fake_bench:main")
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.setattr(sv, "preflight", lambda ctx, methods: {
        m: "vllm_kbit._C is not built (test)" for m in methods if m == "kbit2"})  # fmt: skip
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    base = ["--config", str(cfg), "--input-len", "16", "--output-len", "8",
            "--out-dir", str(out), "--work-dir", str(tmp_path / "models"),
            "--launcher", f"{sys.executable} {script}", "--est-server-start-s", "1",
            "--est-client-s", "0.5", "--est-stop-s", "1", "--server-timeout", "30"]  # fmt: skip
    return out, base, calls


def test_fake_sweep_records_failures_and_resumes(fake, monkeypatch, tmp_path: Path) -> None:
    out, base, calls = fake
    monkeypatch.setenv("FAKE_FAIL_C", "2")
    monkeypatch.setenv("FAKE_MARLIN_UNQUANTIZED", "1")
    argv = ["serve", "--methods", "fp16,kbit2,kbit4,gptq_machete,gptq_marlin", "--client-per-run",
            "--concurrency", "1,2", "--pack", str(tmp_path / "pack.tar.gz")] + base  # fmt: skip
    assert sv.main(argv) == 0
    rec = {(m, c): json.loads(sv.serve_path(out, m, c).read_text())
           for m in ("fp16", "kbit2", "kbit4", "gptq_machete", "gptq_marlin") for c in (1, 2)}  # fmt: skip
    assert rec[("fp16", 1)]["status"] == "ok" and rec[("fp16", 1)]["complete"]
    assert rec[("fp16", 1)]["server"]["load_gib"] == 14.96
    assert rec[("fp16", 2)]["status"] == "failed" and "boom" in rec[("fp16", 2)]["reason"]
    assert "not built" in rec[("kbit2", 1)]["reason"]
    assert rec[("kbit4", 1)]["result"]["output_throughput"] == 200.0
    assert rec[("gptq_machete", 1)]["server"]["kernels"] == [
        "MacheteLinearKernel for AutoGPTQLinearMethod"]  # fmt: skip
    assert rec[("gptq_marlin", 1)]["reason"].startswith("FAILED-verification")
    srv_log = out / rec[("kbit4", 1)]["server"]["log"]
    assert "KBIT_REQUIRE_CUDA_EXT=1" in srv_log.read_text().splitlines()[0]
    assert "--quantization kbit" in srv_log.read_text().splitlines()[0]
    md = (out / "summary.md").read_text()
    assert "| kbit4 | 200 (2.00x) | FAILED |" in md
    assert "| kbit2 | FAILED | FAILED |" in md
    assert "gptq_marlin (FAILED-verification)" in md
    n_calls = len(calls.read_text().splitlines())
    assert n_calls == 4 + 6  # kbit2 blocked; marlin stopped after its verification failed
    with tarfile.open(tmp_path / "pack.tar.gz") as tar:
        names = tar.getnames()
    assert "out/summary.md" in names and "out/runs/serve/kbit4/c1.json" in names
    assert any(n.startswith("out/logs/server_kbit4__") for n in names)
    assert not list((out / "servers").glob("*.pgid"))

    # rerun, failures fixed: only the missing / failed runs execute, complete ones are kept
    monkeypatch.delenv("FAKE_FAIL_C")
    monkeypatch.delenv("FAKE_MARLIN_UNQUANTIZED")
    monkeypatch.setattr(sv, "preflight", lambda ctx, methods: {})
    assert sv.main(argv) == 0
    lines = calls.read_text().splitlines()[n_calls:]
    bench_calls = sorted(ln for ln in lines if ln.startswith("bench"))
    # fp16 c=2, kbit2 c=1,2, kbit4 c=2, gptq_machete c=2, gptq_marlin c=1,2
    assert bench_calls == ["bench serve 1"] * 2 + ["bench serve 2"] * 5
    assert len([ln for ln in lines if ln.startswith("serve")]) == 5
    assert (
        json.loads(sv.serve_path(out, "fp16", 1).read_text())["session"]
        == rec[("fp16", 1)]["session"]
    )
    md = (out / "summary.md").read_text()
    assert "FAILED" not in md and "| fp16 | 100 | 200 |" in md
    assert "| kbit4 | 200 (2.00x) | 400 (2.00x) |" in md
    assert len(list((out / "sessions").glob("*.json"))) == 2


def test_fake_server_crash_and_budget(fake, monkeypatch) -> None:
    out, base, calls = fake
    monkeypatch.setenv("FAKE_SERVER_CRASH", "float1614.96")
    assert sv.main(["serve", "--methods", "fp16", "--concurrency", "1,4"] + base) == 0
    for c in (1, 4):
        r = json.loads(sv.serve_path(out, "fp16", c).read_text())
        assert r["status"] == "failed" and "out of memory" in r["reason"]
    srv = json.loads(next((out / "servers").glob("fp16__*.json")).read_text())
    assert srv["status"] == "failed" and "rc=3" in srv["reason"]
    # a budget too small for a server start + one run: nothing starts, nothing is written
    monkeypatch.delenv("FAKE_SERVER_CRASH")
    n = len(calls.read_text().splitlines())
    argv = ["serve", "--methods", "kbit4", "--concurrency", "1", "--time-budget-s", "2"] + base
    assert sv.main(argv) == 0
    assert len(calls.read_text().splitlines()) == n
    assert not sv.serve_path(out, "kbit4", 1).exists()
    assert "kbit4 c=1" in (out / "summary.md").read_text().split("## Not run yet")[1]


def _records(out: Path, method: str, concs: list[int]) -> dict[int, dict]:
    return {c: json.loads(sv.serve_path(out, method, c).read_text()) for c in concs}


def test_bench_client_fails_times_out_and_resumes(fake, monkeypatch, vllm_cli) -> None:
    """One client process (serving.py _client) runs a method's runs through vLLM's parser and
    the (fake) bench function: an exception fails that run only, a hung run is killed at its
    limit and the client restarted for the rest, a rerun does only what is not complete."""
    out, base, calls = fake
    monkeypatch.setattr(sv, "MIN_RUN_LIMIT_S", 4.0)
    monkeypatch.setattr(sv, "RUN_OVERHEAD_S", 0.1)
    monkeypatch.setenv("FAKE_FAIL_C", "2")
    monkeypatch.setenv("FAKE_HANG_C", "4")
    argv = ["serve", "--methods", "fp16", "--concurrency", "1,2,4,8"] + base
    assert sv.main(argv) == 0
    rec = _records(out, "fp16", [1, 2, 4, 8])
    assert [rec[c]["status"] for c in (1, 2, 4, 8)] == ["ok", "failed", "failed", "ok"]
    assert "rc=1" in rec[2]["reason"] and "RuntimeError: boom (fake)" in rec[2]["reason"]
    assert "timed out" in rec[4]["reason"] and rec[4]["result"] is None
    pid1, pid2 = rec[1]["result"]["pid"], rec[8]["result"]["pid"]
    assert pid1 != pid2  # restarted after the hung run was killed
    assert {rec[c]["client_log"] for c in (1, 2, 4)} == {rec[1]["client_log"]}
    assert "client2__" in rec[8]["client_log"] and (out / rec[8]["client_log"]).exists()
    assert [("client_startup_s" in rec[c]) for c in (1, 2, 4, 8)] == [True, False, False, True]
    for c in (1, 2, 4, 8):  # the records of the per-process mode, and each run's own log
        r = rec[c]
        assert r["client"] == "driver" and r["num_prompts"] == sv.num_prompts_for(c, 4, 8, 512)
        assert r["complete"] is (r["status"] == "ok") and r["elapsed_s"] >= 0
        assert r["command"].startswith(f"{sys.executable} ") and " bench serve " in r["command"]
        text = (out / r["log"]).read_text()
        assert text.startswith("# 20") and r["command"] in text.splitlines()[0]
        assert text.count("fake bench serve") == 1 and f"fake bench serve c={c}\n" in text
        assert (sv.DONE_MARK in text) is (c != 4)
    # the client parsed exactly the recorded command (vLLM's CLI parser, seeds per run)
    for c in (1, 8):
        a = vllm_cli.parse_args(sv.shlex.split(rec[c]["command"])[2:])
        seen = rec[c]["result"]["args"]
        for k in seen:
            if k != "request_id_prefix":
                assert seen[k] == getattr(a, k), k
        assert seen["seed"] == c and rec[c]["raw"].endswith(seen["result_filename"])
    prefixes = {rec[c]["result"]["args"]["request_id_prefix"] for c in (1, 8)}
    assert len(prefixes) == 2  # a new default per run, as in a new process
    n = len(calls.read_text().splitlines())

    monkeypatch.delenv("FAKE_FAIL_C")
    monkeypatch.delenv("FAKE_HANG_C")
    assert sv.main(argv) == 0  # resumes: c=2 and c=4 only, in one client
    new = [ln for ln in calls.read_text().splitlines()[n:] if ln.startswith("bench")]
    assert new == ["bench serve 2", "bench serve 4"]
    again = _records(out, "fp16", [1, 2, 4, 8])
    assert all(again[c]["status"] == "ok" for c in (1, 2, 4, 8))
    assert again[2]["result"]["pid"] == again[4]["result"]["pid"]
    assert again[1] == rec[1] and again[8] == rec[8]
    assert "| fp16 | 100 | 200 | 400 | 800 |" in (out / "summary.md").read_text()


def test_bench_client_that_cannot_start(fake, monkeypatch) -> None:
    out, base, calls = fake
    monkeypatch.setattr(sv, "BENCH_FN", "no_such_module:main")
    assert sv.main(["serve", "--methods", "fp16", "--concurrency", "1,2"] + base) == 0
    for r in _records(out, "fp16", [1, 2]).values():
        assert r["status"] == "failed" and "bench client did not start" in r["reason"]
        assert "ModuleNotFoundError" in r["reason"] and (out / r["log"]).exists()
    assert not [ln for ln in calls.read_text().splitlines() if ln.startswith("bench")]


def test_real_bench_serve_in_one_process_matches_per_process(fake, monkeypatch, tmp_path) -> None:
    """vLLM's own bench serve (vllm.benchmarks.serve.main) against a fake OpenAI server: run
    twice in one client process it sends the same prompts as two `vllm bench serve` processes."""
    out, base, _ = fake
    monkeypatch.setattr(sv, "BENCH_FN", "vllm.benchmarks.serve:main")
    prompts = tmp_path / "prompts.jsonl"
    monkeypatch.setenv("FAKE_PROMPTS", str(prompts))
    argv = ["serve", "--methods", "fp16", "--concurrency", "1,2"] + base

    def sent() -> dict[str, list[tuple[int, str]]]:  # request-id prefix (one per run) -> prompts
        runs: dict[str, list[tuple[int, str]]] = {}
        for ln in prompts.read_text().splitlines():
            rid, max_tokens, digest = json.loads(ln)
            runs.setdefault(rid.rsplit("-", 1)[0], []).append((max_tokens, digest))
        prompts.unlink()
        return {k: sorted(v) for k, v in runs.items()}

    assert sv.main(argv) == 0
    one = _records(out, "fp16", [1, 2])
    in_process = sent()
    monkeypatch.setenv("FAKE_REAL_BENCH", "1")  # the fake launcher execs vLLM's CLI
    out2 = tmp_path / "out2"
    argv = [out2.as_posix() if a == out.as_posix() else a for a in argv] + ["--client-per-run"]
    assert sv.main(argv) == 0
    two = _records(out2, "fp16", [1, 2])
    per_process = sent()
    assert len(in_process) == len(per_process) == 2  # a new request-id prefix per run
    assert sorted(in_process.values()) == sorted(per_process.values())
    assert len({tuple(v) for v in in_process.values()}) == 2  # --seed differs per run
    for c in (1, 2):
        assert one[c]["status"] == two[c]["status"] == "ok", (one[c]["reason"], two[c]["reason"])
        assert one[c]["client"] == "driver" and two[c]["client"] == "per-run"
        port_dir_session = r"--port \d+|/out2?/|__[^ ]*\.json"
        assert sv.re.sub(port_dir_session, "", one[c]["command"]) == sv.re.sub(
            port_dir_session, "", two[c]["command"])  # fmt: skip
        r1, r2 = one[c]["result"], two[c]["result"]
        assert r1["completed"] == r2["completed"] == sv.num_prompts_for(c, 4, 8, 512)
        assert r1["total_input_tokens"] == r2["total_input_tokens"] > 0
        assert r1["kbit_method"] == "fp16" and r1["max_concurrency"] == c


def test_dry_run_prints_every_command(fake, capsys) -> None:
    out, base, calls = fake
    assert sv.main(["serve", "--dry-run", "--methods", "fp16,kbit3,gptq_marlin",
                    "--concurrency", "1,8"] + base) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert text.count(" serve /") == 3 and text.count("bench serve") == 6
    assert "setsid" in text and "--linear-backend marlin" in text and "estimated total" in text
    assert '"bits": 3' in text and "suggested split" in text
    assert text.count(" _client fake_bench:main > ") == 3  # one client per method ...
    assert "fake_vllm.py bench serve" not in text  # ... given the per-run arguments
    assert sv.main(["serve", "--dry-run", "--methods", "fp16", "--concurrency", "1,8",
                    "--client-per-run"] + base) == 0  # fmt: skip
    text = capsys.readouterr().out  # ... or the full command of every run
    assert "_client" not in text and text.count("fake_vllm.py bench serve ") == 2
    assert not out.exists() and calls.read_text() == ""


# ------------------------------------------------------------------ serving_configs/*.yaml

EXPECTED_CONFIGS = {
    "llama-3.1-8b-kbit4.yaml": {"model": "meta-llama/Llama-3.1-8B-Instruct", "bits": 4, "tp": 1,
                                "online": True, "overrides": False},
    "llama-3.1-8b-kbit3.yaml": {"model": "meta-llama/Llama-3.1-8B-Instruct", "bits": 3, "tp": 1,
                                "online": True, "overrides": True},
    "llama-3.1-70b-kbit4-tp2.yaml": {"model": "/models/Llama-3.1-70B-Instruct-kbit4", "bits": None,
                                     "tp": 2, "online": None, "overrides": False},
    "qwen3-30b-a3b-kbit4.yaml": {"model": "Qwen/Qwen3-30B-A3B", "bits": 4, "tp": 1,
                                 "online": True, "overrides": True},
}  # fmt: skip


def test_every_config_is_known() -> None:
    assert sorted(p.name for p in CONFIG_DIR.glob("*.y*ml")) == sorted(EXPECTED_CONFIGS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_serving_config_parses_with_vllm(vllm_cli, name: str) -> None:
    from vllm_kbit.config import KbitConfig

    want = EXPECTED_CONFIGS[name]
    path = CONFIG_DIR / name
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 20  # what it is for comes first
    assert "serve --config" in path.read_text()
    args = vllm_cli.parse_args(["serve", "--config", str(path)])
    assert args.subparser == "serve" and args.model == want["model"]
    assert args.quantization == "kbit"
    assert args.tensor_parallel_size == want["tp"]
    assert args.max_model_len == 8192 and args.dtype == "bfloat16"
    hf = args.hf_overrides or {}
    assert bool(hf) == want["overrides"]
    if hf:
        cfg = KbitConfig.from_config(hf["quantization_config"])
    elif want["online"]:
        cfg = KbitConfig()  # what vLLM builds for --quantization kbit without a config
    else:
        cfg = None  # pre-quantized: the checkpoint's config.json decides
    if cfg is not None:
        assert cfg.quant.bits == want["bits"] and cfg.online is want["online"]
    # the command line still wins over the file (vLLM: CLI > config > defaults)
    args = vllm_cli.parse_args(["serve", "--config", str(path), "--max-model-len", "4096"])
    assert args.max_model_len == 4096


def test_fake_offline_mode(fake, monkeypatch) -> None:
    out, base, calls = fake
    monkeypatch.setattr(sv, "EXIT_GRACE_S", 0.3)
    argv = ["offline", "--methods", "fp16,kbit4,gptq_marlin", "--latency-batch", "1,8",
            "--offline-prompts", "64"] + base  # fmt: skip
    assert sv.main(argv) == 0
    tp = json.loads(sv.offline_path(out, "kbit4", "throughput").read_text())
    assert tp["status"] == "ok" and tp["result"]["output_tokens_per_second"] == 3000.0
    assert tp["load"]["load_gib"] == 5.41 and tp["num_prompts"] == 64
    assert tp["command"].startswith("PYTHONUNBUFFERED=1 KBIT_REQUIRE_CUDA_EXT=1 ")
    lat = json.loads(sv.offline_path(out, "fp16", "latency_b8").read_text())
    assert lat["status"] == "ok" and lat["batch_size"] == 8
    gptq = json.loads(sv.offline_path(out, "gptq_marlin", "throughput").read_text())
    assert gptq["status"] == "failed" and "MarlinLinearKernel" in gptq["reason"]  # no kernel line
    md = (out / "summary.md").read_text()
    assert "| kbit4 | 5.41 | 3000 (1.17x) | 1.500 (1.500 / 1.600) | 1.500 (1.500 / 1.600) |" in md
    assert "| gptq_marlin | 5.31 | FAILED |" in md
    n = len(calls.read_text().splitlines())
    assert sv.main(argv) == 0  # resumed: only the failed GPTQ runs again
    assert (
        calls.read_text().splitlines()[n:] == ["bench throughput None"] + ["bench latency None"] * 2
    )


def test_bench_e2e_kbit_methods():
    """bench_e2e's method names map to the quantization_config it passes to vLLM, and the
    config parses (lm_head flag included); a malformed name is refused by name."""
    from bench_e2e import kbit_config

    from vllm_kbit.format import KbitQuantConfig

    assert kbit_config("kbit4") == {"quant_method": "kbit", "bits": 4, "quantize_lm_head": False}
    cfg = kbit_config("kbit2lm")
    assert cfg == {"quant_method": "kbit", "bits": 2, "quantize_lm_head": True}
    parsed = KbitQuantConfig.from_dict(cfg)
    assert parsed.bits == 2 and parsed.quantize_lm_head
    assert kbit_config("kbit4lmpdl") == {"quant_method": "kbit", "bits": 4, "quantize_lm_head": True}
    for bad in ("kbit6", "kbit4x", "kbitlm", "kbit", "kbit4pdllm"):
        with pytest.raises(ValueError, match=bad):
            kbit_config(bad)


def test_bench_e2e_method_env(monkeypatch):
    """Only ``...pdl`` methods run with KBIT_PDL=1; a KBIT_PDL in the caller's environment does
    not leak into the other methods (they would not measure what their name says)."""
    from bench_e2e import method_env

    monkeypatch.setenv("KBIT_PDL", "1")
    assert method_env("kbit4pdl")["KBIT_PDL"] == "1"
    assert method_env("kbit2lmpdl")["KBIT_PDL"] == "1"
    for m in ("fp16", "kbit4", "kbit4lm"):
        assert "KBIT_PDL" not in method_env(m)


def test_bench_e2e_env_variant(monkeypatch):
    """``METHOD+NAME`` runs with the variables of ``--variant NAME:...``; the other methods run
    without any variant's variables, even when the caller's environment has them; an unknown
    variant is refused by name; the config is METHOD's."""
    from bench_e2e import kbit_config, method_env, method_parts

    variants = {"old": {"KBIT_MMA_CLUSTER_SPLITS": "8"}, "sk": {"KBIT_MMA_STREAMK": "1"}}
    monkeypatch.setenv("KBIT_MMA_STREAMK", "0")
    env = method_env("kbit4+old", variants=variants)
    assert env["KBIT_MMA_CLUSTER_SPLITS"] == "8" and "KBIT_MMA_STREAMK" not in env
    assert method_env("kbit4lmpdl+sk", variants=variants)["KBIT_PDL"] == "1"
    for m in ("kbit4", "fp16"):
        env = method_env(m, variants=variants)
        assert "KBIT_MMA_CLUSTER_SPLITS" not in env and "KBIT_MMA_STREAMK" not in env
    assert method_env("kbit4")["KBIT_MMA_STREAMK"] == "0"  # no variants: the caller's setting
    assert method_parts("kbit2lm@base+old") == ("kbit2lm", "base", "old")
    assert kbit_config("kbit2lm@base+old") == kbit_config("kbit2lm")
    with pytest.raises(ValueError, match="no --variant nope"):
        method_env("kbit4+nope", variants=variants)
    # vLLM's own variables (bench_e2e accepts VLLM_* variants), on an unquantized method too
    mp = {"inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    assert method_env("fp16+inproc", variants=mp)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in method_env("fp16", variants=mp)


def test_bench_e2e_ab_variant(monkeypatch, tmp_path):
    """``METHOD@NAME`` runs the worker with .ab/NAME's vllm_kbit first on PYTHONPATH (kept
    entries after it), the config of METHOD; a missing build is refused by name before any run."""
    from bench_e2e import kbit_config, method_env

    (tmp_path / "base" / "vllm_kbit").mkdir(parents=True)
    monkeypatch.setenv("PYTHONPATH", "/opt/vsite")
    env = method_env("kbit4pdl@base", ab_root=tmp_path)
    assert env["PYTHONPATH"] == f"{tmp_path / 'base'}:/opt/vsite" and env["KBIT_PDL"] == "1"
    assert method_env("kbit4", ab_root=tmp_path)["PYTHONPATH"] == "/opt/vsite"
    monkeypatch.delenv("PYTHONPATH")
    assert method_env("bf16@base", ab_root=tmp_path)["PYTHONPATH"] == str(tmp_path / "base")
    assert kbit_config("kbit2lm@base") == kbit_config("kbit2lm")
    with pytest.raises(ValueError, match="no build at .*nope"):
        method_env("kbit4@nope", ab_root=tmp_path)


def test_bench_e2e_weights_gib_column(tmp_path):
    """The weights' GiB from vLLM's loading log line (both model runners' wordings) lands in
    the table, '?' where the line was not seen, so an unquantized lm_head shows up there."""
    from bench_e2e import weights_gib, write_table

    v1 = "(EngineCore pid=7) INFO 11-24 [gpu_model_runner.py:5348] Model loading took 4.92 GiB memory and 3.1 seconds"
    v2 = "(EngineCore pid=7) INFO 11-24 [model_runner.py:306] Model loading took 2.61 GiB and 2.0 seconds"
    assert weights_gib(v1) == 4.92 and weights_gib(v2) == 2.61
    assert weights_gib("Loading weights took 1.0 seconds") is None
    meta = dict(device="GPU", command="c", date="d", torch="t", vllm="v", cuda="c",
                git_commit="0123456789ab", model_desc="m", input_len=128, output_len=128, repeats=5)  # fmt: skip
    rows = [dict(method="fp16", batch=1, output_tok_s=150.0, load_s=60.0, weights_gib=14.99),
            dict(method="kbit2lm", batch=1, output_tok_s=450.0, load_s=50.0, weights_gib=2.61),
            dict(method="kbit2", batch=1, output_tok_s=375.0, load_s=50.0)]  # fmt: skip
    res = dict(meta=meta, methods=["fp16", "kbit2lm", "kbit2"], baseline="fp16", results=rows, failed={})
    write_table(res, tmp_path / "t.md")
    text = (tmp_path / "t.md").read_text()
    assert "| method | load s | weights GiB | batch 1 tok/s (x fp16) |" in text
    assert "| kbit2lm | 50 | 2.61 | 450 (3.000x) |" in text
    assert "| kbit2 | 50 | ? | 375 (2.500x) |" in text
