# SPDX-License-Identifier: Apache-2.0
"""``torch.ops.kbit.*``: schemas, fake (meta) implementations, CPU implementations
(the pure-PyTorch reference) and the compiled CUDA kernels from ``vllm_kbit._C``.

Schemas are defined here, in Python, so that a CPU-only install (no ``_C``) still has
every op; ``_C`` only adds CUDA implementations (``TORCH_LIBRARY_IMPL(kbit, CUDA, m)``).
Importing this module never initialises CUDA.
"""

from __future__ import annotations

import logging
import os

import torch

from . import reference as ref
from . import reference_moe as ref_moe
from .format import BLOCKSIZE, check_bits

logger = logging.getLogger(__name__)

_SCHEMAS = {
    "quantize": "quantize(Tensor weight, Tensor codebook, int bits) -> (Tensor, Tensor)",
    "dequantize": "dequantize(Tensor qweight, Tensor absmax, Tensor codebook, int bits, "
    "ScalarType dtype) -> Tensor",
    "repack": "repack(Tensor qweight, Tensor absmax, int bits) -> (Tensor, Tensor)",
    "dequantize_tiled": "dequantize_tiled(Tensor qweight, Tensor absmax, Tensor codebook, int bits, "
    "int n, int k, ScalarType dtype) -> Tensor",
    # x[M, K] @ W^T -> [M, n] from the tiled layout; gemv and mma are the individual kernels,
    # linear picks one of gemv / mma / dequantize+cuBLAS from M on the device side of the call.
    "gemv": "gemv(Tensor x, Tensor qweight, Tensor absmax, Tensor codebook, int bits, int n) -> Tensor",
    "mma": "mma(Tensor x, Tensor qweight, Tensor absmax, Tensor codebook, int bits, int n) -> Tensor",
    "linear": "linear(Tensor x, Tensor qweight, Tensor absmax, Tensor codebook, int bits, int n) "
    "-> Tensor",
    # kbit::linear of the elementwise op that feeds it in a decoder layer (vllm_kbit/fusion.py):
    # rms_norm(x + residual) * norm_weight, also returning x + residual; silu(h[:, :K]) * h[:, K:]
    "linear_add_rms_norm": "linear_add_rms_norm(Tensor x, Tensor residual, Tensor norm_weight, "
    "float eps, Tensor qweight, Tensor absmax, Tensor codebook, int bits, int n) -> (Tensor, Tensor)",
    "linear_silu_mul": "linear_silu_mul(Tensor h, Tensor qweight, Tensor absmax, Tensor codebook, "
    "int bits, int n) -> Tensor",
    # x[M, K] @ weight^T for an unquantized fp16/bf16 weight [n, K] (the lm_head kbit leaves
    # unquantized): a streaming GEMV at M <= 4 on CUDA, cuBLAS otherwise
    "dense_linear": "dense_linear(Tensor x, Tensor weight) -> Tensor",
    # grouped MoE experts (gate_up, gated activation, down, weighted sum over top-k) on the
    # tiled layout, one row per local expert; see reference_moe.py for the contract
    "moe": "moe(Tensor x, Tensor w13_qweight, Tensor w13_absmax, Tensor w2_qweight, "
    "Tensor w2_absmax, Tensor codebook, Tensor topk_weights, Tensor topk_ids, Tensor? expert_map, "
    "int bits, int inter_size, str activation, bool apply_router_weight_on_input) -> Tensor",
}
_MATMUL_OPS = ("gemv", "mma", "linear")

_lib: torch.library.Library | None = None
_cuda_backend = "none"  # "compiled", "reference" (no _C: reference ops on the GPU) or "none"
_cuda_reference_ops: list[str] = []  # ops that run the reference on CUDA tensors


def _define() -> None:
    global _lib
    if _lib is not None or hasattr(torch.ops.kbit, "linear"):
        return
    _lib = torch.library.Library("kbit", "DEF")
    for schema in _SCHEMAS.values():
        _lib.define(schema)

    _register_reference("CPU")

    # ---- fakes: shapes and dtypes only (torch.compile / CUDA-graph tracing)
    torch.library.register_fake("kbit::quantize", _quantize_fake, lib=_lib)
    torch.library.register_fake("kbit::dequantize", _dequantize_fake, lib=_lib)
    torch.library.register_fake("kbit::repack", _repack_fake, lib=_lib)
    torch.library.register_fake("kbit::dequantize_tiled", _dequantize_tiled_fake, lib=_lib)
    for name in _MATMUL_OPS:
        torch.library.register_fake(f"kbit::{name}", _linear_fake, lib=_lib)
    torch.library.register_fake("kbit::linear_add_rms_norm", _linear_add_rms_norm_fake, lib=_lib)
    torch.library.register_fake("kbit::linear_silu_mul", _linear_silu_mul_fake, lib=_lib)
    torch.library.register_fake("kbit::moe", _moe_fake, lib=_lib)
    torch.library.register_fake("kbit::dense_linear", _dense_linear_fake, lib=_lib)


