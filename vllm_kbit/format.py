# SPDX-License-Identifier: Apache-2.0
"""Constants of the kbit format and the ``quantization_config`` schema.

The human-readable spec is ``docs/format.md``; ``reference.py`` implements it.
Nothing here touches CUDA, so importing it is always safe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

BLOCKSIZE = 32  # weights per block along K; one warp lane per weight in the kernels
SUPPORTED_BITS = (2, 3, 4, 5)  # 2^5 = 32 codebook entries = one per warp lane
FORMAT_VERSION = 1

# E4M4 absmax: 4-bit exponent, 4-bit mantissa, bias 11, IEEE-style subnormals, no sign.
E4M4_BIAS = 11
E4M4_MAX = 31.0  # code 0xFF = 2^(15-11) * (1 + 15/16)
E4M4_MIN_NORMAL = 2.0**-10  # code 0x10; below it (subnormals) precision drops
E4M4_MIN_SUBNORMAL = 2.0**-14  # code 0x01

# Runtime ("tiled") layout: one tile = 16 output rows x 128 input columns (4 blocks).
# 16 rows = the M of an m16n8k16 tensor-core fragment when weights are the A operand.
TILE_N = 16
TILE_K = 128
BLOCKS_PER_TILE = TILE_K // BLOCKSIZE

# Default codebooks: weighted Lloyd-Max fit to block-normalised N(0,1) weights
# (blocks of 32, E4M4 absmax, error weighted by absmax^2), symmetrised.
# Regenerate with ``vllm_kbit.codebook.fit_codebook(k)``; only the positive half is listed.
_DEFAULT_POSITIVE_HALF: dict[int, tuple[float, ...]] = {
    2: (0.19031106, 0.6519029),
    3: (0.0989755, 0.30674142, 0.54924905, 0.8854298),
    4: (0.04863455, 0.14693236, 0.24854794, 0.35618237,
        0.47393873, 0.6074, 0.7666387, 0.97180724),
    5: (0.022272771, 0.06691763, 0.11215716, 0.15824015, 0.205498, 0.2544219, 0.30523443,
        0.3583644, 0.4144766, 0.47433072, 0.538817, 0.6091807, 0.6867775, 0.7737289,
        0.87354684, 0.99235624),
}


def default_codebook(bits: int) -> torch.Tensor:
    """The project's default 2^bits-entry codebook (float32, sorted, in [-1, 1], bf16-exact)."""
    check_bits(bits)
    pos = torch.tensor(_DEFAULT_POSITIVE_HALF[bits], dtype=torch.float32)
    return round_codebook(torch.cat([-pos.flip(0), pos]))


# Smallest nonzero |codebook value|: 16 v must be a normal fp16 number (the kernels' table).
CODEBOOK_MIN_NONZERO = 2.0**-18


def round_codebook(cb: torch.Tensor) -> torch.Tensor:
    """Codebook values rounded to bfloat16 (8 significant bits), as float32.

    The format requires bf16-exact codebooks: then cb * absmax (5 significant bits in E4M4) is
    exact in 13 bits, and the fp16/bf16 kernels, which multiply a table value by the absmax in
    half precision, round every weight once, to exactly the reference's round(cb * absmax)."""
    return cb.to(torch.bfloat16).to(torch.float32)


def check_bits(bits: int, what: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"kbit: {what} must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def check_codebook(codebook: Any, bits: int, what: str = "codebook") -> torch.Tensor:
    """Validate a codebook (any sorted 2^bits finite values in [-1, 1], each 0 or of magnitude
    >= 2^-18); return it as float32, rounded to bf16 precision (``round_codebook``)."""
    try:
        cb = torch.as_tensor(codebook)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"kbit: {what} must be a list of 2^bits numbers, got {codebook!r:.80}") from None
    if not (cb.dtype.is_floating_point or cb.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"kbit: {what} must hold floats, got dtype {cb.dtype}")
    cb = cb.detach().to(device="cpu", dtype=torch.float32)
    if cb.shape != (2**bits,):
        raise ValueError(
            f"kbit: {what} for bits={bits} must have shape ({2**bits},), got {tuple(cb.shape)}"
        )
    if not bool(torch.isfinite(cb).all()):
        raise ValueError(f"kbit: {what} contains non-finite values")
    if bool((cb.abs() > 1).any()):
        raise ValueError(f"kbit: {what} values must lie in [-1, 1], got max |v| = {cb.abs().max():g}")
    if bool((cb[1:] < cb[:-1]).any()):
        raise ValueError(f"kbit: {what} must be sorted ascending")
    tiny = (cb != 0) & (cb.abs() < CODEBOOK_MIN_NONZERO)
    if bool(tiny.any()):
        raise ValueError(f"kbit: {what} values must be 0 or have |v| >= 2^-18, got "
                         f"{cb[tiny][0].item():g}")  # fmt: skip
    return round_codebook(cb)


# Leaf module names that vLLM serves as quantizable linear layers (dense and MoE experts).
DEFAULT_QUANTIZED_LEAVES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
    "gate_proj", "up_proj", "down_proj", "gate_up_proj",
    "w1", "w2", "w3",  # Mixtral experts
    "dense", "dense_h_to_4h", "dense_4h_to_h", "query_key_value", "fc1", "fc2", "out_proj",
)  # fmt: skip

