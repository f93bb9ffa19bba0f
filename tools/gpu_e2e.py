#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""End-to-end checks of the kbit plugin inside vLLM (GPU machine; driven by tools/gpu_e2e.sh).

    python tools/gpu_e2e.py build  --work DIR            # checkpoints (CPU or GPU)
    python tools/gpu_e2e.py check NAME --work DIR --logs DIR
    python tools/gpu_e2e.py cpu-selftest --work DIR      # build + tokenizer + twin checks, no vLLM run

Checks (each prints exactly one line ``E2E <name> PASS|FAIL <details>``):
  prequant_greedy    kbit4 checkpoint vs its reference-dequantized fp16 twin, greedy 32 tokens
  online_k5_vs_fp16  fp16 model quantized online at k=5 vs plain fp16, first-token agreement
  compiled_graphs    kbit4 checkpoint with torch.compile + CUDA graphs vs the eager run
  dummy_online       Llama-3.1-8B-shaped config.json, load_format=dummy, online kbit4: memory
  serve_openai       `vllm serve` of the kbit4 checkpoint (+ tiny tokenizer), both OpenAI APIs
  moe_qwen3          Qwen3-30B-A3B-shaped MoE (128 experts, top-8, hidden 2048, moe_intermediate
                     768; 2 layers, vocab 32000), random fp16 weights: kbit4 checkpoint vs its
                     dequantized twin (greedy), and online kbit4 vs the kbit4 checkpoint
  moe_mixtral        the same for a small Mixtral shape (8 experts, top-2, hidden 1024, 4 layers)
  moe_compiled       moe_qwen3's kbit4 checkpoint with torch.compile + CUDA graphs vs its eager run
                     (needs the CUDA kbit::moe kernel: the reference fallback syncs with the host)
The MoE checks are not in the default list (time): name them, e.g. `check moe_qwen3`.

Every LLM runs in its own process group with a timeout (``worker`` subcommand); its log goes
to --logs, its results to a JSON file in --work. Near-tie rule (used by the greedy checks):
a prompt whose token sequences differ still counts as agreeing when, at the first differing
step, each run's chosen token is in the other run's top-5 and within TIE_TOL nats of that
run's top-1 -- i.e. the two runs faced an (almost) exact tie that rounding can flip.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# ---------------------------------------------------------------- the tiny model

TINY = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
            max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            initializer_range=0.02, hidden_act="silu")  # fmt: skip
from benchmarks.bench_e2e import LLAMA_8B, QWEN3_30B_A3B  # noqa: E402  (one definition each)
from benchmarks.serving import group_alive  # noqa: E402  (live members of a process group)
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = ("hello world the a an of to and in is it you that he was for on are with as I his they "
         "be at one have this from or had by hot word but what some we can out other were all "
         "there when up use your how said each she which do their time if will way about many "
         "then them write would like so these her long make thing see him two has look more day "
         "could go come did number sound no most people my over know water than call first who "
         "may down side been now find any new work part take get place made live where after "
         "back little only round man year came show every good me give our under name very "
         "through just form sentence great think say help low line differ turn cause much mean "
         "before move right boy old too same tell does set three want air well also play small "
         "end put home read hand port large spell add even land here must big high such follow "
         "act why ask men change went light kind off need house picture try us again animal "
         "point mother story tokenizer model answer question quantization kbit vllm").split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BITS = 4
N_GREEDY, GREEDY_TOKENS = 8, 32
N_FIRST = 64  # prompts of the first-token comparison (online_k5_vs_fp16)
TIE_TOL = 0.03  # nats; see module docstring
LOGPROB_TOL = 0.05  # nats; first-step top-1 logprob, kbit vs dequantized twin
MOE_LOGPROB_TOL = 0.1  # the twin's MoE is vLLM's fp16 fused_experts (other rounding points)


def paths(work: Path) -> dict[str, Path]:
    return {"fp16": work / "tiny-fp16", "kbit": work / f"tiny-kbit{BITS}",
            "twin": work / f"tiny-kbit{BITS}-dequant-fp16", "8b": work / "llama8b-config"}  # fmt: skip


def build_fp16_model(out: Path, seed: int = 0) -> None:
    """Random-weight Llama (``TINY``), fp16 safetensors, via transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**TINY)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    cfgd = json.loads((out / "config.json").read_text())  # vLLM reads torch_dtype or dtype
    cfgd["torch_dtype"] = cfgd["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(cfgd, indent=2) + "\n")


def build_tokenizer(out: Path):
    """Offline WordLevel tokenizer with exactly TINY['vocab_size'] entries + a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n = TINY["vocab_size"]
    vocab: dict[str, int] = {}
    for t in SPECIAL:
        vocab[t] = len(vocab)
    for w in WORDS:
        vocab.setdefault("\u2581" + w, len(vocab))
    i = 0
    while len(vocab) < n:
        vocab.setdefault(f"\u2581w{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>",
                                   additional_special_tokens=SPECIAL[3:],
                                   model_max_length=2048)  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def convert_kbit(src: Path, dst: Path, bits: int = BITS) -> dict:
    from vllm_kbit.quantize import convert

    return convert(src, dst, bits, overwrite=True, progress=False)