def _register_reference(dispatch_key: str, names: list[str] | None = None) -> None:
    """The pure-PyTorch reference as the ``dispatch_key`` implementation of the ops ``names``
    (default: every op)."""
    assert _lib is not None
    impls = {"quantize": _quantize_ref, "dequantize": ref.dequantize, "repack": ref.repack,
             "dequantize_tiled": ref.dequantize_tiled, "moe": ref_moe.moe_tiled,
             "linear_add_rms_norm": _linear_add_rms_norm_ref, "linear_silu_mul": _linear_silu_mul_ref,
             "dense_linear": _dense_linear_ref,
             **{name: _linear_ref for name in _MATMUL_OPS}}  # fmt: skip
    for name in _SCHEMAS if names is None else names:
        _lib.impl(name, impls[name], dispatch_key)


def _quantize_ref(weight: torch.Tensor, codebook: torch.Tensor, bits: int):
    return ref.quantize(weight, bits, codebook)


def _linear_ref(x, qweight, absmax, codebook, bits, n):
    _check_linear_args(x, qweight, absmax, codebook, bits, n)
    return ref.linear_tiled(x, qweight, absmax, codebook, bits, n)


def _check_norm_args(x, residual, norm_weight) -> None:
    torch._check(residual.shape == x.shape and residual.dtype == x.dtype,
                 lambda: f"kbit: residual must match x ({tuple(x.shape)}, {x.dtype}), got "
                 f"{tuple(residual.shape)}, {residual.dtype}")  # fmt: skip
    torch._check(norm_weight.dim() == 1 and norm_weight.shape[0] == x.shape[-1]
                 and norm_weight.dtype == x.dtype,
                 lambda: f"kbit: norm_weight must be [{x.shape[-1]}] {x.dtype}, got "
                 f"{tuple(norm_weight.shape)} {norm_weight.dtype}")  # fmt: skip


def _linear_add_rms_norm_ref(x, residual, norm_weight, eps, qweight, absmax, codebook, bits, n):
    _check_linear_args(x, qweight, absmax, codebook, bits, n)
    _check_norm_args(x, residual, norm_weight)
    return ref.linear_add_rms_norm(x, residual, norm_weight, eps, qweight, absmax, codebook,
                                   bits, n)  # fmt: skip


def _linear_silu_mul_ref(h, qweight, absmax, codebook, bits, n):
    _check_linear_args(h, qweight, absmax, codebook, bits, n)
    torch._check(h.shape[-1] % 2 == 0,
                 lambda: f"kbit: h must be [M, 2K] (gate, up), got {tuple(h.shape)}")  # fmt: skip
    return ref.linear_silu_mul(h, qweight, absmax, codebook, bits, n)


def _check_x(x) -> None:
    torch._check(x.dim() == 2, lambda: f"kbit: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    torch._check(x.dtype in (torch.float16, torch.bfloat16),
                 lambda: f"kbit: x must be float16 or bfloat16, got {x.dtype}")  # fmt: skip


def _check_linear_args(x, qweight, absmax, codebook, bits, n) -> None:
    _check_x(x)
    torch._check(qweight.dtype == torch.int32, lambda: f"kbit: qweight must be int32, got {qweight.dtype}")
    torch._check(absmax.dtype == torch.uint8,
                 lambda: f"kbit: weight_absmax must be uint8, got {absmax.dtype}")  # fmt: skip
    torch._check(codebook.dtype == torch.float32 and codebook.numel() == 2**bits,
                 lambda: f"kbit: codebook must be float32 [{2**bits}], got {codebook.dtype} "
                 f"{tuple(codebook.shape)}")  # fmt: skip


def _check_dense_args(x, weight) -> None:
    _check_x(x)
    torch._check(weight.dim() == 2,
                 lambda: f"kbit: weight must be 2-D [n, K], got shape {tuple(weight.shape)}")  # fmt: skip
    torch._check(weight.dtype == x.dtype,
                 lambda: f"kbit: weight ({weight.dtype}) and x ({x.dtype}) must have one dtype")  # fmt: skip
    torch._check(weight.shape[1] == x.shape[1],
                 lambda: f"kbit: x has K={x.shape[1]} columns, weight {tuple(weight.shape)} has "
                 f"{weight.shape[1]}")  # fmt: skip


def _dense_linear_ref(x, weight):
    _check_dense_args(x, weight)
    return ref.dense_linear(x, weight)


