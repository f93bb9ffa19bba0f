#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Times every kbit matmul path against fp16 cuBLAS, vLLM Marlin and Machete (int4 g128)
on the linear layers of Llama-3.1-8B / 70B, for k = 2..5 and M = 1..4096.

    python3 benchmarks/bench_linear.py [--quick] [--models 8b,70b] [--bits 2,4] [--m 1,16]
                                       [--check-only] [--dry-run] [--out-dir DIR]

Writes bench_linear_<gpu>.{json,md,png} (see benchmarks/README.md for columns and method).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import TypeVar

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    # the repository's vllm_kbit where none is importable; last, so that a PYTHONPATH build
    # (tools/ab_base.sh: A/B timing of two builds) or the editable install comes first
    sys.path.append(str(HERE.parent))

import int4_baselines as i4
import torch
from shapes import MODEL_NAMES, MODELS, Shape, model_shapes, parse_shapes, weight_bytes
from timing import (
    Timing,
    copies_needed,
    l2_cache_bytes,
    reps_for,
    run_metadata,
    time_calls,
    time_interleaved,
    with_env,
)

KBIT_PATHS = ("gemv", "mma", "dequant", "linear")  # "dequant" = dequantize_tiled + matmul
ALL_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
QUICK = {"models": "8b", "bits": "2,4", "m": "1,4,16,64,256,4096"}
# SQNR of the default codebooks on N(0, 1) (docs/format.md); a wrong quantize/dequantize
# chain shows up as a different number.
SQNR_DB = {2: 9.46, 3: 15.47, 4: 21.77, 5: 27.90}
SQNR_TOL_DB = 0.5
REL_ERR_LIMIT = 1e-2
CHECK_MS = {"gemv": (1, 3, 8), "mma": (1, 16, 100), "mma_wg": (64, 100, 300),
            "mma_wg2": (64, 100, 300, 1000), "dequant": (64,), "linear": (1, 5, 64, 300)}  # fmt: skip
WG_MIN_M = 33  # the wgmma paths (mma_wg, mma_wg2, mma_wg2_c<N>) are timed above M = 32
# KBIT_MMA_WGMMA per wgmma-related path: mma_wg = the first wgmma variant of kbit::mma, mma_wg2 =
# the warp-specialized kernel (csrc/wgmma_gemm.cu); with --wgmma, "mma" is the mma.sync variant.
WG_FLAGS = {"mma": "0", "mma_wg": "1", "mma_wg2": "2"}
# --wgmma2-config: the warp-specialized kernel with its tile configuration forced
# (KBIT_WGMMA_CONFIG=N), timed as path mma_wg2_c<N>: 1 = C1 128 rows x 64 tokens, 2 = C2 128 x 128,
# 3 = C3 256 x 128, 4 = C1w 256 x 64, 5 = C2w 128 x 256 (docs/wgmma-plan.md, sections 4 and 9).
WG2_CONFIGS = (1, 2, 3, 4, 5)
WG2_PREFIX = "mma_wg2_c"


def wg2_config_path(config: int) -> str:
    return f"{WG2_PREFIX}{config}"


def wg2_config_of(path: str) -> int | None:
    """N for the path mma_wg2_c<N>, else None."""
    if path.startswith(WG2_PREFIX) and path[len(WG2_PREFIX) :].isdigit():
        c = int(path[len(WG2_PREFIX) :])
        return c if c in WG2_CONFIGS else None
    return None


def is_wg_path(path: str) -> bool:
    """A wgmma path (timed above M = 32 only): mma_wg, mma_wg2 or mma_wg2_c<N>."""
    return path in ("mma_wg", "mma_wg2") or wg2_config_of(path) is not None


def check_ms(path: str) -> tuple[int, ...]:
    """M values at which a path is checked against the fp32 oracle."""
    return CHECK_MS["mma_wg2" if wg2_config_of(path) is not None else path]


H100 = {"l2": 50e6, "bw": 3.0e12, "flops": 600e12}  # for --dry-run estimates only


T = TypeVar("T")


class Fatal(RuntimeError):
    """The CUDA context is unusable (e.g. an illegal memory access): stop and write out."""


# ------------------------------------------------------------------------- config


@dataclass
class Config:
    shapes: list[Shape]
    bits: list[int]
    ms: list[int]
    ms_70b: list[int]
    dtype: str = "fp16"  # activation dtype of every path
    baselines: list[str] = field(default_factory=lambda: ["fp16", "marlin", "machete"])
    gemv_max_m: int = 8
    quick: bool = False
    check_only: bool = False
    dry_run: bool = False
    out_dir: Path = HERE / "results"
    tag: str = ""
    device: str = "cuda"
    warmup: int = 3
    min_reps: int = 10
    max_reps: int = 200
    target_ms: float = 20.0
    l2_factor: float = 3.0
    max_copies: int = 64
    l2_bytes: int | None = None  # override of the queried L2 size
    use_graph: bool = True
    reverse_paths: bool = False  # time linear first (tests for an order effect on clocks)
    interleave: bool = False  # time the kbit paths of a (shape, k, M) in rotating rounds
    wgmma: bool = False  # also time kbit::mma's wgmma variant as the path "mma_wg"
    wgmma2: bool = False  # and its warp-specialized wgmma kernel as "mma_wg2" (implies wgmma)
    # the warp-specialized kernel with KBIT_WGMMA_CONFIG forced, as "mma_wg2_c<N>" (implies wgmma)
    wgmma2_configs: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=lambda: list(KBIT_PATHS))  # kbit paths to time
    time_budget_s: float = 420.0
    vllm_ops_lib: str | None = None
    allow_reference: bool = False

    def ms_for(self, shape: Shape) -> list[int]:
        return self.ms_70b if shape.model == "70b" else self.ms

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(s.model for s in self.shapes))

    @property
    def dense(self) -> str:  # the cuBLAS baseline in the activation dtype
        return self.dtype


