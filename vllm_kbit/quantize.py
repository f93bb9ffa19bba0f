# SPDX-License-Identifier: Apache-2.0
"""Checkpoint converter: Hugging Face safetensors checkpoint -> kbit checkpoint.

    python -m vllm_kbit.quantize --model DIR --bits 4 --out DIR
    vllm-kbit-quantize --model DIR --bits 4 --out DIR --module-bits 'down_proj=5' --skip 'layers\\.0\\.'

Every 2-D floating ``*.weight`` whose module leaf name is in ``DEFAULT_QUANTIZED_LEAVES``
(attention and MLP projections, MoE experts), or that ``--include`` selects, or
``lm_head`` with ``--quantize-lm-head``, becomes ``prefix.qweight`` (int32
[N, K/32*k]) + ``prefix.weight_absmax`` (uint8 [N, K/32]); every other tensor is copied
unchanged. Embeddings, lm_head, norms and router gates stay unquantized by default.

MoE experts stored fused as 3-D tensors (transformers' in-memory layout:
``experts.gate_up_proj`` [E, 2I, H] with gate = rows [0, I) and up = rows [I, 2I),
``experts.down_proj`` [E, H, I]; the transposed [E, H, 2I] / [E, I, H] variants are
recognised with ``hidden_size``) are split into per-expert 2-D weights
``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (``w1`` / ``w3`` / ``w2`` under
``block_sparse_moe``), which is what vLLM loads for quantized experts.

Tensors stream one at a time (plain reads, no mmap, so resident memory stays at about one
input tensor plus one output shard); output shards are flushed at ``--max-shard-size``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import shutil
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from . import reference as ref
from .format import (
    BLOCKSIZE,
    DEFAULT_QUANTIZED_LEAVES,
    FUSED_GROUPS,
    KbitQuantConfig,
    check_bits,
)

REPORT_NAME = "kbit_quantize_report.json"
INDEX_NAME = "model.safetensors.index.json"
COPY_PATTERNS = (
    "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "*.model", "*.tiktoken", "vocab*", "merges*", "chat_template*", "preprocessor_config.json",
)  # fmt: skip
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_QUANTIZABLE_DTYPES = ("F16", "BF16", "F32")
_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(\.weight)?$")
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(\w+)$")
_SUMMARY_ROWS = 40  # more quantized tensors than this: per-type aggregates + worst 10


# ------------------------------------------------------------------ reading input


@dataclass
class Source:
    """One tensor of the input checkpoint (header data only)."""

    file: Path
    key: str
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in ``file``
    nbytes: int


@dataclass
class Item:
    """One tensor of the output, before quantization."""

    name: str
    src: Source
    shape: tuple[int, ...]
    expert: int | None = None  # index along dim 0 of a fused 3-D expert tensor
    transpose: bool = False  # the expert matrix is stored [in, out]
    rows: tuple[int, int] | None = None  # row range (gate / up half of gate_up_proj)
    bits: int | None = None  # quantize at this k; None: copy unchanged
    candidate: bool = False  # selected for quantization (before --skip / dimension checks)
    why: str = ""  # why a candidate stays unquantized

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


def _read_header(path: Path) -> dict[str, Source]:
    try:  # safe_open validates the whole header (offsets, sizes, file length)
        with safe_open(str(path), "pt"):
            pass
    except Exception as e:  # noqa: BLE001  (safetensors raises its own SafetensorError)
        raise ValueError(f"kbit: {path} is not a valid safetensors file: {e}") from None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"kbit: {path}: tensor {key} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[key] = Source(
            path, key, info["dtype"], tuple(info["shape"]), 8 + n + start, end - start
        )
    return out


def scan_checkpoint(model_dir: Path) -> list[Source]:
    """Every tensor of a (sharded or single-file) safetensors checkpoint, in file order."""
    if not model_dir.is_dir():
        raise ValueError(f"kbit: --model {model_dir} is not a directory")
    index = model_dir / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise ValueError(f"kbit: {index} is not a valid index (no weight_map object)") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (model_dir / name).is_file():
                raise ValueError(f"kbit: {index} references {name}, which does not exist")
    else:
        weight_map = None
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
                p.name for p in model_dir.glob("*.pt"))  # fmt: skip
            hint = f" (found {', '.join(other[:3])}: convert to safetensors first)" if other else ""
            raise ValueError(f"kbit: no *.safetensors files in {model_dir}{hint}")
    sources: dict[str, Source] = {}
    for name in files:
        for key, src in _read_header(model_dir / name).items():
            if weight_map is not None and weight_map.get(key) != name:
                if key not in weight_map:
                    _warn(f"{name}: tensor {key} is not in {INDEX_NAME}; ignored")
                continue
            if key in sources:
                raise ValueError(
                    f"kbit: tensor {key} is in both {sources[key].file.name} and {name}"
                )
            sources[key] = src
    if weight_map is not None:
        missing = [k for k in weight_map if k not in sources]
        if missing:
            raise ValueError(f"kbit: {INDEX_NAME} lists {len(missing)} tensor(s) missing from their "
                             f"files, e.g. {missing[0]} (in {weight_map[missing[0]]})")  # fmt: skip
    if not sources:
        raise ValueError(f"kbit: the checkpoint in {model_dir} holds no tensors")
    return list(sources.values())


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"kbit: no config.json in {model_dir}")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"kbit: {path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"kbit: {path} must hold a JSON object")  # noqa: TRY004
    for c in (config, config.get("text_config")):
        if isinstance(c, dict) and c.get("quantization_config"):
            qc = c["quantization_config"]
            method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
            raise ValueError(f"kbit: {model_dir} is already quantized (quantization_config with "
                             f"quant_method {method!r}); start from the unquantized checkpoint")  # fmt: skip
    return config


def _load(item: Item) -> torch.Tensor:
    """Read one output tensor from disk (plain file reads: no mmap in resident memory)."""
    src = item.src
    offset, nbytes, shape = src.offset, src.nbytes, src.shape
    if item.expert is not None:
        nbytes //= shape[0]
        offset += item.expert * nbytes
        shape = shape[1:]
    buf = bytearray(nbytes)
    with open(src.file, "rb") as f:
        f.seek(offset)
        if f.readinto(buf) != nbytes:
            raise ValueError(f"kbit: {src.file} ended while reading tensor {src.key}")
    t = torch.frombuffer(buf, dtype=_DTYPES[src.dtype]).view(shape) if nbytes else \
        torch.empty(shape, dtype=_DTYPES[src.dtype])  # fmt: skip
    if item.transpose:
        t = t.t()
    if item.rows is not None:
        t = t[item.rows[0] : item.rows[1]]
    return t.contiguous()


# ----------------------------------------------------------------------- planning


def _expand(sources: list[Source], hidden: int | None) -> list[Item]:
    """Source tensors -> output items; fused 3-D expert tensors become per-expert 2-D ones."""
    items = []
    for src in sources:
        m = _FUSED_EXPERTS.match(src.key)
        if m is None or len(src.shape) != 3:
            items.append(Item(src.key, src, src.shape))
            continue
        prefix, kind = m[1], m[2]
        n_exp, a, b = src.shape
        moe = "block_sparse_moe" in prefix
        if kind == "gate_up_proj":  # [E, 2I, H] (transformers) or [E, H, 2I]
            transpose = hidden is not None and b != hidden and a == hidden
            two_i = b if transpose else a
            if (hidden is not None and (a if transpose else b) != hidden) or two_i % 2:
                raise ValueError(f"kbit: fused expert tensor {src.key} has shape {src.shape}; "
                                 f"expected [E, 2*I, {hidden}] or [E, {hidden}, 2*I]")  # fmt: skip
            i = two_i // 2
            halves = (("w1", "gate_proj", (0, i)), ("w3", "up_proj", (i, two_i)))
            for e in range(n_exp):
                for mix_name, name, rows in halves:
                    leaf = mix_name if moe else name
                    items.append(Item(f"{prefix}.{e}.{leaf}.weight", src, (i, a if transpose else b),
                                      expert=e, transpose=transpose, rows=rows))  # fmt: skip
        else:  # down_proj: [E, H, I] (transformers) or [E, I, H]
            transpose = hidden is not None and a != hidden and b == hidden
            if hidden is not None and (b if transpose else a) != hidden:
                raise ValueError(f"kbit: fused expert tensor {src.key} has shape {src.shape}; "
                                 f"expected [E, {hidden}, I] or [E, I, {hidden}]")  # fmt: skip
            shape = (b, a) if transpose else (a, b)
            for e in range(n_exp):
                leaf = "w2" if moe else "down_proj"
                items.append(Item(f"{prefix}.{e}.{leaf}.weight", src, shape, expert=e,
                                  transpose=transpose))  # fmt: skip
    return items


def _compile_all(patterns: Sequence[str], option: str) -> list[re.Pattern[str]]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"kbit: {option} {p!r} is not a valid regex: {e}") from None
    return out


def _group_keys(module: str) -> list[tuple[str, ...]]:
    """Groups of modules that vLLM serves as one layer: they must share bits and status."""
    parent, _, leaf = module.rpartition(".")
    keys = [("fused", parent, str(g)) for g, names in enumerate(FUSED_GROUPS) if leaf in names]
    m = _EXPERT.match(module)
    if m:  # one FusedMoE layer, one kbit::moe call: every expert weight shares bits and status
        keys += [("moe", m[1]), ("moe-status", m[1])]
    return keys


def plan(items: list[Item], bits: int, module_bits: dict[str, int], skip: Sequence[str],
         include: Sequence[str], quantize_lm_head: bool) -> list[str]:  # fmt: skip
    """Decide each item's bits (in place). Returns warnings. Raises ValueError on conflicts."""
    check_bits(bits)
    for pat, k in module_bits.items():
        check_bits(k, f"--module-bits {pat!r}")
    mb = list(zip(_compile_all(list(module_bits), "--module-bits"), module_bits.values()))
    skip_re, inc_re = _compile_all(skip, "--skip"), _compile_all(include, "--include")
    warnings = []
    for it in items:
        if not it.name.endswith(".weight"):
            continue
        mod, leaf = it.module, it.module.rpartition(".")[2]
        default = leaf in DEFAULT_QUANTIZED_LEAVES or (quantize_lm_head and leaf == "lm_head")
        if not (default or (len(it.shape) == 2 and any(p.search(mod) for p in inc_re))):
            continue
        skipped = any(p.search(mod) for p in skip_re)
        if len(it.shape) != 2:
            if skipped:
                continue
            raise ValueError(f"kbit: {it.name} has shape {list(it.shape)}, expected a 2-D "
                             f"[out, in] weight (use --skip to copy it unchanged)")  # fmt: skip
        it.candidate = True
        if skipped:
            it.why = "--skip"
            continue
        if it.src.dtype not in _QUANTIZABLE_DTYPES:
            raise ValueError(f"kbit: {it.name} has dtype {it.src.dtype}; only F16, BF16 and F32 "
                             f"weights can be quantized (use --skip to keep it)")  # fmt: skip
        it.bits = next((k for p, k in mb if p.search(mod)), bits)
    if quantize_lm_head and not any(it.candidate and it.module.endswith("lm_head") for it in items):
        warnings.append(
            "--quantize-lm-head: no lm_head weight in the checkpoint (tied embeddings?)"
        )
    if include and not any(
        it.candidate and any(p.search(it.module) for p in inc_re) for it in items
    ):
        warnings.append(f"--include {list(include)} matched no 2-D weight")

    groups: dict[tuple[str, ...], list[Item]] = {}
    for it in items:
        if it.candidate:
            for key in _group_keys(it.module):
                groups.setdefault(key, []).append(it)
    for key, members in groups.items():  # user settings must not split a fused group
        value = (lambda it: it.bits is None) if key[0] == "moe-status" else (lambda it: it.bits)
        odd = next((m for m in members if value(m) != value(members[0])), None)
        if odd is not None:
            a, b = members[0], odd
            raise ValueError(
                f"kbit: --module-bits/--skip give {a.module} {_setting(a)} but {b.module} "
                f"{_setting(b)}; vLLM fuses them into one layer, so they need the same setting"
            )

    odd_k = [it for it in items if it.bits is not None and it.shape[1] % BLOCKSIZE]
    for it in odd_k:
        it.bits, it.why = None, f"in_features {it.shape[1]} is not a multiple of {BLOCKSIZE}"
    if odd_k:
        warnings.append(f"left unquantized ({len(odd_k)} weight(s) with in_features not a "
                        f"multiple of {BLOCKSIZE}): " + ", ".join(f"{it.name} {list(it.shape)}"
                                                          for it in odd_k))  # fmt: skip
    changed = True
    while changed:  # a forced-unquantized member takes its whole fused group along
        changed = False
        for key, members in groups.items():
            lead = next((m for m in members if m.bits is None), None)
            followers = [m for m in members if m.bits is not None]
            if lead is not None and followers:
                for m in followers:
                    m.bits, m.why = None, f"fused with {lead.module}, which stays unquantized"
                warnings.append(f"left unquantized: {', '.join(m.module for m in followers[:4])}"
                                f"{' ...' if len(followers) > 4 else ''} ({len(followers)} "
                                f"weight(s)), fused by vLLM with {lead.module} ({lead.why})")  # fmt: skip
                changed = True
    return warnings


