#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Serving benchmark suite: ``vllm serve`` + ``vllm bench serve`` per method and concurrency,
plus a quick offline mode (``vllm bench throughput`` / ``vllm bench latency``).

Methods (all on one model shape, ``load_format=dummy`` weights, no download):
  fp16 | bf16     unquantized, in --dtype (the baseline of every "x" column)
  kbit2..kbit5    online kbit quantization of the dummy weights at load time
                  (--quantization kbit --hf-overrides {"quantization_config": {..., "bits": k}})
  gptq_machete    vLLM's own GPTQ int4 g128 path (config.json carries a GPTQ
                  quantization_config), kernel left to vLLM: Machete on Hopper
  gptq_marlin     the same checkpoint with --linear-backend marlin (Marlin forced)

Every server start is verified from its log: "Model loading took N GiB" must be well below the
fp16 figure for a quantized method, the GPTQ variants must log the expected
"Using <Kernel> for AutoGPTQLinearMethod", and kbit must not run on the PyTorch reference.

Subcommands:
  serve      the online sweep (one server per method, all concurrencies against it)
  offline    bench throughput + bench latency per method (one engine start each)
  summarize  rebuild summary.md / summary.json / PNGs from a results dir (--merge other dirs)
  pack       write a results dir into one .tar.gz (logs truncated)
  _client    (internal) one bench-serve client process for all runs of a method, see client_main

    python3 benchmarks/serving.py serve --dry-run                 # commands + time estimate
    python3 benchmarks/serving.py serve --methods fp16 --out-dir /tmp/kbit-serving --pack $OUT/serving.tar.gz
    python3 benchmarks/serving.py summarize benchmarks/results/serving_h100