def _ints(s: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: expected comma-separated integers, got {s!r}") from None
    if not out or any(v <= 0 for v in out):
        raise SystemExit(f"--{what}: expected positive integers, got {s!r}")
    return sorted(set(out))


def _pick(given: str | None, quick: str | None, default: str) -> str:
    """An explicit flag wins over --quick's value, which wins over the default."""
    return given if given is not None else quick if quick is not None else default


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add = p.add_argument
    add("--models", help=f"comma list of {','.join(MODELS)} (default 8b,70b)")
    add("--shapes", help="custom shapes name:NxK,... (replaces --models)")
    add("--bits", help="k values (default 2,3,4,5)")
    add("--m", dest="ms", help=f"M values (default {','.join(map(str, ALL_MS))})")
    add("--m-70b", dest="ms_70b", help="M values for 70B shapes (default: as --m)")
    add(
        "--dtype",
        choices=["fp16", "bf16"],
        default="fp16",
        help="activations; bf16 adds bf16 cuBLAS",
    )
    add("--baselines", default="fp16,marlin,machete", help="subset of fp16,marlin,machete or none")
    add("--quick", action="store_true", help="8B, k=2,4, M=1,4,16,64,256,4096")
    add("--check-only", action="store_true", help="correctness checks only")
    add("--dry-run", action="store_true", help="print the plan and a time estimate")
    add("--out-dir", type=Path, default=HERE / "results")
    add("--tag", default="", help="suffix of the output file names")
    add("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: functional tests only")
    add("--gemv-max-m", type=int, default=8, help="time gemv for M up to this")
    add("--warmup", type=int, default=3, help="untimed replays")
    add("--min-reps", type=int, default=10, help="timed replays, at least")
    add("--max-reps", type=int, default=200, help="timed replays, at most")
    add("--target-ms", type=float, default=20.0, help="timed replays fill about this long")
    add("--l2-factor", type=float, default=3.0, help="weight copies total >= this x L2")
    add("--max-copies", type=int, default=64, help="weight copies, at most")
    add("--l2-bytes", type=int, help="override the queried L2 size")
    add("--no-graph", dest="use_graph", action="store_false", help="time eager calls")
    add("--reverse-paths", action="store_true",
        help="time the kbit paths in reverse order (linear, dequant, mma, gemv)")
    add("--interleave", action="store_true",
        help="time the kbit paths of each shape, k and M together, in rounds that replay each\n"
             "path once (first path rotating), instead of one path after the other")
    add("--wgmma", action="store_true",
        help="time kbit::mma's wgmma variant (KBIT_MMA_WGMMA=1, sm_90a builds) as path mma_wg, M > 32,\n"
             "and its mma.sync variant alone (KBIT_MMA_WGMMA=0) as path mma")
    add("--wgmma2", action="store_true",
        help="also time kbit::mma's warp-specialized wgmma kernel (KBIT_MMA_WGMMA=2, sm_90a builds)\n"
             "as path mma_wg2, M > 32; implies --wgmma")
    add("--wgmma2-config", dest="wgmma2_configs",
        help="comma list of tile configurations of the warp-specialized kernel to time side by side,\n"
             "each forced (KBIT_MMA_WGMMA=2 KBIT_WGMMA_CONFIG=N) as path mma_wg2_c<N>, M > 32:\n"
             "1 = C1 128x64, 2 = C2 128x128, 3 = C3 256x128, 4 = C1w 256x64, 5 = C2w 128x256;\n"
             "implies --wgmma\n"
             "(mma_wg2, the kernel's own choice, only with --wgmma2 too)")
    add("--paths", help=f"comma subset of the kbit paths {','.join(KBIT_PATHS)} (default: all)")
    add("--time-budget-s", type=float, default=420.0, help="start no new shape/k after this")
    add("--vllm-ops-lib", help="vLLM's _C_stable_libtorch.abi3.so (or .xz), if vllm won't import")
    add("--allow-reference", action="store_true", help="run without vllm_kbit._C (slow)")
    a = p.parse_args(argv)
    q = QUICK if a.quick else {}
    if a.shapes:
        shapes = parse_shapes(a.shapes)
    else:
        models = _pick(a.models, q.get("models"), "8b,70b").split(",")
        try:
            shapes = model_shapes([m.strip().lower() for m in models if m.strip()])
        except ValueError as e:
            raise SystemExit(f"--models: {e}") from None
    bits = _ints(_pick(a.bits, q.get("bits"), "2,3,4,5"), "bits")
    if any(b not in SQNR_DB for b in bits):
        raise SystemExit(f"--bits: k must be in 2..5, got {bits}")
    ms = _ints(_pick(a.ms, q.get("m"), ",".join(map(str, ALL_MS))), "m")
    ms_70b = ms if a.ms_70b is None else _ints(a.ms_70b, "m-70b")
    base = [b.strip() for b in a.baselines.split(",") if b.strip() and b.strip() != "none"]
    if any(b not in ("fp16", "marlin", "machete") for b in base):
        raise SystemExit(f"--baselines: subset of fp16,marlin,machete or none, got {a.baselines!r}")
    wg2c = [] if a.wgmma2_configs is None else _ints(a.wgmma2_configs, "wgmma2-config")
    if any(c not in WG2_CONFIGS for c in wg2c):
        raise SystemExit(
            f"--wgmma2-config: configurations are {WG2_CONFIGS}, got {a.wgmma2_configs!r}"
        )
    paths = list(KBIT_PATHS) if a.paths is None else [x.strip() for x in a.paths.split(",") if x.strip()]
    if not paths or any(x not in KBIT_PATHS for x in paths):
        raise SystemExit(f"--paths: subset of {','.join(KBIT_PATHS)}, got {a.paths!r}")
    lists = {"shapes": shapes, "bits": bits, "ms": ms, "ms_70b": ms_70b, "baselines": base,
             "wgmma2_configs": wg2c, "paths": paths}  # fmt: skip
    rest = {f.name: getattr(a, f.name) for f in fields(Config) if f.name not in lists}
    rest["wgmma"] = rest["wgmma"] or rest["wgmma2"] or bool(wg2c)
    rest["min_reps"] = max(1, rest["min_reps"])
    rest["max_reps"] = max(rest["min_reps"], rest["max_reps"])
    return Config(**lists, **rest)


# ------------------------------------------------------------------ plan + estimate


def dense_methods(cfg: Config) -> list[str]:
    if "fp16" not in cfg.baselines:
        return []
    return ["fp16", "bf16"] if cfg.dtype == "bf16" else ["fp16"]


def kbit_paths(cfg: Config, m: int | None = None) -> list[str]:
    """The kbit paths timed (at M = m: gemv up to --gemv-max-m, the wgmma paths mma_wg, mma_wg2
    and mma_wg2_c<N> above M = 32)."""
    paths = [p for p in KBIT_PATHS if p in cfg.paths]
    wg = (["mma_wg"] if cfg.wgmma else []) + (["mma_wg2"] if cfg.wgmma2 else [])
    wg += [wg2_config_path(c) for c in cfg.wgmma2_configs]
    at = paths.index("mma") + 1 if "mma" in paths else len(paths)
    paths[at:at] = wg
    if m is None:
        return paths
    return [p for p in paths
            if (p != "gemv" or m <= cfg.gemv_max_m) and (not is_wg_path(p) or m >= WG_MIN_M)]  # fmt: skip


def plan(cfg: Config) -> list[tuple[Shape, str, int | None, int]]:
    """Every timing point: (shape, method, bits or None, M), in run order."""
    out: list[tuple[Shape, str, int | None, int]] = []
    for sh in cfg.shapes:
        ms = cfg.ms_for(sh)
        for meth in dense_methods(cfg) + [b for b in cfg.baselines if b != "fp16"]:
            out += [(sh, meth, None, m) for m in ms]
        for bits in cfg.bits:
            for m in ms:
                out += [(sh, p, bits, m) for p in kbit_paths(cfg, m)]
    return out


def estimate_seconds(
    cfg: Config, l2: float = H100["l2"], bw: float = H100["bw"], flops: float = H100["flops"]
) -> float:
    """Rough wall time on an H100: start-up, setup per shape and k, and per point the eager
    validation, capture and warm-up/timed replays of R = copies calls."""
    setup = 25.0 + sum(2.0 + 0.4 * len(cfg.bits) for _ in cfg.shapes)
    if cfg.check_only:
        return setup
    total = setup
    for sh, meth, bits, m in plan(cfg):
        wb = weight_bytes(meth, sh.n, sh.k, bits)
        calls = copies_needed(wb, int(l2), cfg.l2_factor, cfg.max_copies)
        t = max(wb / bw, 2.0 * m * sh.n * sh.k / flops) + 5e-6
        if meth == "dequant":
            t += sh.n * sh.k * 2.0 / bw
        replay = calls * t
        reps = reps_for(replay, cfg.min_reps, cfg.max_reps, cfg.target_ms / 1e3)
        total += 0.01 + calls * 1e-4 + (cfg.warmup + 3 + reps) * replay
    return total


# ------------------------------------------------------------------------ records


@dataclass
class Point:
    model: str
    shape: str
    n: int
    k: int
    bits: int | None  # None for the baselines
    method: str  # gemv | mma | dequant | linear | fp16 | bf16 | marlin | machete
    m: int
    us: float | None = None
    status: str = "ok"  # "ok" or "n/a: reason"
    timing: str = ""  # graph | events | wall
    note: str = ""
    calls: int = 0
    reps: int = 0
    weight_bytes: float = 0.0
    tbps: float | None = None
    samples_us: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.us is not None


@dataclass
class Check:
    model: str
    shape: str
    bits: int | None
    method: str
    m: int  # 0 for the SQNR check
    metric: str  # rel_err | sqnr_db
    value: float | None
    ok: bool
    detail: str = ""


@dataclass
class Run:
    cfg: Config
    dev: torch.device
    act: torch.dtype
    l2: int
    mem_cap: float
    t0: float
    vllm: str  # where vLLM's kernels came from, or "n/a: why"
    points: list[Point] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def over_budget(self, what: str) -> bool:
        if self.elapsed() <= self.cfg.time_budget_s:
            return False
        self.skipped.append(what)
        return True

    def check(self, sh: Shape, bits: int | None, method: str, m: int, metric: str,
              value: float | None, ok: bool, detail: str = "") -> None:  # fmt: skip
        self.checks.append(Check(sh.model, sh.name, bits, method, m, metric, value, ok, detail))


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    e = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    return e if math.isfinite(e) else float("inf")


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def attempt(run: Run, fn: Callable[[], T]) -> tuple[T | None, str]:
    """(fn(), "") or (None, "why it failed"). Raises Fatal if the CUDA context is broken."""
    try:
        return fn(), ""
    except Fatal:
        raise
    except Exception as e:  # noqa: BLE001  (reported as n/a / a failed check)
        _check_alive(run, e)
        return None, _short(e)


def _check_alive(run: Run, after: BaseException) -> None:
    """Raise Fatal if the CUDA context no longer works after ``after`` was raised."""
    if run.dev.type == "cuda":
        try:
            torch.cuda.synchronize()
        except Exception as e:
            raise Fatal(f"CUDA context broken after {_short(after)}: {_short(e)}") from e


def new_point(sh: Shape, method: str, bits: int | None, m: int, **kw: object) -> Point:
    wb = weight_bytes(method, sh.n, sh.k, bits)
    return Point(sh.model, sh.name, sh.n, sh.k, bits, method, m, weight_bytes=wb, **kw)  # type: ignore[arg-type]


def _timing_kw(run: Run) -> dict[str, object]:
    c = run.cfg
    return {"warmup": c.warmup, "min_reps": c.min_reps, "max_reps": c.max_reps,
            "target_s": c.target_ms / 1e3, "use_graph": c.use_graph, "cuda": run.dev.type == "cuda"}  # fmt: skip


def measure(run: Run, sh: Shape, method: str, bits: int | None, m: int,
            fns: list[Callable[[], object]]) -> Point:  # fmt: skip
    t, why = attempt(run, lambda: time_calls(fns, **_timing_kw(run)))
    return record(run, sh, method, bits, m, t, why)


def measure_interleaved(run: Run, sh: Shape, bits: int, m: int,
                        groups: dict[str, list[Callable[[], object]]]) -> list[Point]:  # fmt: skip
    """--interleave: the kbit paths of one (shape, k, M) timed in rotating rounds."""
    res, why = attempt(run, lambda: time_interleaved(groups, **_timing_kw(run)))
    points = []
    for path in groups:
        t = None if res is None else res.get(path)
        if isinstance(t, Exception):
            _check_alive(run, t)
            t, why_p = None, _short(t)
        else:
            why_p = why
        points.append(record(run, sh, path, bits, m, t, why_p))
    return points


def record(run: Run, sh: Shape, method: str, bits: int | None, m: int, t: Timing | None,
           why: str) -> Point:  # fmt: skip
    p = new_point(sh, method, bits, m)
    if t is None:
        p.status = f"n/a: {why}"
    else:
        p.us, p.timing, p.note, p.calls, p.reps = t.us, t.method, t.note, t.calls, t.reps
        p.samples_us, p.tbps = t.samples_us, p.weight_bytes / (t.us * 1e-6) / 1e12
    run.points.append(p)
    return p


def n_copies(run: Run, bytes_per_copy: float) -> int:
    return copies_needed(bytes_per_copy, run.l2, run.cfg.l2_factor, run.cfg.max_copies, run.mem_cap)


def _free(run: Run) -> None:
    gc.collect()
    if run.dev.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------- baselines


def run_baselines(run: Run, sh: Shape, w: torch.Tensor) -> None:
    ms, check_only = run.cfg.ms_for(sh), run.cfg.check_only
    for meth in [] if check_only else dense_methods(run.cfg):
        wd = w.to(DTYPES[meth])
        copies = [wd] + [wd.clone() for _ in range(n_copies(run, wd.numel() * 2) - 1)]
        for m in ms:
            x = torch.randn(m, sh.k, device=run.dev, dtype=DTYPES[meth])
            p = measure(run, sh, meth, None, m, [_dense_fn(x, wc) for wc in copies])
            run.log(f"{sh.label:<12} {meth:<8} M={m:<5} {_cell(p):>9} us  (R={len(copies)})")
        del copies, wd
    for meth in [b for b in run.cfg.baselines if b in ("marlin", "machete")]:
        why = int4_unavailable(run, meth)
        setup = None
        if not why:
            setup, why = attempt(run, partial(int4_setup, run, sh, w, meth))
            why = why and f"setup failed: {why}"
        if setup is None:
            run.points += (
                []
                if check_only
                else [new_point(sh, meth, None, m, status=f"n/a: {why}") for m in ms]
            )
            run.log(f"{sh.label:<12} {meth:<8} n/a: {why}")
            continue
        factories, w_ref = setup
        check_int4(run, sh, meth, factories[0], w_ref)
        del w_ref
        for m in [] if check_only else ms:
            x = torch.randn(m, sh.k, device=run.dev, dtype=run.act)
            p = measure(run, sh, meth, None, m, [f(x) for f in factories])
            run.log(f"{sh.label:<12} {meth:<8} M={m:<5} {_cell(p):>9} us  (R={len(factories)})")
        del setup, factories
        _free(run)


def _dense_fn(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: torch.matmul(x, w.t())


def int4_unavailable(run: Run, meth: str) -> str:
    if run.vllm.startswith("n/a: "):
        return run.vllm[5:]
    return (i4.machete_supported() or "") if meth == "machete" else ""


Factory = Callable[[torch.Tensor], Callable[[], torch.Tensor]]


def int4_setup(
    run: Run, sh: Shape, w: torch.Tensor, meth: str
) -> tuple[list[Factory], torch.Tensor]:
    """Marlin or Machete weights in R copies -> (one factory x -> call per copy, w_ref)."""
    codes, scales, w_ref = i4.quantize_int4_g128(w)
    packed = i4.pack_int4_along_k(codes)
    del codes
    if meth == "marlin":
        ws = i4.marlin_workspace(run.dev)
        qw, s = i4.marlin_weights(packed, scales, sh.n, sh.k)
        pairs = [(qw, s)] + [
            (qw.clone(), s.clone())
            for _ in range(n_copies(run, qw.numel() * 4 + s.numel() * 2) - 1)
        ]
        return [_marlin_factory(q, sc, sh, ws) for q, sc in pairs], w_ref
    b = i4.machete_weights(packed, run.act)
    nbytes = b.numel() * b.element_size() + scales.numel() * 2
    pairs = [(b, scales)] + [(b.clone(), scales.clone()) for _ in range(n_copies(run, nbytes) - 1)]
    return [_machete_factory(q, sc) for q, sc in pairs], w_ref


def _marlin_factory(qw: torch.Tensor, s: torch.Tensor, sh: Shape, ws: torch.Tensor) -> Factory:
    return lambda x: i4.marlin_fn(x, qw, s, sh.n, sh.k, ws)


def _machete_factory(b: torch.Tensor, s: torch.Tensor) -> Factory:
    return lambda x: i4.machete_fn(x, b, s)


def check_int4(run: Run, sh: Shape, meth: str, factory: Factory, w_ref: torch.Tensor) -> None:
    wf = w_ref.float()
    for m in (1, 16):
        x = torch.randn(m, sh.k, device=run.dev, dtype=run.act)
        err, why = attempt(run, lambda: rel_err(factory(x)(), x.float() @ wf.t()))  # noqa: B023
        run.check(sh, None, meth, m, "rel_err", err, err is not None and err <= REL_ERR_LIMIT, why)


# ---------------------------------------------------------------------------- kbit


def kbit_fn(path: str, x: torch.Tensor, qt: torch.Tensor, at: torch.Tensor, cb: torch.Tensor,
            bits: int, n: int, wgmma: bool = False) -> Callable[[], torch.Tensor]:  # fmt: skip
    """One call of a kbit path. wgmma (--wgmma): "mma" is kbit::mma's mma.sync variant alone
    (KBIT_MMA_WGMMA=0), "mma_wg" its wgmma variant (=1), "mma_wg2" its warp-specialized
    wgmma kernel (=2) and "mma_wg2_c<N>" that kernel with configuration N forced
    (KBIT_WGMMA_CONFIG=N); otherwise "mma" is the op as it chooses by shape."""
    if path == "dequant":
        k, dq = x.shape[1], torch.ops.kbit.dequantize_tiled
        return lambda: torch.matmul(x, dq(qt, at, cb, bits, n, k, x.dtype).t())
    config = wg2_config_of(path)
    if is_wg_path(path) or (path == "mma" and wgmma):
        # the op reads KBIT_MMA_WGMMA and KBIT_WGMMA_CONFIG per call (also while a graph is
        # captured); both are restored afterwards
        env = {"KBIT_MMA_WGMMA": WG_FLAGS["mma_wg2" if config is not None else path]}
        if config is not None:
            env["KBIT_WGMMA_CONFIG"] = str(config)
        return with_env(env, lambda: torch.ops.kbit.mma(x, qt, at, cb, bits, n))
    op = getattr(torch.ops.kbit, path)
    return lambda: op(x, qt, at, cb, bits, n)


def kbit_weights(
    run: Run, w: torch.Tensor, cb: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    qa, why = attempt(run, lambda: torch.ops.kbit.quantize(w, cb, bits))
    if qa is None:
        from vllm_kbit import reference

        run.notes.append(f"torch.ops.kbit.quantize failed ({why}); used the PyTorch reference")
        qa = reference.quantize(w, bits, cb)
    return torch.ops.kbit.repack(qa[0], qa[1], bits)


def check_kbit(run: Run, sh: Shape, bits: int, w: torch.Tensor, qt: torch.Tensor,
               at: torch.Tensor, cb: torch.Tensor) -> None:  # fmt: skip
    """SQNR of the quantized weight, then every path at a few M vs an fp32 matmul on the
    dequantized weight (fresh random x each time)."""
    n0 = len(run.checks)
    wdq, why = attempt(
        run, lambda: torch.ops.kbit.dequantize_tiled(qt, at, cb, bits, sh.n, sh.k, run.act)
    )
    if wdq is None:
        run.check(sh, bits, "dequantize_tiled", 0, "sqnr_db", None, False, why)
        return
    wdq, wf = wdq.float(), w.float()
    sqnr = float(10 * torch.log10(wf.square().sum() / (wf - wdq).square().sum().clamp_min(1e-30)))
    del wf
    expect = f"expected {SQNR_DB[bits]} +- {SQNR_TOL_DB} dB"
    run.check(
        sh,
        bits,
        "dequantize_tiled",
        0,
        "sqnr_db",
        sqnr,
        abs(sqnr - SQNR_DB[bits]) <= SQNR_TOL_DB,
        expect,
    )
    for path in kbit_paths(run.cfg):
        for m in [m for m in check_ms(path) if path in kbit_paths(run.cfg, m)]:
            x = torch.randn(m, sh.k, device=run.dev, dtype=run.act)
            y, why = attempt(run, kbit_fn(path, x, qt, at, cb, bits, sh.n, run.cfg.wgmma))
            if y is None:
                run.check(sh, bits, path, m, "rel_err", None, False, why)
                continue
            err = rel_err(y, x.float() @ wdq.t())
            bad = (
                ""
                if (tuple(y.shape), y.dtype) == ((m, sh.n), run.act)
                else f"output {tuple(y.shape)} {y.dtype}"
            )
            run.check(sh, bits, path, m, "rel_err", err, err <= REL_ERR_LIMIT and not bad, bad)
    del wdq
    mine = run.checks[n0:]
    worst = max(
        (c.value for c in mine if c.metric == "rel_err" and c.value is not None),
        default=float("nan"),
    )
    flagged = ", ".join(f"{c.method}@M={c.m}" for c in mine if not c.ok)
    run.log(f"{sh.label:<12} k={bits} check: SQNR {sqnr:.2f} dB, worst rel err {worst:.2e}"
            + (f"  FLAGGED: {flagged}" if flagged else ""))  # fmt: skip


def run_kbit(run: Run, sh: Shape, bits: int, w: torch.Tensor) -> None:
    cb = torch.tensor(_codebook(bits), device=run.dev)
    qa, why = attempt(run, partial(kbit_weights, run, w, cb, bits))
    if qa is None:
        run.check(sh, bits, "quantize+repack", 0, "sqnr_db", None, False, why)
        ms = [] if run.cfg.check_only else run.cfg.ms_for(sh)
        run.points += [new_point(sh, p, bits, m, status=f"n/a: quantize/repack failed: {why}")
                       for m in ms for p in kbit_paths(run.cfg, m)]  # fmt: skip
        run.log(f"{sh.label:<12} k={bits} quantize/repack failed: {why}")
        return
    qt, at = qa
    check_kbit(run, sh, bits, w, qt, at, cb)
    if run.cfg.check_only:
        return
    R = n_copies(run, qt.numel() * 4 + at.numel())
    copies = [(qt, at)] + [(qt.clone(), at.clone()) for _ in range(R - 1)]
    for m in run.cfg.ms_for(sh):
        x = torch.randn(m, sh.k, device=run.dev, dtype=run.act)
        cells = []
        paths = kbit_paths(run.cfg, m)
        paths = list(reversed(paths)) if run.cfg.reverse_paths else paths
        groups = {p: [kbit_fn(p, x, q, a, cb, bits, sh.n, run.cfg.wgmma) for q, a in copies]
                  for p in paths}  # fmt: skip
        if run.cfg.interleave:
            for path, pt in zip(paths, measure_interleaved(run, sh, bits, m, groups)):
                cells.append(f"{path} {_cell(pt)}")
        else:
            for path in paths:
                cells.append(f"{path} {_cell(measure(run, sh, path, bits, m, groups[path]))}")
        run.log(f"{sh.label:<12} k={bits}  M={m:<5} " + "  ".join(cells) + f" us  (R={R})")
    del copies, qt, at
    _free(run)


def _codebook(bits: int) -> list[float]:
    from vllm_kbit.format import default_codebook

    return default_codebook(bits).tolist()


# ------------------------------------------------------------------------- tables


def md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table padded for reading in a terminal too."""
    w = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: (
        "| "
        + " | ".join(str(c).rjust(w[i]) if i > 1 else str(c).ljust(w[i]) for i, c in enumerate(r))
        + " |"
    )
    return [line(headers), "|" + "|".join("-" * (x + 2) for x in w) + "|", *[line(r) for r in rows]]


def _index(points: list[Point]) -> dict[tuple, Point]:
    return {(p.model, p.shape, p.bits, p.method, p.m): p for p in points}


def _cell(p: Point | None) -> str:
    if p is None:
        return "-"
    if not p.ok:
        return "n/a"
    return f"{p.us:.1f}" + ("*" if p.timing == "events" else "")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def best_kbit(idx: dict[tuple, Point], model: str, shape: str, bits: int, m: int) -> Point | None:
    """The fastest individual kbit kernel path (gemv, mma, mma_wg, mma_wg2, mma_wg2_c<N>,
    dequant); linear is the dispatching op and is compared with it, not counted as a path of
    its own."""
    paths = ("gemv", "mma", "mma_wg", "mma_wg2", *map(wg2_config_path, WG2_CONFIGS), "dequant")
    cands = [idx.get((model, shape, bits, p, m)) for p in paths]
    cands = [p for p in cands if p is not None and p.ok]
    return min(cands, key=lambda p: p.us) if cands else None


def _us(p: Point | None) -> float | None:
    return p.us if p is not None and p.ok else None


def per_m_tables(points: list[Point], cfg: Config) -> list[str]:
    idx, out = _index(points), []
    dense = dense_methods(cfg)
    for m in sorted({p.m for p in points}):
        headers = [
            "shape",
            "k",
            *kbit_paths(cfg),
            *dense,
            "Marlin",
            "Machete",
            "best",
            "best TB/s",
            f"{cfg.dense} TB/s",
            "Marlin TB/s",
            f"x vs {cfg.dense}",
            "x vs Marlin",
        ]
        rows = []
        for sh in cfg.shapes:
            for bits in cfg.bits:
                if not any((sh.model, sh.name, bits, p, m) in idx for p in kbit_paths(cfg)):
                    continue
                b = best_kbit(idx, sh.model, sh.name, bits, m)
                dn = idx.get((sh.model, sh.name, None, cfg.dense, m))
                mar = idx.get((sh.model, sh.name, None, "marlin", m))
                rows.append(
                    [sh.label, str(bits)]
                    + [_cell(idx.get((sh.model, sh.name, bits, p, m))) for p in kbit_paths(cfg)]
                    + [_cell(idx.get((sh.model, sh.name, None, d, m))) for d in dense]
                    + [_cell(mar), _cell(idx.get((sh.model, sh.name, None, "machete", m)))]
                    + [
                        b.method if b else "-",
                        f"{b.tbps:.2f}" if b else "-",
                        f"{dn.tbps:.2f}" if dn is not None and dn.ok else "-",
                        f"{mar.tbps:.2f}" if mar is not None and mar.ok else "-",
                        _ratio(_us(dn), _us(b)),
                        _ratio(_us(mar), _us(b)),
                    ]
                )
        if rows:
            out += [f"### M = {m}", "", *md_table(headers, rows), ""]
    return out


def layer_sums(points: list[Point], cfg: Config) -> dict[tuple[str, int, str], float | None]:
    """(model, M, series) -> sum over the model's shapes in µs (None if any is missing).
    series: 'k=2'.. (the dispatching linear op), 'best k=2'.., and the baselines."""
    idx, out = _index(points), {}
    for model in cfg.models:
        shapes = [s for s in cfg.shapes if s.model == model]
        for m in sorted({p.m for p in points if p.model == model}):
            series = {
                f"k={b}": [idx.get((model, s.name, b, "linear", m)) for s in shapes]
                for b in cfg.bits
            }
            series |= {
                f"best k={b}": [best_kbit(idx, model, s.name, b, m) for s in shapes]
                for b in cfg.bits
            }
            series |= {
                meth: [idx.get((model, s.name, None, meth, m)) for s in shapes]
                for meth in [*dense_methods(cfg), "marlin", "machete"]
            }
            for name, ps in series.items():
                ok = all(p is not None and p.ok for p in ps)
                out[(model, m, name)] = sum(p.us for p in ps) if ok else None  # type: ignore[misc]
    return out


def layer_tables(points: list[Point], cfg: Config) -> tuple[list[str], list[str]]:
    """(per-decoder-layer sums in µs, rows (model, M, k); speedup summary vs the dense
    baseline, rows = series, columns = M)."""
    if not points:
        return [], []
    sums, d = layer_sums(points, cfg), cfg.dense
    headers = [
        "model",
        "M",
        "k",
        "kbit linear",
        "kbit best",
        d,
        "Marlin",
        "Machete",
        f"linear x {d}",
        "linear x Marlin",
        "linear x Machete",
    ]
    rows, summary = [], []
    for model in cfg.models:
        name = MODEL_NAMES.get(model, model)
        ms = sorted({m for (mo, m, _) in sums if mo == model})
        for m in ms:
            base = [sums.get((model, m, s)) for s in (d, "marlin", "machete")]
            for b in cfg.bits:
                lin, best = sums.get((model, m, f"k={b}")), sums.get((model, m, f"best k={b}"))
                rows.append(
                    [
                        name,
                        str(m),
                        str(b),
                        *map(_fmt_sum, [lin, best, *base]),
                        *[_ratio(v, lin) for v in base],
                    ]
                )
        series = [(f"k={b} linear", f"k={b}") for b in cfg.bits]
        series += [("Marlin int4", "marlin"), ("Machete int4", "machete")]
        srows = [
            [name, label, *[_ratio(sums.get((model, m, d)), sums.get((model, m, key))) for m in ms]]
            for label, key in series
        ]
        summary += [*md_table(["model", "series", *[f"M={m}" for m in ms]], srows), ""]
    return (md_table(headers, rows) if rows else []), summary


def _fmt_sum(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else "n/a"


def check_lines(checks: list[Check], flagged_only: bool = False) -> list[str]:
    rows = []
    for c in checks:
        if flagged_only and c.ok:
            continue
        val = (
            "error"
            if c.value is None
            else (f"{c.value:.2f} dB" if c.metric == "sqnr_db" else f"{c.value:.2e}")
        )
        rows.append(
            [
                f"{c.model}.{c.shape}",
                str(c.bits or "-"),
                c.method,
                str(c.m or "-"),
                val,
                "ok" if c.ok else "FLAGGED",
                c.detail,
            ]
        )
    return md_table(["shape", "k", "path", "M", "value", "", "detail"], rows) if rows else []


def notes_lines(run: Run) -> list[str]:
    reasons: dict[str, set[str]] = {}
    for p in run.points:
        if not p.ok:
            reasons.setdefault(f"{p.method}: {p.status}", set()).add(f"{p.model}.{p.shape}")
        elif p.note:
            reasons.setdefault(f"{p.method}: timed without graph ({p.note})", set()).add(
                f"{p.model}.{p.shape}"
            )
    out = [f"- {r} [{', '.join(sorted(s))}]" for r, s in sorted(reasons.items())]
    out += [f"- {n}" for n in run.notes]
    if run.skipped:
        out.append(
            f"- skipped (time budget {run.cfg.time_budget_s:.0f} s): {', '.join(run.skipped)}"
        )
    return out


# ------------------------------------------------------------------------ outputs


def out_stem(cfg: Config, short: str) -> str:
    parts = ["bench_linear", short] + ([cfg.tag] if cfg.tag else [])
    parts += ["quick"] if cfg.quick else []
    parts += ["check"] if cfg.check_only else []
    return "_".join(parts)


def write_outputs(run: Run, meta: dict, final: bool) -> list[Path]:
    cfg = run.cfg
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    stem = cfg.out_dir / out_stem(cfg, str(meta.get("device_short", "gpu")))
    meta = {
        **meta,
        "elapsed_s": round(run.elapsed(), 1),
        "complete": final
        and not run.skipped
        and not any(n.startswith("ABORTED") for n in run.notes),
        "vllm_kernels": run.vllm,
    }
    conf = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "shapes"
    }
    conf["shapes"] = [asdict(s) for s in cfg.shapes]
    doc = {
        "meta": meta,
        "config": conf,
        "points": [asdict(p) for p in run.points],
        "checks": [asdict(c) for c in run.checks],
        "notes": notes_lines(run),
        "skipped": run.skipped,
    }
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    if final and run.points:
        why = plot_speedup(run.points, cfg, stem.with_suffix(".png"))
        if why:
            run.notes.append(f"no plot: {why}")
        else:
            paths.append(stem.with_suffix(".png"))
    doc["notes"] = notes_lines(run)
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    paths[1].write_text("\n".join(markdown(run, meta)) + "\n")
    return paths


def markdown(run: Run, meta: dict) -> list[str]:
    cfg = run.cfg
    layer, summary = layer_tables(run.points, cfg)
    keys = [
        "device",
        "capability",
        "sm_count",
        "l2_bytes",
        "driver",
        "torch",
        "cuda_runtime",
        "vllm",
        "vllm_kernels",
        "kbit_backend",
        "date_utc",
        "command",
        "git_commit",
        "git_dirty",
        "elapsed_s",
        "complete",
    ]
    out = [f"# kbit linear benchmark: {meta.get('device', '?')}", ""]
    out += [f"- {k}: `{meta.get(k)}`" for k in keys if k in meta]
    method = (
        f"Times are µs per call (median of CUDA-graph replays, each replay rotating through "
        f"weight copies that total >= {cfg.l2_factor:g}x L2; `*` = timed without a graph). "
        f"Activations {cfg.dtype}. TB/s = weight bytes / time: kbit N*K*(k+0.25)/8, fp16 N*K*2, "
        "int4 g128 N*K*4.125/8. best = fastest of gemv/mma/dequant; `x vs` = baseline time / "
        "best time. Layer sums add the 4 linear layers of one decoder layer. See "
        "benchmarks/README.md."
    )
    out += ["", method, ""]
    if summary:
        out += [
            f"## Speedup of one decoder layer's linears vs {cfg.dense} (kbit = dispatching linear op)",
            "",
            *summary,
        ]
    if layer:
        out += ["## Per-decoder-layer sums (µs)", "", *layer, ""]
    tables = per_m_tables(run.points, cfg)
    if tables:
        out += ["## Per-M tables (µs per call)", "", *tables]
    how = (
        f"rel err = ‖y − ref‖/‖ref‖ vs fp32 matmul on the dequantized weight, flagged above "
        f"{REL_ERR_LIMIT:g}; SQNR of the kbit weight vs the fp weight."
    )
    out += ["## Correctness checks", "", how, "", *check_lines(run.checks), ""]
    notes = notes_lines(run)
    if notes:
        out += ["## Notes", "", *notes, ""]
    return out


def plot_speedup(points: list[Point], cfg: Config, path: Path) -> str | None:
    """Per-decoder-layer speedup vs the dense baseline over M, one panel per model.
    Returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib not importable ({e})"
    sums, d = layer_sums(points, cfg), cfg.dense
    models = [mo for mo in cfg.models if any(k[0] == mo for k in sums)]
    if not models:
        return "no layer sums"
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    series = [(f"k={b}", f"kbit k={b}", "-", "o") for b in cfg.bits]
    series += [
        ("marlin", "Marlin int4 g128", "--", "s"),
        ("machete", "Machete int4 g128", ":", "^"),
    ]
    for ax, model in zip(axes[0], models):
        ms = sorted({m for (mo, m, _) in sums if mo == model})
        for key, label, ls, mk in series:
            xy = [
                (m, sums[(model, m, d)] / sums[(model, m, key)])
                for m in ms
                if sums.get((model, m, d)) and sums.get((model, m, key))
            ]
            if xy:
                ax.plot(*zip(*xy), ls, marker=mk, label=label)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel(f"speedup vs {d} (decoder-layer linears)")
        ax.set_title(MODEL_NAMES.get(model, model))
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------- main


def _setup_device(cfg: Config) -> tuple[torch.device, str]:
    from vllm_kbit import _ops

    backend = _ops.load()
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device (use --device cpu for a functional run on the CPU)")
        if backend != "compiled" and not cfg.allow_reference:
            raise SystemExit(
                f"vllm_kbit._C is not built (backend {backend!r}): build the extension first "
                "(pip install --no-build-isolation --no-deps -e .) or pass --allow-reference"
            )
        torch.cuda.init()
    return torch.device(cfg.device), backend


def run_shape(run: Run, sh: Shape) -> None:
    """Baselines, then every k: quantize, check, time. Frees the GPU memory it used."""
    w = torch.randn(sh.n, sh.k, device=run.dev, dtype=run.act) * 0.02
    run_baselines(run, sh, w)
    for bits in run.cfg.bits:
        if not run.over_budget(f"{sh.label} k={bits}"):
            run_kbit(run, sh, bits, w)
    del w
    _free(run)


def main(argv: Sequence[str] | None = None) -> int:
    t0 = time.monotonic()  # the time budget counts from here
    cfg = parse_args(argv)
    pts = plan(cfg)
    n_pts = 0 if cfg.check_only else len(pts)
    est = estimate_seconds(cfg)
    print(
        f"plan: {len(cfg.shapes)} shapes x k={cfg.bits}, M={cfg.ms}"
        + (f" (70B: {cfg.ms_70b})" if cfg.ms_70b != cfg.ms else "")
        + f", {n_pts} timing points; estimated {est:.0f} s on an H100 (rough)",
        flush=True,
    )
    if cfg.dry_run:
        return 0
    dev, backend = _setup_device(cfg)
    torch.manual_seed(0)
    meta = run_metadata(sys.argv if argv is None else ["benchmarks/bench_linear.py", *argv])
    meta["kbit_backend"] = backend
    if dev.type == "cuda":
        l2 = cfg.l2_bytes if cfg.l2_bytes is not None else l2_cache_bytes()
        mem_cap = 0.3 * torch.cuda.mem_get_info()[0]
    else:
        l2, mem_cap = cfg.l2_bytes or 0, 4e9
    vllm = "n/a: not requested"
    if dev.type != "cuda":
        vllm = "n/a: no CUDA"
    elif {"marlin", "machete"} & set(cfg.baselines):
        try:
            vllm = i4.load_vllm_ops(cfg.vllm_ops_lib)
        except Exception as e:  # noqa: BLE001
            vllm = f"n/a: {e}"
    run = Run(cfg, dev, DTYPES[cfg.dtype], l2, mem_cap, t0, vllm)
    meta["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    meta["fp16_reduced_precision_reduction"] = (
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    )
    print(
        f"device {meta.get('device')} ({meta.get('capability', '-')}, {meta.get('sm_count')} SMs, "
        f"L2 {l2 / 2**20:.0f} MiB), torch {torch.__version__}, kbit backend {backend}, vLLM kernels: {vllm}",
        flush=True,
    )
    try:
        for sh in cfg.shapes:
            if run.over_budget(f"{sh.label} (all)"):
                continue
            try:
                run_shape(run, sh)
            except Fatal:
                raise
            except Exception as e:  # noqa: BLE001  (a bug here: kernel failures are caught per call)
                traceback.print_exc()
                run.notes.append(f"{sh.label}: stopped by {_short(e)}")
                _check_alive(run, e)
                _free(run)
            write_outputs(run, meta, final=False)
    except Fatal as e:
        run.notes.append(f"ABORTED: {e}")
        print(f"ABORTED: {e}", flush=True)
    files = write_outputs(run, meta, final=True)
    layer, summary = layer_tables(run.points, cfg)
    print("\n" + "\n".join(per_m_tables(run.points, cfg)))
    if layer:
        print("Per-decoder-layer sums (µs)\n" + "\n".join(layer) + "\n")
    print("\n".join(notes_lines(run)))
    flagged = [c for c in run.checks if not c.ok]
    print(
        f"\ncorrectness: {len(run.checks) - len(flagged)}/{len(run.checks)} checks ok"
        + (", FLAGGED:\n" + "\n".join(check_lines(flagged)) if flagged else "")
    )
    if summary:
        print(f"\nSpeedup of one decoder layer's linears vs {cfg.dense}\n" + "\n".join(summary))
    print(f"elapsed {run.elapsed():.0f} s; wrote " + ", ".join(map(str, files)), flush=True)
    return (
        1 if (cfg.check_only and flagged) or any(n.startswith("ABORTED") for n in run.notes) else 0
    )


if __name__ == "__main__":
    sys.exit(main())
