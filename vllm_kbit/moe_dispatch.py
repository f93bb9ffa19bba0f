# SPDX-License-Identifier: Apache-2.0
"""``kbit_moe``: the routed experts of one kbit MoE layer, exactly as ``KbitMoEMethod.apply``
runs them (benchmarks/bench_moe.py times this same function). Same arguments and contract as
``torch.ops.kbit.moe`` (reference_moe.py). Two paths, chosen from shapes only:

- few tokens per expert: ``torch.ops.kbit.moe``, which dequantizes the k-bit weights in
  registers: for decode with few slots two GEMV launches over the routed experts
  (csrc/moe_gemv.cu), else the grouped MMA kernels (csrc/moe.cu). Decode and small prefills are
  bound by weight bandwidth there, so reading k + 0.25 bits per weight instead of 16 is the win.
- many tokens per expert (``use_dequant``), on GPUs other than sm_90: ``moe_dequant``
  dequantizes the local experts to x.dtype with ``kbit::dequantize_tiled`` (in chunks of at most
  ``DEQUANT_MAX_BYTES``) and runs vLLM's bf16/fp16 Triton ``fused_experts`` on them. On sm_90
  with an sm_90a build (``has_wgmma_moe``) kbit::moe keeps these calls: its grouped wgmma path
  (csrc/moe_wgmma.cu) dequantizes in registers and beats dequantize + fused_experts there.

Settings: module constants read at import, each with an environment override:
  ``KBIT_MOE_DEQUANT_MIN_M`` (default 1024) and ``KBIT_MOE_DEQUANT_MIN_TPE`` (256): the dequant
  path needs T >= MIN_M tokens and T * topk >= MIN_TPE * global_E, i.e. at least MIN_TPE
  tokens per expert on average (0 and 0: always; a huge MIN_M: never).
  ``KBIT_MOE_DEQUANT_MAX_MIB`` (1536): the most dequantized expert weights held at once.

No host sync and no branch on tensor values: the path and the chunks depend on T and the
layer's shapes only, so a CUDA graph captured at one T replays that T's path. (vLLM runs
``apply`` eagerly inside its opaque ``vllm::moe_forward`` op, and captures it in CUDA graphs
for the batch sizes it captures.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from .format import TILE_N
from .reference_moe import check_moe_args

# (x [T, H], w13 [c, 2I, H], w2 [c, H, I] in x.dtype, topk_weights float32 [T, topk],
#  topk_ids [T, topk] global ids, expert_map int32 [global_E] -> 0..c-1 or -1 (None: ids are
#  local), activation, apply_router_weight_on_input) -> [T, H] in x.dtype: vLLM's fused_experts
#  contract. Slots whose expert maps to -1 must contribute exactly 0.
GroupedGemm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
     str, bool],
    torch.Tensor,
]  # fmt: skip


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"kbit: {name} must be a non-negative integer, got {value!r}") from None
    if number < 0:
        raise ValueError(f"kbit: {name} must be a non-negative integer, got {value!r}")
    return number


DEQUANT_MIN_M = _env_int("KBIT_MOE_DEQUANT_MIN_M", 1024)
# 256 tokens per expert: measured crossover on an H100, k=4 (bench_moe_h100__s5_largem.md).
# Qwen3-30B-A3B: at 128 per expert (T=2048) the fused kernel wins (987 vs 1182 us), at 256
# (T=4096) the dequant path (1473 vs 1848 us); Mixtral at 256 (T=1024) ties (3284 vs 3217 us)
# and at 512 the dequant path wins (4803 vs 6332 us).
DEQUANT_MIN_TPE = _env_int("KBIT_MOE_DEQUANT_MIN_TPE", 256)
# The whole layer in one fused_experts call is fastest: each call also allocates, runs the
# activation on, zeroes and top-k-sums all T * topk rows of its caches, whichever experts it
# holds. 1536 MiB takes Qwen3-30B-A3B's 128 experts at TP1 (1152 MiB in bf16) in one call and
# Mixtral-8x7B's 8 (2688 MiB) in two. The scratch comes from the caching allocator per call.
# The choice is monotone in T, so vLLM's profile run (a forward of max_num_batched_tokens
# tokens) takes this path whenever any batch can, and the scratch is counted before the KV
# cache is sized.
DEQUANT_MAX_BYTES = _env_int("KBIT_MOE_DEQUANT_MAX_MIB", 1536) << 20


def vllm_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       expert_map: torch.Tensor | None, activation: str,
                       apply_router_weight_on_input: bool) -> torch.Tensor:  # fmt: skip
    """vLLM 0.26's bf16/fp16 Triton ``fused_experts`` (fused_moe/fused_moe.py:1529), the
    ``GroupedGemm`` on CUDA. With an expert_map it aligns the slots with
    ``moe_align_block_size(..., expert_map, ignore_invalid_experts=True)`` (fused_moe.py:1714-1725),
    which drops the slots of experts mapped to -1 before the GEMMs; their rows of the down
    output cache are zeroed first (fused_moe.py:1763-1764) and ``moe_sum`` adds the top-k
    rows (fused_moe.py:1790): those slots contribute exactly 0."""
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    n_global = w13.shape[0] if expert_map is None else expert_map.numel()
    return fused_experts(x, w13, w2, topk_weights, topk_ids,
                         activation=MoEActivation(activation),
                         apply_router_weight_on_input=apply_router_weight_on_input,
                         global_num_experts=n_global, expert_map=expert_map)  # fmt: skip


# The grouped bf16/fp16 GEMM of the dequant path per device type. No CPU entry: on the CPU
# kbit::moe is the PyTorch reference already (tests register reference_moe.grouped_experts).
GROUPED_GEMMS: dict[str, GroupedGemm] = {"cuda": vllm_fused_experts}


def use_dequant(t: int, topk: int, n_global: int, min_m: int | None = None,
                min_tpe: int | None = None) -> bool:  # fmt: skip
    """Whether T tokens routed top-k over n_global experts take the dequant path.

    Dequantizing costs one pass over the layer: read (k + 0.25) / 8 bytes and write 2 bytes per
    weight, then fused_experts reads the 2 bytes back (~1.55 GB of traffic, ~0.5 ms on an H100,
    for Qwen3-30B-A3B's 128 experts at k = 4), once per call whatever T is. It pays off when
    each expert gets many tokens: the layer is then compute bound, and the fused kernel's
    mma.sync main loop, which also unpacks codes and scales in the same warps, runs far below
    tensor-core peak (Qwen3-30B-A3B shape on an H100 at T = 4096: 1.8 ms, vs 0.9 ms for
    fused_experts on bf16 weights), while vLLM's Triton kernel on bf16 weights runs near it."""
    min_m = DEQUANT_MIN_M if min_m is None else min_m
    min_tpe = DEQUANT_MIN_TPE if min_tpe is None else min_tpe
    return t > 0 and t >= min_m and t * topk >= min_tpe * n_global


@functools.cache
def _sm90a_build() -> bool:
    try:
        import vllm_kbit._C as C
    except ImportError:
        return False
    return getattr(C, "sm90a", 0) == 1


def has_wgmma_moe(device: torch.device) -> bool:
    """Does kbit::moe run its grouped wgmma path (many slots per expert) on this device: a build
    with sm_90a code, an sm_90 GPU, and not disabled with ``KBIT_MOE_WGMMA=0``?"""
    if device.type != "cuda" or os.environ.get("KBIT_MOE_WGMMA", "").strip() == "0":
        return False
    return _sm90a_build() and torch.cuda.get_device_capability(device) == (9, 0)


def takes_dequant(x: torch.Tensor, topk: int, n_global: int) -> bool:
    """Whether ``kbit_moe`` sends this call to the dequant path (given a grouped GEMM for x's
    device): ``use_dequant`` for T = x.shape[0], except where kbit::moe has its wgmma path."""
    return use_dequant(x.shape[0], topk, n_global) and not has_wgmma_moe(x.device)


def expert_bytes(h: int, i: int, dtype: torch.dtype) -> int:
    """Bytes of one expert's dequantized weights (gate, up and down: 3 x [h, i]) in dtype."""
    return 3 * h * i * torch.empty(0, dtype=dtype).element_size()


def chunk_experts(n_experts: int, expert_bytes: int, max_bytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges of local experts dequantized together: as few chunks as
    ``max_bytes`` allows (at least one expert each), of balanced sizes (the last one may be
    smaller)."""
    per_chunk = max(1, max_bytes // max(1, expert_bytes))
    n_chunks = -(-n_experts // per_chunk)
    size = -(-n_experts // max(1, n_chunks))
    return [(s, min(s + size, n_experts)) for s in range(0, n_experts, size)]


def dequant_experts(qweight: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
                    bits: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Tiled rows qweight [c, words] / absmax [c, bytes] (c experts' [n, k] weights) -> [c, n, k]
    in dtype, in one launch: the tiled layout is N-tile-major and n % TILE_N == 0, so c stacked
    experts are the tiled layout of their [c * n, k] concatenation."""
    assert n % TILE_N == 0, f"n={n} is not a multiple of {TILE_N}"  # H, I % 32 == 0 is checked
    c = qweight.shape[0]
    w = torch.ops.kbit.dequantize_tiled(qweight.reshape(-1), absmax.reshape(-1), codebook, bits,
                                        c * n, k, dtype)  # fmt: skip
    return w.view(c, n, k)


def moe_dequant(x: torch.Tensor, w13_qweight: torch.Tensor, w13_absmax: torch.Tensor,
                w2_qweight: torch.Tensor, w2_absmax: torch.Tensor, codebook: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: torch.Tensor | None, bits: int, inter_size: int, activation: str,
                apply_router_weight_on_input: bool, *, grouped_gemm: GroupedGemm | None = None,
                max_bytes: int | None = None) -> torch.Tensor:  # fmt: skip
    """The large-T path of ``kbit_moe`` (``torch.ops.kbit.moe``'s arguments and contract):
    dequantize the local experts to x.dtype and run ``grouped_gemm`` (default: GROUPED_GEMMS
    for x's device) on them, in chunks of at most ``max_bytes`` (default DEQUANT_MAX_BYTES) of
    dequantized weights.

    One chunk: one call with the layer's own expert_map. Several: chunk [s, e) is called with
    a map that sends the global experts whose local id l lies in [s, e) to l - s and every
    other one to -1 (the layer's -1 entries stay -1), so each slot is computed by exactly one
    chunk and contributes 0 to the others; the chunk outputs are summed in fp32 and rounded
    once.
    """
    check_moe_args(x, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, topk_weights,
                   topk_ids, expert_map, bits, inter_size, activation,
                   apply_router_weight_on_input)  # fmt: skip
    gemm = grouped_gemm or GROUPED_GEMMS.get(x.device.type)
    if gemm is None:
        raise ValueError(f"kbit: the dequant MoE path has no grouped GEMM for {x.device.type} "
                         "tensors (moe_dispatch.GROUPED_GEMMS)")  # fmt: skip
    max_bytes = DEQUANT_MAX_BYTES if max_bytes is None else max_bytes
    h, i, n_local = x.shape[1], inter_size, w13_qweight.shape[0]
    x = x.contiguous()  # fused_experts asserts it; kbit::moe also takes a row stride

    def run(s: int, e: int, emap: torch.Tensor | None) -> torch.Tensor:
        w13 = dequant_experts(w13_qweight[s:e], w13_absmax[s:e], codebook, bits, 2 * i, h, x.dtype)
        w2 = dequant_experts(w2_qweight[s:e], w2_absmax[s:e], codebook, bits, h, i, x.dtype)
        # returning frees w13 / w2 before the next chunk is dequantized: one chunk at a time
        return gemm(x, w13, w2, topk_weights, topk_ids, emap, activation,
                    apply_router_weight_on_input)  # fmt: skip

    chunks = chunk_experts(n_local, expert_bytes(h, i, x.dtype), max_bytes)
    if len(chunks) == 1:
        return run(0, n_local, expert_map)
    local = expert_map if expert_map is not None else \
        torch.arange(n_local, dtype=torch.int32, device=x.device)  # fmt: skip
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for s, e in chunks:
        emap = torch.where((local >= s) & (local < e), local - s, -1).to(torch.int32)
        out += run(s, e, emap)
    return out.to(x.dtype)


def kbit_moe(x: torch.Tensor, w13_qweight: torch.Tensor, w13_absmax: torch.Tensor,
             w2_qweight: torch.Tensor, w2_absmax: torch.Tensor, codebook: torch.Tensor,
             topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
             bits: int, inter_size: int, activation: str, apply_router_weight_on_input: bool, *,
             grouped_gemm: GroupedGemm | None = None) -> torch.Tensor:  # fmt: skip
    """The routed experts of one MoE layer (``torch.ops.kbit.moe``'s arguments and contract):
    ``moe_dequant`` when ``takes_dequant`` says so for this T and a grouped GEMM exists for x's
    device (``grouped_gemm``, else GROUPED_GEMMS), torch.ops.kbit.moe otherwise."""
    gemm = grouped_gemm or GROUPED_GEMMS.get(x.device.type)
    n_global = w13_qweight.shape[0] if expert_map is None else expert_map.numel()
    topk = topk_ids.shape[-1] if topk_ids.dim() else 1
    if gemm is not None and takes_dequant(x, topk, n_global):
        return moe_dequant(x, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook,
                           topk_weights, topk_ids, expert_map, bits, inter_size, activation,
                           apply_router_weight_on_input, grouped_gemm=gemm)  # fmt: skip
    return torch.ops.kbit.moe(x, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook,
                              topk_weights, topk_ids, expert_map, bits, inter_size, activation,
                              apply_router_weight_on_input)  # fmt: skip