Results (--out-dir): runs/serve/<method>/c<C>.json and runs/offline/<method>/*.json (one per
run, vLLM's own result JSON inside), servers/<method>__<session>.json, sessions/<id>.json,
sweep.json (the settings every run of the directory shares), raw/ (vLLM's files), logs/,
summary.{md,json}, serving_throughput.png, serving_tpot.png. A run whose JSON says
``"complete": true`` is skipped when the command is repeated; failed runs are retried.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import io
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_e2e  # one definition of the model shapes
from bench_e2e import LLAMA_8B

# bench_e2e's named shapes when it has them (e.g. an MoE one), else the 8B alone
SHAPES: dict[str, tuple[dict, str]] = getattr(
    bench_e2e, "SHAPES", {"llama-8b": (LLAMA_8B, "Llama-3.1-8B shape")}
)

SCHEMA = "kbit-serving/1"
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,128,256"
DEFAULT_LAUNCHER = "{python} -m vllm.entrypoints.cli.main"
GPTQ_MODULES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
STARTUP_MARK = "Application startup complete"
# vLLM 0.26: v1/worker/gpu_model_runner.py ("... GiB memory and ... seconds") and
# v1/worker/gpu/model_runner.py ("... GiB and ... seconds", the V2 model runner)
LOAD_RE = re.compile(r"Model loading took ([0-9.]+) GiB(?: memory)? and ([0-9.]+) seconds")
KERNEL_RE = re.compile(r"Using (\w+) for (\w+)")
KBIT_REFERENCE_RE = re.compile(r"vllm_kbit\._C is not built")
THROUGHPUT_RE = re.compile(r"Throughput: ([0-9.]+) requests/s, ([0-9.]+) total tokens/s, "
                           r"([0-9.]+) output tokens/s")  # fmt: skip
BENCH_FN = "vllm.benchmarks.serve:main"  # what `vllm bench serve` runs (tests swap in a fake)
READY_MARK, DONE_MARK = "KBIT_CLIENT_READY", "KBIT_CLIENT_DONE "  # client_main's protocol lines
RUN_OVERHEAD_S = 3.0  # per run inside the client: parser, tokenizer, prompt sampling
MIN_RUN_LIMIT_S = 180.0  # a run's time limit is max(3 x estimate, this)
EXIT_GRACE_S = 15.0  # an offline bench that wrote its JSON gets this long to exit by itself
VERIFY_FRACTION = 0.9  # a quantized method loading >= 90% of fp16's memory did not quantize


# ------------------------------------------------------------------ methods


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "dense" | "kbit" | "gptq"
    bits: int = 16
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kernel: str | None = None  # expected "Using <kernel> for AutoGPTQLinearMethod"
    dtype: str | None = None  # dense only: the dtype it implies

    @property
    def quantized(self) -> bool:
        return self.kind != "dense"


def method_table() -> dict[str, Method]:
    m = {
        "fp16": Method("fp16", "dense", dtype="float16"),
        "bf16": Method("bf16", "dense", dtype="bfloat16"),
    }
    for k in (2, 3, 4, 5):
        qc = {"quantization_config": {"quant_method": "kbit", "bits": k}}
        m[f"kbit{k}"] = Method(f"kbit{k}", "kbit", k,
                               ("--quantization", "kbit", "--hf-overrides", json.dumps(qc)))  # fmt: skip
    # vLLM 0.26 picks the mixed-precision kernel in model_executor/kernels/linear/__init__.py
    # (choose_mp_linear_kernel): CutlassW4A8 (fp8 activations only), Machete (sm90), AllSpark,
    # Marlin, ...; --linear-backend marlin keeps only Marlin (_LINEAR_BACKEND_KERNEL_MAP).
    m["gptq_machete"] = Method("gptq_machete", "gptq", 4, (), kernel="MacheteLinearKernel")
    m["gptq_marlin"] = Method("gptq_marlin", "gptq", 4, ("--linear-backend", "marlin"),
                              kernel="MarlinLinearKernel")  # fmt: skip
    return m


METHODS = method_table()


def baseline_name(dtype: str) -> str:
    return "bf16" if dtype == "bfloat16" else "fp16"


def default_methods(dtype: str) -> list[str]:
    return [baseline_name(dtype), "kbit2", "kbit3", "kbit4", "kbit5", "gptq_machete", "gptq_marlin"]


def parse_methods(spec: str, dtype: str) -> list[str]:
    names = default_methods(dtype) if spec in ("all", "") else [s.strip() for s in spec.split(",")]
    out = []
    for n in names:
        if n not in METHODS:
            raise SystemExit(f"unknown method {n!r}; known: {', '.join(METHODS)}")
        if METHODS[n].kind == "dense" and METHODS[n].dtype != dtype:
            raise SystemExit(f"method {n} needs --dtype {METHODS[n].dtype} (given {dtype})")
        if n not in out:
            out.append(n)
    return out


def parse_ints(spec: str) -> list[int]:
    return sorted({int(s) for s in str(spec).split(",") if s.strip()})


def num_prompts_for(c: int, factor: int, lo: int, hi: int) -> int:
    """Prompts of one run at concurrency c: factor * c clamped to [lo, hi], at least c."""
    return max(c, min(hi, max(lo, factor * c)))


# ------------------------------------------------------------------ model size model


def param_counts(cfg: dict) -> tuple[int, int] | None:
    """(linear-layer params, embedding + lm_head params) of a dense Llama-like config; None
    for MoE or unknown layouts (no estimate then)."""
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    try:
        h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        nh = cfg["num_attention_heads"]
        nkv = cfg.get("num_key_value_heads", nh)
        hd = cfg.get("head_dim") or h // nh
        vocab = cfg["vocab_size"]
    except KeyError:
        return None
    per_layer = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter
    emb = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer, emb


def weight_bytes(method: Method, counts: tuple[int, int]) -> float:
    lin, emb = counts
    if method.kind == "dense":
        return 2.0 * (lin + emb)
    if method.kind == "kbit":
        return lin * (method.bits + 0.25) / 8 + 2.0 * emb
    return lin * (4 / 8 + 2 / 128) + 2.0 * emb  # GPTQ int4, one fp16 scale per 128


def expected_gib(method: Method, cfg: dict) -> float | None:
    counts = param_counts(cfg)
    return None if counts is None else weight_bytes(method, counts) / 2**30


def kv_bytes_per_token(cfg: dict) -> float:
    nh = cfg.get("num_attention_heads", 32)
    hd = cfg.get("head_dim") or cfg.get("hidden_size", 4096) // nh
    return cfg.get("num_hidden_layers", 32) * 2 * cfg.get("num_key_value_heads", nh) * hd * 2


# ------------------------------------------------------------------ time estimate

# Rough H100 model, fitted to benchmarks/results/bench_e2e.md (8B: fp16 6.8 ms/token at batch 1,
# kbit4 3.4 ms): step = 1.6 ms + weight bytes / 3.1 TB/s + c * (per-token compute + KV read).
# kbit's large-M paths run at about half of cuBLAS (bench_linear_h100.md), hence the factors.
STEP_FIXED_MS, HBM_BPS, FLOPS = 1.6, 3.1e12, 4.0e14
COMPUTE_FACTOR = {"dense": 1.0, "kbit": 2.0, "gptq": 1.3}
PREFILL_FACTOR = {"dense": 1.0, "kbit": 1.2, "gptq": 1.2}


def estimate_run_s(method: Method, cfg: dict, c: int, n: int, input_len: int, output_len: int,
                   warmups: int, client_overhead_s: float) -> float:  # fmt: skip
    counts = param_counts(cfg) or param_counts(LLAMA_8B)
    assert counts is not None
    params = sum(counts)
    wb = weight_bytes(method, counts)
    per_tok_ms = 2 * params / FLOPS * 1e3 * COMPUTE_FACTOR[method.kind]
    kv_ms = kv_bytes_per_token(cfg) * (input_len + output_len / 2) / HBM_BPS * 1e3

    def step(b: int) -> float:
        return STEP_FIXED_MS + wb / HBM_BPS * 1e3 + b * (per_tok_ms + kv_ms)

    prefill_ms = 2 * params * input_len / FLOPS * 1e3 * PREFILL_FACTOR[method.kind]
    waves = math.ceil(n / c)
    decode_s = waves * output_len * step(c) / 1e3
    warm_s = (output_len * step(max(1, warmups)) + warmups * prefill_ms) / 1e3 if warmups else 0.0
    return client_overhead_s + warm_s + decode_s + n * prefill_ms / 1e3


# ------------------------------------------------------------------ model directories


def load_model_config(path: str | None, shape: str = "llama-8b") -> tuple[dict, str]:
    if not path:
        cfg, desc = SHAPES[shape]
        return dict(cfg), f"{desc} (benchmarks/bench_e2e.py, --shape {shape})"
    cfg = json.loads(Path(path).read_text())
    cfg.pop("quantization_config", None)
    return cfg, str(path)


def config_digest(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]


def gptq_config(cfg: dict) -> dict:
    """config.json of the GPTQ int4 g128 variant. ``modules_in_block_to_quantize`` must be
    given: without it vLLM 0.26's AutoGPTQConfig.maybe_update_config derives the list from the
    safetensors headers, and a dummy model has none -> every layer would stay fp16."""
    out = dict(cfg)
    out["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                  "desc_act": False, "sym": True, "lm_head": False,
                                  "modules_in_block_to_quantize": list(GPTQ_MODULES)}  # fmt: skip
    return out


def model_dirs(work: Path, cfg: dict) -> dict[str, Path]:
    root = work / f"model-{config_digest(cfg)}"
    return {"dense": root / "dense", "kbit": root / "dense", "gptq": root / "gptq"}


def build_tokenizer(out: Path, vocab_size: int, max_len: int) -> None:
    """Offline WordLevel tokenizer with exactly ``vocab_size`` entries: ``<unk> <s> </s>`` then
    ``▁w0 ▁w1 ...``; decode -> encode round-trips, which vLLM's random dataset relies on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(vocab_size - len(vocab)):
        vocab[f"\u2581w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>",
                                   model_max_length=max_len)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)


def build_model_dirs(work: Path, cfg: dict, kinds: set[str]) -> dict[str, Path]:
    """config.json (+ GPTQ variant) + tokenizer files; nothing else (load_format=dummy)."""
    dirs = model_dirs(work, cfg)
    tok_src = dirs["dense"].parent / "tokenizer"
    if not (tok_src / "tokenizer.json").exists():
        build_tokenizer(tok_src, int(cfg["vocab_size"]),
                        int(cfg.get("max_position_embeddings", 8192)))  # fmt: skip
    wanted = {"dense": cfg, "gptq": gptq_config(cfg)}
    for kind in {"dense" if k == "kbit" else k for k in kinds}:
        d = dirs[kind]
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(wanted[kind], indent=1) + "\n")
        for f in tok_src.iterdir():
            shutil.copy2(f, d / f.name)
    return dirs


# ------------------------------------------------------------------ commands


@dataclass
class Settings:
    """Everything that shapes the commands (from the CLI; tests build it directly)."""

    model_cfg: dict
    model_desc: str = "Llama-3.1-8B shape"
    dtype: str = "float16"
    input_len: int = 1024
    output_len: int = 256
    launcher: str = DEFAULT_LAUNCHER
    gpu_mem: float = 0.90
    max_num_seqs: int = 256
    max_model_len: int | None = None
    extra_engine_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    warmup_cap: int = 16
    prompts_factor: int = 4
    prompts_min: int = 8
    prompts_max: int = 512
    seed: int = 0
    require_kernels: bool = True

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.input_len + self.output_len + 64

    def launcher_argv(self) -> list[str]:
        return shlex.split(self.launcher.replace("{python}", sys.executable))

    def client_cmd(self) -> list[str]:
        """The bench client driver (client_main), run by the launcher's python."""
        head = self.launcher_argv()[0]
        py = head if "python" in Path(head).name else sys.executable
        return [py, str(Path(__file__).resolve()), "_client", BENCH_FN]

    def engine_args(self, method: Method) -> list[str]:
        """Engine arguments shared by vllm serve / bench throughput / bench latency."""
        args = ["--load-format", "dummy", "--dtype", self.dtype,
                "--max-model-len", str(self.model_len),
                "--gpu-memory-utilization", f"{self.gpu_mem:g}",
                "--max-num-seqs", str(self.max_num_seqs), "--seed", str(self.seed),
                # every run of a server reuses the seed's prompts: no cache hits across runs
                "--no-enable-prefix-caching"]  # fmt: skip
        return args + list(method.args) + list(self.extra_engine_args)

    def method_env(self, method: Method) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1"}
        if method.kind == "kbit" and self.require_kernels:
            env["KBIT_REQUIRE_CUDA_EXT"] = "1"  # no silent PyTorch-reference fallback
        env.update(dict(method.env))
        return env

    def num_prompts(self, c: int) -> int:
        return num_prompts_for(c, self.prompts_factor, self.prompts_min, self.prompts_max)

    def warmups(self, c: int) -> int:
        return min(c, self.warmup_cap)


def server_cmd(s: Settings, method: Method, model: Path, port: int) -> list[str]:
    return s.launcher_argv() + ["serve", str(model)] + s.engine_args(method) + [
        "--host", s.host, "--port", str(port)]  # fmt: skip


def bench_serve_cmd(s: Settings, model: Path, port: int, method: str, c: int,
                    result_dir: Path, result_file: str) -> list[str]:  # fmt: skip
    n = s.num_prompts(c)
    return s.launcher_argv() + [
        "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
        "--host", s.host, "--port", str(port), "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(s.input_len),
        "--random-output-len", str(s.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(n), "--max-concurrency", str(c), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--num-warmups", str(s.warmups(c)),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--seed", str(s.seed + c), "--disable-tqdm",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file,
        "--metadata", f"kbit_method={method}", f"kbit_concurrency={c}"]  # fmt: skip


def throughput_cmd(s: Settings, method: Method, model: Path, num_prompts: int,
                   out_json: Path) -> list[str]:  # fmt: skip
    return s.launcher_argv() + [
        "bench", "throughput", "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--input-len", str(s.input_len),
        "--output-len", str(s.output_len), "--num-prompts", str(num_prompts),
        "--output-json", str(out_json)] + s.engine_args(method)  # fmt: skip


def latency_cmd(s: Settings, method: Method, model: Path, batch: int, warmup_iters: int,
                iters: int, out_json: Path) -> list[str]:  # fmt: skip
    return s.launcher_argv() + [
        "bench", "latency", "--model", str(model), "--tokenizer", str(model),
        "--input-len", str(s.input_len), "--output-len", str(s.output_len),
        "--batch-size", str(batch), "--num-iters-warmup", str(warmup_iters),
        "--num-iters", str(iters), "--output-json", str(out_json)] + s.engine_args(method)  # fmt: skip


def shell(cmd: list[str], env: dict[str, str] | None = None) -> str:
    pre = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (pre + " " if pre else "") + shlex.join(cmd)


# ------------------------------------------------------------------ log parsing / verification


def parse_server_log(text: str) -> dict:
    """What a vLLM server / engine log says about the load: model memory, load time, the
    mixed-precision kernels chosen, whether kbit fell back to the PyTorch reference."""
    loads = LOAD_RE.findall(text)
    kernels = sorted({f"{k} for {m}" for k, m in KERNEL_RE.findall(text) if k.endswith("Kernel")})
    return {
        "load_gib": float(loads[0][0]) if loads else None,
        "load_gib_all_ranks": [float(g) for g, _ in loads],
        "load_s": float(loads[0][1]) if loads else None,
        "kernels": kernels,
        "startup_complete": STARTUP_MARK in text,
        "kbit_reference_fallback": bool(KBIT_REFERENCE_RE.search(text)),
    }


def verify_load(method: Method, info: dict, fp16_gib: float | None,
                fp16_source: str = "") -> dict:  # fmt: skip
    """``{"status": ok|failed|unknown, "reason": ...}`` for one method's load."""
    gib = info.get("load_gib")
    if gib is None:
        return {"status": "failed", "reason": "no 'Model loading took ... GiB' line in the log"}
    problems = []
    if method.quantized:
        if fp16_gib is None:
            problems_unknown = "no fp16/bf16 load figure to compare with"
        else:
            problems_unknown = ""
            if gib >= VERIFY_FRACTION * fp16_gib:
                problems.append(f"loaded {gib:.2f} GiB, fp16 {fp16_gib:.2f} GiB{fp16_source}: "
                                "weights not quantized")  # fmt: skip
        if method.kernel:
            want = f"{method.kernel} for AutoGPTQLinearMethod"
            if want not in info.get("kernels", []):
                problems.append(
                    f"expected '{want}' in the log, found {info.get('kernels') or 'none'}"
                )
        if method.kind == "kbit" and info.get("kbit_reference_fallback"):
            problems.append("vllm_kbit._C not built: kbit ran on the PyTorch reference")
        if problems:
            return {"status": "failed", "reason": "; ".join(problems)}
        if problems_unknown:
            return {"status": "unknown", "reason": problems_unknown}
    return {"status": "ok", "reason": None}


def log_tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def error_line(path: Path) -> str:
    """The most telling error line of a log (for the one-line failure reason)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for pat in (r"\b\w*(Error|Exception)\b:", r"Traceback", r"ERROR", r"error"):
        hits = [ln for ln in lines if re.search(pat, ln)]
        if hits:
            return hits[-1].strip()[:300]
    return lines[-1].strip()[:300] if lines else "empty log"


# ------------------------------------------------------------------ run records


def classify_serve_result(raw: dict | None, num_prompts: int, rc: int | None,
                          timed_out: bool, why: str = "") -> tuple[str, str | None]:  # fmt: skip
    """(status, reason) of one bench-serve run from vLLM's result JSON and the client's exit."""
    if timed_out:
        return "failed", f"bench client timed out{': ' + why if why else ''}"
    if raw is None:
        return "failed", f"no result JSON (client rc={rc}){': ' + why if why else ''}"
    if rc not in (0, None):
        return "failed", f"client rc={rc}{': ' + why if why else ''}"
    done, bad = raw.get("completed", 0), raw.get("failed", 0)
    if bad or done != num_prompts:
        return "failed", f"{done}/{num_prompts} requests completed, {bad} failed"
    missing = [k for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                           "median_tpot_ms", "p99_tpot_ms") if raw.get(k) is None]  # fmt: skip
    if missing:
        return "failed", f"result JSON lacks {missing}"
    return "ok", None


def is_complete(path: Path) -> bool:
    rec = read_json(path)
    return bool(rec and rec.get("schema") == SCHEMA and rec.get("status") == "ok"
                and rec.get("complete") is True)  # fmt: skip


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def serve_path(out: Path, method: str, c: int) -> Path:
    return out / "runs" / "serve" / method / f"c{c}.json"


def offline_path(out: Path, method: str, what: str) -> Path:
    return out / "runs" / "offline" / method / f"{what}.json"


def pending_serve_runs(out: Path, methods: list[str], concs: list[int],
                       retry_failed: bool = True) -> dict[str, list[int]]:  # fmt: skip
    """Per method, the concurrencies still to run (no JSON, or a failed one when retrying)."""
    todo: dict[str, list[int]] = {}
    for m in methods:
        left = []
        for c in concs:
            p = serve_path(out, m, c)
            if is_complete(p):
                continue
            if not retry_failed and read_json(p) is not None:
                continue
            left.append(c)
        if left:
            todo[m] = left
    return todo


# ------------------------------------------------------------------ sweep identity / metadata


def sweep_identity(s: Settings) -> dict:
    return {"schema": SCHEMA, "model_desc": s.model_desc, "model_config": s.model_cfg,
            "config_digest": config_digest(s.model_cfg), "dtype": s.dtype,
            "input_len": s.input_len, "output_len": s.output_len}  # fmt: skip


def check_sweep(out: Path, s: Settings) -> None:
    """All runs of a directory share model, dtype and lengths; refuse to mix."""
    want = sweep_identity(s)
    have = read_json(out / "sweep.json")
    if have is None:
        write_json(out / "sweep.json", want)
        return
    keys = ("config_digest", "dtype", "input_len", "output_len")
    diff = {k: (have.get(k), want[k]) for k in keys if have.get(k) != want[k]}
    if diff:
        raise SystemExit(f"{out}/sweep.json was written with other settings {diff} "
                         "(existing, requested); use another --out-dir")  # fmt: skip


def _run(cmd: list[str], timeout: float = 20) -> str:
    try:
        return subprocess.run(cmd, check=False, capture_output=True, text=True,
                              timeout=timeout).stdout  # fmt: skip
    except Exception:  # noqa: BLE001  (no nvidia-smi: meta says so)
        return ""


def device_info() -> dict:
    q = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
              "--format=csv,noheader"]).strip().splitlines()  # fmt: skip
    info: dict[str, Any] = {"gpus": [ln.strip() for ln in q]}
    info["device"] = q[0].split(",")[0].strip() if q else "unknown (no nvidia-smi)"
    return info


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "host": platform.node()}
    for pkg in ("vllm", "torch", "vllm-kbit", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "n/a"
    try:
        out["git_commit"] = os.environ.get("KBIT_GIT_COMMIT") or subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=REPO, text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001  (the GPU copy of the tree has no .git)
        out["git_commit"] = "unknown"
    return out


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def gpu_used_mib() -> list[int] | None:
    out = _run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], 10)
    vals = [int(v) for v in re.findall(r"\d+", out)]
    return vals or None


def wait_gpu_free(limit_mib: int, timeout_s: float) -> tuple[bool, list[int] | None]:
    t_end = time.time() + timeout_s
    while True:
        used = gpu_used_mib()
        if used is None or max(used) <= limit_mib:
            return True, used
        if time.time() > t_end:
            return False, used
        time.sleep(1.0)


# ------------------------------------------------------------------ processes


_GROUPS: set[int] = set()


def group_alive(pgid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(d.name))
    return pids


def kill_group(pgid: int, term_wait_s: float = 8.0, kill_wait_s: float = 30.0) -> None:
    """SIGTERM the process group we started, SIGKILL what is left, wait until it is gone."""
    for sig, wait in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        t_end = time.time() + wait
        while group_alive(pgid) and time.time() < t_end:
            time.sleep(0.2)
        if not group_alive(pgid):
            break
    _GROUPS.discard(pgid)


def start_group(cmd: list[str], log: Path, env: dict[str, str],
                stdin: int | None = None) -> subprocess.Popen:  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    with open(log, "w") as f:
        f.write(f"# {now_iso()} {shell(cmd, env)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=f, stderr=subprocess.STDOUT,
                                env=full_env, start_new_session=True, cwd=REPO)  # setsid  # fmt: skip
    _GROUPS.add(proc.pid)
    return proc


def _on_signal(signum, frame):  # the caller's timeout: leave no server behind
    for g in list(_GROUPS):
        kill_group(g, 2.0, 10.0)
    print(f"[serving] stopped by signal {signum}; server groups killed", flush=True)
    os._exit(128 + signum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the driver


class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0 = time.time()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


def say(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Ctx:
    s: Settings
    out: Path
    work: Path
    budget: Budget
    session: dict
    args: argparse.Namespace
    dirs: dict[str, Path] = field(default_factory=dict)
    calib: float = 1.0  # measured / estimated run time, from this session's runs

    def est(self, method: Method, c: int) -> float:
        s = self.s
        return self.calib * estimate_run_s(method, s.model_cfg, c, s.num_prompts(c), s.input_len,
                                           s.output_len, s.warmups(c),
                                           client_costs(self.args)[1])  # fmt: skip


def fp16_reference(out: Path, s: Settings) -> tuple[float | None, str]:
    """Measured fp16/bf16 load GiB in this directory, else the estimate from the config."""
    base = baseline_name(s.dtype)
    for p in sorted((out / "servers").glob(f"{base}__*.json")):
        rec = read_json(p) or {}
        if rec.get("load_gib"):
            return float(rec["load_gib"]), " (measured)"
    est = expected_gib(METHODS[base], s.model_cfg)
    return est, " (estimated from config)" if est else ""


def preflight(ctx: Ctx, methods: list[str]) -> dict[str, str]:
    """Reasons why kbit methods cannot run here (plugin not registered / no kernels)."""
    if not any(METHODS[m].kind == "kbit" for m in methods):
        return {}
    code = ("import json, importlib.metadata as md\n"
            "eps = [e.name for e in md.entry_points(group='vllm.general_plugins')]\n"
            "from vllm_kbit import _ops\n"
            "print('KBIT_PREFLIGHT ' + json.dumps({'plugin': 'kbit' in eps, "
            "'kernels': _ops.has_cuda_kernels()}))\n")  # fmt: skip
    try:
        r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                           text=True, timeout=180, cwd=REPO)  # fmt: skip
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("KBIT_PREFLIGHT "))
        res = json.loads(line.split(" ", 1)[1])
    except Exception as e:  # noqa: BLE001
        res = {"plugin": False, "kernels": False, "error": f"{type(e).__name__}: {e}"}
    ctx.session["kbit_preflight"] = res
    why = []
    if not res.get("plugin"):
        why.append("vllm-kbit is not installed as a vLLM plugin (pip install -e . first)")
    if not res.get("kernels") and not ctx.args.allow_reference:
        why.append("vllm_kbit._C is not built (the PyTorch reference would be timed)")
    return {m: "; ".join(why) for m in methods if METHODS[m].kind == "kbit" and why}


def server_record(ctx: Ctx, method: Method, cmd: list[str], env: dict, log: Path) -> dict:
    return {"schema": SCHEMA, "method": method.name, "session": ctx.session["id"],
            "device": ctx.session["device"], "command": shell(cmd, env), "log": str(log.relative_to(ctx.out)),
            "date": now_iso(), "status": "starting"}  # fmt: skip


def start_server(ctx: Ctx, method: Method) -> tuple[subprocess.Popen | None, dict, int]:
    model = ctx.dirs[method.kind]
    port = free_port()
    cmd = server_cmd(ctx.s, method, model, port)
    env = ctx.s.method_env(method)
    log = ctx.out / "logs" / f"server_{method.name}__{ctx.session['id']}.log"
    rec = server_record(ctx, method, cmd, env, log)
    rec_path = ctx.out / "servers" / f"{method.name}__{ctx.session['id']}.json"
    ok, used = wait_gpu_free(ctx.args.gpu_free_mib, 60)
    if not ok:
        rec.update(status="failed", reason=f"GPU memory busy before start: {used} MiB used")
        write_json(rec_path, rec)
        return None, rec, port
    say(f"[{method.name}] starting server: {shell(cmd, env)}")
    t0 = time.time()
    proc = start_group(cmd, log, env)
    pgid_file = ctx.out / "servers" / f"{method.name}.pgid"
    pgid_file.parent.mkdir(parents=True, exist_ok=True)
    pgid_file.write_text(str(proc.pid))
    limit = min(ctx.args.server_timeout, max(30.0, ctx.budget.left() - 20))
    reason = None
    while True:
        text = log.read_text(errors="replace")
        if STARTUP_MARK in text:
            break
        if proc.poll() is not None:
            reason = f"server exited rc={proc.returncode} before startup: {error_line(log)}"
            break
        if time.time() - t0 > limit:
            reason = f"no '{STARTUP_MARK}' after {limit:.0f} s: {error_line(log)}"
            break
        time.sleep(0.2 if time.time() - t0 < 5 else 1.0)
    rec["startup_s"] = round(time.time() - t0, 1)
    rec.update(parse_server_log(log.read_text(errors="replace")))
    if reason:
        rec.update(status="failed", reason=reason)
        say(f"[{method.name}] server FAILED: {reason}\n--- log tail ---\n{log_tail(log)}\n---")
        stop_server(ctx, proc, pgid_file)
        write_json(rec_path, rec)
        return None, rec, port
    fp16_gib, src = fp16_reference(ctx.out, ctx.s)
    rec["fp16_reference_gib"] = fp16_gib
    rec["expected_gib"] = expected_gib(method, ctx.s.model_cfg)
    rec["verification"] = verify_load(method, rec, fp16_gib, src)
    rec["status"] = "up"
    write_json(rec_path, rec)
    say(f"[{method.name}] up in {rec['startup_s']:.0f} s; model loading {rec['load_gib']} GiB "
        f"(expected ~{_fmt(rec['expected_gib'], '.2f')}); kernels {rec['kernels'] or '-'}; "
        f"verification {rec['verification']['status']}"
        + (f": {rec['verification']['reason']}" if rec["verification"]["reason"] else ""))  # fmt: skip
    return proc, rec, port


def stop_server(ctx: Ctx, proc: subprocess.Popen, pgid_file: Path | None = None) -> None:
    t0 = time.time()
    kill_group(proc.pid)
    if pgid_file is not None:
        pgid_file.unlink(missing_ok=True)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    ok, used = wait_gpu_free(ctx.args.gpu_free_mib, 60)
    say(f"server stopped in {time.time() - t0:.0f} s; GPU memory used {used} MiB"
        + ("" if ok else " (still busy)"))  # fmt: skip


def server_summary(rec: dict) -> dict:
    keys = ("session", "device", "command", "log", "startup_s", "load_gib", "load_gib_all_ranks",
            "load_s", "kernels", "kbit_reference_fallback", "expected_gib", "fp16_reference_gib",
            "verification", "status", "reason")  # fmt: skip
    return {k: rec.get(k) for k in keys}


def run_record(ctx: Ctx, kind: str, method: str, **kw: Any) -> dict:
    s = ctx.s
    rec = {"schema": SCHEMA, "kind": kind, "method": method, "dtype": s.dtype,
           "input_len": s.input_len, "output_len": s.output_len, "session": ctx.session["id"],
           "device": ctx.session["device"], "date": now_iso()}  # fmt: skip
    rec.update(kw)
    rec["complete"] = rec.get("status") == "ok"
    return rec


def fail_runs(ctx: Ctx, method: str, concs: list[int], reason: str, server: dict | None) -> None:
    for c in concs:
        write_json(serve_path(ctx.out, method, c),
                   run_record(ctx, "serve", method, concurrency=c,
                              num_prompts=ctx.s.num_prompts(c), status="failed", reason=reason,
                              server=server_summary(server) if server else None))  # fmt: skip
        say(f"[{method}] c={c} FAILED: {reason}")


def run_client(ctx: Ctx, cmd: list[str], log: Path, timeout: float, env: dict | None = None,
               done_file: Path | None = None, grace_s: float | None = None) -> tuple[int | None, bool]:  # fmt: skip
    """Run a client / offline bench in its own group; (rc, timed_out). With ``done_file``, the
    process is ended ``grace_s`` after that file appears (a finished LLM can hang at exit)."""
    grace_s = EXIT_GRACE_S if grace_s is None else grace_s
    proc = start_group(cmd, log, env or {"PYTHONUNBUFFERED": "1"})
    t0, t_done = time.time(), None
    try:
        while proc.poll() is None:
            if done_file is not None and t_done is None and done_file.exists():
                t_done = time.time()
            if t_done is not None and time.time() - t_done > grace_s:
                return 0, False  # result written; the hang at exit is not a failure
            if time.time() - t0 > timeout:
                return None, True
            time.sleep(0.05 if time.time() - t0 < 2 else 0.5)
        return proc.returncode, False
    finally:
        kill_group(proc.pid, 3.0, 20.0)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def client_main(bench_fn: str) -> int:
    """``serving.py _client MODULE:FUNC``: one process runs every `vllm bench serve` of a
    method, saving the imports each client process pays (21-34 s on the H100). Each stdin line
    is a JSON ``{"argv": ["bench", "serve", ...], "log": PATH}`` (the per-run CLI arguments);
    stdout and stderr go to PATH for the run, which ends with the line DONE_MARK {"rc": ...}.

    Reusing vLLM 0.26's vllm/benchmarks/serve.py main (what `vllm bench serve` calls,
    entrypoints/cli/benchmark/serve.py:21) in one process, from its source:
    - main() is asyncio.run(main_async(args)) (serve.py:1883): a new event loop per run; its
      aiohttp sessions are made inside it (benchmark() :818, prompt alignment :88), so no
      connection, semaphore or loop is shared between runs.
    - main_async seeds random and np.random with args.seed first (:1889); the random dataset
      draws from its own np.random.default_rng(args.seed) (datasets.py:582), so a run gets the
      same prompts as a fresh process with the same --seed.
    - the tokenizer is loaded per run by get_tokenizer (:1973; only argument resolution is
      lru_cached), nothing else is cached at module level.
    - main_async mutates args (ignore_eos, self_timed, random_range_ratio): every run parses a
      new Namespace with a newly built parser, which also draws a new --request-id-prefix
      default (bench-<uuid>-, evaluated in add_cli_args, :1715) as a new process would.
    - freeze_gc_heap() (:2093) gc.freeze()s each run: earlier runs' objects stay frozen (MBs).
    - an exception leaves that run's aiohttp session unclosed (a warning); the loop closes.
    The parser and platform are set up as vllm/entrypoints/cli/main.py does for `vllm bench`.
    """
    import importlib
    import traceback

    mod, fn = bench_fn.split(":")
    bench = getattr(importlib.import_module(mod), fn)
    sys.argv = ["vllm", "bench", "serve"]  # vLLM adds the bench subparsers only for `vllm bench`
    from vllm import platforms
    from vllm.entrypoints.cli.benchmark import main as bench_cli
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    home = os.dup(1)
    print(READY_MARK, flush=True)
    while line := sys.stdin.readline():
        job = json.loads(line)
        fd = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        rc = 0
        try:
            sys.argv = ["vllm"] + job["argv"]
            parser = FlexibleArgumentParser(description="vLLM CLI")
            sub = parser.add_subparsers(required=False, dest="subparser")
            for cmd in bench_cli.cmd_init():
                cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
            args = parser.parse_args(job["argv"])
            if (args.subparser, getattr(args, "bench_type", None)) != ("bench", "serve"):
                raise ValueError(f"not a bench serve command: {job['argv'][:2]}")
            bench(args)
        except (Exception, SystemExit) as e:  # noqa: BLE001  (the run fails, the next goes on)
            traceback.print_exc()
            rc = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        print(DONE_MARK + json.dumps({"rc": rc}), flush=True)
        os.dup2(home, 1)
        os.dup2(home, 2)
    return 0


class BenchClient:
    """The parent's handle on the client_main process of a method: start() once, run() per
    run; a run past its limit kills it, and the next run starts a new one."""

    def __init__(self, ctx: Ctx, name: str) -> None:
        self.ctx, self.name, self.starts = ctx, name, 0
        self.proc: subprocess.Popen | None = None
        self.log = ctx.out / "logs" / f"bench_{name}_client__{ctx.session['id']}.log"
        self.error: str | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, limit: float) -> dict:
        """Start it and wait for its READY line; the run record's start-up field."""
        self.starts += 1
        sfx = "" if self.starts == 1 else str(self.starts)
        self.log = self.log.with_name(f"bench_{self.name}_client{sfx}__{self.ctx.session['id']}"
                                      ".log")  # fmt: skip
        t0, self.error = time.time(), None
        self.proc = start_group(self.ctx.s.client_cmd(), self.log, {"PYTHONUNBUFFERED": "1"},
                                stdin=subprocess.PIPE)  # fmt: skip
        while READY_MARK not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.time() - t0 > limit:
                why = (f"exited rc={self.proc.returncode}" if self.proc.poll() is not None
                       else f"not ready after {limit:.0f} s")  # fmt: skip
                self.error = f"bench client did not start ({why}): {error_line(self.log)}"
                self.stop(0)
                break
            time.sleep(0.2)
        dt = time.time() - t0
        say(f"[{self.name}] bench client " + (self.error or f"up in {dt:.0f} s"))
        return {"client_startup_s": round(dt, 1)}

    def run(self, cmd: list[str], log: Path, timeout: float) -> tuple[int | None, bool]:
        """(rc, timed_out) of one run, as run_client; its output goes to ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            f.write(f"# {now_iso()} {shell(cmd)}\n")
            if self.proc is None or self.proc.stdin is None:
                f.write(f"{self.error}\n")
                return None, False
            f.write(f"# run by the bench client pid {self.proc.pid} ({self.log.name})\n")
        job = {"argv": cmd[len(self.ctx.s.launcher_argv()) :], "log": str(log)}
        t0 = time.time()
        with contextlib.suppress(OSError):  # a dead client is seen below
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        while True:
            m = re.search(DONE_MARK + r"(\{.*\})", log.read_text(errors="replace"))
            if m:
                return json.loads(m.group(1))["rc"], False
            if self.proc.poll() is not None or time.time() - t0 > timeout:
                rc = self.proc.returncode
                self.stop(0)
                return (rc, False) if rc is not None else (None, True)
            time.sleep(0.05 if time.time() - t0 < 2 else 0.5)

    def stop(self, wait_s: float = 2.0) -> None:
        """EOF on its stdin (it exits by itself), then SIGTERM / SIGKILL to its group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
        kill_group(proc.pid, 3.0, 20.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def serve_method(ctx: Ctx, name: str, concs: list[int], blocked: str | None) -> bool:
    """All pending concurrencies of one method against one server. False = budget stop."""
    method = METHODS[name]
    if blocked:
        fail_runs(ctx, name, concs, blocked, None)
        return True
    once_s = client_costs(ctx.args)[0]
    need = ctx.args.est_server_start_s + once_s + ctx.est(method, concs[0]) + ctx.args.est_stop_s
    if need > ctx.budget.left():
        say(f"[{name}] budget: not starting the server (needs ~{need:.0f} s, "
            f"{ctx.budget.left():.0f} s left); rerun the command to continue")  # fmt: skip
        return False
    proc, srv, port = start_server(ctx, method)
    if proc is None:
        fail_runs(ctx, name, concs, f"server: {srv.get('reason')}", srv)
        return True
    client = None if ctx.args.client_per_run else BenchClient(ctx, name)
    try:
        ver = srv["verification"]
        if ver["status"] == "failed" and not ctx.args.bench_unverified:
            fail_runs(ctx, name, concs, f"FAILED-verification: {ver['reason']}", srv)
            return True
        model = ctx.dirs[method.kind]
        for c in concs:
            est = ctx.est(method, c)
            start_s = once_s if client and not client.alive() else 0.0
            if start_s + est + ctx.args.est_stop_s > ctx.budget.left():
                say(f"[{name}] budget: c={c} needs ~{est:.0f} s, {ctx.budget.left():.0f} s left; "
                    "stopping here (rerun the command to resume)")  # fmt: skip
                return False
            if srv and proc.poll() is not None:
                fail_runs(ctx, name, [c], f"server died: {error_line(ctx.out / srv['log'])}", srv)
                continue
            raw_name = f"{name}_c{c}__{ctx.session['id']}.json"
            raw_path = ctx.out / "raw" / raw_name
            cmd = bench_serve_cmd(ctx.s, model, port, name, c, ctx.out / "raw", raw_name)
            log = ctx.out / "logs" / f"bench_{name}_c{c}__{ctx.session['id']}.log"
            extra: dict[str, Any] = {"client": "per-run"}
            if client:  # its start-up has its own limit and is not part of elapsed_s
                if not client.alive():
                    extra.update(client.start(min(max(120.0, 4 * once_s),
                                                  max(30.0, ctx.budget.left()))))  # fmt: skip
                extra.update(client="driver", client_log=str(client.log.relative_to(ctx.out)))
            timeout = min(max(3 * est, MIN_RUN_LIMIT_S),
                          max(30.0, ctx.budget.left() - ctx.args.est_stop_s))  # fmt: skip
            say(f"[{name}] c={c} n={ctx.s.num_prompts(c)} (est {est:.0f} s, limit {timeout:.0f} s)")
            t0 = time.time()
            if client:
                rc, timed_out = client.run(cmd, log, timeout)
            else:
                rc, timed_out = run_client(ctx, cmd, log, timeout)
            dt = time.time() - t0
            raw = read_json(raw_path)
            why = "" if rc == 0 and raw else error_line(log)
            if timed_out:
                why = f"after {timeout:.0f} s"
            status, reason = classify_serve_result(raw, ctx.s.num_prompts(c), rc, timed_out, why)
            rec = run_record(ctx, "serve", name, concurrency=c, num_prompts=ctx.s.num_prompts(c),
                             status=status, reason=reason, command=shell(cmd),
                             elapsed_s=round(dt, 1), estimated_s=round(est, 1),
                             log=str(log.relative_to(ctx.out)),
                             raw=str(raw_path.relative_to(ctx.out)) if raw else None,
                             server=server_summary(srv), result=raw, **extra)  # fmt: skip
            write_json(serve_path(ctx.out, name, c), rec)
            if status == "ok":
                ctx.calib = min(
                    3.0, max(0.5, 0.5 * ctx.calib + 0.5 * dt / max(1.0, est / ctx.calib))
                )
                say(f"[{name}] c={c} ok in {dt:.0f} s: {raw['output_throughput']:.0f} out tok/s, "
                    f"TTFT {raw['median_ttft_ms']:.0f} ms, TPOT {raw['median_tpot_ms']:.1f} ms")  # fmt: skip
            else:
                say(
                    f"[{name}] c={c} FAILED: {reason}\n--- client log tail ---\n{log_tail(log, 15)}"
                )
        return True
    finally:
        if client:
            client.stop()
        stop_server(ctx, proc, ctx.out / "servers" / f"{name}.pgid")


def offline_method(ctx: Ctx, name: str, blocked: str | None) -> bool:
    method = METHODS[name]
    a, s = ctx.args, ctx.s
    model = ctx.dirs[method.kind]
    (ctx.out / "raw").mkdir(parents=True, exist_ok=True)  # vLLM opens --output-json as is
    jobs: list[tuple[str, list[str], Path, dict]] = []
    tp_raw = ctx.out / "raw" / f"offline_{name}_throughput__{ctx.session['id']}.json"
    jobs.append(("throughput", throughput_cmd(s, method, model, a.offline_prompts, tp_raw), tp_raw,
                 {"num_prompts": a.offline_prompts}))  # fmt: skip
    for b in parse_ints(a.latency_batch):
        raw = ctx.out / "raw" / f"offline_{name}_latency_b{b}__{ctx.session['id']}.json"
        jobs.append((f"latency_b{b}", latency_cmd(s, method, model, b, a.latency_warmup,
                                                  a.latency_iters, raw), raw, {"batch_size": b}))  # fmt: skip
    for what, cmd, raw_path, extra in jobs:
        path = offline_path(ctx.out, name, what)
        if is_complete(path) or (not a.retry_failed and read_json(path) is not None):
            say(f"[{name}] offline {what}: done already")
            continue
        if blocked:
            write_json(path, run_record(ctx, "offline", name, what=what, status="failed",
                                        reason=blocked, **extra))  # fmt: skip
            continue
        need = a.est_server_start_s + 60 + a.est_stop_s
        if need > ctx.budget.left():
            say(f"[{name}] budget: not starting offline {what} ({ctx.budget.left():.0f} s left)")
            return False
        ok, used = wait_gpu_free(a.gpu_free_mib, 60)
        log = ctx.out / "logs" / f"offline_{name}_{what}__{ctx.session['id']}.log"
        say(f"[{name}] offline {what}: {shell(cmd, s.method_env(method))}")
        t0 = time.time()
        if not ok:
            rc, timed_out = None, False
            why = f"GPU memory busy before start: {used} MiB"
        else:
            rc, timed_out = run_client(ctx, cmd, log, max(60.0, ctx.budget.left() - a.est_stop_s),
                                       env=s.method_env(method), done_file=raw_path)  # fmt: skip
            why = ""
        dt = time.time() - t0
        text = log.read_text(errors="replace") if log.exists() else ""
        info = parse_server_log(text)
        raw = read_json(raw_path)
        m = THROUGHPUT_RE.findall(text)
        if raw is not None and m and what == "throughput":
            raw = dict(raw, output_tokens_per_second=float(m[-1][2]),
                       stdout_requests_per_second=float(m[-1][0]))  # fmt: skip
        fp16_gib, src = fp16_offline_reference(ctx.out, s)
        ver = verify_load(method, info, fp16_gib, src)
        if why:
            status, reason = "failed", why
        elif timed_out:
            status, reason = "failed", f"timed out after {dt:.0f} s: {error_line(log)}"
        elif raw is None:
            status, reason = "failed", f"no output JSON (rc={rc}): {error_line(log)}"
        elif what == "throughput" and "output_tokens_per_second" not in raw:
            status, reason = "failed", "no 'Throughput: ... output tokens/s' line in the log"
        elif ver["status"] == "failed":
            status, reason = "failed", f"FAILED-verification: {ver['reason']}"
        else:
            status, reason = "ok", None
        rec = run_record(ctx, "offline", name, what=what, status=status, reason=reason,
                         command=shell(cmd, s.method_env(method)), elapsed_s=round(dt, 1),
                         log=str(log.relative_to(ctx.out)), load=info, verification=ver,
                         expected_gib=expected_gib(method, s.model_cfg), result=raw, **extra)  # fmt: skip
        write_json(path, rec)
        say(f"[{name}] offline {what}: {status}" + (f" ({reason})" if reason else "")
            + f" in {dt:.0f} s; model loading {info['load_gib']} GiB")  # fmt: skip
    return True


def fp16_offline_reference(out: Path, s: Settings) -> tuple[float | None, str]:
    base = baseline_name(s.dtype)
    for p in sorted((out / "runs" / "offline" / base).glob("*.json")):
        gib = ((read_json(p) or {}).get("load") or {}).get("load_gib")
        if gib:
            return float(gib), " (measured)"
    return fp16_reference(out, s)


def kill_stale_servers(out: Path) -> None:
    """A previous command of this sweep killed at its limit may have left its server up."""
    for p in (out / "servers").glob("*.pgid"):
        try:
            pgid = int(p.read_text().strip())
        except ValueError:
            continue
        alive = group_alive(pgid)
        if alive:
            try:
                cmdline = Path(f"/proc/{alive[0]}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                cmdline = b""
            if b"vllm" in cmdline:
                say(f"killing stale server group {pgid} ({p.stem})")
                kill_group(pgid)
        p.unlink(missing_ok=True)


# ------------------------------------------------------------------ planning / dry run


def client_costs(args: argparse.Namespace) -> tuple[float, float]:
    """Estimated client start-up (once per method part, per run): the client (client_main)
    starts once and pays RUN_OVERHEAD_S per run; --client-per-run pays the start every run."""
    if getattr(args, "client_per_run", False):
        return 0.0, args.est_client_s
    return args.est_client_s, RUN_OVERHEAD_S


def method_estimate(s: Settings, name: str, concs: list[int],
                    args: argparse.Namespace) -> tuple[float, list[float]]:  # fmt: skip
    m = METHODS[name]
    once, per_run = client_costs(args)
    runs = [estimate_run_s(m, s.model_cfg, c, s.num_prompts(c), s.input_len, s.output_len,
                           s.warmups(c), per_run) for c in concs]  # fmt: skip
    return args.est_server_start_s + once + sum(runs) + args.est_stop_s, runs


def split_plan(s: Settings, todo: dict[str, list[int]], args: argparse.Namespace,
               command_s: float, session_s: float) -> list[list[tuple[str, list[int], float]]]:  # fmt: skip
    """Greedy split of the pending runs into commands of <= command_s (each method part
    pays one server start) and sessions of <= session_s. Returns sessions of commands, each
    command a list of (method, concurrencies, estimated s)."""
    commands: list[list[tuple[str, list[int], float]]] = []
    cur: list[tuple[str, list[int], float]] = []
    used = 0.0
    once, per_run = client_costs(args)
    fixed = args.est_server_start_s + once + args.est_stop_s
    for name, concs in todo.items():
        m = METHODS[name]
        whole = fixed + sum(
            estimate_run_s(m, s.model_cfg, c, s.num_prompts(c), s.input_len, s.output_len,
                           s.warmups(c), per_run) for c in concs)  # fmt: skip
        if cur and used + whole > command_s and whole <= command_s:
            commands.append(cur)  # a method that fits a command alone is not split
            cur, used = [], 0.0
        part: list[int] = []
        part_s = fixed
        for c in concs:
            r = estimate_run_s(m, s.model_cfg, c, s.num_prompts(c), s.input_len, s.output_len,
                               s.warmups(c), per_run)  # fmt: skip
            if used + part_s + r > command_s and (part or cur):
                if part:
                    cur.append((name, part, part_s))
                commands.append(cur)
                cur, used, part, part_s = [], 0.0, [], fixed
            part.append(c)
            part_s += r
        if part:
            cur.append((name, part, part_s))
            used += part_s
    if cur:
        commands.append(cur)
    sessions: list[list] = []
    sess: list = []
    sess_used = 0.0
    for cmd in commands:
        t = sum(x[2] for x in cmd)
        if sess and sess_used + t > session_s:
            sessions.append(sess)
            sess, sess_used = [], 0.0
        sess.append(cmd)
        sess_used += t
    if sess:
        sessions.append(sess)
    return sessions


def print_plan(s: Settings, out: Path, work: Path, methods: list[str], concs: list[int],
               todo: dict[str, list[int]], args: argparse.Namespace, commands: bool) -> None:  # fmt: skip
    dirs = model_dirs(work, s.model_cfg)
    print(f"model: {s.model_desc}; dirs {dirs['dense']} (dense/kbit), {dirs['gptq']} (GPTQ)")
    print(f"sweep: input {s.input_len} / output {s.output_len} tokens, dtype {s.dtype}, "
          f"concurrency {concs}, prompts per run {[s.num_prompts(c) for c in concs]}")  # fmt: skip
    total = 0.0
    for name in methods:
        concs_m = todo.get(name, [])
        t, runs = method_estimate(s, name, concs_m, args) if concs_m else (0.0, [])
        total += t
        egib = expected_gib(METHODS[name], s.model_cfg)
        state = f"{len(concs_m)} runs pending" if concs_m else "complete"
        print(f"  {name:13s} ~{t:5.0f} s ({state}; expected model memory {_fmt(egib, '.2f')} GiB)")
        if commands and concs_m:
            port = 8000
            model = dirs[METHODS[name].kind]
            print(f"    server: setsid {shell(server_cmd(s, METHODS[name], model, port), s.method_env(METHODS[name]))}"
                  f" > {out}/logs/server_{name}__<session>.log 2>&1 &")  # fmt: skip
            print(f"    wait for '{STARTUP_MARK}' (limit {args.server_timeout:.0f} s)")
            n = 0 if args.client_per_run else len(s.launcher_argv())
            if n:
                print(f"    client: setsid {shell(s.client_cmd(), {'PYTHONUNBUFFERED': '1'})} > "
                      f"{out}/logs/bench_{name}_client__<session>.log 2>&1 (~{args.est_client_s:.0f}"
                      ' s start-up); per run one stdin line {"argv": ARGS, "log": ...}, ARGS as '
                      f"after `{shell(s.launcher_argv())}`:")  # fmt: skip
            for c, r in zip(concs_m, runs):
                cmd = bench_serve_cmd(s, model, port, name, c, out / "raw",
                                      f"{name}_c{c}__<session>.json")  # fmt: skip
                print(f"    c={c:<4d} ~{r:4.0f} s: {shell(cmd[n:])}")
            print("    stop: kill -TERM/-KILL -- -<server pgid>, wait for GPU memory to drop")
    print(f"estimated total ~{total / 60:.1f} min (server start ~{args.est_server_start_s:.0f} s "
          f"per method, client start ~{args.est_client_s:.0f} s per "
          f"{'run' if args.client_per_run else 'method'}; rough H100 model, see estimate_run_s)")  # fmt: skip
    plan = split_plan(s, todo, args, args.time_budget_s, args.session_s)
    if plan:
        print(f"suggested split (commands <= {args.time_budget_s:.0f} s, sessions <= "
              f"{args.session_s:.0f} s of benchmarking):")  # fmt: skip
        for i, sess in enumerate(plan, 1):
            print(f"  session {i}:")
            for cmd in sess:
                parts = ", ".join(
                    f"{m} c={','.join(map(str, cs))} (~{t:.0f} s)" for m, cs, t in cmd
                )
                print(f"    command: {parts}")


# ------------------------------------------------------------------ summary


def _fmt(v: Any, spec: str = ".0f", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def collect(out: Path) -> dict:
    """Every record of a results directory (nothing else feeds the summary)."""
    serve: dict[tuple[str, int], dict] = {}
    for p in sorted((out / "runs" / "serve").glob("*/c*.json")):
        rec = read_json(p)
        if rec and rec.get("schema") == SCHEMA:
            serve[(rec["method"], int(rec["concurrency"]))] = rec
    offline: dict[tuple[str, str], dict] = {}
    for p in sorted((out / "runs" / "offline").glob("*/*.json")):
        rec = read_json(p)
        if rec and rec.get("schema") == SCHEMA:
            offline[(rec["method"], rec["what"])] = rec
    sessions = [r for p in sorted((out / "sessions").glob("*.json")) if (r := read_json(p))]
    servers = [r for p in sorted((out / "servers").glob("*__*.json")) if (r := read_json(p))]
    return {"sweep": read_json(out / "sweep.json") or {}, "serve": serve, "offline": offline,
            "sessions": sessions, "servers": servers}  # fmt: skip


