# SPDX-License-Identifier: Apache-2.0
"""vLLM's int4 group-128 kernels as benchmark baselines: Marlin (``marlin_gemm``) and
Machete (``machete_mm``, sm90 only), called through ``torch.ops._C`` exactly as vLLM 0.26's
``MarlinLinearKernel`` / ``MacheteLinearKernel`` call them for a GPTQ uint4b8 checkpoint
without act-order or zero points.

Weight preparation is done here in plain PyTorch (symmetric int4 per group of 128, stored
with bias 8; 8 codes per int32 along K) so it runs where only vLLM's compiled library is
available; tests/test_bench_utils.py checks it against vLLM's own helpers
(``quantize_weights``, ``pack_quantized_values_into_int32``, ``marlin_permute_scales``).
"""

from __future__ import annotations

import lzma
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

GROUP = 128
# vllm.scalar_type.scalar_types.uint4b8.id (4-bit unsigned, bias 8); checked by the tests.
UINT4B8_ID = 1125899907892224


def load_vllm_ops(lib: str | None = None) -> str:
    """Make vLLM's kernels (``torch.ops._C.marlin_gemm`` ...) callable; returns where they
    came from, raises RuntimeError saying why not.

    Tries, in order: already loaded; ``import vllm._custom_ops`` (a vLLM install, or the
    staged one of /work/shared/gpu/README.md); ``lib``, a path to vLLM's
    ``_C_stable_libtorch.abi3.so`` (or an ``.xz`` of it), loaded with torch.ops.load_library.
    """
    if hasattr(torch.ops._C, "marlin_gemm"):
        return "torch.ops._C (already loaded)"
    why = []
    try:
        import vllm
        import vllm._custom_ops

        if hasattr(torch.ops._C, "marlin_gemm"):
            return f"vllm {vllm.__version__} ({Path(vllm.__file__).parent})"
        why.append(f"vllm {vllm.__version__} imported but torch.ops._C.marlin_gemm is missing")
    except Exception as e:  # noqa: BLE001
        why.append(f"import vllm._custom_ops: {type(e).__name__}: {e}")
    if lib:
        path = Path(lib)
        if path.suffix == ".xz":
            out = Path(tempfile.gettempdir()) / "kbit-bench-vllm" / path.stem
            out.parent.mkdir(parents=True, exist_ok=True)
            if not out.exists():
                with lzma.open(path) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 24)
            path = out
        try:
            torch.ops.load_library(str(path))
        except Exception as e:  # noqa: BLE001
            why.append(f"load_library({lib}): {type(e).__name__}: {e}")
        else:
            if hasattr(torch.ops._C, "marlin_gemm"):
                return f"library {lib}"
            why.append(f"{lib} loaded but defines no torch.ops._C.marlin_gemm")
    raise RuntimeError("vLLM kernels unavailable: " + "; ".join(why))


# ------------------------------------------------------------ weight preparation


def quantize_int4_g128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W[N, K] fp16/bf16 -> (codes int32 [N, K] in 0..15 (value + 8), scales [K/128, N]
    in w.dtype, w_ref [N, K] in w.dtype = dequantized weight).

    Same arithmetic as vLLM's ``quantize_weights(w.t(), uint4b8, 128)``: per group,
    s = max(|max/7|, |min/-8|) and q = clamp(round(w/s), -8, 7), in w's dtype.
    """
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 g128 needs K % {GROUP} == 0, got K={k}")
    wg = w.view(n, k // GROUP, GROUP)
    s = torch.maximum((wg.amax(-1) / 7).abs(), (wg.amin(-1) / -8).abs())  # [N, K/128]
    q = torch.round(wg / s.unsqueeze(-1)).int().clamp_(-8, 7)
    w_ref = (q.to(w.dtype) * s.unsqueeze(-1)).view(n, k)
    return (q + 8).view(n, k), s.t().contiguous(), w_ref


def pack_int4_along_k(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) -> int32 [N, K/8]: word j holds codes 8j..8j+7 of its row, code
    8j+i in bits 4i..4i+3. Its transpose ``[K/8, N]`` is the GPTQ ``qweight`` layout."""
    n, k = codes.shape
    c = codes.to(torch.int32).view(n, k // 8, 8)
    out = torch.zeros(n, k // 8, dtype=torch.int32, device=codes.device)
    for i in range(8):
        out |= (c[..., i] & 15) << (4 * i)
    return out


def marlin_permute_scales(s: torch.Tensor) -> torch.Tensor:
    """Scales [K/128, N] (grouped, group < K) -> Marlin's scale order (vLLM's
    ``marlin_permute_scales`` for group_size < size_k)."""
    perm = [i + 8 * j for i in range(8) for j in range(8)]
    n = s.shape[1]
    return s.reshape(-1, len(perm))[:, perm].reshape(-1, n).contiguous()


# --------------------------------------------------------------------- kernels


def marlin_weights(
    packed: torch.Tensor, scales: torch.Tensor, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [N, K/8], scales [K/128, N]) -> (Marlin qweight, Marlin scales) on the GPU."""
    empty = torch.empty(0, dtype=torch.int32, device=packed.device)
    # _C::gptq_marlin_repack(b_q_weight, perm, size_k, size_n, num_bits, is_a_8bit)
    qw = torch.ops._C.gptq_marlin_repack(packed.t().contiguous(), empty, k, n, 4, False)
    return qw, marlin_permute_scales(scales)


def marlin_fn(
    x: torch.Tensor, qw: torch.Tensor, s: torch.Tensor, n: int, k: int, workspace: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """y = x @ W^T through marlin_gemm, as vLLM's apply_gptq_marlin_linear calls it (no
    act-order, no zero points, fp32 reduce on, atomic add off)."""
    empty = torch.empty(0, dtype=torch.int32, device=x.device)
    m = x.shape[0]

    def call() -> torch.Tensor:
        # fmt: off
        # _C::marlin_gemm(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros,
        #   g_idx, perm, workspace, b_type_id, size_m, size_n, size_k, is_k_full,
        #   use_atomic_add, use_fp32_reduce, is_zp_float)
        return torch.ops._C.marlin_gemm(x, None, qw, None, s, None, None, empty, empty, empty,
                                        workspace, UINT4B8_ID, m, n, k, True, False, True, False)
        # fmt: on

    return call


def marlin_workspace(device: torch.device) -> torch.Tensor:
    """vLLM's marlin_make_workspace_new: one int32 lock per SM."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(sms, dtype=torch.int32, device=device)


def machete_weights(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed [N, K/8] -> Machete's prepacked B (GPTQ [K/8, N] in column-major order)."""
    # _C::machete_prepack_B(B, a_type, b_type, group_scales_type)
    return torch.ops._C.machete_prepack_B(packed.t(), dtype, UINT4B8_ID, dtype)


def machete_fn(x: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> Callable[[], torch.Tensor]:
    """y = x @ W^T through machete_mm with group scales [K/128, N] (default schedule)."""

    def call() -> torch.Tensor:
        # _C::machete_mm(A, B, b_type, out_type, group_scales, group_zeros, group_size,
        #   channel_scales, token_scales, schedule)
        return torch.ops._C.machete_mm(x, b, UINT4B8_ID, None, s, None, GROUP, None, None, None)

    return call


def machete_supported() -> str | None:
    """None if Machete can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"Machete is sm90 only (this GPU is sm_{cap[0]}{cap[1]})"
    if not hasattr(torch.ops._C, "machete_mm"):
        return "torch.ops._C.machete_mm is missing from the loaded vLLM library"
    return None
