# SPDX-License-Identifier: Apache-2.0
"""Pure-PyTorch reference of every kbit op: the executable spec (``docs/format.md``),
the oracle of the CUDA kernels' tests, and the CPU fallback of the plugin.

Tensors (one quantized linear weight ``W[N, K]``, K % 32 == 0, KB = K // 32):
  checkpoint layout: ``qweight`` int32 [N, KB * bits], ``absmax`` uint8 [N, KB] (E4M4)
  runtime (tiled) layout: ``qweight`` int32 [Np * Kp * bits / 32], ``absmax`` uint8
      [Np * Kp / 32], with Np = ceil(N / 16) * 16 and Kp = ceil(K / 128) * 128.
Everything runs on any device; big tensors are processed in row chunks to bound memory.
"""

from __future__ import annotations

import sys

import torch

from .format import (
    BLOCKS_PER_TILE,
    BLOCKSIZE,
    E4M4_BIAS,
    E4M4_MAX,
    TILE_K,
    TILE_N,
    check_bits,
    check_codebook,
    default_codebook,
)

if sys.byteorder != "little":  # int32 <-> 4 x uint8 views below assume little-endian words
    raise ImportError("vllm_kbit.reference requires a little-endian machine")

_CHUNK_ELEMS = 1 << 22  # elements per row chunk: keeps temporaries to a few hundred MB


# ----------------------------------------------------------------------------- E4M4


