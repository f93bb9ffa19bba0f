# SPDX-License-Identifier: Apache-2.0
"""Shared timing helpers of the kbit benchmarks.

Method (see benchmarks/README.md): each call reads its own copy of the weights, and the
copies together exceed ``factor`` x the GPU's L2, so every call streams cold weights from
HBM. One rotation through the copies (R calls) is captured in a CUDA graph; graph replays
are timed with CUDA events; the result is the median over the replays divided by R. If
capture fails, the same rotation is timed with events around eager calls (the note says
why). On a machine without CUDA the wall clock is used (for tests only).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Timing:
    us: float  # median microseconds per call
    calls: int  # calls per timed replay (= weight copies rotated through)
    reps: int  # timed replays
    method: str  # "graph", "events" (eager calls, no graph) or "wall" (CPU)
    note: str = ""  # why the graph was not used, if it was not
    samples_us: list[float] = field(default_factory=list)  # per replay, per call


def with_env(env: dict[str, str], fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the environment variables `env` set around each call, then restored. For ops that
    read a KBIT_* setting per call: under CUDA-graph capture the captured path is the one the
    setting chose."""

    def call() -> object:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return call


def l2_cache_bytes(device: int = 0) -> int:
    """The GPU's L2 size in bytes (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def copies_needed(
    bytes_per_copy: float,
    l2_bytes: int,
    factor: float = 3.0,
    max_copies: int = 64,
    max_total_bytes: float | None = None,
) -> int:
    """Weight copies to rotate through so that they total >= factor x L2 (at least 1),
    capped at ``max_copies`` and at ``max_total_bytes`` of memory."""
    if bytes_per_copy <= 0:
        raise ValueError(f"bytes_per_copy must be positive, got {bytes_per_copy}")
    n = max(1, math.ceil(factor * l2_bytes / bytes_per_copy))
    n = min(n, max(1, max_copies))
    if max_total_bytes is not None:
        n = min(n, max(1, int(max_total_bytes // bytes_per_copy)))
    return n


def reps_for(
    replay_s: float, min_reps: int = 10, max_reps: int = 200, target_s: float = 0.02
) -> int:
    """Timed replays: enough to fill ``target_s``, within [min_reps, max_reps]."""
    if replay_s <= 0:
        return max_reps
    return max(min_reps, min(max_reps, math.ceil(target_s / replay_s)))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def capture_graph(fns: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """One CUDA graph of the calls ``fns`` in order, after one warm-up pass of them."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch recommends
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return g


def _runner(fns: Sequence[Callable[[], object]], use_graph: bool,
            cuda: bool) -> tuple[Callable[[], object], str, str]:  # fmt: skip
    """(run one rotation, timing method, note) for ``fns``: every call runs once eagerly first,
    outside any try (an op that fails raises here, for the caller to report), then the rotation
    is captured in a CUDA graph; should capture fail, it runs as eager calls between events."""
    if not fns:
        raise ValueError("timing needs at least one callable")
    for f in fns:  # validates every call and warms caches/handles
        f()
    _sync()

    def eager() -> None:
        for f in fns:
            f()

    if not cuda:
        return eager, "wall", ""
    if not use_graph:
        return eager, "events", "graphs disabled (--no-graph)"
    try:
        return capture_graph(fns).replay, "graph", ""
    except Exception as e:  # noqa: BLE001  (reported, then timed without a graph)
        _sync()  # a broken context raises here, which the caller treats as fatal
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return eager, "events", f"graph capture failed: {type(e).__name__}: {first}"


def time_calls(
    fns: Sequence[Callable[[], object]],
    *,
    warmup: int = 3,
    min_reps: int = 10,
    max_reps: int = 200,
    target_s: float = 0.02,
    use_graph: bool = True,
    cuda: bool | None = None,
) -> Timing:
    """Median time of one call, rotating through ``fns`` (one closure per weight copy); see
    _runner for the eager first calls and the graph. ``cuda=False`` times with the wall clock
    (CPU tensors)."""
    t = time_interleaved({"": fns}, warmup=warmup, min_reps=min_reps, max_reps=max_reps,
                         target_s=target_s, use_graph=use_graph, cuda=cuda)[""]  # fmt: skip
    if isinstance(t, Exception):
        raise t
    return t