def build_dequant_twin(kbit_dir: Path, out: Path) -> int:
    """fp16 checkpoint computing the same function as ``kbit_dir``: every qweight/weight_absmax
    pair replaced by ``reference.dequantize`` (fp32 math, rounded to fp16; on a GPU the
    dequantize kernel, which tests/test_cuda_format.py checks bit for bit against it).
    Returns #replaced."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_kbit import _ops
    from vllm_kbit import reference as ref
    from vllm_kbit.format import KbitQuantConfig

    def dequantize(q, a, cb, k):
        if not torch.cuda.is_available():
            return ref.dequantize(q, a, cb, k, dtype=torch.float16)
        _ops.load()
        return torch.ops.kbit.dequantize(q.cuda(), a.cuda(), cb.cuda(), k, torch.float16).cpu()

    cfg = json.loads((kbit_dir / "config.json").read_text())
    qcfg = KbitQuantConfig.from_dict(cfg["quantization_config"])
    out.mkdir(parents=True, exist_ok=True)
    replaced = 0
    files = sorted(kbit_dir.glob("*.safetensors"))
    weight_map = {}
    for f in files:
        tensors = {}
        with safe_open(str(f), "pt") as sf:
            keys = list(sf.keys())
            for key in keys:
                if key.endswith(".weight_absmax"):
                    continue
                if key.endswith(".qweight"):
                    mod = key[: -len(".qweight")]
                    q, a = sf.get_tensor(key), sf.get_tensor(mod + ".weight_absmax")
                    k = q.shape[1] // a.shape[1]
                    tensors[mod + ".weight"] = dequantize(q, a, qcfg.codebook(k), k)
                    replaced += 1
                else:
                    tensors[key] = sf.get_tensor(key)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        weight_map.update({k: f.name for k in tensors})
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))  # fmt: skip
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for p in kbit_dir.iterdir():  # generation config, tokenizer files
        if p.is_file() and p.suffix != ".safetensors" and p.name not in (
                "config.json", "model.safetensors.index.json", "kbit_quantize_report.json"):
            shutil.copy2(p, out / p.name)
    return replaced


def build_8b_config(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(LLAMA_8B, indent=1) + "\n")


def build_all(work: Path, force: bool = False) -> dict[str, Path]:
    p = paths(work)
    marker = work / "BUILD_OK"
    if marker.exists() and not force:
        print(f"checkpoints already built under {work}")
        return p
    t0 = time.time()
    for d in p.values():
        shutil.rmtree(d, ignore_errors=True)
    build_fp16_model(p["fp16"])
    build_tokenizer(p["fp16"])
    report = convert_kbit(p["fp16"], p["kbit"])
    n = build_dequant_twin(p["kbit"], p["twin"])
    build_8b_config(p["8b"])
    tot = report["totals"]
    if n != tot["quantized_tensors"] or n != 7 * TINY["num_hidden_layers"]:
        raise RuntimeError(f"twin replaced {n} tensors, converter quantized {tot['quantized_tensors']}")
    marker.write_text("ok\n")
    print(f"built {', '.join(str(v) for v in p.values())} in {time.time() - t0:.1f} s "
          f"({n} quantized tensors, {tot['original_gb']} -> {tot['new_gb']} GB)")  # fmt: skip
    return p


# ------------------------------------------------------------------ the MoE models

_VOCAB = {"vocab_size": TINY["vocab_size"], "max_position_embeddings": 2048, "bos_token_id": 1,
          "eos_token_id": 2, "torch_dtype": "float16"}  # prompts are token ids of TINY's range
MOE = {
    "qwen3": {**QWEN3_30B_A3B, "num_hidden_layers": 2, **_VOCAB},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 4,
                "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
                "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
                "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                "sliding_window": None, **_VOCAB},
}  # fmt: skip


def moe_paths(work: Path, arch: str) -> dict[str, Path]:
    return {k: work / f"moe-{arch}-{k}" for k in ("fp16", "kbit", "twin")}


def moe_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the checkpoint transformers' save_pretrained writes for ``cfg``
    (per-expert 2-D expert weights; cpu-selftest compares this with transformers)."""
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    qwen = cfg["model_type"] == "qwen3_moe"
    e = cfg["num_experts"] if qwen else cfg["num_local_experts"]
    i = cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"]
    mlp, (gate, up, down) = (("mlp", ("gate_proj", "up_proj", "down_proj")) if qwen
                             else ("block_sparse_moe", ("w1", "w3", "w2")))  # fmt: skip
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}  # fmt: skip
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes |= {f"{p}.input_layernorm.weight": (h,),
                   f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                   f"{p}.{mlp}.gate.weight": (e, h)}  # fmt: skip
        if qwen:
            shapes |= {f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)}
        for x in range(e):
            shapes |= {f"{p}.{mlp}.experts.{x}.{gate}.weight": (i, h),
                       f"{p}.{mlp}.experts.{x}.{up}.weight": (i, h),
                       f"{p}.{mlp}.experts.{x}.{down}.weight": (h, i)}  # fmt: skip
    return shapes


def build_moe_model(out: Path, cfg: dict, seed: int = 0) -> None:
    """Random fp16 checkpoint of ``cfg``: matrices N(0, 0.02) (transformers' initializer_range),
    norms 1; one safetensors shard per layer (generated on the GPU when there is one)."""
    import torch
    from safetensors.torch import save_file

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    shards: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in moe_tensor_shapes(cfg).items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        shards.setdefault(f"layer{int(m[1]):03d}" if m else "other", {})[name] = shape
    out.mkdir(parents=True, exist_ok=True)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, group in zip(files, shards.values(), strict=True):
        tensors = {n: (torch.ones(sh, device=dev) if len(sh) == 1 else
                       torch.randn(sh, generator=gen, device=dev) * 0.02).half().cpu()
                   for n, sh in group.items()}  # fmt: skip
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, fname)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")