def e4m4_values(device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 E4M4 values, float32, ascending with the code (code c -> value)."""
    c = torch.arange(256, dtype=torch.int32, device=device)
    e, m = c >> 4, (c & 15).float()
    normal = torch.exp2((e - E4M4_BIAS).float()) * (1 + m / 16)
    subnormal = m * 2.0 ** (1 - E4M4_BIAS - 4)
    return torch.where(e == 0, subnormal, normal)


def e4m4_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M4 codes -> float32 values."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"kbit: E4M4 codes must be uint8, got {codes.dtype}")
    return e4m4_values(codes.device)[codes.long()]


def e4m4_encode(values: torch.Tensor) -> torch.Tensor:
    """Non-negative floats -> nearest E4M4 code (ties to the larger value), uint8.

    Values above the largest code saturate to 31.0; callers check the range first.
    """
    table = e4m4_values(values.device)
    mids = (table[:-1] + table[1:]) * 0.5  # exact in float32
    return torch.bucketize(values.float(), mids, right=True).to(torch.uint8)


# ------------------------------------------------------------------- bit planes


def pack_bitplanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [..., 32] -> int32 [..., bits]: word j holds bit j of the 32 codes,
    lane i of the block in bit i."""
    if codes.shape[-1] != BLOCKSIZE:
        raise ValueError(f"kbit: pack_bitplanes needs a last dim of {BLOCKSIZE}, got {codes.shape}")
    shifts = torch.arange(8, dtype=torch.uint8, device=codes.device)
    c = codes.to(torch.uint8).unflatten(-1, (4, 8))  # [..., byte, bit-in-byte]
    planes = [(((c >> j) & 1) << shifts).sum(-1, dtype=torch.uint8) for j in range(bits)]
    return torch.stack(planes, -2).contiguous().view(torch.int32).squeeze(-1)


def unpack_bitplanes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., bits] -> codes uint8 [..., 32] (inverse of ``pack_bitplanes``)."""
    if words.dtype != torch.int32 or words.shape[-1] != bits:
        raise ValueError(f"kbit: unpack_bitplanes needs int32 [..., {bits}], got {words.dtype} "
                         f"{tuple(words.shape)}")  # fmt: skip
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    b = words.contiguous().unsqueeze(-1).view(torch.uint8)  # [..., bits, 4]
    lanes = ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [..., bits, 32]
    weights = (1 << torch.arange(bits, dtype=torch.uint8, device=words.device)).view(bits, 1)
    return (lanes * weights).sum(-2, dtype=torch.uint8)


# --------------------------------------------------------------- quantization


def codebook_midpoints(codebook: torch.Tensor) -> torch.Tensor:
    """Decision thresholds between neighbouring entries, float32 (the kernels use the same)."""
    cb = codebook.float()
    return (cb[:-1] + cb[1:]) * 0.5


def _resolve_codebook(codebook: torch.Tensor | None, bits: int, device: torch.device) -> torch.Tensor:
    cb = default_codebook(bits) if codebook is None else check_codebook(codebook, bits)
    return cb.to(device)


def _check_weight(weight: torch.Tensor, name: str) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"kbit: {name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"kbit: {name} must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"kbit: {name} must be float16, bfloat16 or float32, got {weight.dtype}")
    if weight.shape[1] % BLOCKSIZE:
        raise ValueError(f"kbit: {name} has in_features={weight.shape[1]}, not a multiple of "
                         f"{BLOCKSIZE}; leave it unquantized")  # fmt: skip


def _row_chunks(n: int, k: int):
    step = max(1, _CHUNK_ELEMS // max(k, 1))
    for r in range(0, n, step):
        yield r, min(n, r + step)


def quantize(weight: torch.Tensor, bits: int, codebook: torch.Tensor | None = None,
             name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """W[N, K] float -> (qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]).

    Per block of 32: absmax = max|w| encoded to E4M4 (nearest); q = decoded absmax;
    v = w / q (0 where q == 0); code = index of the nearest codebook entry to v
    (count of midpoints strictly below v, so ties go to the lower entry).
    Raises ValueError naming ``name`` for non-finite weights or blocks with absmax > 31.
    """
    check_bits(bits)
    _check_weight(weight, name)
    n, k = weight.shape
    kb = k // BLOCKSIZE
    cb = _resolve_codebook(codebook, bits, weight.device)
    mids = codebook_midpoints(cb)
    qweight = torch.empty(n, kb * bits, dtype=torch.int32, device=weight.device)
    absmax = torch.empty(n, kb, dtype=torch.uint8, device=weight.device)
    for r0, r1 in _row_chunks(n, k):
        blocks = weight[r0:r1].float().view(r1 - r0, kb, BLOCKSIZE)
        amax = blocks.abs().amax(-1)
        _check_range(amax, name, r0)
        acode = e4m4_encode(amax)
        q = e4m4_decode(acode).unsqueeze(-1)
        v = torch.where(q > 0, blocks / q, torch.zeros_like(blocks))
        codes = torch.bucketize(v, mids, right=False).to(torch.uint8)
        qweight[r0:r1] = pack_bitplanes(codes, bits).view(r1 - r0, kb * bits)
        absmax[r0:r1] = acode
    return qweight, absmax


def _check_range(amax: torch.Tensor, name: str, row0: int) -> None:
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        r, b = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"kbit: {name} has non-finite values (first at row {row0 + r}, "
                         f"columns {b * BLOCKSIZE}..{b * BLOCKSIZE + 31}); it cannot be quantized")  # fmt: skip
    over = amax > E4M4_MAX
    if bool(over.any()):
        r, b = (int(i) for i in over.nonzero()[0])
        raise ValueError(
            f"kbit: {name} has {int(over.sum())} block(s) with absmax above {E4M4_MAX} (the E4M4 "
            f"maximum), e.g. {float(amax[r, b]):g} at row {row0 + r}, columns {b * BLOCKSIZE}.."
            f"{b * BLOCKSIZE + 31}; leave this module unquantized (modules_to_not_convert / --skip)"
        )


def _check_quantized(qweight: torch.Tensor, absmax: torch.Tensor, bits: int) -> tuple[int, int]:
    check_bits(bits)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"kbit: qweight must be 2-D int32, got {qweight.dtype} {tuple(qweight.shape)}")
    if absmax.dtype != torch.uint8 or absmax.dim() != 2:
        raise ValueError(f"kbit: weight_absmax must be 2-D uint8, got {absmax.dtype} "
                         f"{tuple(absmax.shape)}")  # fmt: skip
    n, kb = absmax.shape
    if tuple(qweight.shape) != (n, kb * bits):
        raise ValueError(f"kbit: qweight shape {tuple(qweight.shape)} does not match weight_absmax "
                         f"{tuple(absmax.shape)} at bits={bits} (expected {(n, kb * bits)})")  # fmt: skip
    return n, kb * BLOCKSIZE


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight int32 [N, KB*bits] -> codes uint8 [N, KB*32]."""
    n = qweight.shape[0]
    return unpack_bitplanes(qweight.view(n, -1, bits), bits).view(n, -1)


def dequantize(qweight: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float16) -> torch.Tensor:  # fmt: skip
    """-> W[N, K] in ``dtype``: codebook[code] * absmax, computed in float32, then rounded."""
    n, k = _check_quantized(qweight, absmax, bits)
    cb = check_codebook(codebook, bits).to(qweight.device)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    for r0, r1 in _row_chunks(n, k):
        codes = unpack_codes(qweight[r0:r1], bits).view(r1 - r0, -1, BLOCKSIZE)
        scale = e4m4_decode(absmax[r0:r1]).unsqueeze(-1)
        out[r0:r1] = (cb[codes.long()] * scale).view(r1 - r0, k).to(dtype)
    return out