def time_interleaved(
    groups: dict[str, Sequence[Callable[[], object]]],
    *,
    warmup: int = 3,
    min_reps: int = 10,
    max_reps: int = 200,
    target_s: float = 0.02,
    use_graph: bool = True,
    cuda: bool | None = None,
) -> dict[str, Timing | Exception]:
    """time_calls for several paths at once (time_calls is the one-path case). After the warm-up
    replays and one untimed replay per path (the slowest sizes the replay count), the timed
    replays run in rounds: every round replays each path once, the first path of a round
    rotating, so that clock, power and cache drift fall on all paths alike instead of on
    whichever is timed first (the order effect seen in bench_linear_h100__s3_reverse / __s4).
    A path whose first calls raise gets its exception; the others are still timed."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    out: dict[str, Timing | Exception] = {}
    runners: dict[str, tuple[Callable[[], object], str, str]] = {}
    for name, fns in groups.items():
        try:
            runners[name] = _runner(fns, use_graph, cuda)
        except Exception as e:  # noqa: BLE001  (reported by the caller)
            out[name] = e
    if not runners:
        return out
    slowest = 0.0
    for run, _, _ in runners.values():
        for _ in range(warmup):
            run()
        _sync()
        t0 = time.perf_counter()
        run()
        _sync()
        slowest = max(slowest, time.perf_counter() - t0)
    reps = reps_for(slowest, min_reps, max_reps, target_s)
    names = list(runners)
    samples: dict[str, list] = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            run = runners[name][0]
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
                run()
                ev[1].record()
                samples[name].append(ev)
            else:
                t0 = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - t0)
    _sync()
    for name in names:
        calls = len(groups[name])
        us = [s.elapsed_time(e) * 1e3 / calls for s, e in samples[name]] if cuda else [
            t * 1e6 / calls for t in samples[name]]  # fmt: skip
        _, method, note = runners[name]
        out[name] = Timing(statistics.median(us), calls, reps, method, note, _round(us))
    return out


def _round(xs: list[float]) -> list[float]:
    return [round(x, 3) for x in xs]


# ----------------------------------------------------------------- device + run facts


def device_short_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA GeForce RTX 4090' -> 'rtx4090'."""
    s = name.replace("NVIDIA", "").replace("GeForce", "").strip()
    m = re.search(r"\bRTX\s*(?:PRO\s*)?(\d{4})", s, re.IGNORECASE)
    if m:
        return f"rtx{m.group(1)}"
    m = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", s)
    if m:
        return m.group(1).lower()
    slug = re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")
    return slug[:24] or "unknown"


def _cmd(args: list[str], timeout: float = 10.0) -> str:
    try:
        r = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, check=False
        )
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    """HEAD of this checkout; KBIT_GIT_COMMIT overrides it (the GPU machine's copy of the tree
    can carry a stale .git: pass the commit in the command, KBIT_GIT_COMMIT=$(git rev-parse HEAD)
    evaluated here)."""
    return os.environ.get("KBIT_GIT_COMMIT") or _cmd(["git", "rev-parse", "HEAD"]) or "unknown"


def run_metadata(argv: Sequence[str] | None = None) -> dict[str, object]:
    """Facts about this run: device, versions, date, command line, git commit."""
    argv = list(sys.argv if argv is None else argv)
    meta: dict[str, object] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "python": platform.python_version(),
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "git_commit": git_commit(),
        "git_dirty": None if os.environ.get("KBIT_GIT_COMMIT") else bool(
            _cmd(["git", "status", "--porcelain", "--untracked-files=no"])),
    }
    try:
        from importlib.metadata import version

        meta["vllm"] = version("vllm")
    except Exception:  # noqa: BLE001
        meta["vllm"] = "not installed"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta.update(
            {
                "device": p.name,
                "device_short": device_short_name(p.name),
                "capability": f"sm_{p.major}{p.minor}",
                "sm_count": p.multi_processor_count,
                "l2_bytes": int(p.L2_cache_size),
                "memory_bytes": int(p.total_memory),
            }
        )
        q = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,persistence_mode"
        smi = _cmd(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader", "-i", "0"])
        if smi:
            meta.update(
                dict(
                    zip(
                        [f"smi_{k.replace('.', '_')}" for k in q.split(",")],
                        [v.strip() for v in smi.split(",")],
                    )
                )
            )
        meta["driver"] = meta.get("smi_driver_version", "unknown")
    else:
        meta.update({"device": "cpu", "device_short": "cpu", "sm_count": 0, "l2_bytes": 0})
    return meta


def write_results(out_dir: Path, name: str, meta: dict[str, object], rows: list[dict],
                  title: str, notes: Sequence[str], table: Sequence[str]) -> None:  # fmt: skip
    """``<out_dir>/<name>.json`` ({"meta", "rows"}) and ``<name>.md``: the title with the device,
    the command, date / commit / versions, ``notes`` as bullets, then the ``table`` lines. The md
    is also printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# {title} ({meta.get('device')})", "", f"- command: `{meta['command']}`",
             f"- date: {meta['date_utc']}, commit {meta['git_commit']}, torch {meta['torch']}, "
             f"CUDA {meta['cuda_runtime']}", *(f"- {n}" for n in notes), "", *table]  # fmt: skip
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