def _order(names: set[str], dtype: str) -> list[str]:
    known = default_methods(dtype)
    return [m for m in known if m in names] + sorted(n for n in names if n not in known)


def method_loads(data: dict) -> dict[str, dict]:
    """Per method: load GiB, kernels, startup s, from the servers of its run JSONs (the
    newest), re-verified against the fp16/bf16 load measured in this directory."""
    sweep = data["sweep"]
    dtype = sweep.get("dtype", "float16")
    cfg = sweep.get("model_config") or {}
    by_method: dict[str, list[dict]] = {}
    for rec in list(data["serve"].values()):
        srv = rec.get("server")
        if srv:
            by_method.setdefault(rec["method"], []).append(srv)
    out: dict[str, dict] = {}
    for m, srvs in by_method.items():
        # one server per method and session; every run of it carries a copy
        srvs = sorted({str(r.get("session")): r for r in srvs}.values(),
                      key=lambda r: str(r.get("session")))  # fmt: skip
        latest = srvs[-1]
        out[m] = {"load_gib": latest.get("load_gib"), "kernels": latest.get("kernels") or [],
                  "kbit_reference_fallback": any(r.get("kbit_reference_fallback") for r in srvs),
                  "startup_s": [r.get("startup_s") for r in srvs if r.get("startup_s")],
                  "load_values": sorted({r.get("load_gib") for r in srvs if r.get("load_gib")}),
                  "expected_gib": expected_gib(METHODS[m], cfg) if m in METHODS and cfg else None,
                  "server_status": latest.get("status"), "server_reason": latest.get("reason")}  # fmt: skip
    base = baseline_name(dtype)
    ref = out.get(base, {}).get("load_gib")
    src = " (measured)"
    if ref is None:
        ref, src = (expected_gib(METHODS[base], cfg) if cfg else None), " (estimated from config)"
    for m, info in out.items():
        if m not in METHODS:
            continue
        if info["load_gib"] is None and info["server_status"] == "failed":
            info["verification"] = {
                "status": "failed",
                "reason": f"server: {info['server_reason']}",
            }
            continue
        info["verification"] = verify_load(METHODS[m], info, ref, src)
        if m != base and info["load_gib"] and ref:
            info["vs_fp16"] = info["load_gib"] / ref
    return out