def linear(x: torch.Tensor, qweight: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
           bits: int) -> torch.Tensor:  # fmt: skip
    """x[..., K] @ dequantize(W)^T -> [..., N] in x.dtype (fp32 accumulation)."""
    w = dequantize(qweight, absmax, codebook, bits, dtype=x.dtype)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"kbit: x has {x.shape[-1]} features, weight expects {w.shape[1]}")
    return dense_linear(x, w)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """kbit::dense_linear: x[..., K] @ weight^T for an unquantized weight [n, K] (the lm_head that
    kbit leaves unquantized), fp32 accumulation, in x.dtype. The quantized linears are this of
    their dequantized weight."""
    return (x.float() @ weight.float().t()).to(x.dtype)


# ------------------------------------------------------- runtime (tiled) layout
#
# Tile (nt, kc) = rows [16 nt, 16 nt + 16) x columns [128 kc, 128 kc + 128): 4 blocks.
# Stored tile-major, K-tiles of one N-tile contiguous: qweight[nt][kc][plane j][lane][8 bytes],
# absmax[nt][kc][row r][block b]. Lane l holds, per plane and per block b, 2 bytes
# (byte 2b + h): row 16 nt + 8h + l // 4, and in bit e the element at column
# COLS[l % 4][e] of the block -- exactly the A fragment of mma.m16n8k16 for two k16 steps.


def _tile_cols(device: torch.device) -> torch.Tensor:
    t = torch.arange(4, device=device).view(4, 1)
    e = torch.tensor([0, 1, 8, 9, 16, 17, 24, 25], device=device).view(1, 8)
    return 2 * t + e  # [t, e] -> column within the 32-block


def tiled_shape(n: int, k: int, bits: int) -> tuple[int, int, int, int]:
    """(Np, Kp, qweight words, absmax bytes) of the runtime layout of W[n, k]."""
    np_, kp = -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K
    return np_, kp, np_ * kp * bits // 32, np_ * kp // 32