# Groups of checkpoint modules that vLLM fuses into one layer: they must share bits.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


@dataclass
class KbitQuantConfig:
    """Parsed, validated ``quantization_config`` of a kbit checkpoint.

    Keys (JSON): ``quant_method`` ("kbit"), ``bits`` (default k), ``blocksize`` (32),
    ``codebooks`` ({"k": [2^k floats]}, one per k in use; defaults filled in),
    ``modules_to_not_convert`` (regexes of modules left unquantized),
    ``module_bits`` ({regex: k}, first match wins), ``quantize_lm_head`` (bool),
    ``format_version``.
    """

    bits: int = 4
    codebooks: dict[int, torch.Tensor] = field(default_factory=dict)
    modules_to_not_convert: list[str] = field(default_factory=list)
    module_bits: dict[str, int] = field(default_factory=dict)
    quantize_lm_head: bool = False
    blocksize: int = BLOCKSIZE
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        check_bits(self.bits)
        for pat, k in self.module_bits.items():
            _compile(pat, "module_bits")
            check_bits(k, f"module_bits[{pat!r}]")
        for pat in self.modules_to_not_convert:
            _compile(pat, "modules_to_not_convert")
        cbs = {}
        for k, cb in self.codebooks.items():
            k = check_bits(int(k), "codebooks key")
            cbs[k] = check_codebook(cb, k, f"codebooks[{k}]")
        for k in self.all_bits():
            cbs.setdefault(k, default_codebook(k))
        self.codebooks = dict(sorted(cbs.items()))

    def all_bits(self) -> list[int]:
        return sorted({self.bits, *self.module_bits.values()})

    def is_skipped(self, module: str) -> bool:
        return any(re.search(p, module) for p in self.modules_to_not_convert)

    def bits_for(self, module: str) -> int:
        for pat, k in self.module_bits.items():
            if re.search(pat, module):
                return k
        return self.bits

    def codebook(self, bits: int) -> torch.Tensor:
        return self.codebooks[bits]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KbitQuantConfig:
        if not isinstance(d, Mapping):
            raise ValueError(f"kbit: quantization_config must be a JSON object, got {type(d).__name__}")
        known = {"quant_method", "bits", "blocksize", "codebooks", "modules_to_not_convert",
                 "module_bits", "quantize_lm_head", "format_version"}  # fmt: skip
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"kbit: unknown quantization_config keys {unknown}; known: {sorted(known)}")
        method = str(d.get("quant_method", "kbit")).lower()
        if method != "kbit":
            raise ValueError(f"kbit: quant_method must be 'kbit', got {d.get('quant_method')!r}")
        bs = d.get("blocksize", BLOCKSIZE)
        if bs != BLOCKSIZE:
            raise ValueError(f"kbit: blocksize must be {BLOCKSIZE}, got {bs!r}")
        ver = d.get("format_version", FORMAT_VERSION)
        if ver != FORMAT_VERSION:
            raise ValueError(f"kbit: format_version {ver!r} is not supported (this is {FORMAT_VERSION})")
        skip = d.get("modules_to_not_convert") or []
        mbits = d.get("module_bits") or {}
        cbs = d.get("codebooks") or {}
        if not isinstance(skip, Sequence) or isinstance(skip, str):
            raise ValueError("kbit: modules_to_not_convert must be a list of regex strings")
        if not isinstance(mbits, Mapping):
            raise ValueError("kbit: module_bits must be an object {regex: bits}")
        if not isinstance(cbs, Mapping):
            raise ValueError("kbit: codebooks must be an object {bits: [values]}")
        lm = d.get("quantize_lm_head", False)
        if not isinstance(lm, bool):
            raise ValueError(f"kbit: quantize_lm_head must be true or false, got {lm!r}")
        return cls(bits=d.get("bits", 4), codebooks={_int_key(k): v for k, v in cbs.items()},
                   modules_to_not_convert=list(skip), module_bits=dict(mbits),
                   quantize_lm_head=lm)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": "kbit",
            "format_version": self.format_version,
            "bits": self.bits,
            "blocksize": self.blocksize,
            "codebooks": {str(k): [float(v) for v in cb.tolist()] for k, cb in self.codebooks.items()},
            "modules_to_not_convert": list(self.modules_to_not_convert),
            "module_bits": dict(self.module_bits),
            "quantize_lm_head": self.quantize_lm_head,
        }


def _int_key(k: Any) -> int:
    try:
        return int(k)
    except (TypeError, ValueError):
        raise ValueError(f"kbit: codebooks keys must be bit widths, got {k!r}") from None


def _compile(pat: Any, what: str) -> re.Pattern[str]:
    if not isinstance(pat, str):
        raise ValueError(f"kbit: {what} patterns must be strings, got {pat!r}")
    try:
        return re.compile(pat)
    except re.error as e:
        raise ValueError(f"kbit: {what} pattern {pat!r} is not a valid regex: {e}") from None