def build_moe(work: Path, arch: str, force: bool = False) -> dict[str, Path]:
    """fp16 checkpoint, its kbit4 conversion and the conversion's dequantized twin."""
    p = moe_paths(work, arch)
    marker = work / f"BUILD_MOE_{arch}_OK"
    if marker.exists() and not force:
        return p
    t0 = time.time()
    for d in p.values():
        shutil.rmtree(d, ignore_errors=True)
    cfg = MOE[arch]
    build_moe_model(p["fp16"], cfg)
    report = convert_kbit(p["fp16"], p["kbit"])
    n = build_dequant_twin(p["kbit"], p["twin"])
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    want = cfg["num_hidden_layers"] * (4 + 3 * experts)  # q, k, v, o + the experts
    if n != report["totals"]["quantized_tensors"] or n != want:
        raise RuntimeError(f"moe {arch}: twin replaced {n} tensors, converter quantized "
                           f"{report['totals']['quantized_tensors']}, expected {want}")  # fmt: skip
    marker.write_text("ok\n")
    print(f"built moe {arch} ({n} quantized tensors, {report['totals']['original_gb']} -> "
          f"{report['totals']['new_gb']} GB) in {time.time() - t0:.1f} s", flush=True)  # fmt: skip
    return p


def make_prompts(n: int, seed: int, lo: int = 8, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    first = len(SPECIAL)
    return [[rng.randrange(first, TINY["vocab_size"]) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]  # fmt: skip


GREEDY_PROMPTS = make_prompts(N_GREEDY, seed=1)
FIRST_PROMPTS = make_prompts(N_FIRST, seed=2)


# ------------------------------------------------------------------- LLM worker


def worker(spec_path: Path, result_path: Path) -> None:
    """Runs in its own process group: one LLM, the generate calls of the spec, JSON out."""
    spec = json.loads(spec_path.read_text())
    try:
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        llm = LLM(**spec["llm"])
        res = {"load_s": round(time.perf_counter() - t0, 2), "gens": {}}
        print(f"WORKER loaded in {res['load_s']} s", flush=True)
        for gen in spec["gens"]:
            sp = SamplingParams(max_tokens=gen["max_tokens"], temperature=0.0, ignore_eos=True,
                                logprobs=gen.get("logprobs"), detokenize=False)  # fmt: skip
            outs = []
            for batch in gen["batches"]:  # one generate call per batch of prompts
                got = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
                for o in got:
                    c = o.outputs[0]
                    steps = []
                    for step in c.logprobs or []:
                        items = step.items() if hasattr(step, "items") else dict(step).items()
                        top = sorted(((int(t), float(lp.logprob)) for t, lp in items),
                                     key=lambda x: -x[1])  # fmt: skip
                        steps.append(top)
                    outs.append({"tokens": [int(t) for t in c.token_ids], "top": steps})
            res["gens"][gen["name"]] = outs
        result_path.write_text(json.dumps(res))
        print("WORKER_DONE", flush=True)
    except BaseException:  # noqa: BLE001  report any failure, then exit hard
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a finished LLM can hang at exit (engine process)


_GROUPS: set[int] = set()  # process groups this process started and has not ended yet


def kill_group(pgid: int, wait_s: float = 30.0) -> None:
    """SIGKILL the process group we started and wait until none of it is alive (GPU freed)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    t_end = time.time() + wait_s
    while group_alive(pgid) and time.time() < t_end:
        time.sleep(0.2)
    _GROUPS.discard(pgid)
    time.sleep(1.0)  # let the driver release the memory


def _on_term(signum, frame):  # the driver's `timeout` fired: leave no engine behind
    for g in list(_GROUPS):
        kill_group(g, wait_s=5)
    print(f"E2E {_CURRENT[0]} FAIL killed by signal {signum} (driver timeout)", flush=True)
    os._exit(124)


_CURRENT = ["?"]


def log_error(log: Path) -> str:
    """The most telling error line of a log, for the one-line summary."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for pat in (r"^\w*(Error|Exception)\b.*:", r"(Error|error|Exception)", r"Traceback"):
        hits = [ln for ln in lines if re.search(pat, ln)]
        if hits:
            return hits[-1].strip()[:240]
    return (lines[-1].strip()[:240] if lines else "empty log")


def run_llm(name: str, llm_kw: dict, gens: list[dict], ctx: argparse.Namespace,
            timeout: float) -> tuple[dict | None, str]:  # fmt: skip
    """One LLM in a fresh process group; returns (result, error)."""
    work, logs = Path(ctx.work), Path(ctx.logs)
    spec, result, log = work / f"{name}.spec.json", work / f"{name}.result.json", logs / f"{name}.log"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({"llm": llm_kw, "gens": gens}))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    t0 = time.time()
    with open(log, "w") as lf:
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "worker", "--spec",
                              str(spec), "--result", str(result)], stdout=lf,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
        _GROUPS.add(p.pid)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_group(p.pid)
            p.wait()
    dt = time.time() - t0
    print(f"  [{name}] rc={rc} {dt:.0f} s log={log}", flush=True)
    if rc is None:
        return None, f"{name} timed out after {timeout:.0f} s ({log_error(log)})"
    if rc != 0 or not result.exists():
        return None, f"{name} rc={rc}: {log_error(log)}"
    shutil.copy2(result, logs / result.name)  # small; lets the lead inspect tokens/logprobs
    return json.loads(result.read_text()), ""


def tiny_llm_kw(model: Path, eager: bool = True, **extra) -> dict:
    kw = dict(model=str(model), dtype="float16", skip_tokenizer_init=True, seed=0,
              max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.5,
              enforce_eager=eager)  # fmt: skip
    kw.update(extra)
    return kw


def greedy_gens(batch1: bool = False) -> list[dict]:
    gens = [{"name": "b8", "batches": [GREEDY_PROMPTS], "max_tokens": GREEDY_TOKENS, "logprobs": 5}]
    if batch1:  # two prompts, each alone in its own generate call (batch size 1)
        gens.append({"name": "b1", "batches": [[p] for p in GREEDY_PROMPTS[:2]],
                     "max_tokens": GREEDY_TOKENS, "logprobs": 5})  # fmt: skip
    return gens


# ------------------------------------------------------------------ comparisons