def summarize(out: Path, write: bool = True) -> str:
    data = collect(out)
    sweep = data["sweep"]
    dtype = sweep.get("dtype", "float16")
    base = baseline_name(dtype)
    planned_m: set[str] = set()
    planned_c: set[int] = set()
    for sess in data["sessions"]:
        plan = sess.get("plan") or {}
        if plan.get("mode") == "serve":
            planned_m.update(plan.get("methods", []))
            planned_c.update(plan.get("concurrency", []))
    serve = data["serve"]
    methods = _order(planned_m | {m for m, _ in serve}, dtype)
    concs = sorted(planned_c | {c for _, c in serve})
    loads = method_loads(data)

    def tput(m: str, c: int) -> float | None:
        r = serve.get((m, c))
        return r["result"]["output_throughput"] if r and r.get("status") == "ok" else None

    def cell(m: str, c: int) -> str:
        r = serve.get((m, c))
        if r is None:
            return "not run"
        if r.get("status") != "ok":
            return "FAILED"
        t, b = tput(m, c), tput(base, c)
        return f"{t:.0f}" + (f" ({t / b:.2f}x)" if b and m != base else "")

    devices = sorted({s.get("device", "?") for s in data["sessions"]} | {
        r.get("device", "?") for r in serve.values()})  # fmt: skip
    lines = [f"# Serving benchmark: {sweep.get('model_desc', '?')} on {', '.join(devices) or '?'}",
             ""]  # fmt: skip
    if len(devices) > 1:
        lines += [f"**Runs come from {len(devices)} different devices: {devices}.**", ""]
    lines += [(f"- input {sweep.get('input_len')} / output {sweep.get('output_len')} tokens, "
               f"dummy weights, dtype {dtype}, prefix caching off, torch.compile + CUDA graphs "
               "(vLLM defaults); online: `vllm bench serve`, random dataset, `--ignore-eos`, "
               "temperature 0, request rate inf with `--max-concurrency`; offline: `vllm bench "
               "throughput` (random dataset) and `vllm bench latency`"),
              (f"- x = output tok/s relative to the unquantized {base} run at the same "
               "concurrency (same directory)"),
              ("- every number below is read from this directory's JSON files "
               "(`python3 benchmarks/serving.py summarize DIR` rebuilds this file)"), "",
              "## Sessions", "",
              "| session | device | date | vLLM | torch | commit | command |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for sess in data["sessions"]:
        v = sess.get("versions", {})
        lines.append(f"| {sess.get('id')} | {sess.get('device')} | {sess.get('date')} | "
                     f"{v.get('vllm')} | {v.get('torch')} | {str(v.get('git_commit'))[:10]} | "
                     f"`{sess.get('command')}` |")  # fmt: skip
    failures: list[str] = []
    if methods:  # the online sweep
        lines += ["", "## Methods: what the server loaded", "",
                  (f"| method | model loading GiB | expected GiB | vs {base} | kernel (GPTQ) | "
                   "server start s | verification |"), "|---|---|---|---|---|---|---|"]  # fmt: skip
        for m in methods:
            info = loads.get(m)
            if not info:
                lines.append(f"| {m} | - | - | - | - | - | not run |")
                continue
            ver = info.get("verification") or {"status": "unknown", "reason": None}
            vtxt = {"ok": "ok", "unknown": "unknown", "failed": "FAILED-verification"}[
                ver["status"]
            ]
            if ver.get("reason"):
                vtxt += f": {ver['reason']}"
            gib = _fmt(info["load_gib"], ".2f")
            if len(info["load_values"]) > 1:
                gib += f" (seen {info['load_values']})"
            kern = ", ".join(k.split(" for ")[0] for k in info["kernels"]) or "-"
            st = "/".join(f"{x:.0f}" for x in info["startup_s"]) or "-"
            lines.append(f"| {m} | {gib} | {_fmt(info['expected_gib'], '.2f')} | "
                         f"{_fmt(info.get('vs_fp16'), '.2f')} | {kern} | {st} | {vtxt} |")  # fmt: skip
        lines += ["", f"## Output throughput, tok/s (x vs {base})", "",
                  "| method | " + " | ".join(f"c={c}" for c in concs) + " |",
                  "|---|" + "---|" * len(concs)]  # fmt: skip
        for m in methods:
            flag = " (FAILED-verification)" if (loads.get(m, {}).get("verification") or {}).get(
                "status") == "failed" else ""  # fmt: skip
            lines.append(f"| {m}{flag} | " + " | ".join(cell(m, c) for c in concs) + " |")
        lines += ["", "## Per run", "",
                  ("| method | c | prompts | output tok/s | x | TTFT median ms | TTFT p99 ms | "
                   "TPOT median ms | TPOT p99 ms | s | status |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for m in methods:
            for c in concs:
                r = serve.get((m, c))
                if r is None:
                    continue
                if r.get("status") != "ok":
                    lines.append(f"| {m} | {c} | {r.get('num_prompts')} | FAILED | | | | | | "
                                 f"{_fmt(r.get('elapsed_s'))} | FAILED: {r.get('reason')} |")  # fmt: skip
                    failures.append(f"- {m} c={c} ({r.get('session')}): {r.get('reason')}")
                    continue
                res = r["result"]
                b = tput(base, c)
                x = f"{res['output_throughput'] / b:.2f}" if b and m != base else ""
                lines.append(f"| {m} | {c} | {r.get('num_prompts')} | {res['output_throughput']:.0f} | "
                             f"{x} | {res['median_ttft_ms']:.1f} | {res['p99_ttft_ms']:.1f} | "
                             f"{res['median_tpot_ms']:.2f} | {res['p99_tpot_ms']:.2f} | "
                             f"{_fmt(r.get('elapsed_s'))} | ok |")  # fmt: skip
        missing = [f"{m} c={c}" for m in methods for c in concs if (m, c) not in serve]
        if failures:
            lines += ["", "## Failures", ""] + failures
        if missing:
            lines += ["", "## Not run yet", "", ", ".join(missing)]
    off = data["offline"]
    if off:
        whats = sorted({w for _, w in off}, key=lambda w: (w != "throughput", w))
        lines += ["", "## Offline (`vllm bench throughput` / `vllm bench latency`)", "",
                  "| method | model loading GiB | " + " | ".join(
                      "throughput output tok/s (x)" if w == "throughput" else
                      f"{w.replace('_b', ' batch ')} avg s (p50 / p99)" for w in whats) + " |",
                  "|---|---|" + "---|" * len(whats)]  # fmt: skip
        omethods = _order({m for m, _ in off}, dtype)
        for m in omethods:
            cells = []
            gib = None
            for w in whats:
                r = off.get((m, w))
                if r is None:
                    cells.append("not run")
                    continue
                gib = gib or (r.get("load") or {}).get("load_gib")
                if r.get("status") != "ok":
                    cells.append("FAILED")
                    failures.append(f"- offline {m} {w}: {r.get('reason')}")
                    continue
                res = r["result"]
                if w == "throughput":
                    t = res["output_tokens_per_second"]
                    br = off.get((base, w))
                    bt = (
                        br["result"]["output_tokens_per_second"]
                        if br and br.get("status") == "ok"
                        else None
                    )
                    cells.append(f"{t:.0f}" + (f" ({t / bt:.2f}x)" if bt and m != base else ""))
                else:
                    pc = res.get("percentiles", {})
                    cells.append(f"{res['avg_latency']:.3f} ({_fmt(pc.get('50'), '.3f')} / "
                                 f"{_fmt(pc.get('99'), '.3f')})")  # fmt: skip
            lines.append(f"| {m} | {_fmt(gib, '.2f')} | " + " | ".join(cells) + " |")
        off_fail = [f for f in failures if f.startswith("- offline")]
        if off_fail:
            lines += ["", "Offline failures:", ""] + off_fail
    md = "\n".join(lines) + "\n"
    if write:
        (out / "summary.md").write_text(md)
        keys = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms")  # fmt: skip

        def brief(r: dict) -> dict:
            res = r.get("result") or {}
            return {"status": r.get("status"), "reason": r.get("reason"),
                    "session": r.get("session")} | {k: res.get(k) for k in keys}  # fmt: skip

        table = {"methods": methods, "concurrency": concs, "baseline": base, "loads": loads,
                 "serve": {f"{m}@{c}": brief(r) for (m, c), r in sorted(serve.items())},
                 "offline": {f"{m}@{w}": {"status": r.get("status"), "reason": r.get("reason"),
                                          "result": r.get("result")}
                             for (m, w), r in sorted(off.items())},
                 "sessions": [{k: s.get(k) for k in ("id", "device", "date", "command", "versions")}
                              for s in data["sessions"]]}  # fmt: skip
        write_json(out / "summary.json", table)
        unverified = {
            m for m, i in loads.items() if (i.get("verification") or {}).get("status") == "failed"
        }
        plot(out, data, methods, concs, base, unverified)
    return md


def plot(out: Path, data: dict, methods: list[str], concs: list[int], base: str,
         unverified: set[str] = frozenset()) -> list[Path]:  # fmt: skip
    serve = data["serve"]
    if not any(r.get("status") == "ok" for r in serve.values()):
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plots", flush=True)
        return []
    sw = data["sweep"]
    title = f"{sw.get('model_desc', '')}, in {sw.get('input_len')} / out {sw.get('output_len')}"
    written = []
    for key, ylabel, fname in (("output_throughput", "output tokens/s", "serving_throughput.png"),
                               ("median_tpot_ms", "TPOT median (ms)", "serving_tpot.png")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(8, 5))
        for m in methods:
            pts = [(c, serve[(m, c)]["result"][key]) for c in concs
                   if (m, c) in serve and serve[(m, c)].get("status") == "ok"]  # fmt: skip
            bad = [c for c in concs if (m, c) in serve and serve[(m, c)].get("status") != "ok"]
            if not pts and not bad:
                continue
            label = m + (f" (FAILED c={','.join(map(str, bad))})" if bad else "")
            label += " (FAILED-verification)" if m in unverified else ""
            style = "--" if m == base else ("-" if m.startswith("kbit") else ":")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency (--max-concurrency)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(out / fname)
    return written


# ------------------------------------------------------------------ merge / pack


def merge_dirs(dst: Path, srcs: list[Path]) -> int:
    """Copy other results dirs into dst: run JSONs where dst has none or a failed one (a
    complete run is never replaced), sessions/servers/raw/logs by name."""
    n = 0
    dst_sweep = read_json(dst / "sweep.json")
    for src in srcs:
        sw = read_json(src / "sweep.json")
        if dst_sweep is None and sw is not None:
            write_json(dst / "sweep.json", sw)
            dst_sweep = sw
        elif sw and dst_sweep and sw.get("config_digest") != dst_sweep.get("config_digest"):
            raise SystemExit(f"{src} is a sweep of another model/config; not merged")
        elif sw and dst_sweep and any(sw.get(k) != dst_sweep.get(k)
                                      for k in ("dtype", "input_len", "output_len")):  # fmt: skip
            raise SystemExit(f"{src} has other dtype/lengths than {dst}; not merged")
        for p in sorted(src.rglob("*")):
            if not p.is_file():
                continue
            rel = p.relative_to(src)
            if rel.parts[0] not in ("runs", "sessions", "servers", "raw", "logs"):
                continue
            if rel.suffix == ".pgid":
                continue
            q = dst / rel
            if rel.parts[0] == "runs":
                if is_complete(q) or (q.exists() and not is_complete(p)):
                    continue
            elif q.exists():
                continue
            q.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, q)
            n += 1
    return n


def pack(out: Path, dest: Path, max_log_bytes: int = 2 << 20) -> Path:
    """One .tar.gz of the results dir; logs above max_log_bytes keep their head and tail."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for p in sorted(out.rglob("*")):
            if not p.is_file() or p.suffix in (".pgid", ".tmp") or p.resolve() == dest.resolve():
                continue
            arc = str(Path(out.name) / p.relative_to(out))
            if p.suffix == ".log" and p.stat().st_size > max_log_bytes:
                data = p.read_bytes()
                half = max_log_bytes // 2
                blob = data[:half] + b"\n[... truncated by serving.py pack ...]\n" + data[-half:]
                ti = tarfile.TarInfo(arc)
                ti.size = len(blob)
                ti.mtime = int(p.stat().st_mtime)
                tar.addfile(ti, io.BytesIO(blob))
            else:
                tar.add(p, arcname=arc)
    return dest


# ------------------------------------------------------------------ CLI


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="config.json of the model shape (overrides --shape); its quantization_config "
        "is dropped",
    )
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES),
                   help="built-in shape from benchmarks/bench_e2e.py")  # fmt: skip
    p.add_argument("--methods", default="all",
                   help=f"comma list or 'all' (= fp16|bf16,kbit2..5,gptq_machete,gptq_marlin); "
                   f"known: {','.join(METHODS)}")  # fmt: skip
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--out-dir", default="/tmp/kbit-serving", help="results directory")
    p.add_argument(
        "--work-dir",
        default="/tmp/kbit-serving-models",
        help="where the dummy model dirs (config.json + tokenizer) are written",
    )
    p.add_argument(
        "--launcher",
        default=DEFAULT_LAUNCHER,
        help="how to start vLLM's CLI ({python} = this interpreter); the staged "
        "/opt/vsite/bin/vllm lacks a __main__ guard and breaks the engine spawn",
    )
    p.add_argument("--gpu-mem", type=float, default=0.90, help="--gpu-memory-utilization")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None, help="default input+output+64")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra engine argument for every method (repeat; e.g. --engine-arg=--enforce-eager)")  # fmt: skip
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=540.0,
        help="stop starting servers / runs that would end after this many seconds",
    )
    p.add_argument(
        "--session-s",
        type=float,
        default=1200.0,
        help="benchmark seconds per GPU session, for the suggested split only",
    )
    p.add_argument(
        "--server-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for 'Application startup complete'",
    )
    # H100, 8B shape, cold torch.compile cache: 124 s (fp16) and 123 s (kbit4) in
    # benchmarks/results/serving_h100 (a warm cache on the same machine starts in ~40-60 s)
    p.add_argument("--est-server-start-s", type=float, default=125.0)
    p.add_argument("--est-stop-s", type=float, default=15.0)
    p.add_argument(
        "--est-client-s",
        type=float,
        default=28.0,
        help="estimated start-up of the bench client (imports; 21-34 s on the H100), paid once "
        "per method (every run with --client-per-run)",
    )
    p.add_argument(
        "--gpu-free-mib",
        type=int,
        default=2048,
        help="GPU memory.used (MiB) under which the GPU counts as free",
    )
    p.add_argument(
        "--no-retry-failed",
        dest="retry_failed",
        action="store_false",
        help="skip runs that already have a failed JSON (default: retry them)",
    )
    p.add_argument(
        "--bench-unverified",
        action="store_true",
        help="benchmark a method even when its load failed verification",
    )
    p.add_argument(
        "--allow-reference",
        action="store_true",
        help="run kbit without vllm_kbit._C (times the PyTorch reference)",
    )
    p.add_argument(
        "--import-dir",
        action="append",
        default=[],
        help="merge an earlier results dir into --out-dir first (repeat)",
    )
    p.add_argument("--pack", help="write the results dir into this .tar.gz at the end")
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands only")


def settings_from(args: argparse.Namespace) -> Settings:
    cfg, desc = load_model_config(args.config, args.shape)
    s = Settings(model_cfg=cfg, model_desc=desc, dtype=args.dtype, input_len=args.input_len,
                 output_len=args.output_len, launcher=args.launcher, gpu_mem=args.gpu_mem,
                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                 extra_engine_args=list(args.engine_arg),
                 require_kernels=not args.allow_reference)  # fmt: skip
    for name in ("warmup_cap", "prompts_factor", "prompts_min", "prompts_max"):
        if hasattr(args, name):
            setattr(s, name, getattr(args, name))
    return s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_client"]:  # internal: not in --help
        return client_main(argv[1] if len(argv) > 1 else BENCH_FN)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # progress reaches a pipe / log at once
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="mode", required=True)
    ps = sub.add_parser("serve", help="online sweep: vllm serve + vllm bench serve")
    add_common(ps)
    ps.add_argument("--concurrency", default=DEFAULT_CONCURRENCY)
    ps.add_argument("--prompts-factor", type=int, default=4, help="num prompts = factor * c ...")
    ps.add_argument("--prompts-min", type=int, default=8, help="... at least this ...")
    ps.add_argument("--prompts-max", type=int, default=512, help="... at most this (and >= c)")
    ps.add_argument("--warmup-cap", type=int, default=16, help="--num-warmups = min(c, this)")
    ps.add_argument("--client-per-run", action="store_true",
                    help="one `vllm bench serve` process per run (default: one client process "
                    "per method runs them all, see client_main)")  # fmt: skip
    po = sub.add_parser("offline", help="vllm bench throughput + latency per method")
    add_common(po)
    po.add_argument(
        "--offline-prompts", type=int, default=512, help="bench throughput --num-prompts"
    )
    po.add_argument(
        "--latency-batch", default="1", help="bench latency batch sizes (one engine each)"
    )
    po.add_argument("--latency-warmup", type=int, default=3)
    po.add_argument("--latency-iters", type=int, default=10)
    pz = sub.add_parser("summarize", help="rebuild summary.md/json and PNGs of a results dir")
    pz.add_argument("dir")
    pz.add_argument("--merge", nargs="*", default=[], help="results dirs to merge into DIR first")
    pz.add_argument("--pack")
    pp = sub.add_parser("pack", help="write a results dir into one .tar.gz")
    pp.add_argument("dir")
    pp.add_argument("dest")
    args = ap.parse_args(argv)

    if args.mode == "summarize":
        out = Path(args.dir)
        if args.merge:
            print(f"merged {merge_dirs(out, [Path(d) for d in args.merge])} files", flush=True)
        print(summarize(out), flush=True)
        if args.pack:
            print(f"packed {pack(out, Path(args.pack))}", flush=True)
        return 0
    if args.mode == "pack":
        print(f"packed {pack(Path(args.dir), Path(args.dest))}", flush=True)
        return 0

    s = settings_from(args)
    methods = parse_methods(args.methods, s.dtype)
    out, work = Path(args.out_dir), Path(args.work_dir)
    concs = parse_ints(args.concurrency) if args.mode == "serve" else []
    if concs and max(concs) > s.max_num_seqs:
        raise SystemExit(f"concurrency {max(concs)} > --max-num-seqs {s.max_num_seqs}")
    if args.mode == "serve":
        todo = pending_serve_runs(out, methods, concs, args.retry_failed)
    else:
        todo = {m: [0] for m in methods}
    if args.dry_run:
        if args.mode == "serve":
            print_plan(s, out, work, methods, concs, todo, args, commands=True)
        else:
            dirs = model_dirs(work, s.model_cfg)
            for m in methods:
                mm, raw = METHODS[m], out / "raw"
                tp = throughput_cmd(s, mm, dirs[mm.kind], args.offline_prompts,
                                    raw / f"offline_{m}_throughput.json")  # fmt: skip
                print(f"{m}: {shell(tp, s.method_env(mm))}")
                for b in parse_ints(args.latency_batch):
                    lat = latency_cmd(s, mm, dirs[mm.kind], b, args.latency_warmup,
                                      args.latency_iters, raw / f"offline_{m}_latency_b{b}.json")  # fmt: skip
                    print(f"{m}: {shell(lat, s.method_env(mm))}")
            print(f"estimate: ~{(2 * args.est_server_start_s + 90) * len(methods) / 60:.1f} min "
                  "(two engine starts + runs per method)")  # fmt: skip
        return 0

    budget = Budget(args.time_budget_s)
    old_handlers = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_sweep(args, argv, s, methods, concs, out, work, budget)
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)


def run_sweep(args: argparse.Namespace, argv: list[str], s: Settings, methods: list[str],
              concs: list[int], out: Path, work: Path, budget: Budget) -> int:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    for d in args.import_dir:
        print(f"imported {merge_dirs(out, [Path(d)])} files from {d}", flush=True)
    check_sweep(out, s)
    kill_stale_servers(out)
    if args.mode == "serve":
        todo = pending_serve_runs(out, methods, concs, args.retry_failed)
    else:  # offline_method skips what is complete itself
        todo = {m: [0] for m in methods}
    dev = device_info()
    sid = (
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}"
    )
    session = {"schema": SCHEMA, "id": sid, "date": now_iso(), "device": dev["device"],
               "gpus": dev["gpus"], "versions": versions(),
               "command": shlex.join(["python3", os.path.relpath(__file__, REPO)] + argv),
               "plan": {"mode": args.mode, "methods": methods, "concurrency": concs,
                        "time_budget_s": args.time_budget_s}}  # fmt: skip
    ctx = Ctx(s=s, out=out, work=work, budget=budget, session=session, args=args)
    if args.mode == "serve":
        print_plan(s, out, work, methods, concs, todo, args, commands=False)
    blocked = preflight(ctx, list(todo))
    write_json(out / "sessions" / f"{sid}.json", session)
    ctx.dirs = build_model_dirs(work, s.model_cfg, {METHODS[m].kind for m in methods})
    say(f"session {sid} on {dev['device']}; pending: {todo or 'nothing'}")
    try:
        for m in methods:
            if m not in todo:
                say(f"[{m}] complete already, skipping")
                continue
            if args.mode == "serve":
                cont = serve_method(ctx, m, todo[m], blocked.get(m))
            else:
                cont = offline_method(ctx, m, blocked.get(m))
            if not cont:
                break
    finally:
        for g in list(_GROUPS):  # an exception must not leave a server holding the GPU
            kill_group(g)
        session["elapsed_s"] = round(ctx.budget.elapsed(), 1)
        write_json(out / "sessions" / f"{sid}.json", session)
        md = summarize(out)
        print(md, flush=True)
        if args.pack:
            say(f"packed {pack(out, Path(args.pack))}")
    left = pending_serve_runs(out, methods, concs, False) if args.mode == "serve" else {}
    say(f"done in {ctx.budget.elapsed():.0f} s; still pending: {left or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