def repack(qweight: torch.Tensor, absmax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint layout -> runtime tiled layout (run once at load). Padding rows and blocks
    get code 0 and absmax 0, so they dequantize to exactly 0."""
    n, k = _check_quantized(qweight, absmax, bits)
    np_, kp, _, _ = tiled_shape(n, k, bits)
    nt, kc, dev = np_ // TILE_N, kp // TILE_K, qweight.device
    codes = torch.zeros(np_, kp, dtype=torch.uint8, device=dev)
    codes[:n, :k] = unpack_codes(qweight, bits)
    amax = torch.zeros(np_, kp // BLOCKSIZE, dtype=torch.uint8, device=dev)
    amax[:n, : k // BLOCKSIZE] = absmax
    # codes[(nt, h, g), (kc, b, col)] -> [nt, h, g, kc, b, t, e]
    c = codes.view(nt, 2, 8, kc, BLOCKS_PER_TILE, BLOCKSIZE)[..., _tile_cols(dev)]
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    planes = torch.stack([(((c >> j) & 1) << shifts).sum(-1, dtype=torch.uint8)
                          for j in range(bits)], -1)  # [nt, h, g, kc, b, t, j]  # fmt: skip
    q = planes.permute(0, 3, 6, 2, 5, 4, 1)  # [nt, kc, j, g, t, b, h]
    qt = q.contiguous().reshape(-1).view(torch.int32)
    at = amax.view(nt, TILE_N, kc, BLOCKS_PER_TILE).permute(0, 2, 1, 3).contiguous().reshape(-1)
    return qt, at


def _check_tiled(qt: torch.Tensor, at: torch.Tensor, bits: int, n: int, k: int) -> tuple[int, int]:
    check_bits(bits)
    if n <= 0 or k <= 0 or k % BLOCKSIZE:
        raise ValueError(f"kbit: bad tiled weight size n={n}, k={k} (k must be a multiple of 32)")
    np_, kp, words, nbytes = tiled_shape(n, k, bits)
    if qt.dtype != torch.int32 or qt.numel() != words:
        raise ValueError(f"kbit: tiled qweight must be int32 with {words} elements for n={n}, k={k}, "
                         f"bits={bits}; got {qt.dtype} with {qt.numel()}")  # fmt: skip
    if at.dtype != torch.uint8 or at.numel() != nbytes:
        raise ValueError(f"kbit: tiled weight_absmax must be uint8 with {nbytes} elements for n={n}, "
                         f"k={k}; got {at.dtype} with {at.numel()}")  # fmt: skip
    return np_, kp


def unrepack(qt: torch.Tensor, at: torch.Tensor, bits: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Runtime tiled layout -> checkpoint layout (inverse of ``repack``)."""
    np_, kp = _check_tiled(qt, at, bits, n, k)
    nt, kc, dev = np_ // TILE_N, kp // TILE_K, qt.device
    q = qt.contiguous().view(torch.uint8).view(nt, kc, bits, 8, 4, BLOCKS_PER_TILE, 2)
    bitsel = ((q.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=dev)) & 1)
    weights = (1 << torch.arange(bits, dtype=torch.uint8, device=dev)).view(bits, 1, 1, 1, 1, 1)
    cte = (bitsel * weights).sum(2, dtype=torch.uint8)  # [nt, kc, g, t, b, h, e]
    codes = torch.empty(nt, 2, 8, kc, BLOCKS_PER_TILE, BLOCKSIZE, dtype=torch.uint8, device=dev)
    codes[..., _tile_cols(dev)] = cte.permute(0, 5, 2, 1, 4, 3, 6)  # [nt, h, g, kc, b, t, e]
    codes = codes.view(np_, kp)[:n, :k].reshape(n, k // BLOCKSIZE, BLOCKSIZE)
    qweight = pack_bitplanes(codes, bits).reshape(n, -1)
    amax = at.view(nt, kc, TILE_N, BLOCKS_PER_TILE).permute(0, 2, 1, 3).reshape(np_, -1)
    return qweight, amax[:n, : k // BLOCKSIZE].contiguous()


def dequantize_tiled(qt: torch.Tensor, at: torch.Tensor, codebook: torch.Tensor, bits: int, n: int,
                     k: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:  # fmt: skip
    """Runtime tiled layout -> W[n, k] in ``dtype`` (same values as ``dequantize``)."""
    qweight, absmax = unrepack(qt, at, bits, n, k)
    return dequantize(qweight, absmax, codebook, bits, dtype)


def linear_tiled(x: torch.Tensor, qt: torch.Tensor, at: torch.Tensor, codebook: torch.Tensor,
                 bits: int, n: int) -> torch.Tensor:  # fmt: skip
    """The op the plugin calls: x[..., K] @ W^T with W in the runtime layout."""
    w = dequantize_tiled(qt, at, codebook, bits, n, x.shape[-1], dtype=x.dtype)
    return dense_linear(x, w)


# ------------------------------------------------ fused input ops (kbit::linear_*)
#
# The elementwise op before a linear layer in vLLM's decoder layers, folded into the layer
# (vllm_kbit/fusion.py rewrites the compiled graph). Rounding follows vLLM 0.26 exactly:
# fused_add_rms_norm (vllm/ir/ops/layernorm.py) and SiluAndMul.forward_native.


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(rms_norm(x + residual) * weight, x + residual), the sum in fp32 and rounded once."""
    v = x.float() + residual.float()
    variance = v.pow(2).mean(dim=-1, keepdim=True)
    out = (v * torch.rsqrt(variance + eps)).to(weight.dtype) * weight
    return out.to(x.dtype), v.to(x.dtype)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(h[..., :d]) * h[..., d:], each rounded to h.dtype (d = h.shape[-1] // 2)."""
    d = h.shape[-1] // 2
    return torch.nn.functional.silu(h[..., :d]) * h[..., d:]


def linear_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, qt: torch.Tensor, at: torch.Tensor, codebook: torch.Tensor,
                        bits: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """kbit::linear_add_rms_norm: (linear_tiled(normed), x + residual)."""
    xn, res = add_rms_norm(x, residual, norm_weight, eps)
    return linear_tiled(xn, qt, at, codebook, bits, n), res


def linear_silu_mul(h: torch.Tensor, qt: torch.Tensor, at: torch.Tensor, codebook: torch.Tensor,
                    bits: int, n: int) -> torch.Tensor:  # fmt: skip
    """kbit::linear_silu_mul: linear_tiled(silu_mul(h)), h = [M, 2K] (gate, up)."""
    return linear_tiled(silu_mul(h), qt, at, codebook, bits, n)
