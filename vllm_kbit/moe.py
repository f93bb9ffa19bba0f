# SPDX-License-Identifier: Apache-2.0
"""``KbitMoEMethod``: the vLLM fused-MoE method of the kbit format.

Per MoE layer (``RoutedExperts``) with E local experts, hidden size H and intermediate size
I per TP rank, after loading: ``w13_qweight`` int32 [E, W13] and ``w13_weight_absmax`` uint8
[E, B13] (row e = expert e's gate_up weight [2I, H] in the tiled runtime layout), the same
for ``w2_*`` (down [H, I]), and the non-persistent buffer ``kbit_codebook``. ``apply`` is
``moe_dispatch.kbit_moe``: one ``torch.ops.kbit.moe`` call, or for many tokens per expert the
experts dequantized to the activation dtype and vLLM's Triton ``fused_experts`` (the legacy
direct-apply design: no modular kernel, so TP, EP without all2all, and DP without EP work;
DP+EP all2all backends are refused).

Pre-quantized: the checkpoint's per-expert 2-D tensors ``experts.{e}.gate_proj.qweight``
[I_full, H/32*k], ``.weight_absmax`` [I_full, H/32] (``up_proj`` / ``down_proj``, or
Mixtral's ``w1`` / ``w3`` / ``w2``) load through vLLM's own MoE weight loader into
``w13_qweight`` [E, 2I, H/32*k], ``w13_weight_absmax`` [E, 2I, H/32], ``w2_qweight``
[E, H, I/32*k], ``w2_weight_absmax`` [E, H, I/32]. Every name contains "weight" and none
contains "scale"/"zero"/"offset", so the loader treats all four as weights: w1/w3 narrow dim 0
(rows), w2 narrows dim 1 by ``loaded.shape[1] // tp`` -- (I/32/tp)*k words and I/32/tp
absmax bytes, block-aligned iff (I/32) % tp == 0 (``KbitConfig`` checks it).
Online: bf16 ``w13_weight`` / ``w2_weight`` on the meta device; vLLM's layer-wise loader
materialises the layer once all its local experts are loaded and calls
``process_weights_after_loading``, which quantizes expert by expert.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.utils import replace_parameter, set_weight_attrs

from .format import BLOCKSIZE
from .linear import (
    _DONE,
    _dummy_quantized,
    _init_method,
    _initialize_online_processing,
    _load_format_is_dummy,
    _quantize,
)
from .moe_dispatch import kbit_moe
from .reference import tiled_shape
from .reference_moe import ACTIVATIONS


def check_moe_layer(moe: FusedMoEConfig, prefix: str) -> None:
    """Raise if ``kbit::moe`` cannot run this MoE layer (whatever the checkpoint holds)."""
    what = f"kbit: MoE layer {prefix or '?'}"
    fix = (f"; leave its experts unquantized (modules_to_not_convert: "
           f"['{re.escape(prefix)}$'])")  # fmt: skip
    act = moe.activation.value
    if act not in ACTIVATIONS:
        raise NotImplementedError(f"{what} uses activation {act!r}; kbit MoE supports "
                                  f"{sorted(ACTIVATIONS)} (gated){fix}")  # fmt: skip
    if getattr(moe, "has_bias", False):
        raise NotImplementedError(f"{what} has expert biases, which kbit MoE does not support{fix}")
    if getattr(moe, "swiglu_limit", None) is not None:
        raise NotImplementedError(f"{what} uses a clamped SwiGLU (swiglu_limit), which kbit "
                                  f"MoE does not support{fix}")  # fmt: skip
    if moe.moe_parallel_config.use_all2all_kernels:
        raise NotImplementedError(f"{what}: kbit MoE does not support all2all expert-parallel "
                                  "backends (data parallel + --enable-expert-parallel); use "
                                  "tensor parallelism, or expert parallelism without data "
                                  "parallelism")  # fmt: skip


class KbitMoEMethod(FusedMoEMethodBase):
    """All experts of one MoE layer: k-bit codes + E4M4 absmax per block of 32 along K."""

    def __init__(self, moe: FusedMoEConfig, bits: int, codebook: torch.Tensor,
                 online: bool = False, prefix: str = "") -> None:  # fmt: skip
        super().__init__(moe)
        _init_method(self, bits, codebook, online, prefix)

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:  # fmt: skip
        e, h, i, k = num_experts, hidden_size, intermediate_size_per_partition, self.bits
        check_moe_layer(self.moe, self.prefix)
        if h % BLOCKSIZE or i % BLOCKSIZE:
            raise ValueError(f"kbit: MoE layer {self.prefix} has hidden size {h} and "
                             f"intermediate size {i} per rank; both must be multiples of 32")
        if self.online:
            dt = params_dtype
            shapes = {"w13_weight": ((e, 2 * i, h), dt), "w2_weight": ((e, h, i), dt)}
            device = "meta"
        else:
            shapes = {"w13_qweight": ((e, 2 * i, h // BLOCKSIZE * k), torch.int32),
                      "w2_qweight": ((e, h, i // BLOCKSIZE * k), torch.int32),
                      "w13_weight_absmax": ((e, 2 * i, h // BLOCKSIZE), torch.uint8),
                      "w2_weight_absmax": ((e, h, i // BLOCKSIZE), torch.uint8)}  # fmt: skip
            device = None
        for name, (shape, dtype) in shapes.items():
            p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                   requires_grad=False)  # fmt: skip
            layer.register_parameter(name, p)
            set_weight_attrs(p, extra_weight_attrs)  # weight_loader: vLLM's per-expert loader
        if self.online:
            _initialize_online_processing(layer)
        else:
            self.dummy = _load_format_is_dummy()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, _DONE, False):  # online layers are processed layer-wise, then again
            return
        bits = self.bits
        if self.online:
            w13, w2 = layer.w13_weight.data, layer.w2_weight.data
            (e, two_i, h), dev = w13.shape, w13.device
            codebook = self.codebook.to(dev)

            def quantize(w: torch.Tensor, what: str) -> Callable[[int], tuple[torch.Tensor, ...]]:
                return lambda j: _quantize(w[j], codebook, bits,
                                           f"{self.prefix} (expert {j}, {what})")  # fmt: skip

            w13_tiled = _tile_experts(quantize(w13, "gate/up"), e, two_i, h, bits, dev)
            w2_tiled = _tile_experts(quantize(w2, "down"), e, h, two_i // 2, bits, dev)
            del layer.w13_weight, layer.w2_weight  # the bf16 experts: freed once tiled
        else:
            q13, a13 = layer.w13_qweight.data, layer.w13_weight_absmax.data
            q2, a2 = layer.w2_qweight.data, layer.w2_weight_absmax.data
            (e, two_i, kb_h), dev = a13.shape, q13.device
            h = kb_h * BLOCKSIZE
            codebook = self.codebook.to(dev)
            if self.dummy:  # integer params are uninitialised with load_format="dummy"
                w13_tiled = _dummy_tiled(e, two_i, h, bits, codebook)
                w2_tiled = _dummy_tiled(e, h, two_i // 2, bits, codebook)
                self.dummy = False  # a later reload brings real weights
            else:
                w13_tiled = _tile_experts(lambda j: (q13[j], a13[j]), e, two_i, h, bits, dev)
                w2_tiled = _tile_experts(lambda j: (q2[j], a2[j]), e, h, two_i // 2, bits, dev)
        for w, (qt, at) in (("w13", w13_tiled), ("w2", w2_tiled)):
            replace_parameter(layer, f"{w}_qweight", qt)
            replace_parameter(layer, f"{w}_weight_absmax", at)
        layer.register_buffer("kbit_codebook", codebook, persistent=False)
        setattr(layer, _DONE, True)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig | None:
        return None  # weight-only, own kernel: no activation quantization for vLLM to set up

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts: object | None,
              shared_experts_input: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        # shared experts are run (and everything is all-reduced) by vLLM's MoE runner. This
        # runs eagerly inside vLLM's opaque vllm::moe_forward op, so kbit_moe may pick its path
        # from x.shape[0] (shapes only: a CUDA graph captured at one T replays that T's path).
        return kbit_moe(
            x, layer.w13_qweight, layer.w13_weight_absmax, layer.w2_qweight,
            layer.w2_weight_absmax, layer.kbit_codebook, topk_weights.float(), topk_ids,
            layer.expert_map, self.bits, layer.intermediate_size_per_partition,
            layer.activation.value, layer.apply_router_weight_on_input)  # fmt: skip


def _tile_experts(expert: Callable[[int], tuple[torch.Tensor, ...]], e: int, n: int, k: int,
                  bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack E experts (``expert(j)`` -> checkpoint-layout qweight, absmax of [n, k]) into
    preallocated [E, words] / [E, bytes] tensors, one expert at a time (low peak memory)."""
    _, _, words, nbytes = tiled_shape(n, k, bits)
    qt = torch.empty(e, words, dtype=torch.int32, device=device)
    at = torch.empty(e, nbytes, dtype=torch.uint8, device=device)
    for j in range(e):
        q, a = expert(j)
        qt[j], at[j] = torch.ops.kbit.repack(q, a, bits)
    return qt, at


def _dummy_tiled(e: int, n: int, k: int, bits: int,
                 codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """load_format="dummy": one expert of quantized N(0, 0.02) weights, copied to all E
    (same bytes per expert as real weights, at the cost of quantizing one)."""
    qt, at = torch.ops.kbit.repack(*_dummy_quantized(n, k, bits, codebook), bits)
    return qt.expand(e, -1).contiguous(), at.expand(e, -1).contiguous()
