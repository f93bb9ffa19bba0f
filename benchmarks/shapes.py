# SPDX-License-Identifier: Apache-2.0
"""Shared shape table of the kbit benchmarks: the dense linear layers of one decoder layer.

Shapes are ``(name, N, K)`` with vLLM's weight layout ``W[N, K]`` (``[out, in]``), so a
layer computes ``y[M, N] = x[M, K] @ W^T``. Llama-3.1 models at tensor parallelism 1:
qkv is fused q/k/v (GQA with 8 KV heads), gate_up is fused gate/up.
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA_8B: list[tuple[str, int, int]] = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
]
LLAMA_70B: list[tuple[str, int, int]] = [
    ("qkv", 10240, 8192),
    ("o", 8192, 8192),
    ("gate_up", 57344, 8192),
    ("down", 8192, 28672),
]
MODELS: dict[str, list[tuple[str, int, int]]] = {"8b": LLAMA_8B, "70b": LLAMA_70B}
MODEL_NAMES: dict[str, str] = {"8b": "Llama-3.1-8B", "70b": "Llama-3.1-70B"}


@dataclass(frozen=True)
class Shape:
    model: str  # key of MODELS ("8b", "70b") or a free label for custom shapes
    name: str  # "qkv", "o", "gate_up", "down", ...
    n: int  # output features (rows of W)
    k: int  # input features (columns of W)

    @property
    def label(self) -> str:
        return f"{self.model}.{self.name}"


def model_shapes(models: list[str]) -> list[Shape]:
    """The shapes of the given models, in table order."""
    out = []
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; known: {sorted(MODELS)}")
        out += [Shape(m, name, n, k) for name, n, k in MODELS[m]]
    return out


def parse_shapes(spec: str) -> list[Shape]:
    """``"name:NxK,..."`` (optionally ``model.name:NxK``) -> custom shapes, e.g. for tests."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        label, _, dims = item.partition(":")
        n, _, k = dims.lower().partition("x")
        if not (label and n.isdigit() and k.isdigit()):
            raise ValueError(f"bad shape {item!r}; expected name:NxK, e.g. qkv:6144x4096")
        model, _, name = label.rpartition(".")
        out.append(Shape(model or "custom", name, int(n), int(k)))
    return out


# ------------------------------------------------------------------ weight bytes


def kbit_bytes(n: int, k: int, bits: int) -> float:
    """Bytes of a kbit weight: k bits per weight + one E4M4 byte per block of 32."""
    return n * k * (bits + 0.25) / 8


def fp16_bytes(n: int, k: int) -> float:
    return n * k * 2.0


def int4_g128_bytes(n: int, k: int) -> float:
    """Marlin / Machete int4 with one fp16 scale per group of 128."""
    return n * k * (4 + 16 / 128) / 8


def weight_bytes(method: str, n: int, k: int, bits: int | None = None) -> float:
    """Weight bytes read by one call of ``method`` (the effective-bandwidth numerator)."""
    if method in ("fp16", "bf16"):
        return fp16_bytes(n, k)
    if method in ("marlin", "machete"):
        return int4_g128_bytes(n, k)
    if bits is None:
        raise ValueError(f"method {method!r} needs bits")
    return kbit_bytes(n, k, bits)
