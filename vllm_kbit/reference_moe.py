# SPDX-License-Identifier: Apache-2.0
"""Pure-PyTorch reference of ``kbit::moe``: the grouped MoE expert computation on weights in
the tiled runtime layout. Spec and test oracle of the CUDA kernel, and its CPU fallback.

Per layer (E local experts, hidden size H, intermediate size I per TP rank, both % 32 == 0):
  ``w13_qweight`` int32 [E, W13] / ``w13_absmax`` uint8 [E, B13]: row e is ``reference.repack``
      of expert e's gate_up weight [2I, H] (rows 0..I-1 gate = w1, rows I..2I-1 up = w3),
      W13, B13 = ``tiled_shape(2I, H, bits)[2:]``;
  ``w2_qweight`` / ``w2_absmax``: the same for the down weight [H, I].

Output[t] = sum over the top-k slots j of token t whose expert is on this rank of
``topk_weights[t, j] * down(act(gate(x[t])) * up(x[t]))``. Precision follows vLLM's
``fused_experts``: the gate_up product is accumulated in fp32 and rounded to x.dtype; the
activation is computed in fp32 and rounded to x.dtype; the down product and the weighted sum
over slots are fp32, rounded once at the end.

This reference syncs with the host (it dequantizes only the experts that received tokens), so
it cannot run inside a CUDA graph: serve with ``--enforce-eager`` while it is the CUDA fallback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .format import BLOCKSIZE, check_bits
from .reference import dequantize_tiled, tiled_shape

# vLLM's gated MoEActivation values: act(h[:, :I]) * h[:, I:].
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
}


def check_moe_args(x: torch.Tensor, w13_qweight: torch.Tensor, w13_absmax: torch.Tensor,
                   w2_qweight: torch.Tensor, w2_absmax: torch.Tensor, codebook: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   expert_map: torch.Tensor | None, bits: int, inter_size: int, activation: str,
                   apply_router_weight_on_input: bool) -> None:  # fmt: skip
    """Metadata checks shared by the reference and the fake (no data access, so they also
    run on fake tensors with symbolic T). Raise ValueError naming the tensor."""

    def check(cond, msg: Callable[[], str] | str) -> None:
        text = msg if callable(msg) else (lambda: msg)
        torch._check_with(ValueError, cond, lambda: f"kbit::moe: {text()}")

    check_bits(bits)
    check(activation in ACTIVATIONS,
          lambda: f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    check(x.dim() == 2, lambda: f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    check(x.dtype in (torch.float16, torch.bfloat16),
          lambda: f"x must be float16 or bfloat16, got {x.dtype}")  # fmt: skip
    h = x.shape[1]
    check(h > 0 and h % BLOCKSIZE == 0,
          lambda: f"x has hidden size {h}, not a positive multiple of 32")  # fmt: skip
    check(inter_size > 0 and inter_size % BLOCKSIZE == 0,
          lambda: f"inter_size must be a positive multiple of 32, got {inter_size}")  # fmt: skip
    e = w13_qweight.shape[0] if w13_qweight.dim() == 2 else -1
    for name, t, dtype, size in (
        ("w13_qweight", w13_qweight, torch.int32, tiled_shape(2 * inter_size, h, bits)[2]),
        ("w13_absmax", w13_absmax, torch.uint8, tiled_shape(2 * inter_size, h, bits)[3]),
        ("w2_qweight", w2_qweight, torch.int32, tiled_shape(h, inter_size, bits)[2]),
        ("w2_absmax", w2_absmax, torch.uint8, tiled_shape(h, inter_size, bits)[3]),
    ):
        check(t.dtype == dtype and t.dim() == 2 and t.shape[0] == e and t.shape[1] == size,
              f"{name} must be {dtype} [E, {size}] (tiled layout of {bits}-bit weights, H={h}, "
              f"inter_size={inter_size}, E={e} from w13_qweight), got {t.dtype} "
              f"{tuple(t.shape)}")  # fmt: skip
    check(codebook.dtype == torch.float32 and tuple(codebook.shape) == (2**bits,),
          lambda: f"codebook must be float32 [{2**bits}], got {codebook.dtype} "
          f"{tuple(codebook.shape)}")  # fmt: skip
    check(topk_weights.dtype == torch.float32 and topk_weights.dim() == 2
          and topk_weights.shape[0] == x.shape[0],
          lambda: f"topk_weights must be float32 [T={x.shape[0]}, topk], got {topk_weights.dtype} "
          f"{tuple(topk_weights.shape)}")  # fmt: skip
    check(topk_ids.dtype in (torch.int32, torch.int64)
          and tuple(topk_ids.shape) == tuple(topk_weights.shape),
          lambda: f"topk_ids must be int32 or int64 with the shape of topk_weights "
          f"{tuple(topk_weights.shape)}, got {topk_ids.dtype} {tuple(topk_ids.shape)}")  # fmt: skip
    if expert_map is not None:
        check(expert_map.dtype == torch.int32 and expert_map.dim() == 1,
              lambda: f"expert_map must be int32 [global_E], got {expert_map.dtype} "
              f"{tuple(expert_map.shape)}")  # fmt: skip
    check(not apply_router_weight_on_input or topk_weights.shape[1] == 1,
          lambda: "apply_router_weight_on_input needs topk == 1, got topk "
          f"{topk_weights.shape[1]}")  # fmt: skip
    tensors = {"w13_qweight": w13_qweight, "w13_absmax": w13_absmax, "w2_qweight": w2_qweight,
               "w2_absmax": w2_absmax, "codebook": codebook, "topk_weights": topk_weights,
               "topk_ids": topk_ids, "expert_map": expert_map}  # fmt: skip
    for name, t in tensors.items():
        if t is not None:
            check(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")


def moe_tiled(x: torch.Tensor, w13_qweight: torch.Tensor, w13_absmax: torch.Tensor,
              w2_qweight: torch.Tensor, w2_absmax: torch.Tensor, codebook: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
              bits: int, inter_size: int, activation: str,
              apply_router_weight_on_input: bool) -> torch.Tensor:  # fmt: skip
    """``kbit::moe``: -> [T, H] in x.dtype (see the module docstring).

    ``topk_ids`` hold global expert ids in [0, global_E): global_E is ``expert_map.numel()``,
    or E when ``expert_map`` is None. ``expert_map[g]`` is the local id of expert g or -1
    (another rank's expert: its slots contribute nothing). With
    ``apply_router_weight_on_input`` (topk == 1) the router weight scales the token before the
    experts -- applied to the fp32 gate_up accumulator, as vLLM's fused_experts does -- and the
    sum over slots is unweighted.
    """
    check_moe_args(x, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, topk_weights,
                   topk_ids, expert_map, bits, inter_size, activation,
                   apply_router_weight_on_input)  # fmt: skip
    h = x.shape[1]
    n_local = w13_qweight.shape[0]
    n_global = n_local if expert_map is None else expert_map.numel()
    ids = topk_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_global):
        raise ValueError(f"kbit::moe: topk_ids must lie in [0, {n_global}) (global experts), got "
                         f"{int(ids.min())}..{int(ids.max())}")  # fmt: skip
    local = ids if expert_map is None else expert_map.long()[ids]
    if local.numel() and int(local.max()) >= n_local:
        raise ValueError(f"kbit::moe: expert_map maps to local expert {int(local.max())}, but "
                         f"w13_qweight holds {n_local} experts")  # fmt: skip
    i = inter_size

    def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_tiled(w13_qweight[e], w13_absmax[e], codebook, bits, 2 * i, h, x.dtype),
                dequantize_tiled(w2_qweight[e], w2_absmax[e], codebook, bits, h, i, x.dtype))  # fmt: skip

    return _experts_sum(x, local, topk_weights, weights, activation, apply_router_weight_on_input)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_map: torch.Tensor | None, activation: str,
                    apply_router_weight_on_input: bool) -> torch.Tensor:  # fmt: skip
    """Pure-PyTorch stand-in for vLLM's ``fused_experts`` on dequantized weights, with the
    signature of ``moe_dispatch.GroupedGemm``: w13 [c, 2I, H] and w2 [c, H, I] in x.dtype,
    ``expert_map`` int32 [global_E] -> local id in [0, c) or -1 (None: ids are local). Same
    math and rounding as ``moe_tiled`` (so that one call over all experts is bit-identical to
    it); vLLM's Triton kernel also rounds each slot's down product to x.dtype before the top-k
    sum. Syncs with the host: tests and CPU only."""
    ids = topk_ids.long()
    local = ids if expert_map is None else expert_map.long()[ids]
    return _experts_sum(x, local, topk_weights, lambda e: (w13[e], w2[e]), activation,
                        apply_router_weight_on_input)  # fmt: skip


def _experts_sum(x: torch.Tensor, local: torch.Tensor, topk_weights: torch.Tensor,
                 weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]], activation: str,
                 apply_router_weight_on_input: bool) -> torch.Tensor:  # fmt: skip
    """The MoE math of the module docstring: ``local`` [T, topk] local expert per slot (< 0:
    skipped), ``weights(e)`` -> (w13 [2I, H], w2 [H, I]) in x.dtype; experts in ascending order."""
    act = ACTIVATIONS[activation]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in local.unique().tolist():
        if e < 0:  # expert on another rank
            continue
        tok, slot = (local == e).nonzero(as_tuple=True)
        weight = topk_weights[tok, slot].unsqueeze(1)
        w13, w2 = weights(e)
        i = w2.shape[1]
        gate_up = x[tok].float() @ w13.float().t()
        if apply_router_weight_on_input:
            gate_up = gate_up * weight
        gate_up = gate_up.to(x.dtype)
        a = (act(gate_up[:, :i].float()) * gate_up[:, i:].float()).to(x.dtype)
        y = a.float() @ w2.float().t()
        out.index_add_(0, tok, y if apply_router_weight_on_input else y * weight)
    return out.to(x.dtype)
