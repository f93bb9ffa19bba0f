# SPDX-License-Identifier: Apache-2.0
"""End-to-end decode throughput through vLLM's offline ``LLM`` API: output tokens/s at
several batch sizes for a model built from a ``config.json`` with dummy weights, for fp16
and kbit k = 2..5 (online quantization of the dummy weights at load time).

Each method runs in its own subprocess (fresh GPU memory); results are appended to a JSON
file as they finish, and finished (method, batch) pairs are skipped when re-run.

    python benchmarks/bench_e2e.py --methods fp16,kbit4 --batch 1,64 --out-dir benchmarks/results
    # MoE, Qwen3-30B-A3B shape (48 layers, 128 experts, top-8): bf16 vs online kbit4
    python benchmarks/bench_e2e.py --shape qwen3-30b-a3b --dtype bfloat16 --methods bf16,kbit4
        --batch 1,16,64 --tag _qwen3_30b_a3b        (one command line)

``--profile`` adds, after the timed runs of each batch size, one more generate under vLLM's torch
profiler (``profiler_config``) and a table of where the GPU time per output token goes
(``trace_summary.py``: kernel families, top kernels, GPU idle share) in ``bench_e2e{tag}_profile.md``.
The host side of a step: ``--threads`` records the busiest host threads during the timed runs
(at batch 1 vLLM's engine-core thread: ~100% busy when the step waits on it, ~45% for fp16's
GPU-bound step), ``--host-profile`` runs one more generate under cProfile with the engine in the
worker's process (``bench_e2e{tag}_{method}_b{batch}_host.txt``). Each batch size's timed runs
follow ``--warmup`` discarded generates (default 3).

A method is ``kbitK`` (online k-bit), ``kbitKlm`` (the same with the lm_head quantized too,
config key ``quantize_lm_head``), either of them + ``pdl`` (run with ``KBIT_PDL=1`` set; the
other methods run with KBIT_PDL unset, i.e. the kernels' default, programmatic dependent launch
on since session 29: compare with it off through ``--variant off:KBIT_PDL=0``) or anything else
(the unquantized model in ``--dtype``); the first unquantized method is the baseline of the table.
Any method + ``@NAME`` runs with the build in ``.ab/NAME`` (tools/ab_base.sh: another git ref),
e.g. ``--methods bf16,kbit4@base,kbit4`` times main's build against the checkout's in one run.
Any method + ``+NAME`` runs with the settings of ``--variant NAME:KBIT_VAR=VALUE,...`` (tuning
variables, as in probe_env.py, vLLM's ``VLLM_*`` or torch.compile's ``TORCHINDUCTOR_*``; the
other methods run without the variants' variables), e.g. ``--methods fp16,kbit4,kbit4+old
--variant old:KBIT_MMA_CLUSTER_SPLITS=8`` or ``--methods fp16,fp16+inproc,kbit2lm,kbit2lm+inproc
--variant inproc:VLLM_ENABLE_V1_MULTIPROCESSING=0``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import select
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001,
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
SHAPES = {"llama-8b": (LLAMA_8B, "Llama-3.1-8B shape"),
          "qwen3-30b-a3b": (QWEN3_30B_A3B, "Qwen3-30B-A3B shape (MoE, 128 experts top-8)")}


def model_dir(config: str | None, work: Path, shape: str = "llama-8b",
              layers: int | None = None) -> Path:
    """A directory holding only config.json (dummy weights need nothing else); ``layers``
    overrides num_hidden_layers."""
    d = work / "model"
    d.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(Path(config).read_text()) if config else dict(SHAPES[shape][0])
    cfg.pop("quantization_config", None)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        cfg["num_hidden_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


# The variables a --variant may set: the kernels' tuning variables and, since every method runs in
# a fresh vLLM process, vLLM's and torch.compile's (e.g. TORCHINDUCTOR_ENABLE_PDL=1, given its own
# VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR so that no graph compiled without it is reused).
VARIANT_PREFIXES = ("KBIT_", "VLLM_", "TORCHINDUCTOR_")

# kbit method names: kbitK[lm][pdl], K in 2..5.
KBIT_METHOD = re.compile(r"kbit([2-5])(lm)?(pdl)?")


def method_parts(method: str) -> tuple[str, str, str]:
    """``BASE[@BUILD][+VARIANT]`` -> (BASE, BUILD, VARIANT), "" where absent."""
    rest, _, variant = method.partition("+")
    base, _, build = rest.partition("@")
    return base, build, variant


def kbit_config(method: str) -> dict:
    """``kbitK[lm][pdl][@NAME][+VARIANT]`` -> the ``quantization_config`` passed through
    ``hf_overrides`` (``lm``: quantize the lm_head too; ``pdl``: the same config, run with
    ``KBIT_PDL=1``; ``@NAME`` / ``+VARIANT``: the same config, run with another build or other
    tuning variables, see method_env)."""
    m = KBIT_METHOD.fullmatch(method_parts(method)[0])
    if m is None:
        raise ValueError(f"bench_e2e: method {method!r} is not kbitK[lm][pdl] with K in 2..5")
    return {"quant_method": "kbit", "bits": int(m.group(1)), "quantize_lm_head": m.group(2) is not None}


def method_env(
    method: str, ab_root: Path = HERE.parent / ".ab", variants: dict[str, dict[str, str]] | None = None
) -> dict[str, str]:
    """Environment of a method's worker: ``...pdl`` methods run with ``KBIT_PDL=1`` set, every
    other method with KBIT_PDL unset (the kernels' default) unless a variant sets it.
    ``METHOD@NAME`` imports vllm_kbit from ``.ab/NAME`` (a build of another git ref, tools/ab_base.sh; prepended to
    PYTHONPATH, which vLLM's engine process inherits): end-to-end A/B of two builds in one run.
    ``METHOD+NAME`` sets the variables of ``variants[NAME]``; a variable of any variant is
    removed from every other method's environment."""
    variants = variants or {}
    base, build, variant = method_parts(method)
    if variant and variant not in variants:
        raise ValueError(f"bench_e2e: method {method!r}: no --variant {variant}:VAR=VALUE,...")
    drop = {"KBIT_PDL"}.union(*variants.values())
    env = {k: v for k, v in os.environ.items() if k not in drop}
    m = KBIT_METHOD.fullmatch(base)
    if m is not None and m.group(3):
        env["KBIT_PDL"] = "1"
    if build:
        d = ab_root / build
        if not (d / "vllm_kbit").is_dir():
            raise ValueError(f"bench_e2e: method {method!r}: no build at {d} (tools/ab_base.sh "
                             f"export REF {build}, then build it)")  # fmt: skip
        env["PYTHONPATH"] = str(d) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(variants.get(variant, {}))
    return env


def parse_cpus(spec: str) -> list[int]:
    """``--cpus`` "0-3,8" -> [0, 1, 2, 3, 8]."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        hi = hi or lo
        if not (lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):  # "", "a", "-1", "5-3"
            raise ValueError(f"--cpus takes CPU numbers and ranges like 0-3,8, got {spec!r}")
        cpus.update(range(int(lo), int(hi) + 1))
    return sorted(cpus)


def worker(args: argparse.Namespace) -> None:
    """Runs inside the subprocess: one method, all batch sizes; prints one JSON line each."""
    if args.cpus:  # before vLLM starts: its engine processes inherit the affinity
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    from vllm import LLM, SamplingParams

    kw = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0,
              dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=max(args.batch), gpu_memory_utilization=args.gpu_mem,
              enforce_eager=args.eager)  # fmt: skip
    if args.method.startswith("kbit"):
        kw.update(quantization="kbit", hf_overrides={"quantization_config": kbit_config(args.method)})
    if args.profile_dir:  # configured only: the profiler records between start/stop_profile
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": args.profile_dir,
                                 "torch_profiler_with_stack": False,
                                 "torch_profiler_dump_cuda_time_total": False}  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    print(json.dumps({"event": "loaded", "method": args.method, "load_s": load_s}), flush=True)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    vocab = 1000
    for b in args.batch:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % vocab + 10 for j in range(args.input_len)]}
                   for i in range(b)]  # fmt: skip
        warm = []
        for _ in range(args.warmup):  # discarded: the first generates after start run slow
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            warm.append(time.perf_counter() - t)
        times = []
        cpu0, t0 = (thread_cpu(), time.perf_counter()) if args.threads else (None, 0.0)
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            times.append(time.perf_counter() - t)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        med = statistics.median(times)
        ev = {"event": "result", "method": args.method, "batch": b, "output_tokens": n_out,
              "seconds_median": med, "seconds_all": times, "seconds_warmup": warm,
              "output_tok_s": n_out / med, "load_s": load_s}  # fmt: skip
        if cpu0 is not None:
            ev["threads"] = busiest_threads(cpu0, thread_cpu(), time.perf_counter() - t0)
        print(json.dumps(ev), flush=True)
        if args.host_profile_file:  # the engine runs in this process (main sets it): its host work
            import cProfile
            import pstats

            prof, t = cProfile.Profile(), time.perf_counter()
            prof.enable()
            llm.generate(prompts, sp, use_tqdm=False)
            prof.disable()
            t = time.perf_counter() - t
            path = f"{args.host_profile_file}_b{b}.txt"
            with open(path, "w") as f:
                f.write(f"# {args.method}, batch {b}: one generate of {args.output_len} tokens "
                        f"under cProfile, {t:.3f} s (untimed median {med:.3f} s); the engine ran "
                        "in this process\n")
                st = pstats.Stats(prof, stream=f)
                st.sort_stats("cumulative").print_stats(60)
                st.sort_stats("tottime").print_stats(40)
            print(json.dumps({"event": "host_profile", "method": args.method, "batch": b,
                              "seconds": t, "file": path}), flush=True)  # fmt: skip
        if args.profile_dir:  # vLLM restarts its profiler: one trace file per start/stop
            llm.start_profile()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            llm.stop_profile()
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            print(json.dumps({"event": "profile", "method": args.method, "batch": b,
                              "output_tokens": n_out, "dir": args.profile_dir}), flush=True)  # fmt: skip
    os._exit(0)  # a finished LLM can hang at exit (engine process)


def thread_cpu(root: int | None = None) -> dict[int, tuple[int, str, float, int]]:
    """CPU seconds so far of every thread of process `root` (default: this one) and of its
    descendants (vLLM's engine process): {tid: (pid, name, seconds, CPU it last ran on)},
    from /proc (Linux)."""
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                ppid = int((d / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(ppid, []).append(int(d.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    out = {}
    for pid in pids:
        for t in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (t / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            f = stat.rpartition(")")[2].split()  # f[0] = state (field 3): field n is f[n - 3]
            out[int(t.name)] = (pid, name, (int(f[11]) + int(f[12])) / tick, int(f[36]))
    return out


def busiest_threads(before: dict, after: dict, wall_s: float, top: int = 8) -> list[dict]:
    """The `top` threads by CPU time between two thread_cpu() snapshots, as a share of wall_s:
    which of vLLM's threads a batch-1 decode step waits on (the host side of the step)."""
    rows = [{"pid": pid, "tid": tid, "name": name, "cpu": cpu,
             "busy": round((s - before.get(tid, (0, "", 0.0))[2]) / wall_s, 3)}
            for tid, (pid, name, s, cpu) in after.items()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["busy"])[:top]


def _git_head() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=HERE, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def versions() -> dict:
    import torch

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception as e:  # pragma: no cover
        info["vllm"] = f"n/a ({e})"
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    info["git_commit"] = os.environ.get("KBIT_GIT_COMMIT") or _git_head()
    return info


# vLLM's engine logs the GPU memory of the loaded weights (gpu_model_runner.py and the V2
# runner's model_runner.py, vLLM 0.26): the check that a kbit method quantized what it should
# (an lm_head left in fp16 adds ~0.8 GiB at k=2 on the 8B shape: 3.80 against 2.96 GiB in
# benchmarks/results/bench_e2e_h100_s24_b1.md).
LOADING_RE = re.compile(r"Model loading took ([0-9.]+) GiB")


def weights_gib(line: str) -> float | None:
    """The GiB of vLLM's 'Model loading took N GiB ...' log line, else None."""
    m = LOADING_RE.search(line)
    return float(m.group(1)) if m else None


def write_table(res: dict, path: Path) -> None:
    rows = res["results"]
    batches = sorted({r["batch"] for r in rows})
    methods = [m for m in res["methods"] if any(r["method"] == m for r in rows)]
    base = {r["batch"]: r["output_tok_s"] for r in rows if r["method"] == res["baseline"]}
    lines = [f"# End-to-end decode throughput ({res['meta'].get('device', '?')})", "",
             f"- command: `{res['meta']['command']}`", f"- date: {res['meta']['date']}",
             f"- versions: torch {res['meta']['torch']}, vLLM {res['meta']['vllm']}, CUDA "
             f"{res['meta']['cuda']}, commit {res['meta']['git_commit'][:10]}",
             f"- model: {res['meta']['model_desc']}, dummy weights, input {res['meta']['input_len']} / "
             f"output {res['meta']['output_len']} tokens, greedy, ignore_eos; median of "
             f"{res['meta']['repeats']} runs after {res['meta'].get('warmup', 1)} warm-up "
             "run(s)", "",
             "| method | load s | weights GiB | " + " | ".join(f"batch {b} tok/s (x {res['baseline']})" for b in batches) + " |",
             "|---|---|---|" + "---|" * len(batches)]  # fmt: skip
    for m in methods:
        cells = []
        load = next((r["load_s"] for r in rows if r["method"] == m), float("nan"))
        gib = next((r.get("weights_gib") for r in rows if r["method"] == m), None)
        for b in batches:
            r = next((r for r in rows if r["method"] == m and r["batch"] == b), None)
            if r is None:
                cells.append("failed" if m in res.get("failed", {}) else "-")
            else:
                x = r["output_tok_s"] / base[b] if b in base else float("nan")
                # three decimals: a ratio next to a target (2.8x) must not round up across it
                cells.append(f"{r['output_tok_s']:.0f} ({x:.3f}x)")
        gib_cell = "?" if gib is None else f"{gib:.2f}"
        lines.append(f"| {m} | {load:.0f} | {gib_cell} | " + " | ".join(cells) + " |")
    for m, why in res.get("failed", {}).items():
        lines.append(f"\n{m} failed: {why}")
    path.write_text("\n".join(lines) + "\n")


def profile_summary(d: Path, tokens: int, seen: set[str] | None = None, wait_s: float = 60.0) -> dict:
    """trace_summary of the newest torch-profiler trace in d whose name is not in `seen` (traces
    already summarised); the trace is written as the profiler stops: waits for it to appear and
    stop growing."""
    from trace_summary import load_trace, summarize

    t0, last = time.time(), None
    while time.time() - t0 < wait_s:
        files = sorted((f for f in d.glob("*.pt.trace.json*") if f.name not in (seen or ())),
                       key=lambda f: f.stat().st_mtime)  # fmt: skip
        if files:
            cur = (files[-1], files[-1].stat().st_size)
            if cur == last:
                return summarize(load_trace(cur[0]), tokens) | {"trace": cur[0].name}
            last = cur
        time.sleep(2.0)
    raise FileNotFoundError(f"bench_e2e: no complete profiler trace in {d} after {wait_s:.0f} s")


def write_profile_table(res: dict, path: Path) -> None:
    from trace_summary import table

    prof = res.get("profiles", {})
    lines = [f"# Where the GPU time per output token goes ({res['meta'].get('device', '?')})", "",
             f"- command: `{res['meta']['command']}`", f"- date: {res['meta']['date']}, commit "
             f"{res['meta']['git_commit'][:10]}", f"- model: {res['meta']['model_desc']}, input "
             f"{res['meta']['input_len']} / output {res['meta']['output_len']} tokens; one generate "
             "per method and batch under vLLM's torch profiler (CUPTI), after the timed runs; the "
             "prefill step is included (1 of the output tokens' steps); traced kernels run slower "
             "than untraced ones, so compare columns, not absolute times with the throughput table",
             ""] + table(prof)  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", help="config.json to use (overrides --shape)")
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES),
                   help="built-in model shape (default: llama-8b)")  # fmt: skip
    p.add_argument("--methods", default="fp16,kbit2,kbit3,kbit4,kbit5")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3,
                   help="discarded generates per batch size before the timed ones (default 3: "
                        "the first one or two after the start ran up to 29%% slow at batch 1)")
    p.add_argument("--threads", action="store_true",
                   help="record the busiest host threads (CPU share, CPU) in the timed runs")
    p.add_argument("--dtype", default="float16", help="model dtype for every method")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument(
        "--eager", action="store_true", help="--enforce-eager (default: compile + graphs)"
    )
    p.add_argument("--layers", type=int,
                   help="override num_hidden_layers (e.g. 1: the per-step cost outside the "
                        "decoder layers: host, embedding, lm_head, sampling)")  # fmt: skip
    p.add_argument("--cpus", help="run every method's process and vLLM's engine processes on "
                                  "these CPUs only, e.g. 0-7 (default: all)")  # fmt: skip
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--timeout", type=int, default=420, help="seconds per method")
    p.add_argument("--profile", action="store_true",
                   help="also profile one generate per batch size (see above)")  # fmt: skip
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:VAR=VALUE,... (KBIT_* or VLLM_*) for methods METHOD+NAME (see above)")  # fmt: skip
    p.add_argument("--host-profile", action="store_true",
                   help="also run one generate per batch size under cProfile, with vLLM's engine "
                        "in the worker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, every method):"
                        " where a step's host time goes (bench_e2e{tag}_{method}_b{batch}_host"
                        ".txt)")
    p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    p.add_argument("--host-profile-file", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch = [int(b) for b in str(args.batch).split(",")]
    if args.worker:
        args.method = args.worker
        return worker(args)
    if args.cpus:
        parse_cpus(args.cpus)  # a typo fails here, not in every worker

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_e2e{args.tag}"
    res = (
        json.loads(stem.with_suffix(".json").read_text())
        if stem.with_suffix(".json").exists()
        else None
    )
    methods = args.methods.split(",")
    from probe_env import parse_variant  # (imports torch: only here, not in the worker path)

    variants = dict(parse_variant(v, VARIANT_PREFIXES) for v in args.variant)
    for m in methods:  # a typo fails here, not after the baseline has run
        if m.startswith("kbit"):
            kbit_config(m)
        method_env(m, variants=variants)  # @NAME: its build exists; +NAME: its variant too
    if res is None:
        meta = versions() | {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                             "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                             "input_len": args.input_len, "output_len": args.output_len,
                             "repeats": args.repeats, "warmup": args.warmup, "dtype": args.dtype,
                             "model_desc": (args.config or SHAPES[args.shape][1]) +
                                           (f", {args.layers} layer(s)" if args.layers else ""),
                             "cpus": args.cpus or "all"}  # fmt: skip
        baseline = next((m for m in methods if not m.startswith("kbit")), "fp16")
        res = {"meta": meta, "methods": [], "baseline": baseline, "results": [], "failed": {}}
    res["methods"] = list(dict.fromkeys(res["methods"] + methods))
    if variants:
        res["meta"]["variants"] = res["meta"].get("variants", {}) | variants
    mdir = model_dir(args.config, Path("/tmp/kbit-e2e"), args.shape, args.layers)
    for m in methods:
        todo = [
            b
            for b in args.batch
            if not any(r["method"] == m and r["batch"] == b for r in res["results"])
        ]
        if not todo:
            print(f"[{m}] done already, skipping", flush=True)
            continue
        cmd = [sys.executable, __file__, "--worker", m, "--model", str(mdir), "--batch",
               ",".join(map(str, todo)), "--input-len", str(args.input_len), "--output-len",
               str(args.output_len), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--dtype",
               args.dtype,
               "--gpu-mem", str(args.gpu_mem)] + (["--eager"] if args.eager else []) + (
               ["--threads"] if args.threads else []) + (
               ["--cpus", args.cpus] if args.cpus else [])  # fmt: skip
        if args.profile:
            pdir = Path("/tmp/kbit-e2e/profile") / m
            shutil.rmtree(pdir, ignore_errors=True)
            pdir.mkdir(parents=True)
            cmd += ["--profile-dir", str(pdir)]
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", m)  # file names: no @ or +
        env = method_env(m, variants=variants)
        if args.host_profile:
            cmd += ["--host-profile-file", f"{stem}_{safe}_host"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        print(f"[{m}] starting: batches {todo}", flush=True)
        t0 = time.time()
        log = out / f"bench_e2e{args.tag}_{safe}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True,
                                    start_new_session=True, env=env)
            try:
                # vLLM's engine process inherits the pipe and can outlive the worker: never wait
                # for EOF; poll, and stop once the worker has exited and its lines are read.
                os.set_blocking(proc.stdout.fileno(), False)  # type: ignore[union-attr]
                buf = ""
                gib = None  # from the engine's log line (stdout), see weights_gib
                while True:
                    ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                    chunk = proc.stdout.read() if ready else ""  # type: ignore[union-attr]
                    buf += chunk or ""
                    *lines, buf = buf.split("\n")
                    for line in lines:
                        if not line.startswith("{"):  # vLLM's own log lines: keep them
                            f.write(line + "\n")
                            gib = weights_gib(line) if gib is None else gib
                        else:
                            ev = json.loads(line)
                            print(f"[{m}] {ev}", flush=True)
                            if ev["event"] == "result":
                                ev["weights_gib"] = gib
                                res["results"].append(ev)
                                res["failed"].pop(m, None)
                                stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
                            elif ev["event"] == "profile":
                                prof = res.setdefault("profiles", {})
                                seen = {v["trace"] for k, v in prof.items() if k.startswith(f"{m} b")}
                                s = profile_summary(Path(ev["dir"]), ev["output_tokens"], seen)
                                prof[f"{m} b{ev['batch']}"] = s
                                stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
                                write_profile_table(res, Path(f"{stem}_profile.md"))
                    if proc.poll() is not None and not chunk:
                        break
                    if time.time() - t0 > args.timeout:
                        raise TimeoutError(f"over {args.timeout} s")
            except Exception as e:
                res["failed"][m] = f"{type(e).__name__}: {e}"
            finally:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                time.sleep(3)  # let the killed engine release GPU memory
        if not any(r["method"] == m for r in res["results"]):
            res["failed"].setdefault(m, f"no result; see {log.name}")
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
        write_table(res, stem.with_suffix(".md"))
    write_table(res, stem.with_suffix(".md"))
    print(stem.with_suffix(".md").read_text(), flush=True)


if __name__ == "__main__":
    main()