def compare_seq(a: dict, b: dict, tol: float = TIE_TOL) -> str:
    """'match', 'tie@i' (first difference is a near-tie, see docstring) or 'diff@i (...)'."""
    ta, tb = a["tokens"], b["tokens"]
    if ta == tb:
        return "match"
    i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    if i >= min(len(ta), len(tb)) or i >= len(a["top"]) or i >= len(b["top"]):
        return f"diff@{i} (length {len(ta)} vs {len(tb)})"
    x, y = ta[i], tb[i]
    da, db = dict(a["top"][i]), dict(b["top"][i])
    gap_a = da[x] - da[y] if y in da else math.inf  # how much run a preferred its token
    gap_b = db[y] - db[x] if x in db else math.inf
    if gap_a <= tol and gap_b <= tol:
        return f"tie@{i}"
    return f"diff@{i} (gaps {gap_a:.3f}/{gap_b:.3f})"


def agree_count(ref: list[dict], test: list[dict]) -> tuple[int, int, list[str]]:
    verdicts = [compare_seq(r, t) for r, t in zip(ref, test)]
    exact = sum(v == "match" for v in verdicts)
    ok = sum(v == "match" or v.startswith("tie") for v in verdicts)
    return exact, ok, verdicts


def top1_lp(r: dict, step: int = 0) -> float:
    return r["top"][step][0][1]


def first_token_agreement(ref: list[dict], test: list[dict]) -> tuple[int, int, int, list[float]]:
    """(prompts, same top-1, ref top-1 within test's top-5, |dlogprob top-1| per prompt) of the
    first generated token."""
    top1 = sum(r["top"][0][0][0] == t["top"][0][0][0] for r, t in zip(ref, test))
    in5 = sum(r["top"][0][0][0] in [x for x, _ in t["top"][0][:5]] for r, t in zip(ref, test))
    return len(ref), top1, in5, [abs(top1_lp(r) - top1_lp(t)) for r, t in zip(ref, test)]


def emit(name: str, ok: bool, details: str) -> bool:
    print(f"E2E {name} {'PASS' if ok else 'FAIL'} {details}", flush=True)
    return ok


# ----------------------------------------------------------------------- checks


def check_prequant_greedy(ctx) -> bool:
    p = paths(Path(ctx.work))
    kb, err = run_llm("kbit4_eager", tiny_llm_kw(p["kbit"]), greedy_gens(), ctx, ctx.llm_timeout)
    if kb is None:
        return emit("prequant_greedy", False, err)
    tw, err = run_llm("twin_eager", tiny_llm_kw(p["twin"]), greedy_gens(), ctx, ctx.llm_timeout)
    if tw is None:
        return emit("prequant_greedy", False, err)
    ref, test = tw["gens"]["b8"], kb["gens"]["b8"]
    exact, ok, verdicts = agree_count(ref, test)
    d0 = [abs(top1_lp(r) - top1_lp(t)) for r, t in zip(ref, test)]
    same0 = sum(r["top"][0][0][0] == t["top"][0][0][0] for r, t in zip(ref, test))
    passed = ok >= N_GREEDY - 1 and max(d0) <= LOGPROB_TOL
    return emit("prequant_greedy", passed,
                f"seq agree {ok}/{N_GREEDY} (exact {exact}, need >= {N_GREEDY - 1}; tie tol "
                f"{TIE_TOL}); step-0 top-1 same {same0}/{N_GREEDY}; max |dlogprob top-1 step 0| "
                f"{max(d0):.4f} (tol {LOGPROB_TOL}); verdicts {verdicts}; load kbit "
                f"{kb['load_s']} s twin {tw['load_s']} s")  # fmt: skip


def check_online_k5(ctx) -> bool:
    p = paths(Path(ctx.work))
    gens = [{"name": "first", "batches": [FIRST_PROMPTS], "max_tokens": 1, "logprobs": 5}]
    fp, err = run_llm("fp16_eager", tiny_llm_kw(p["fp16"]), gens + greedy_gens(), ctx,
                      ctx.llm_timeout)  # fmt: skip
    if fp is None:
        return emit("online_k5_vs_fp16", False, err)
    kw = tiny_llm_kw(p["fp16"], quantization="kbit",
                     hf_overrides={"quantization_config": {"quant_method": "kbit", "bits": 5}})  # fmt: skip
    k5, err = run_llm("online_k5_eager", kw, gens, ctx, ctx.llm_timeout)
    if k5 is None:
        return emit("online_k5_vs_fp16", False, err)
    ref, test = fp["gens"]["first"], k5["gens"]["first"]
    n, top1, in5, dlp = first_token_agreement(ref, test)
    mean_dlp = sum(dlp) / n
    first16 = sum(r["top"][0][0][0] == t["top"][0][0][0] for r, t in zip(ref[:16], test[:16]))
    passed = top1 >= n // 2 and in5 >= n - 4 and mean_dlp <= 0.15
    # context: how far the pre-quantized kbit4 run of check 1 is from fp16 (not judged)
    ctx_note = ""
    kb_path = Path(ctx.work) / "kbit4_eager.result.json"
    if kb_path.exists():
        exact, ok, _ = agree_count(fp["gens"]["b8"], json.loads(kb_path.read_text())["gens"]["b8"])
        ctx_note = f"; context: kbit4 vs fp16 greedy-32 exact {exact}/{N_GREEDY}, tie-ok {ok}"
    return emit("online_k5_vs_fp16", passed,
                f"top-1 agree {top1}/{n} (need >= {n // 2}; first 16: {first16}/16); fp16 top-1 in "
                f"k5 top-5 {in5}/{n} (need >= {n - 4}); mean |dlogprob top-1| {mean_dlp:.4f} "
                f"(need <= 0.15, max {max(dlp):.4f}); load k5 {k5['load_s']} s{ctx_note}")  # fmt: skip