def _dense_linear_fake(x, weight):
    _check_dense_args(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))


def _quantize_fake(weight, codebook, bits):
    check_bits(bits)
    torch._check(weight.dim() == 2, lambda: f"kbit: weight must be 2-D, got {tuple(weight.shape)}")
    n, k = weight.shape
    kb = k // BLOCKSIZE
    return (weight.new_empty((n, kb * bits), dtype=torch.int32),
            weight.new_empty((n, kb), dtype=torch.uint8))  # fmt: skip


def _dequantize_fake(qweight, absmax, codebook, bits, dtype):
    return qweight.new_empty((absmax.shape[0], absmax.shape[1] * BLOCKSIZE), dtype=dtype)


def _repack_fake(qweight, absmax, bits):
    n, kb = absmax.shape
    _, _, words, nbytes = ref.tiled_shape(n, kb * BLOCKSIZE, bits)
    return qweight.new_empty((words,)), absmax.new_empty((nbytes,))


def _dequantize_tiled_fake(qweight, absmax, codebook, bits, n, k, dtype):
    return qweight.new_empty((n, k), dtype=dtype)


def _linear_fake(x, qweight, absmax, codebook, bits, n):
    _check_linear_args(x, qweight, absmax, codebook, bits, n)
    return x.new_empty((x.shape[0], n))


def _linear_add_rms_norm_fake(x, residual, norm_weight, eps, qweight, absmax, codebook, bits, n):
    _check_linear_args(x, qweight, absmax, codebook, bits, n)
    _check_norm_args(x, residual, norm_weight)
    return x.new_empty((x.shape[0], n)), x.new_empty(x.shape)


def _linear_silu_mul_fake(h, qweight, absmax, codebook, bits, n):
    _check_linear_args(h, qweight, absmax, codebook, bits, n)
    return h.new_empty((h.shape[0], n))


def _moe_fake(x, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, topk_weights, topk_ids,
              expert_map, bits, inter_size, activation, apply_router_weight_on_input):  # fmt: skip
    ref_moe.check_moe_args(x, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook,
                           topk_weights, topk_ids, expert_map, bits, inter_size, activation,
                           apply_router_weight_on_input)  # fmt: skip
    return x.new_empty(x.shape)


def _load_cuda() -> None:
    """Attach CUDA implementations: the compiled kernels, else the reference on the GPU."""
    global _cuda_backend, _cuda_reference_ops
    if _cuda_backend != "none":
        return
    try:
        from . import _C  # noqa: F401  (its static initialisers register the CUDA kernels)
    except ImportError as e:
        if os.environ.get("KBIT_REQUIRE_CUDA_EXT", "0") == "1":
            raise ImportError("vllm_kbit._C is not built (KBIT_REQUIRE_CUDA_EXT=1)") from e
        logger.warning("vllm_kbit._C is not built (%s); CUDA tensors use the slow PyTorch "
                       "reference. Reinstall with nvcc available to get the kernels.", e)  # fmt: skip
        _register_reference("CUDA")
        _cuda_backend, _cuda_reference_ops = "reference", list(_SCHEMAS)
        return
    _cuda_backend = "compiled"
    # an _C built before an op existed (or without it) lacks its kernel: use the reference
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    _cuda_reference_ops = [n for n in _SCHEMAS if not has_kernel(f"kbit::{n}", "CUDA")]
    # KBIT_MOE_REFERENCE=1 (csrc/torch_bindings.cpp) leaves kbit::moe's kernel out on purpose
    chosen = ["moe"] if os.environ.get("KBIT_MOE_REFERENCE", "0") == "1" else []
    if chosen and "moe" in _cuda_reference_ops:
        logger.info("KBIT_MOE_REFERENCE=1: kbit::moe uses the PyTorch reference on CUDA tensors")
    if [n for n in _cuda_reference_ops if n not in chosen]:
        logger.warning("vllm_kbit._C has no CUDA kernel for %s; those ops use the slow PyTorch "
                       "reference on CUDA tensors (rebuild the extension to get them)",
                       ", ".join(f"kbit::{n}" for n in _cuda_reference_ops if n not in chosen))  # fmt: skip
    if _cuda_reference_ops:
        _register_reference("CUDA", _cuda_reference_ops)


def load() -> str:
    """Define every ``torch.ops.kbit`` op (idempotent); returns the CUDA backend in use."""
    if _lib is None and hasattr(torch.ops.kbit, "linear"):
        return _cuda_backend  # defined by another copy of this module; nothing to add
    _define()
    _load_cuda()
    return _cuda_backend


def has_cuda_kernels() -> bool:
    return load() == "compiled"
