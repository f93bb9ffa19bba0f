# SPDX-License-Identifier: Apache-2.0
"""CPU tests of benchmarks/trace_summary.py (GPU time per output token from a torch.profiler
trace) and of bench_e2e.py's ``--profile`` path: the worker's calls into vLLM's LLM (a fake LLM
records them; the profiler_config is checked against vLLM's real ProfilerConfig), finding and
summarising the trace, and the table."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_e2e
import trace_summary as ts

DENSE = "void kbit::(anonymous namespace)::gemv_kernel<4, __nv_bfloat16, 0>(kbit::(anonymous namespace)::Params, kbit::(anonymous namespace)::MoeArgs)"
GATE_UP = DENSE.replace(", 0>", ", 1>")
DOWN = DENSE.replace(", 0>", ", 2>")


def _ev(name: str, ts_us: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur, "pid": 0, "tid": 7}


def _trace() -> dict:
    return {"traceEvents": [
        _ev(DENSE, 0, 10), _ev(GATE_UP, 12, 8), _ev(DOWN, 19, 6),  # down overlaps gate_up by 1
        _ev("flash_fwd_splitkv_kernel<...>", 30, 5), _ev("triton_poi_fused_add_rms_norm_0", 40, 2),
        _ev("Memcpy DtoH (Device -> Pinned)", 45, 3, cat="gpu_memcpy"),
        _ev("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 50, 10), _ev("some_elementwise_kernel", 60, 4),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # not GPU
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5},  # not a complete event
    ]}  # fmt: skip


def test_families():
    assert ts.family(DENSE) == "kbit GEMV (dense)"
    assert ts.family(DENSE.replace(", 0>", ", 3>")) == "kbit GEMV (dense)"  # paired n-tiles
    assert ts.family(GATE_UP) == "kbit MoE gate_up GEMV"
    assert ts.family(DOWN) == "kbit MoE down GEMV"
    assert ts.family("void kbit::(anonymous namespace)::moe_wgmma_kernel<4>()") == "kbit other"
    assert ts.family("flash_fwd_splitkv_kernel") == "attention"
    assert ts.family("void vllm::moe::topkGatingSoftmax<float>") == "MoE routing / unquantized experts"
    assert ts.family("nvjet_tst_64x8") == "GEMM (cuBLAS / CUTLASS)"
    assert ts.family("triton_poi_fused_add_rms_norm_0") == "norm"  # family before inductor
    # seen in a vLLM Qwen3-MoE trace: a norm, although its name ends in the MoE op's
    assert ts.family("triton_red_fused_fused_add_rms_norm_moe_forward_0") == "norm"
    assert ts.family("triton_poi_fused_mul_silu_1") == "triton (inductor fused)"
    assert ts.family("anything", cat="gpu_memset") == "copy / memset"
    assert ts.family("some_elementwise_kernel") == "other"


def test_summarize_numbers():
    s = ts.summarize(_trace(), tokens=2)
    assert s["kernels"] == 8
    assert s["span_us_per_token"] == pytest.approx(64 / 2)
    busy = 10 + 13 + 5 + 2 + 3 + 10 + 4  # gate_up + down = [12, 25): the overlap counted once
    assert s["busy_us_per_token"] == pytest.approx(busy / 2)
    assert s["kernel_us_per_token"] == pytest.approx((10 + 8 + 6 + 5 + 2 + 3 + 10 + 4) / 2)
    assert s["idle_fraction"] == pytest.approx(1 - busy / 64)
    fam = s["families"]
    assert fam["kbit GEMV (dense)"] == {"us_per_token": 5.0, "launches_per_token": 0.5}
    assert fam["GEMM (cuBLAS / CUTLASS)"]["us_per_token"] == 5.0
    assert fam["copy / memset"]["us_per_token"] == 1.5
    assert list(fam)[0] in ("kbit GEMV (dense)", "GEMM (cuBLAS / CUTLASS)")  # sorted by time
    assert s["top_kernels"][0]["us_per_token"] == 5.0
    assert len(ts.summarize(_trace(), tokens=1, top=3)["top_kernels"]) == 3


def test_summarize_refuses_bad_input():
    with pytest.raises(ValueError, match="tokens"):
        ts.summarize(_trace(), tokens=0)
    with pytest.raises(ValueError, match="no GPU kernel events"):
        ts.summarize({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}, 1)


def test_table_and_cli(tmp_path: Path, capsys):
    a, b = ts.summarize(_trace(), 2), ts.summarize(_trace(), 4)
    lines = ts.table({"bf16 b1": a, "kbit4 b1": b})
    assert lines[0] == "| us per output token | bf16 b1 | kbit4 b1 |"
    assert "| traced GPU span | 32.0 | 16.0 |" in lines
    assert any(x.startswith("| kbit MoE down GEMV (launches) | 3.0 (0) | 1.5 (0) |") for x in lines)
    p = tmp_path / "w.pt.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(_trace(), f)
    ts.main([str(p), "2"])
    assert "| traced GPU span | 32.0 |" in capsys.readouterr().out


def test_bench_e2e_profile_summary_and_table(tmp_path: Path):
    d = tmp_path / "prof"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="no complete profiler trace"):
        bench_e2e.profile_summary(d, 2, wait_s=0.1)
    (d / "old.pt.trace.json").write_text(json.dumps({"traceEvents": [_ev(DENSE, 0, 100)]}))
    newest = d / "rank0.123.pt.trace.json.gz"
    with gzip.open(newest, "wt") as f:
        json.dump(_trace(), f)
    s = bench_e2e.profile_summary(d, 2)
    assert s["trace"] == newest.name and s["span_us_per_token"] == pytest.approx(32.0)
    # the next batch's trace: the newest not summarised yet
    s_old = bench_e2e.profile_summary(d, 2, seen={newest.name})
    assert s_old["trace"] == "old.pt.trace.json" and s_old["span_us_per_token"] == 50.0
    with pytest.raises(FileNotFoundError):
        bench_e2e.profile_summary(d, 2, seen={newest.name, "old.pt.trace.json"}, wait_s=0.1)
    meta = {"device": "NVIDIA H100", "command": "bench_e2e.py --profile", "date": "2026-11-23",
            "git_commit": "0123456789abc", "model_desc": "tiny", "input_len": 128, "output_len": 16}  # fmt: skip
    out = tmp_path / "p.md"
    bench_e2e.write_profile_table({"meta": meta, "profiles": {"kbit4 b1": s}}, out)
    text = out.read_text()
    assert text.startswith("# Where the GPU time per output token goes (NVIDIA H100)")
    assert "| us per output token | kbit4 b1 |" in text and "commit 0123456789" in text


class _FakeLLM:
    """Records what bench_e2e's worker asks of vLLM's LLM."""

    calls: list = []

    def __init__(self, **kw):
        _FakeLLM.calls.append(("init", kw))

    def generate(self, prompts, sp, use_tqdm=False):
        _FakeLLM.calls.append(("generate", len(prompts)))
        out = argparse.Namespace(token_ids=[1] * sp.max_tokens)
        return [argparse.Namespace(outputs=[out]) for _ in prompts]

    def start_profile(self):
        _FakeLLM.calls.append(("start_profile",))

    def stop_profile(self):
        _FakeLLM.calls.append(("stop_profile",))


def test_bench_e2e_worker_profiles_each_batch(monkeypatch, capsys, tmp_path: Path):
    import vllm
    from vllm.config import ProfilerConfig

    _FakeLLM.calls = []
    monkeypatch.setattr(vllm, "LLM", _FakeLLM)

    def _exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(bench_e2e.os, "_exit", _exit)
    args = argparse.Namespace(model="m", dtype="bfloat16", input_len=8, output_len=4, batch=[2, 4],
                              gpu_mem=0.5, eager=False, method="kbit4", repeats=1, warmup=2,
                              threads=True, host_profile_file=str(tmp_path / "h"),
                              profile_dir=str(tmp_path), cpus=None)  # fmt: skip
    with pytest.raises(SystemExit):
        bench_e2e.worker(args)
    kw = _FakeLLM.calls[0][1]
    cfg = ProfilerConfig(**kw["profiler_config"])  # vLLM's own validation of the keys
    assert cfg.profiler == "torch" and cfg.torch_profiler_dir == str(tmp_path)
    names = [c[0] for c in _FakeLLM.calls]
    # per batch: 2 warm-ups, 1 timed, 1 under cProfile, 1 profiled
    per_batch = ["generate"] * 4 + ["start_profile", "generate", "stop_profile"]
    assert names == ["init"] + per_batch * 2
    events = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    prof = [e for e in events if e["event"] == "profile"]
    assert prof == [{"event": "profile", "method": "kbit4", "batch": b, "output_tokens": 4 * b,
                     "dir": str(tmp_path)} for b in (2, 4)]  # fmt: skip
    res = [e for e in events if e["event"] == "result"]
    assert [len(e["seconds_warmup"]) for e in res] == [2, 2] and all(e["threads"] for e in res)
    assert {t["pid"] for t in res[0]["threads"]} == {os.getpid()}  # no engine process here
    host = [e for e in events if e["event"] == "host_profile"]
    assert [e["file"] for e in host] == [f"{tmp_path / 'h'}_b{b}.txt" for b in (2, 4)]
    listing = (tmp_path / "h_b2.txt").read_text()
    assert listing.startswith("# kbit4, batch 2: one generate of 4 tokens under cProfile")
    assert "(generate)" in listing  # pstats of the profiled call: _FakeLLM.generate
    # without --profile / --host-profile / --threads: no profiler_config, nothing profiled
    _FakeLLM.calls = []
    plain = {"profile_dir": None, "host_profile_file": None, "threads": False, "warmup": 1}
    with pytest.raises(SystemExit):
        bench_e2e.worker(argparse.Namespace(**(vars(args) | plain)))
    assert "profiler_config" not in _FakeLLM.calls[0][1]
    assert [c[0] for c in _FakeLLM.calls] == ["init"] + ["generate"] * 4  # 1 warm-up + 1 timed, x2
    events = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [e["event"] for e in events] == ["loaded", "result", "result"]
    assert all("threads" not in e and len(e["seconds_warmup"]) == 1 for e in events[1:])


def test_gaps_by_length_and_pair():
    # _trace(): gaps [10, 12) after DENSE, [25, 30) after DOWN (gate_up and down overlap),
    # [35, 40), [42, 45), [48, 50); none between nvjet [50, 60) and the last kernel [60, 64)
    s = ts.summarize(_trace(), tokens=2)
    g = s["gaps"]
    assert g["< 3 us"] == {"us_per_token": (2 + 2) / 2, "per_token": 1.0}
    assert g["3-20 us"] == {"us_per_token": (5 + 5 + 3) / 2, "per_token": 1.5}
    assert g[">= 20 us"] == {"us_per_token": 0.0, "per_token": 0.0}
    assert sum(v["us_per_token"] for v in g.values()) == pytest.approx(
        s["span_us_per_token"] - s["busy_us_per_token"])  # fmt: skip
    pairs = {p["pair"]: p for p in s["gap_pairs"]}
    # the gap after the overlapping pair is charged to the kernel that ended last (down)
    assert pairs["kbit::gemv_kernel -> flash_fwd_splitkv_kernel"][
        "us_per_token"] == 2.5  # fmt: skip
    assert ts.short_name(DENSE) == "kbit::gemv_kernel"
    assert ts.short_name("Memcpy DtoH (Device -> Pinned)") == "Memcpy DtoH"
    assert ts.short_name("nvjet_tst_64x8") == "nvjet_tst_64x8"
    lines = ts.table({"kbit4 b1": s})
    assert "| idle in gaps 3-20 us (gaps per token) | 6.5 (2) |" in lines
    assert any(x.startswith("Most idle time between two kernels, kbit4 b1") for x in lines)
    # profiles summarised before gaps existed (older JSON) still render
    old = {k: v for k, v in s.items() if k not in ("gaps", "gap_pairs")}
    assert "| idle in gaps < 3 us (gaps per token) | - |" in ts.table({"old": old})