def check_compiled(ctx) -> bool:
    work, p = Path(ctx.work), paths(Path(ctx.work))
    eager_path = work / "kbit4_eager.result.json"
    if not eager_path.exists():
        eager_path = work / "twin_eager.result.json"  # kbit eager failed: twin is next best
    cg, err = run_llm("kbit4_compiled", tiny_llm_kw(p["kbit"], eager=False), greedy_gens(True),
                      ctx, ctx.compiled_timeout)  # fmt: skip
    if cg is None:
        return emit("compiled_graphs", False, err)
    if not eager_path.exists():
        return emit("compiled_graphs", False, "ran, but no eager reference (check 1 failed)")
    ref = json.loads(eager_path.read_text())["gens"]["b8"]
    exact8, ok8, v8 = agree_count(ref, cg["gens"]["b8"])
    exact1, ok1, v1 = agree_count(ref[:2], cg["gens"]["b1"])
    passed = ok8 >= N_GREEDY - 1 and ok1 == 2
    return emit("compiled_graphs", passed,
                f"vs {eager_path.stem.split('.')[0]}: batch 8 agree {ok8}/{N_GREEDY} (exact "
                f"{exact8}, need >= {N_GREEDY - 1}); batch 1 agree {ok1}/2 (exact {exact1}); "
                f"verdicts b8 {v8} b1 {v1}; load+compile {cg['load_s']} s")  # fmt: skip


def check_dummy_online(ctx) -> bool:
    p = paths(Path(ctx.work))
    kw = dict(model=str(p["8b"]), load_format="dummy", quantization="kbit", enforce_eager=True,
              max_model_len=512, max_num_seqs=16, skip_tokenizer_init=True, seed=0,
              gpu_memory_utilization=0.5)  # fmt: skip
    prompts = [[(7 * i + 13 * j) % 1000 + 10 for j in range(16)] for i in range(4)]
    gens = [{"name": "gen", "batches": [prompts], "max_tokens": 8, "logprobs": 1}]
    res, err = run_llm("dummy8b_online", kw, gens, ctx, ctx.dummy_timeout)
    log = Path(ctx.logs) / "dummy8b_online.log"
    m = re.findall(r"Model loading took ([0-9.]+) GiB", log.read_text(errors="replace"))
    gib = float(m[-1]) if m else None
    if res is None:
        return emit("dummy_online", False, f"{err}; model loading GiB {gib}")
    outs = res["gens"]["gen"]
    ntok = [len(o["tokens"]) for o in outs]
    finite = all(math.isfinite(lp) for o in outs for st in o["top"] for _, lp in st)
    passed = gib is not None and gib < 7.0 and all(n == 8 for n in ntok) and finite
    return emit("dummy_online", passed,
                f"Model loading took {gib} GiB (need < 7; fp16 ~15); tokens {ntok}; logprobs "
                f"finite {finite}; load {res['load_s']} s")  # fmt: skip


def check_lm_head(ctx) -> bool:
    """quantize_lm_head: the dummy 8B loads ~0.72 GiB less with it (128256 x 4096 weights at
    4.25 instead of 16 bits), and the tiny model's online k=5 with its lm_head quantized stays as
    close to fp16 as check online_k5_vs_fp16 requires of the body alone."""
    p = paths(Path(ctx.work))
    qc = {"quant_method": "kbit", "bits": 4, "quantize_lm_head": True}
    kw = dict(model=str(p["8b"]), load_format="dummy", quantization="kbit", enforce_eager=True,
              max_model_len=512, max_num_seqs=16, skip_tokenizer_init=True, seed=0,
              gpu_memory_utilization=0.5, hf_overrides={"quantization_config": qc})  # fmt: skip
    prompts = [[(7 * i + 13 * j) % 1000 + 10 for j in range(16)] for i in range(4)]
    gens = [{"name": "gen", "batches": [prompts], "max_tokens": 8, "logprobs": 1}]
    res, err = run_llm("dummy8b_online_lm_head", kw, gens, ctx, ctx.dummy_timeout)
    gib = re.findall(r"Model loading took ([0-9.]+) GiB",
                     (Path(ctx.logs) / "dummy8b_online_lm_head.log").read_text(errors="replace"))
    base = re.findall(r"Model loading took ([0-9.]+) GiB",
                      (Path(ctx.logs) / "dummy8b_online.log").read_text(errors="replace")
                      if (Path(ctx.logs) / "dummy8b_online.log").exists() else "")  # fmt: skip
    if res is None or not gib:
        return emit("lm_head", False, f"{err or 'no Model loading line'}")
    gib_lm, gib_base = float(gib[-1]), float(base[-1]) if base else None
    saved = None if gib_base is None else gib_base - gib_lm
    finite = all(math.isfinite(lp) for o in res["gens"]["gen"] for st in o["top"] for _, lp in st)
    first = [{"name": "first", "batches": [FIRST_PROMPTS], "max_tokens": 1, "logprobs": 5}]
    fp_path = Path(ctx.work) / "fp16_eager.result.json"
    if fp_path.exists():
        fp = json.loads(fp_path.read_text())
    else:
        fp, err = run_llm("fp16_eager", tiny_llm_kw(p["fp16"]), first, ctx, ctx.llm_timeout)
        if fp is None:
            return emit("lm_head", False, err)
    kw5 = tiny_llm_kw(p["fp16"], quantization="kbit", hf_overrides={"quantization_config": {
        "quant_method": "kbit", "bits": 5, "quantize_lm_head": True}})  # fmt: skip
    k5, err = run_llm("online_k5_lm_head_eager", kw5, first, ctx, ctx.llm_timeout)
    if k5 is None:
        return emit("lm_head", False, err)
    n, top1, _, dlp = first_token_agreement(fp["gens"]["first"], k5["gens"]["first"])
    mean_dlp = sum(dlp) / n
    passed = (finite and (saved is None or saved >= 0.6) and gib_lm < 6.4 and top1 >= n // 2
              and mean_dlp <= 0.15)  # fmt: skip
    return emit("lm_head", passed,
                f"dummy 8B Model loading {gib_lm} GiB with the lm_head quantized (need < 6.4; "
                f"without: {gib_base}, saved {saved if saved is None else round(saved, 2)} GiB, "
                f"need >= 0.6 when known); logprobs finite {finite}; tiny k=5 + lm_head vs fp16: "
                f"top-1 agree {top1}/{n} (need >= {n // 2}), mean |dlogprob top-1| {mean_dlp:.4f} "
                f"(need <= 0.15)")  # fmt: skip


