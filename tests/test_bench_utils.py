# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the benchmark scripts' pure-Python parts (benchmarks/): shape table,
argument parsing, plan and time estimate, L2-rotation counts, tables / JSON / markdown /
plot from synthetic timings, the int4 baseline weight preparation (against vLLM's own
helpers), and one end-to-end run of bench_linear.py on the CPU reference ops. Tests
marked ``gpu`` exercise the CUDA-graph timing and the Marlin/Machete calls."""

from __future__ import annotations

import json
import lzma
import math
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_linear as bl
import int4_baselines as i4
import probe_env
import shapes
import timing

H100_L2 = 50 * 2**20


# ------------------------------------------------------------------ shapes, bytes


def test_shape_table() -> None:
    assert shapes.MODELS["8b"] == [("qkv", 6144, 4096), ("o", 4096, 4096),
                                   ("gate_up", 28672, 4096), ("down", 4096, 14336)]  # fmt: skip
    assert shapes.MODELS["70b"] == [("qkv", 10240, 8192), ("o", 8192, 8192),
                                    ("gate_up", 57344, 8192), ("down", 8192, 28672)]  # fmt: skip
    got = shapes.model_shapes(["70b", "8b"])
    assert [s.label for s in got][:2] == ["70b.qkv", "70b.o"] and len(got) == 8
    with pytest.raises(ValueError):
        shapes.model_shapes(["13b"])


def test_parse_shapes() -> None:
    assert shapes.parse_shapes("a:64x128, m.b:32X256") == [
        shapes.Shape("custom", "a", 64, 128), shapes.Shape("m", "b", 32, 256)]  # fmt: skip
    for bad in ("a:64", "a:x128", ":64x128", "a:64x1.5"):
        with pytest.raises(ValueError):
            shapes.parse_shapes(bad)


def test_weight_bytes() -> None:
    n, k = 4096, 4096
    assert shapes.weight_bytes("fp16", n, k) == n * k * 2
    assert shapes.weight_bytes("bf16", n, k) == n * k * 2
    assert shapes.weight_bytes("marlin", n, k) == n * k * 4.125 / 8
    assert shapes.weight_bytes("machete", n, k) == n * k * 4.125 / 8
    for bits, bpw in ((2, 2.25), (3, 3.25), (4, 4.25), (5, 5.25)):
        assert shapes.weight_bytes("mma", n, k, bits) == n * k * bpw / 8
    with pytest.raises(ValueError):
        shapes.weight_bytes("linear", n, k)


# ------------------------------------------------------------------------ timing


def test_copies_needed_l2_rotation() -> None:
    # 8B o at k=2: 4.72 MB a copy -> 34 copies to exceed 3 x 50 MiB
    b = shapes.kbit_bytes(4096, 4096, 2)
    r = timing.copies_needed(b, H100_L2, 3.0)
    assert r == 34 and r * b >= 3 * H100_L2 > (r - 1) * b
    # 70B gate_up fp16 (940 MB) is far bigger than L2: one copy
    assert timing.copies_needed(shapes.fp16_bytes(57344, 8192), H100_L2) == 1
    assert timing.copies_needed(b, H100_L2, 3.0, max_copies=16) == 16
    assert timing.copies_needed(b, H100_L2, 3.0, max_total_bytes=10 * b) == 10
    assert timing.copies_needed(b, H100_L2, 3.0, max_total_bytes=1) == 1
    assert timing.copies_needed(b, 0) == 1
    with pytest.raises(ValueError):
        timing.copies_needed(0, H100_L2)


def test_every_default_shape_rotates_past_l2() -> None:
    for sh in shapes.model_shapes(["8b", "70b"]):
        for meth, bits in [("fp16", None), ("marlin", None), *[("mma", b) for b in (2, 3, 4, 5)]]:
            b = shapes.weight_bytes(meth, sh.n, sh.k, bits)
            r = timing.copies_needed(b, H100_L2, 3.0, max_copies=64)
            assert r * b >= 3 * H100_L2, (sh, meth, bits, r)


def test_reps_for() -> None:
    assert timing.reps_for(1e-3, 10, 200, 0.02) == 20
    assert timing.reps_for(1e-1, 10, 200, 0.02) == 10
    assert timing.reps_for(1e-6, 10, 200, 0.02) == 200
    assert timing.reps_for(0.0, 10, 200, 0.02) == 200


def test_time_calls_wall_clock() -> None:
    x, ws = torch.randn(4, 64), [torch.randn(32, 64) for _ in range(3)]
    calls = []
    fns = [(lambda w=w: calls.append(1) or x @ w.t()) for w in ws]
    t = timing.time_calls(fns, warmup=1, min_reps=5, max_reps=7, target_s=1e-9, cuda=False)
    assert t.method == "wall" and t.calls == 3 and 5 <= t.reps <= 7
    assert len(t.samples_us) == t.reps and t.us > 0
    assert t.us == pytest.approx(statistics.median(t.samples_us), abs=1e-3)
    assert len(calls) == 3 * (1 + 1 + 1 + t.reps)  # validation, warm-up, estimate, timed
    with pytest.raises(ValueError):
        timing.time_calls([], cuda=False)


def test_time_calls_propagates_op_errors() -> None:
    def bad() -> None:
        raise RuntimeError("kernel not implemented")

    with pytest.raises(RuntimeError, match="not implemented"):
        timing.time_calls([bad], cuda=False)


@pytest.mark.parametrize(("name", "short"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA L40S", "l40s"), ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx6000"), ("Some Odd Device", "some-odd-device"),
])  # fmt: skip
def test_device_short_name(name: str, short: str) -> None:
    assert timing.device_short_name(name) == short


def test_run_metadata_cpu() -> None:
    meta = timing.run_metadata(["bench.py", "--quick", "--out-dir", "a b"])
    assert meta["command"].endswith("bench.py --quick --out-dir 'a b'")
    for key in ("date_utc", "torch", "git_commit", "device", "sm_count", "l2_bytes", "vllm"):
        assert key in meta
    json.dumps(meta)


# ------------------------------------------------------------- arguments, plan


def test_parse_args_defaults() -> None:
    cfg = bl.parse_args([])
    assert [s.label for s in cfg.shapes] == [f"{m}.{n}" for m in ("8b", "70b")
                                             for n in ("qkv", "o", "gate_up", "down")]  # fmt: skip
    assert cfg.bits == [2, 3, 4, 5] and cfg.ms == list(bl.ALL_MS) and cfg.ms_70b == cfg.ms
    assert cfg.baselines == ["fp16", "marlin", "machete"] and cfg.dtype == "fp16"
    assert cfg.use_graph and not cfg.quick and cfg.out_dir == BENCH / "results"
    assert bl.dense_methods(cfg) == ["fp16"]


def test_parse_args_quick_and_overrides() -> None:
    cfg = bl.parse_args(["--quick"])
    assert cfg.models == ["8b"] and cfg.bits == [2, 4] and cfg.ms == [1, 4, 16, 64, 256, 4096]
    cfg = bl.parse_args(["--quick", "--bits", "3", "--m", "16,1,16"])
    assert cfg.models == ["8b"] and cfg.bits == [3] and cfg.ms == [1, 16]
    cfg = bl.parse_args(["--models", "70B", "--m-70b", "1,64", "--dtype", "bf16",
                         "--baselines", "fp16,marlin", "--no-graph", "--out-dir", "/tmp/x"])  # fmt: skip
    assert cfg.models == ["70b"] and cfg.ms_for(cfg.shapes[0]) == [1, 64]
    assert bl.dense_methods(cfg) == ["fp16", "bf16"] and cfg.dense == "bf16"
    assert (
        cfg.baselines == ["fp16", "marlin"] and not cfg.use_graph and cfg.out_dir == Path("/tmp/x")
    )
    assert bl.parse_args(["--baselines", "none"]).baselines == []
    cfg = bl.parse_args(["--shapes", "x:64x128", "--min-reps", "0", "--max-reps", "0"])
    assert (
        cfg.shapes == [shapes.Shape("custom", "x", 64, 128)] and cfg.min_reps == cfg.max_reps == 1
    )


@pytest.mark.parametrize("argv", [["--bits", "6"], ["--bits", "2,x"], ["--m", "0"], ["--m", ""],
                                  ["--models", "13b"], ["--baselines", "exllama"],
                                  ["--dtype", "fp32"], ["--shapes", "bad"]])  # fmt: skip
def test_parse_args_errors(argv: list[str]) -> None:
    with pytest.raises((SystemExit, ValueError)):
        bl.parse_args(argv)


def test_plan_counts() -> None:
    cfg = bl.parse_args([])
    pts = bl.plan(cfg)
    # per shape: 3 baselines x 12 M; per k: 3 paths x 12 M + gemv at M = 1, 2, 4, 8
    assert len(pts) == 8 * (3 * 12 + 4 * (3 * 12 + 4)) == 1568
    assert all(m <= 8 for _, meth, _, m in pts if meth == "gemv")
    assert len(bl.plan(bl.parse_args(["--quick"]))) == 4 * (3 * 6 + 2 * (3 * 6 + 2)) == 232
    cfg = bl.parse_args(["--m-70b", "1,16,64,256"])
    assert len([p for p in bl.plan(cfg) if p[0].model == "70b" and p[1] == "fp16"]) == 4 * 4


def test_estimates_fit_the_gpu_call() -> None:
    full, quick = (
        bl.estimate_seconds(bl.parse_args([])),
        bl.estimate_seconds(bl.parse_args(["--quick"])),
    )
    assert quick < full < bl.parse_args([]).time_budget_s
    assert quick < 120
    assert bl.estimate_seconds(bl.parse_args(["--check-only"])) < full


# --------------------------------------------------------- tables from synthetic data


def _synthetic(cfg: bl.Config, broken: tuple = ()) -> list[bl.Point]:
    """fp16 100 us, Marlin 40, Machete 50; kbit gemv 20, mma 25, dequant 120, linear 21."""
    times = {"fp16": 100.0, "marlin": 40.0, "machete": 50.0,
             "gemv": 20.0, "mma": 25.0, "dequant": 120.0, "linear": 21.0}  # fmt: skip
    pts = []
    for sh, meth, bits, m in bl.plan(cfg):
        p = bl.new_point(sh, meth, bits, m)
        if (sh.name, meth, bits, m) in broken:
            p.status = "n/a: RuntimeError: boom"
        else:
            p.us, p.timing, p.calls, p.reps = times[meth], "graph", 3, 10
            p.tbps = p.weight_bytes / (p.us * 1e-6) / 1e12
        pts.append(p)
    return pts


def _row(lines: list[str], *starts: str) -> list[str]:
    for ln in lines:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cells[: len(starts)] == list(starts):
            return cells
    raise AssertionError(f"no row {starts} in\n" + "\n".join(lines))


def test_per_m_tables() -> None:
    cfg = bl.parse_args(["--models", "8b", "--bits", "2,4", "--m", "1,64"])
    pts = _synthetic(cfg, broken={("o", "marlin", None, 64)})
    lines = bl.per_m_tables(pts, cfg)
    assert "### M = 1" in lines and "### M = 64" in lines
    m1 = lines[lines.index("### M = 1") : lines.index("### M = 64")]
    header = [c.strip() for c in m1[2].strip("|").split("|")]
    assert header[:11] == ["shape", "k", "gemv", "mma", "dequant", "linear", "fp16", "Marlin",
                           "Machete", "best", "best TB/s"]  # fmt: skip
    row = dict(zip(header, _row(m1, "8b.qkv", "2")))
    assert row["gemv"] == "20.0" and row["best"] == "gemv" and row["x vs fp16"] == "5.00x"
    assert row["x vs Marlin"] == "2.00x"
    assert float(row["best TB/s"]) == pytest.approx(6144 * 4096 * 2.25 / 8 / 20e-6 / 1e12, abs=0.01)
    assert float(row["fp16 TB/s"]) == pytest.approx(6144 * 4096 * 2 / 100e-6 / 1e12, abs=0.01)
    m64 = lines[lines.index("### M = 64") :]
    row = dict(zip(header, _row(m64, "8b.o", "4")))
    assert row["gemv"] == "-" and row["best"] == "mma" and row["Marlin"] == "n/a"
    assert row["x vs Marlin"] == "-" and row["x vs fp16"] == "4.00x"


def test_layer_sums_and_summary() -> None:
    cfg = bl.parse_args(["--models", "8b", "--bits", "2,4", "--m", "1,64"])
    pts = _synthetic(cfg, broken={("down", "linear", 4, 64)})
    sums = bl.layer_sums(pts, cfg)
    assert sums[("8b", 1, "k=2")] == pytest.approx(4 * 21.0)
    assert sums[("8b", 1, "best k=2")] == pytest.approx(4 * 20.0)
    assert sums[("8b", 64, "best k=2")] == pytest.approx(4 * 25.0)  # no gemv above M=8
    assert sums[("8b", 1, "fp16")] == pytest.approx(400.0)
    assert sums[("8b", 64, "k=4")] is None  # one shape failed: no sum
    layer, summary = bl.layer_tables(pts, cfg)
    row = _row(layer, "Llama-3.1-8B", "1", "2")
    assert row[3:] == ["84.0", "80.0", "400.0", "160.0", "200.0", "4.76x", "1.90x", "2.38x"]
    assert _row(layer, "Llama-3.1-8B", "64", "4")[3] == "n/a"
    assert _row(summary, "Llama-3.1-8B", "k=2 linear")[2:] == ["4.76x", "4.76x"]
    assert _row(summary, "Llama-3.1-8B", "k=4 linear")[2:] == ["4.76x", "-"]
    assert _row(summary, "Llama-3.1-8B", "Marlin int4")[2:] == ["2.50x", "2.50x"]
    assert bl.layer_tables([], cfg) == ([], [])


def _run(cfg: bl.Config, points: list[bl.Point]) -> bl.Run:
    run = bl.Run(cfg, torch.device("cpu"), torch.float16, H100_L2, 1e9, 0.0, "n/a: test")
    run.points = points
    sh = cfg.shapes[0]
    run.check(sh, 2, "dequantize_tiled", 0, "sqnr_db", 9.5, True, "expected 9.46")
    run.check(sh, 2, "mma", 16, "rel_err", 3e-4, True)
    run.check(sh, 2, "gemv", 1, "rel_err", 0.5, False)
    run.check(sh, None, "marlin", 1, "rel_err", None, False, "RuntimeError: no kernel")
    run.notes.append("a note")
    return run


def test_write_outputs(tmp_path: Path) -> None:
    cfg = bl.parse_args(["--models", "8b", "--bits", "2,4", "--m", "1,64", "--out-dir", str(tmp_path),
                         "--tag", "t"])  # fmt: skip
    run = _run(cfg, _synthetic(cfg, broken={("qkv", "machete", None, 1)}))
    run.skipped.append("70b.qkv (all)")
    meta = {
        "device": "NVIDIA H100 80GB HBM3",
        "device_short": "h100",
        "command": "x",
        "l2_bytes": H100_L2,
    }
    files = bl.write_outputs(run, meta, final=True)
    names = {f.name for f in files}
    assert {"bench_linear_h100_t.json", "bench_linear_h100_t.md"} <= names
    doc = json.loads((tmp_path / "bench_linear_h100_t.json").read_text())
    assert doc["meta"]["device_short"] == "h100" and doc["meta"]["complete"] is False
    assert len(doc["points"]) == len(run.points) and doc["skipped"] == ["70b.qkv (all)"]
    assert doc["config"]["bits"] == [2, 4] and doc["config"]["shapes"][0]["n"] == 6144
    p0 = doc["points"][0]
    for key in ("model", "shape", "n", "k", "bits", "method", "m", "us", "status", "timing",
                "calls", "reps", "weight_bytes", "tbps", "samples_us"):  # fmt: skip
        assert key in p0
    assert sum(not c["ok"] for c in doc["checks"]) == 2
    md = (tmp_path / "bench_linear_h100_t.md").read_text()
    for heading in ("# kbit linear benchmark: NVIDIA H100", "## Speedup of one decoder layer",
                    "## Per-decoder-layer sums", "## Per-M tables", "### M = 64",
                    "## Correctness checks", "## Notes"):  # fmt: skip
        assert heading in md
    assert "FLAGGED" in md and "machete: n/a: RuntimeError: boom [8b.qkv]" in md
    assert "skipped (time budget" in md and "- a note" in md
    if any(n.startswith("no plot") for n in run.notes):
        pytest.skip("matplotlib missing: " + run.notes[-1])
    png = tmp_path / "bench_linear_h100_t.png"
    assert png in files and png.read_bytes()[:4] == b"\x89PNG"


def test_out_stem() -> None:
    assert bl.out_stem(bl.parse_args([]), "h100") == "bench_linear_h100"
    assert bl.out_stem(bl.parse_args(["--quick"]), "h200") == "bench_linear_h200_quick"
    assert (
        bl.out_stem(bl.parse_args(["--check-only", "--tag", "v2"]), "h100")
        == "bench_linear_h100_v2_check"
    )


def test_md_table_alignment() -> None:
    lines = bl.md_table(["a", "b", "c"], [["x", "1", "2.5"], ["yy", "22", "n/a"]])
    assert len({len(ln) for ln in lines}) == 1 and lines[1].startswith("|---")


# ----------------------------------------------------------- int4 baseline weights


def _w(n: int = 96, k: int = 512, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, k, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int4_quantize_self_consistent(dtype: torch.dtype) -> None:
    w = _w(dtype=dtype)
    codes, s, w_ref = i4.quantize_int4_g128(w)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert s.shape == (512 // 128, 96) and s.dtype == dtype and w_ref.dtype == dtype
    deq = (codes - 8).view(96, 4, 128).to(dtype) * s.t().unsqueeze(-1)
    assert torch.equal(deq.view(96, 512), w_ref)
    err = float((w_ref.float() - w.float()).norm() / w.float().norm())
    assert 0.05 < err < 0.15  # 4-bit symmetric, group 128
    with pytest.raises(ValueError):
        i4.quantize_int4_g128(_w(k=96))


def test_int4_pack_layout() -> None:
    codes = torch.randint(0, 16, (3, 16), dtype=torch.int32)
    packed = i4.pack_int4_along_k(codes)
    assert packed.shape == (3, 2) and packed.dtype == torch.int32
    for n in range(3):
        for j in range(2):
            word = int(packed[n, j]) & 0xFFFFFFFF
            assert [(word >> (4 * i)) & 15 for i in range(8)] == codes[
                n, 8 * j : 8 * j + 8
            ].tolist()


def test_int4_matches_vllm_helpers() -> None:
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
    from vllm.scalar_type import scalar_types

    assert scalar_types.uint4b8.id == i4.UINT4B8_ID
    w = _w(n=128, k=1024)
    w_ref_v, q_v, s_v, _ = qu.quantize_weights(w.t(), scalar_types.uint4b8, 128)
    codes, s, w_ref = i4.quantize_int4_g128(w)
    assert (
        torch.equal(q_v.t().int(), codes)
        and torch.equal(s_v, s)
        and torch.equal(w_ref_v.t(), w_ref)
    )
    packed_v = qu.pack_quantized_values_into_int32(q_v, scalar_types.uint4b8, packed_dim=0)
    assert torch.equal(packed_v.contiguous(), i4.pack_int4_along_k(codes).t().contiguous())
    assert torch.equal(mu.marlin_permute_scales(s, 1024, 128, 128), i4.marlin_permute_scales(s))


def test_load_vllm_ops_reports_why(tmp_path: Path) -> None:
    if hasattr(torch.ops._C, "marlin_gemm"):
        pytest.skip("vLLM's kernels are loaded here")
    lib = tmp_path / "not_a_library.so.xz"
    with lzma.open(lib, "wb") as f:
        f.write(b"garbage")
    with pytest.raises(RuntimeError, match="vLLM kernels unavailable") as e:
        i4.load_vllm_ops(str(lib))
    assert "load_library" in str(e.value) and "vllm" in str(e.value)


# ------------------------------------------------------- end to end on the CPU ops


def test_main_cpu_end_to_end(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--shapes", "t.a:16x256,t.b:32x128", "--bits", "2", "--m", "1,16",
            "--min-reps", "2", "--max-reps", "2", "--warmup", "0", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu.json").read_text())
    cfg = bl.parse_args(argv)
    assert len(doc["points"]) == len(bl.plan(cfg))
    by = {(p["shape"], p["bits"], p["method"], p["m"]): p for p in doc["points"]}
    assert by[("a", 2, "gemv", 1)]["status"] == "ok" and by[("a", 2, "gemv", 1)]["us"] > 0
    assert ("a", 2, "gemv", 16) not in by
    assert by[("b", None, "fp16", 16)]["status"] == "ok"
    assert by[("b", None, "marlin", 1)]["status"].startswith("n/a")
    assert doc["checks"] and all(c["ok"] for c in doc["checks"])
    sqnr = [c["value"] for c in doc["checks"] if c["metric"] == "sqnr_db"]
    assert len(sqnr) == 2 and all(math.isfinite(v) for v in sqnr)
    assert doc["meta"]["complete"] is True and doc["meta"]["kbit_backend"] in (
        "reference",
        "compiled",
    )
    assert "### M = 16" in (tmp_path / "bench_linear_cpu.md").read_text()


def test_main_cpu_wgmma_path(tmp_path: Path) -> None:
    # --wgmma adds the path mma_wg (kbit::mma with KBIT_MMA_WGMMA=1) above M = 32, checked and
    # timed like the others; on the CPU it is the reference, so it must agree with mma
    argv = ["--device", "cpu", "--shapes", "t.a:16x256", "--bits", "4", "--m", "16,64",
            "--baselines", "none", "--min-reps", "1", "--max-reps", "1", "--warmup", "0",
            "--wgmma", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu.json").read_text())
    by = {(p["method"], p["m"]): p for p in doc["points"]}
    assert by[("mma_wg", 64)]["status"] == "ok" and ("mma_wg", 16) not in by
    wg = [c for c in doc["checks"] if c["method"] == "mma_wg"]
    assert [c["m"] for c in wg] == list(bl.CHECK_MS["mma_wg"]) and all(c["ok"] for c in wg)
    assert "mma_wg" in (tmp_path / "bench_linear_cpu.md").read_text()
    assert "KBIT_MMA_WGMMA" not in os.environ


def test_main_cpu_wgmma2_path(tmp_path: Path) -> None:
    # --wgmma2 adds mma_wg2 (kbit::mma with KBIT_MMA_WGMMA=2) beside mma and mma_wg above M = 32
    argv = ["--device", "cpu", "--shapes", "t.a:16x256", "--bits", "3", "--m", "16,64",
            "--baselines", "none", "--min-reps", "1", "--max-reps", "1", "--warmup", "0",
            "--wgmma2", "--out-dir", str(tmp_path)]  # fmt: skip
    cfg = bl.parse_args(argv)
    assert cfg.wgmma and cfg.wgmma2
    assert bl.kbit_paths(cfg) == ["gemv", "mma", "mma_wg", "mma_wg2", "dequant", "linear"]
    assert bl.kbit_paths(cfg, 16) == ["mma", "dequant", "linear"]
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu.json").read_text())
    by = {(p["method"], p["m"]): p for p in doc["points"]}
    assert by[("mma_wg2", 64)]["status"] == "ok" and ("mma_wg2", 16) not in by
    wg2 = [c for c in doc["checks"] if c["method"] == "mma_wg2"]
    assert [c["m"] for c in wg2] == list(bl.CHECK_MS["mma_wg2"]) and all(c["ok"] for c in wg2)
    assert "mma_wg2" in (tmp_path / "bench_linear_cpu.md").read_text()
    assert "KBIT_MMA_WGMMA" not in os.environ


def test_time_interleaved_rounds_and_failures() -> None:
    # every path runs once per round, the first path rotating; a path whose calls raise gets
    # its exception and the others are still timed
    order: list[str] = []

    def fn(name: str):
        return lambda: order.append(name)

    def broken() -> None:
        raise RuntimeError("boom")

    groups = {"a": [fn("a"), fn("a")], "b": [fn("b")], "bad": [broken]}
    res = timing.time_interleaved(groups, warmup=0, min_reps=3, max_reps=3, cuda=False)
    assert isinstance(res["bad"], RuntimeError)
    for name, calls in (("a", 2), ("b", 1)):
        t = res[name]
        assert isinstance(t, timing.Timing) and t.method == "wall" and t.calls == calls
        assert t.reps == 3 and len(t.samples_us) == 3 and t.us > 0
    rounds = order[-9:]  # 3 rounds of (a, a, b) / (b, a, a) / (a, a, b): a's two copies per replay
    assert rounds == ["a", "a", "b", "b", "a", "a", "a", "a", "b"]


def test_main_cpu_interleave(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--shapes", "t.a:16x256", "--bits", "4", "--m", "1,16",
            "--baselines", "none", "--min-reps", "2", "--max-reps", "2", "--warmup", "0",
            "--interleave", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu.json").read_text())
    by = {(p["method"], p["m"]): p for p in doc["points"]}
    for key in [("gemv", 1), ("mma", 1), ("dequant", 1), ("linear", 1), ("mma", 16)]:
        assert by[key]["status"] == "ok" and by[key]["reps"] == 2 and by[key]["us"] > 0, key


def test_main_cpu_check_only_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--device", "cpu", "--shapes", "t.a:32x256", "--bits", "3", "--check-only",
            "--out-dir", str(tmp_path)]  # fmt: skip
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu_check.json").read_text())
    n_checks = sum(len(ms) for p, ms in bl.CHECK_MS.items() if p not in ("mma_wg", "mma_wg2"))
    assert doc["points"] == [] and len(doc["checks"]) == 1 + n_checks
    capsys.readouterr()
    assert bl.main(["--dry-run"]) == 0
    assert "1568 timing points" in capsys.readouterr().out


def test_main_cpu_reports_failing_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_mma(*args: object) -> None:
        raise RuntimeError("mma: no kernel for this shape")

    monkeypatch.setattr(torch.ops.kbit, "mma", broken_mma)
    argv = ["--device", "cpu", "--shapes", "t.a:16x256", "--bits", "2", "--m", "1",
            "--min-reps", "1", "--max-reps", "1", "--warmup", "0", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu.json").read_text())
    by = {(p["method"], p["m"]): p for p in doc["points"] if p["bits"] == 2}
    assert by[("mma", 1)]["status"] == "n/a: RuntimeError: mma: no kernel for this shape"
    assert by[("gemv", 1)]["status"] == "ok" and by[("linear", 1)]["status"] == "ok"
    bad = [c for c in doc["checks"] if not c["ok"]]
    assert {c["method"] for c in bad} == {"mma"} and len(bad) == len(bl.CHECK_MS["mma"])
    assert any("mma: n/a: RuntimeError" in n for n in doc["notes"])
    assert bl.main([*argv, "--check-only"]) == 1  # flagged checks fail a check-only run


def test_main_cpu_survives_a_bug_in_one_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = bl.run_kbit

    def flaky(run: bl.Run, sh: shapes.Shape, bits: int, w: torch.Tensor) -> None:
        if sh.name == "a":
            raise KeyError("oops")
        real(run, sh, bits, w)

    monkeypatch.setattr(bl, "run_kbit", flaky)
    argv = ["--device", "cpu", "--shapes", "t.a:16x128,t.b:16x128", "--bits", "2", "--m", "1",
            "--min-reps", "1", "--max-reps", "1", "--warmup", "0", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bl.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_cpu.json").read_text())
    assert any("t.a: stopped by KeyError" in n for n in doc["notes"])
    assert {p["shape"] for p in doc["points"] if p["bits"] == 2} == {"b"}


# ------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_time_calls_graph_cuda() -> None:
    x = torch.randn(16, 1024, device="cuda", dtype=torch.float16)
    ws = [torch.randn(2048, 1024, device="cuda", dtype=torch.float16) for _ in range(4)]
    t = timing.time_calls([(lambda w=w: x @ w.t()) for w in ws], min_reps=10)
    assert t.method == "graph" and t.note == "" and t.calls == 4 and t.reps >= 10 and t.us > 0


@pytest.mark.gpu
@pytest.mark.parametrize("meth", ["marlin", "machete"])
def test_int4_kernels_cuda(meth: str) -> None:
    try:
        i4.load_vllm_ops()
    except RuntimeError as e:
        pytest.skip(str(e))
    if meth == "machete" and i4.machete_supported():
        pytest.skip(i4.machete_supported())
    n, k = 256, 1024
    w = _w(n, k).cuda()
    codes, s, w_ref = i4.quantize_int4_g128(w)
    packed = i4.pack_int4_along_k(codes)
    for m in (1, 33):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        if meth == "marlin":
            qw, sm = i4.marlin_weights(packed, s, n, k)
            y = i4.marlin_fn(x, qw, sm, n, k, i4.marlin_workspace(x.device))()
        else:
            y = i4.machete_fn(x, i4.machete_weights(packed, torch.float16), s)()
        ref = x.float() @ w_ref.float().t()
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


def test_with_env_sets_and_restores(monkeypatch) -> None:
    monkeypatch.setenv("KBIT_TEST_SET", "old")
    monkeypatch.delenv("KBIT_TEST_UNSET", raising=False)
    seen = []

    def fn():
        seen.append((os.environ.get("KBIT_TEST_SET"), os.environ.get("KBIT_TEST_UNSET")))
        if len(seen) == 2:
            raise RuntimeError("boom")
        return 7

    call = timing.with_env({"KBIT_TEST_SET": "new", "KBIT_TEST_UNSET": "1"}, fn)
    assert call() == 7
    with pytest.raises(RuntimeError):
        call()  # restored on an exception as well
    assert seen == [("new", "1"), ("new", "1")]
    assert os.environ["KBIT_TEST_SET"] == "old" and "KBIT_TEST_UNSET" not in os.environ


def test_probe_env_variants() -> None:
    assert probe_env.parse_variant("base:") == ("base", {})
    assert probe_env.parse_variant("nt4:KBIT_MMA_WGMMA=0,KBIT_MMA_NT=4") == (
        "nt4", {"KBIT_MMA_WGMMA": "0", "KBIT_MMA_NT": "4"})  # fmt: skip
    for bad in ["nt4", ":KBIT_MMA_NT=4", "nt4:KBIT_MMA_NT", "nt4:CUDA_VISIBLE_DEVICES=1",
                "mp:VLLM_ENABLE_V1_MULTIPROCESSING=0"]:  # fmt: skip
        with pytest.raises(ValueError, match="--variant"):
            probe_env.parse_variant(bad)
    # bench_e2e's workers are fresh vLLM processes: vLLM's own variables are allowed there
    vllm_ok = ("KBIT_", "VLLM_")
    assert probe_env.parse_variant("mp:VLLM_ENABLE_V1_MULTIPROCESSING=0", vllm_ok) == (
        "mp", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
    with pytest.raises(ValueError, match="KBIT_VAR=VALUE or VLLM_VAR=VALUE"):
        probe_env.parse_variant("x:CUDA_VISIBLE_DEVICES=1", vllm_ok)
    # ... and torch.compile's (bench_e2e's own list)
    import bench_e2e

    pdl = "pdl:TORCHINDUCTOR_ENABLE_PDL=1,VLLM_CACHE_ROOT=/tmp/v,KBIT_PDL=1"
    assert probe_env.parse_variant(pdl, bench_e2e.VARIANT_PREFIXES) == (
        "pdl", {"TORCHINDUCTOR_ENABLE_PDL": "1", "VLLM_CACHE_ROOT": "/tmp/v", "KBIT_PDL": "1"})  # fmt: skip
    with pytest.raises(ValueError, match="--variant"):
        probe_env.parse_variant("x:CUDA_VISIBLE_DEVICES=1", bench_e2e.VARIANT_PREFIXES)


def test_probe_env_op_gemv_rejects_wide_batches() -> None:
    # the GEMV takes M <= 8: refused before anything is loaded or timed (also on a CPU machine)
    with pytest.raises(SystemExit, match="--op gemv takes M <= 8"):
        probe_env.main(["--op", "gemv", "--m", "1,16", "--variant", "base:"])
    with pytest.raises(SystemExit):  # argparse: an op that does not exist
        probe_env.main(["--op", "moe", "--variant", "base:"])


def test_bench_e2e_model_dir_layers(tmp_path: Path) -> None:
    # --layers N: the built-in shape with num_hidden_layers = N, nothing else changed
    import bench_e2e

    full = json.loads((bench_e2e.model_dir(None, tmp_path / "a") / "config.json").read_text())
    one = json.loads((bench_e2e.model_dir(None, tmp_path / "b", layers=1) / "config.json").read_text())
    assert full["num_hidden_layers"] == 32 and one["num_hidden_layers"] == 1
    assert {k: v for k, v in one.items() if k != "num_hidden_layers"} == {
        k: v for k, v in full.items() if k != "num_hidden_layers"}  # fmt: skip
    with pytest.raises(ValueError, match="--layers must be >= 1"):
        bench_e2e.model_dir(None, tmp_path / "c", layers=0)


def test_bench_e2e_cpus() -> None:
    # --cpus: the CPUs every worker (and vLLM's engine processes, which inherit it) is pinned to
    import bench_e2e

    assert bench_e2e.parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert bench_e2e.parse_cpus("5") == [5]
    for bad in ("", "a", "3-x", "-1", "0-3,,4", "5-3"):
        with pytest.raises(ValueError, match="--cpus takes CPU numbers"):
            bench_e2e.parse_cpus(bad)
    with pytest.raises(ValueError, match="--cpus"):  # before any worker starts
        bench_e2e.main(["--methods", "fp16", "--cpus", "0-x"])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_bench_e2e_busiest_threads() -> None:
    # --threads: per-thread CPU time of this process and its children, busiest first
    import subprocess
    import threading
    import time

    import bench_e2e

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                              "while time.time() - t < 1.0: pass"])  # fmt: skip
    stop = threading.Event()

    def spin() -> None:  # busy until stopped
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, name="spin")
    before, t0 = bench_e2e.thread_cpu(), time.perf_counter()
    spinner.start()
    time.sleep(0.6)
    rows = bench_e2e.busiest_threads(before, bench_e2e.thread_cpu(), time.perf_counter() - t0)
    stop.set()
    spinner.join()
    child.wait()
    assert {r["tid"] for r in rows[:2]} == {spinner.native_id, child.pid}  # the two spinners
    assert all(r["busy"] > 0.3 for r in rows[:2]) and rows == sorted(rows, key=lambda r: -r["busy"])
    assert {r["pid"] for r in rows[:2]} == {os.getpid(), child.pid}


def test_write_results_json_and_table(tmp_path: Path, capsys) -> None:
    meta = timing.run_metadata(["bench_x.py", "--m", "1"])
    rows = [{"m": 1, "us": 2.5}]
    timing.write_results(tmp_path / "out", "bench_x_cpu_t", meta, rows, "Title", ["a note"],
                         ["| m | us |", "|---|---|", "| 1 | 2.5 |"])  # fmt: skip
    data = json.loads((tmp_path / "out" / "bench_x_cpu_t.json").read_text())
    assert data["rows"] == rows and data["meta"]["command"].endswith("bench_x.py --m 1")
    md = (tmp_path / "out" / "bench_x_cpu_t.md").read_text().splitlines()
    assert md[0] == f"# Title ({meta['device']})" and md[2] == f"- command: `{meta['command']}`"
    assert md[3].startswith(f"- date: {meta['date_utc']}, commit ") and md[4] == "- a note"
    assert md[-1] == "| 1 | 2.5 |" and "| 1 | 2.5 |" in capsys.readouterr().out