def _setting(it: Item) -> str:
    return "--skip" if it.bits is None else f"bits={it.bits}"


def not_converted(items: list[Item], skip: Sequence[str]) -> list[str]:
    """``modules_to_not_convert``: the --skip patterns, then every other 2-D weight left
    unquantized as an anchored regex of its exact name (plus its MoE layer's name)."""
    skip_re = _compile_all(skip, "--skip")
    names: list[str] = []
    for it in items:
        if it.bits is None and it.name.endswith(".weight") and len(it.shape) == 2:
            mod = it.module
            m = _EXPERT.match(mod)
            for n in [mod, m[1]] if m else [mod]:
                if not any(p.search(n) for p in skip_re) and n not in names:
                    names.append(n)
    return list(skip) + [re.escape(n) + "$" for n in names]


# ----------------------------------------------------------------------- writing


class ShardWriter:
    """Buffers output tensors and flushes a safetensors shard whenever the next tensor
    would push the buffer past ``max_bytes``; ``close()`` names the shards and writes the
    index (a single ``model.safetensors`` and no index when everything fits one shard)."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.buf_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.buf and self.buf_bytes + nbytes > self.max_bytes:
            self.flush()
        self.buf[name] = t.contiguous()
        self.buf_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if self.buf:
            save_file(self.buf, str(self._tmp(len(self.shards))), metadata={"format": "pt"})
            self.shards.append(list(self.buf))
            self.buf, self.buf_bytes = {}, 0

    def discard(self) -> None:
        self.buf = {}
        for i in range(len(self.shards) + 1):  # + the one a failed flush may have begun
            self._tmp(i).unlink(missing_ok=True)

    def _tmp(self, i: int) -> Path:
        return self.out / f"kbit-tmp-{i:05d}.safetensors"

    def close(self) -> list[str]:
        self.flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                      for i in range(n)]  # fmt: skip
        for i, name in enumerate(names):
            self._tmp(i).rename(self.out / name)
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self.shards) for t in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return names


# ------------------------------------------------------------------- quantization


def _quantize(w: torch.Tensor, bits: int, cb: torch.Tensor, name: str, device: str
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:  # fmt: skip
    """-> (qweight, absmax) on the CPU and quality stats (SQNR, subnormal blocks)."""
    if device == "cuda":
        w, cb = w.to(device), cb.to(device)
        try:
            q, a = torch.ops.kbit.quantize(w, cb, bits)
        except (RuntimeError, ValueError) as e:  # the kernel's range checks; name the tensor
            raise ValueError(f"kbit: {name}: {e}") from None
    else:
        q, a = ref.quantize(w, bits, cb, name=name)
    sig = err = 0.0
    n, k = w.shape
    step = max(1, (1 << 22) // max(k, 1))
    for r0 in range(0, n, step):  # dequantize in row chunks to bound memory
        r1 = min(n, r0 + step)
        if device == "cuda":
            d = torch.ops.kbit.dequantize(q[r0:r1], a[r0:r1], cb, bits, torch.float32)
        else:
            d = ref.dequantize(q[r0:r1], a[r0:r1], cb, bits, torch.float32)
        x = w[r0:r1].float()
        sig += float(x.square().sum(dtype=torch.float64))
        err += float((x - d).square().sum(dtype=torch.float64))
    sqnr = math.inf if err == 0 else (-math.inf if sig == 0 else 10 * math.log10(sig / err))
    stats = {
        "sqnr_db": round(sqnr, 3) if math.isfinite(sqnr) else sqnr,
        "subnormal_blocks": int(((a > 0) & (a < 16)).sum()),
        "zero_blocks": int((a == 0).sum()),
    }
    return q.cpu(), a.cpu(), stats


def _pick_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"kbit: --device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("kbit: --device cuda but no CUDA GPU is available")
        from . import _ops

        _ops.load()
    return device


def _prepare_out(model_dir: Path, out_dir: Path, overwrite: bool) -> None:
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("kbit: --out must differ from --model")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"kbit: --out {out_dir} exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise ValueError(f"kbit: --out {out_dir} is not empty (use --overwrite)")
        for p in [*out_dir.glob("*.safetensors"), out_dir / INDEX_NAME, out_dir / REPORT_NAME]:
            p.unlink(missing_ok=True)  # stale shards would be loaded with the new ones
    out_dir.mkdir(parents=True, exist_ok=True)


def convert(model: str | Path, out: str | Path, bits: int = 4, *,
            module_bits: dict[str, int] | None = None, skip: Sequence[str] = (),
            include: Sequence[str] = (), quantize_lm_head: bool = False, device: str = "auto",
            max_shard_size: int = 5 * 10**9, overwrite: bool = False, progress: bool = True,
            ) -> dict[str, Any]:  # fmt: skip
    """Quantize a Hugging Face safetensors checkpoint into ``out``; returns the report.

    Raises ValueError (with a one-line message) on any bad input or option.
    """
    t0 = time.time()
    model_dir, out_dir = Path(model), Path(out)
    module_bits = dict(module_bits or {})
    if max_shard_size <= 0:
        raise ValueError(f"kbit: --max-shard-size must be positive, got {max_shard_size}")
    sources = scan_checkpoint(model_dir)
    config = read_config(model_dir)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    hidden = config.get("hidden_size") or text.get("hidden_size")
    items = _expand(sources, hidden if isinstance(hidden, int) else None)
    warnings = plan(items, bits, module_bits, skip, include, quantize_lm_head)
    for w in warnings:
        _warn(w)
    lm_head_done = any(it.bits is not None and it.module.endswith("lm_head") for it in items)
    qcfg = KbitQuantConfig(bits=bits, module_bits=module_bits, quantize_lm_head=lm_head_done,
                           modules_to_not_convert=not_converted(items, skip))  # fmt: skip
    device = _pick_device(device)
    created = not out_dir.exists()
    _prepare_out(model_dir, out_dir, overwrite)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    writer = ShardWriter(out_dir, max_shard_size)
    rows = []
    try:
        for it in tqdm(items, desc="kbit quantize", unit="tensor", disable=not progress):
            t = _load(it)
            if it.bits is None:
                writer.add(it.name, t)
                continue
            q, a, stats = _quantize(t, it.bits, qcfg.codebook(it.bits), it.name, device)
            writer.add(it.module + ".qweight", q)
            writer.add(it.module + ".weight_absmax", a)
            bpw = (q.numel() * 4 + a.numel()) * 8 / t.numel()
            rows.append({"name": it.module, "shape": list(it.shape), "bits": it.bits,
                         "bits_per_weight": round(bpw, 4), **stats})  # fmt: skip
            del t, q, a
        shards = writer.close()
    except BaseException:  # leave no half-written checkpoint behind
        writer.discard()
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise

    config["quantization_config"] = qcfg.to_dict()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = _copy_side_files(model_dir, out_dir)
    orig = sum(s.nbytes for s in sources)
    totals = {
        "quantized_tensors": len(rows),
        "quantized_params": sum(math.prod(r["shape"]) for r in rows),
        "unquantized_weights": [it.module for it in items if it.candidate and it.bits is None],
        "original_gb": round(orig / 1e9, 6),
        "new_gb": round(writer.total_bytes / 1e9, 6),
        "ratio": round(writer.total_bytes / orig, 4) if orig else None,
        "elapsed_s": round(time.time() - t0, 2),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3),
        "device": device,
        "shards": shards,
        "copied_files": copied,
    }
    if device == "cuda":
        totals["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
    report = {"tensors": rows, "totals": totals, "warnings": warnings,
              "quantization_config": qcfg.to_dict()}  # fmt: skip
    (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    print(format_summary(report))
    return report


def _copy_side_files(model_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for pat in COPY_PATTERNS:
        for p in sorted(model_dir.glob(pat)):
            if p.is_file() and p.name not in copied:
                shutil.copy2(p, out_dir / p.name)
                copied.append(p.name)
    return copied


# ------------------------------------------------------------------------ summary


def format_summary(report: dict[str, Any]) -> str:
    rows, tot = report["tensors"], report["totals"]
    lines = []
    head = f"{'tensor':<60} {'shape':>14} {'bits':>4} {'SQNR dB':>8} {'bits/w':>6} {'subnorm':>7}"

    def row(r: dict[str, Any], name: str | None = None) -> str:
        shape = "x".join(map(str, r["shape"]))
        return (f"{(name or r['name'])[-60:]:<60} {shape:>14} {r['bits']:>4} {r['sqnr_db']:>8.2f} "
                f"{r['bits_per_weight']:>6.2f} {r['subnormal_blocks']:>7}")  # fmt: skip

    if len(rows) <= _SUMMARY_ROWS:
        lines += [head] + [row(r) for r in rows]
    elif rows:
        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault((re.sub(r"\.\d+(?=\.|$)", ".*", r["name"]), r["bits"]), []).append(r)
        lines.append(f"{'layer type':<60} {'count':>6} {'bits':>4} {'mean dB':>8} {'min dB':>8} "
                     f"{'subnorm':>7}")  # fmt: skip
        for (name, k), rs in groups.items():
            dbs = [r["sqnr_db"] for r in rs]
            lines.append(f"{name[-60:]:<60} {len(rs):>6} {k:>4} {sum(dbs) / len(dbs):>8.2f} "
                         f"{min(dbs):>8.2f} {sum(r['subnormal_blocks'] for r in rs):>7}")  # fmt: skip
        lines += ["", "worst 10 by SQNR:", head]
        lines += [row(r) for r in sorted(rows, key=lambda r: r["sqnr_db"])[:10]]
    lines.append(
        f"quantized {tot['quantized_tensors']} tensors ({tot['quantized_params'] / 1e6:.2f}M params); "
        f"size {_human(tot['original_gb'])} -> {_human(tot['new_gb'])} (x{tot['ratio'] or 0:.3f}); "
        f"{tot['elapsed_s']:.1f} s on {tot['device']}; peak RSS {tot['peak_rss_gb']:.2f} GB"
        + (f"; peak GPU {tot['peak_gpu_gb']:.2f} GB" if "peak_gpu_gb" in tot else "")
    )
    if tot["unquantized_weights"]:
        lines.append(f"left unquantized: {len(tot['unquantized_weights'])} selected weight(s) "
                     f"(see warnings / modules_to_not_convert)")  # fmt: skip
    return "\n".join(lines)


def _human(gb: float) -> str:
    return f"{gb:.2f} GB" if gb >= 1 else f"{gb * 1e3:.2f} MB"


# ---------------------------------------------------------------------------- CLI


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def parse_size(s: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", s, re.IGNORECASE)
    if not m:
        raise ValueError(f"kbit: bad size {s!r} (use e.g. 5GB, 500MB, 2GiB or a byte count)")
    unit = (m[2] or "B").upper()
    scale = (1024 if "I" in unit else 1000) ** "BKMGT".index(unit[0])
    return int(float(m[1]) * scale)


def _parse_module_bits(specs: Sequence[str]) -> dict[str, int]:
    out = {}
    for spec in specs:
        pat, sep, k = spec.rpartition("=")
        if not sep or not pat or not k.strip().isdigit():
            raise ValueError(f"kbit: --module-bits expects REGEX=K, got {spec!r}")
        out[pat] = check_bits(int(k), f"--module-bits {spec!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-kbit-quantize",
        description="Quantize a Hugging Face safetensors checkpoint to the kbit format.",
    )
    p.add_argument("--model", required=True, help="input checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--bits", type=int, default=4, help="default bits per weight, 2..5 (default 4)")
    p.add_argument(
        "--module-bits",
        action="append",
        default=[],
        metavar="REGEX=K",
        help="bits for modules matching REGEX (re.search; first match wins; repeatable)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="REGEX",
        help="leave modules matching REGEX unquantized (repeatable)",
    )
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="REGEX",
        help="also quantize 2-D weights of modules matching REGEX (repeatable)",
    )
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too")
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to quantize (default: cuda when available)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="output shard size (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        convert(args.model, args.out, args.bits, module_bits=_parse_module_bits(args.module_bits),
                skip=args.skip, include=args.include, quantize_lm_head=args.quantize_lm_head,
                device=args.device, max_shard_size=parse_size(args.max_shard_size),
                overwrite=args.overwrite, progress=not args.no_progress)  # fmt: skip
    except (ValueError, OSError) as e:
        msg = str(e).removeprefix("kbit: ").splitlines()[0]
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