def _post(url: str, body: dict, timeout: float = 60) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def check_serve(ctx) -> bool:
    p = paths(Path(ctx.work))
    log = Path(ctx.logs) / "serve.log"
    # `python -m`, not a `vllm` console script: vLLM 0.26 starts the engine core with spawn,
    # which re-runs the parent's main file, and a console script without a __main__ guard
    # (the staged GPU machine's /opt/vsite/bin/vllm) then starts a second server and dies.
    base = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    port = ctx.port
    cmd = base + ["serve", str(p["kbit"]), "--host", "127.0.0.1", "--port", str(port),
                  "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16",
                  "--dtype", "float16", "--gpu-memory-utilization", "0.5",
                  "--served-model-name", "kbit-e2e"]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    t0 = time.time()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # setsid
    _GROUPS.add(proc.pid)
    try:
        while True:
            text = log.read_text(errors="replace")
            if "Application startup complete" in text:
                break
            if proc.poll() is not None:
                return emit("serve_openai", False, f"server exited rc={proc.returncode}: {log_error(log)}")
            if time.time() - t0 > ctx.serve_timeout:
                return emit("serve_openai", False,
                            f"no 'Application startup complete' after {ctx.serve_timeout} s: "
                            f"{log_error(log)}")  # fmt: skip
            time.sleep(1)
        up = time.time() - t0
        url = f"http://127.0.0.1:{port}/v1"
        results, errs = {}, []
        try:
            r = _post(url + "/completions", {"model": "kbit-e2e", "prompt": "hello world the",
                                             "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            results["completions"] = r["choices"][0]["text"]
        except Exception as e:  # noqa: BLE001
            errs.append(f"completions: {type(e).__name__}: {str(e)[:200]}")
        try:
            r = _post(url + "/chat/completions",
                      {"model": "kbit-e2e", "messages": [{"role": "user", "content": "hello world"}],
                       "max_tokens": 8, "temperature": 0, "ignore_eos": True})  # fmt: skip
            results["chat"] = r["choices"][0]["message"]["content"]
        except Exception as e:  # noqa: BLE001
            errs.append(f"chat: {type(e).__name__}: {str(e)[:200]}")
        ok = not errs and all(isinstance(v, str) and v.strip() for v in results.values()) \
            and len(results) == 2
        return emit("serve_openai", ok,
                    f"startup {up:.0f} s; texts {json.dumps(results)}"
                    + (f"; errors {errs}; server: {log_error(log)}" if errs else ""))  # fmt: skip
    finally:
        kill_group(proc.pid)
        proc.wait()


def check_moe(ctx, arch: str) -> bool:
    """kbit4 checkpoint vs its dequantized twin (both eager: kbit::moe vs vLLM's fp16 fused
    MoE), then online kbit4 of the fp16 model vs the checkpoint: the converter and the online
    path quantize with the same kernel, so the weights are identical and so must the tokens be
    (ties aside)."""
    name = f"moe_{arch}"
    p = build_moe(Path(ctx.work), arch)
    runs = {}
    qcfg = {"quant_method": "kbit", "bits": BITS}
    online = dict(quantization="kbit", hf_overrides={"quantization_config": qcfg})
    for run, kw in (("kbit4", tiny_llm_kw(p["kbit"])), ("twin", tiny_llm_kw(p["twin"])),
                    ("online4", tiny_llm_kw(p["fp16"], **online))):  # fmt: skip
        res, err = run_llm(f"{name}_{run}_eager", kw, greedy_gens(), ctx, ctx.moe_timeout)
        if res is None:
            return emit(name, False, err)
        runs[run] = res
    kb, tw, on = (runs[r]["gens"]["b8"] for r in ("kbit4", "twin", "online4"))
    exact, ok, verdicts = agree_count(tw, kb)
    d0 = max(abs(top1_lp(r) - top1_lp(t)) for r, t in zip(tw, kb, strict=True))
    exact_on, ok_on, verdicts_on = agree_count(kb, on)
    passed = ok >= N_GREEDY - 1 and d0 <= MOE_LOGPROB_TOL and ok_on == N_GREEDY
    return emit(name, passed,
                f"kbit4 vs dequantized twin: seq agree {ok}/{N_GREEDY} (exact {exact}, need >= "
                f"{N_GREEDY - 1}), max |dlogprob top-1 step 0| {d0:.4f} (tol {MOE_LOGPROB_TOL}), "
                f"verdicts {verdicts}; online kbit4 vs checkpoint: agree {ok_on}/{N_GREEDY} (exact "
                f"{exact_on}, need all) {verdicts_on}; load kbit {runs['kbit4']['load_s']} s, twin "
                f"{runs['twin']['load_s']} s, online {runs['online4']['load_s']} s")  # fmt: skip


def check_moe_compiled(ctx) -> bool:
    from vllm_kbit import _ops

    _ops.load()  # no CUDA initialisation; tells whether _C has the moe kernel
    if "moe" in _ops._cuda_reference_ops:
        return emit("moe_compiled", False, "no CUDA kbit::moe kernel in vllm_kbit._C: the "
                    "reference fallback cannot be captured in a CUDA graph")  # fmt: skip
    p = build_moe(Path(ctx.work), "qwen3")
    eager_path = Path(ctx.work) / "moe_qwen3_kbit4_eager.result.json"
    if not eager_path.exists():
        res, err = run_llm("moe_qwen3_kbit4_eager", tiny_llm_kw(p["kbit"]), greedy_gens(), ctx,
                           ctx.moe_timeout)  # fmt: skip
        if res is None:
            return emit("moe_compiled", False, err)
    cg, err = run_llm("moe_qwen3_kbit4_compiled", tiny_llm_kw(p["kbit"], eager=False),
                      greedy_gens(True), ctx, ctx.moe_timeout + ctx.compiled_timeout)  # fmt: skip
    if cg is None:
        return emit("moe_compiled", False, err)
    ref = json.loads(eager_path.read_text())["gens"]["b8"]
    exact8, ok8, v8 = agree_count(ref, cg["gens"]["b8"])
    exact1, ok1, v1 = agree_count(ref[:2], cg["gens"]["b1"])
    return emit("moe_compiled", ok8 >= N_GREEDY - 1 and ok1 == 2,
                f"vs moe_qwen3 kbit4 eager: batch 8 agree {ok8}/{N_GREEDY} (exact {exact8}); "
                f"batch 1 agree {ok1}/2 (exact {exact1}); verdicts b8 {v8} b1 {v1}; "
                f"load+compile {cg['load_s']} s")  # fmt: skip


def check_tp2(ctx, which: str) -> bool:
    """Tensor parallel 2 vs 1 on the same kbit4 checkpoint (needs 2 GPUs): greedy tokens agree
    (near-ties aside: TP changes the reduction order) and step-0 top-1 logprobs within the
    tolerance. Dense: TP=2 eager and TP=2 compiled + CUDA graphs; MoE (Qwen3-30B-A3B-shaped,
    I=768 -> 384 per rank): TP=2 eager and TP=2 compiled + CUDA graphs (the grouped kbit::moe
    kernel; under KBIT_MOE_REFERENCE=1 the compiled run cannot capture the reference)."""
    name = f"tp2_{which}"
    if which == "dense":
        model, timeout, tol = paths(Path(ctx.work))["kbit"], ctx.llm_timeout, LOGPROB_TOL
        runs = [("tp1_eager", 1, True), ("tp2_eager", 2, True), ("tp2_compiled", 2, False)]
    else:
        model, timeout, tol = build_moe(Path(ctx.work), "qwen3")["kbit"], ctx.moe_timeout, MOE_LOGPROB_TOL
        runs = [("tp1_eager", 1, True), ("tp2_eager", 2, True), ("tp2_compiled", 2, False)]
    res = {}
    for run, tp, eager in runs:
        extra = ctx.compiled_timeout if not eager else 0
        r, err = run_llm(f"{name}_{run}", tiny_llm_kw(model, eager=eager, tensor_parallel_size=tp),
                         greedy_gens(), ctx, timeout + extra)  # fmt: skip
        if r is None:
            return emit(name, False, err)
        res[run] = r["gens"]["b8"]
    ref, parts, ok_all = res["tp1_eager"], [], True
    for run in list(res)[1:]:
        exact, ok, verdicts = agree_count(ref, res[run])
        d0 = max(abs(top1_lp(a) - top1_lp(b)) for a, b in zip(ref, res[run], strict=True))
        ok_all &= ok >= N_GREEDY - 1 and d0 <= tol
        parts.append(f"{run} vs tp1_eager: seq agree {ok}/{N_GREEDY} (exact {exact}), max "
                     f"|dlogprob top-1 step 0| {d0:.4f} (tol {tol}), verdicts {verdicts}")  # fmt: skip
    return emit(name, ok_all, "; ".join(parts))


CHECKS = {"prequant_greedy": check_prequant_greedy, "online_k5_vs_fp16": check_online_k5,
          "compiled_graphs": check_compiled, "dummy_online": check_dummy_online,
          "serve_openai": check_serve, "lm_head": check_lm_head, "moe_qwen3": lambda ctx: check_moe(ctx, "qwen3"),
          "moe_mixtral": lambda ctx: check_moe(ctx, "mixtral"),
          "moe_compiled": check_moe_compiled, "tp2_dense": lambda ctx: check_tp2(ctx, "dense"),
          "tp2_moe": lambda ctx: check_tp2(ctx, "moe")}  # fmt: skip
DEFAULT_CHECKS = ["prequant_greedy", "online_k5_vs_fp16", "compiled_graphs", "dummy_online",
                  "serve_openai"]  # the MoE checks take minutes each: run them by name


# ---------------------------------------------------------------- CPU self-test


def cpu_selftest(work: Path) -> bool:
    """Everything that does not need vLLM's engine: build, twin equivalence, tokenizer."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    p = build_all(work, force=True)
    ok = True

    def say(name, good, det):
        nonlocal ok
        ok &= bool(good)
        print(f"SELFTEST {name} {'PASS' if good else 'FAIL'} {det}", flush=True)

    orig = load_file(str(p["fp16"] / "model.safetensors"))
    kb = load_file(str(p["kbit"] / "model.safetensors"))
    tw = load_file(str(p["twin"] / "model.safetensors"))
    say("twin_keys", set(tw) == set(orig), f"{len(tw)} tensors, same names as the fp16 model")
    say("twin_dtypes", all(tw[k].dtype == orig[k].dtype and tw[k].shape == orig[k].shape for k in tw),
        "dtypes and shapes equal")  # fmt: skip
    qk = [k for k in kb if k.endswith(".qweight")]
    rel = []
    for k in qk:
        w = k[: -len(".qweight")] + ".weight"
        a, b = orig[w].float(), tw[w].float()
        rel.append(float((a - b).norm() / a.norm()))
    sqnr = -20 * math.log10(max(rel))
    say("twin_close", 0 < min(rel) and max(rel) < 0.12,
        f"{len(qk)} weights, relative error {min(rel):.4f}..{max(rel):.4f} (worst SQNR {sqnr:.1f} dB)")
    same = [k for k in tw if not k.endswith("proj.weight")]
    say("twin_unquantized_same", all(torch.equal(tw[k], orig[k]) for k in same),
        f"{len(same)} other tensors bit-identical")
    cfg_k, cfg_t = (json.loads((p[d] / "config.json").read_text()) for d in ("kbit", "twin"))
    say("configs", "quantization_config" in cfg_k and "quantization_config" not in cfg_t
        and cfg_k["quantization_config"].get("bits") == BITS, "kbit has quantization_config, twin not")
    for d in ("fp16", "kbit", "twin"):
        tok = AutoTokenizer.from_pretrained(p[d])
        ids = tok("hello world the quantization")["input_ids"]
        chat = tok.apply_chat_template([{"role": "user", "content": "hello world"}],
                                       tokenize=False, add_generation_prompt=True)  # fmt: skip
        cids = tok(chat, add_special_tokens=False)["input_ids"]
        say(f"tokenizer_{d}", len(tok) == TINY["vocab_size"] and 0 not in ids and 0 not in cids
            and tok.decode(ids) == "hello world the quantization" and tok.chat_template,
            f"{type(tok).__name__} len {len(tok)}; ids {ids}; chat {chat!r} -> {cids}; "
            f"decode(3 ids) {tok.decode([100, 200, 31999])!r}")  # fmt: skip
    for arch in MOE:
        for name, good, det in moe_selftest(work, arch):
            say(name, good, det)
    return ok


def moe_selftest(work: Path, arch: str) -> list[tuple[str, bool, str]]:
    """The MoE builder on a tiny config: names/shapes equal transformers' save_pretrained, and
    build -> convert -> twin gives a twin with the fp16 model's names, dtypes and shapes."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    e_key, i_key = (("num_experts", "moe_intermediate_size") if arch == "qwen3"
                    else ("num_local_experts", "intermediate_size"))  # fmt: skip
    tiny = {**MOE[arch], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, e_key: 4, i_key: 64}  # fmt: skip
    d = {k: work / f"selftest-moe-{arch}-{k}" for k in ("hf", "fp16", "kbit", "twin")}
    for x in d.values():
        shutil.rmtree(x, ignore_errors=True)
    d["hf"].mkdir(parents=True)
    (d["hf"] / "config.json").write_text(json.dumps(tiny))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d["hf"])).save_pretrained(d["hf"])

    def shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                out |= {k: (tuple(sf.get_slice(k).get_shape()), sf.get_slice(k).get_dtype())
                        for k in sf.keys()}  # fmt: skip
        return out

    hf = {k: v[0] for k, v in shapes(d["hf"]).items()}
    mine = moe_tensor_shapes(tiny)
    build_moe_model(d["fp16"], tiny)
    report = convert_kbit(d["fp16"], d["kbit"])
    n = build_dequant_twin(d["kbit"], d["twin"])
    fp, tw = shapes(d["fp16"]), shapes(d["twin"])
    return [
        (f"moe_{arch}_names", hf == mine, f"{len(mine)} tensors; differ: "
         f"{sorted(set(hf.items()) ^ set(mine.items()))[:4]}"),
        (f"moe_{arch}_pipeline", fp == tw and n == 16 == report["totals"]["quantized_tensors"],
         f"twin == fp16 names/shapes/dtypes: {fp == tw}; {n} weights dequantized (want 16)"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["build", "check", "worker", "cpu-selftest"])
    ap.add_argument("names", nargs="*", help=f"checks: {', '.join(CHECKS)}")
    ap.add_argument("--work", default="/tmp/kbit_e2e")
    ap.add_argument("--logs", default=os.environ.get("OUT", "/tmp/kbit-out") + "/e2e")
    ap.add_argument("--spec"), ap.add_argument("--result")
    ap.add_argument("--llm-timeout", type=float, default=float(os.environ.get("E2E_LLM_TIMEOUT", "150")))
    ap.add_argument("--compiled-timeout", type=float,
                    default=float(os.environ.get("E2E_COMPILED_TIMEOUT", "240")))
    ap.add_argument("--dummy-timeout", type=float, default=float(os.environ.get("E2E_DUMMY_TIMEOUT", "200")))
    ap.add_argument("--serve-timeout", type=float, default=float(os.environ.get("E2E_SERVE_TIMEOUT", "180")))
    ap.add_argument("--moe-timeout", type=float, default=float(os.environ.get("E2E_MOE_TIMEOUT", "240")))
    ap.add_argument("--port", type=int, default=8123)
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        worker(Path(a.spec), Path(a.result))
        return 1  # not reached
    if a.cmd == "build":
        build_all(Path(a.work))
        return 0
    if a.cmd == "cpu-selftest":
        return 0 if cpu_selftest(Path(a.work)) else 1
    Path(a.logs).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    bad = 0
    for name in a.names or DEFAULT_CHECKS:
        _CURRENT[0] = name
        t0 = time.time()
        try:
            good = CHECKS[name](a)
        except Exception as e:  # noqa: BLE001  a bug here must not hide the other checks
            import traceback

            traceback.print_exc()
            good = emit(name, False, f"check raised {type(e).__name__}: {str(e)[:200]}")
        print(f"  [{name}] {time.time() - t0:.0f} s", flush=True)
        bad += not good
    for g in list(_GROUPS):
        kill_group(g, wait_s=5)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
