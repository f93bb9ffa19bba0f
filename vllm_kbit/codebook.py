# SPDX-License-Identifier: Apache-2.0
"""Codebook fitting and quality helpers.

``fit_codebook(k)`` regenerates ``vllm_kbit.format.default_codebook(k)``: a weighted
Lloyd-Max fit to block-normalised N(0, 1) weights. Per block of 32 samples the stored
scale is the E4M4-rounded absmax ``q``; the quantizer sees ``v = w / q`` and its error
in weight space is ``q * (v - cb[code])``, so each sample's squared error is weighted
by ``q^2``. ``nf_codebook(k)`` is the earlier symmetric normal-float codebook.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import torch

from .format import BLOCKSIZE, check_bits
from .reference import e4m4_decode, e4m4_encode


def fit_codebook(bits: int, n: int = 1 << 22, seed: int = 0, iters: int = 200) -> torch.Tensor:
    """Weighted Lloyd-Max codebook for block-normalised N(0, 1) weights (float32, sorted).

    ``n`` samples (numpy ``default_rng(seed).standard_normal``, float64 cast to float32) in blocks of 32, absmax E4M4-encoded
    and decoded, ``v = w / q`` weighted by ``q^2``; initialised at the quantiles of ``v``
    at (i + 0.5) / 2^k, then ``iters`` rounds of midpoint / weighted-centroid updates;
    finally symmetrised ``(cb - cb.flip(0)) / 2`` and clipped to [-1, 1].
    """
    check_bits(bits)
    if n < BLOCKSIZE or n % BLOCKSIZE:
        raise ValueError(f"kbit: n must be a positive multiple of {BLOCKSIZE}, got {n}")
    w = np.random.default_rng(seed).standard_normal(n).astype(np.float32).reshape(-1, BLOCKSIZE)
    amax = torch.from_numpy(np.abs(w).max(1))
    q = e4m4_decode(e4m4_encode(amax)).numpy()
    v = (w / q[:, None]).ravel()
    wt = np.repeat(q.astype(np.float64) ** 2, BLOCKSIZE)
    order = np.argsort(v, kind="stable")
    v, wt = v[order].astype(np.float64), wt[order]
    # Prefix sums make each Lloyd step O(2^k log n): a cell is a contiguous range of sorted v.
    cum_w = np.concatenate([[0.0], np.cumsum(wt)])
    cum_wv = np.concatenate([[0.0], np.cumsum(wt * v)])
    size = 2**bits
    cb = np.quantile(v, (np.arange(size) + 0.5) / size)
    for _ in range(iters):
        mids = (cb[:-1] + cb[1:]) * 0.5
        edges = np.concatenate([[0], np.searchsorted(v, mids, side="right"), [v.size]])
        mass = cum_w[edges[1:]] - cum_w[edges[:-1]]
        total = cum_wv[edges[1:]] - cum_wv[edges[:-1]]
        cb = np.where(mass > 0, total / np.maximum(mass, 1e-300), cb)
    cb = torch.from_numpy(cb).float()
    return ((cb - cb.flip(0)) / 2).clamp(-1.0, 1.0)


def nf_codebook(bits: int) -> torch.Tensor:
    """The earlier symmetric normal-float codebook: N(0, 1) quantiles at (i + 0.5) / 2^k,
    scaled so the largest entry is 1 (float32, sorted)."""
    check_bits(bits)
    size = 2**bits
    qs = [NormalDist().inv_cdf((i + 0.5) / size) for i in range(size)]
    return torch.tensor([x / qs[-1] for x in qs], dtype=torch.float32)


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum x^2 / sum (x - y)^2).

    ``inf`` when the two are equal (including all-zero tensors).
    """
    x = reference.double()
    err = float((x - approx.to(device=x.device, dtype=torch.float64)).pow(2).sum())
    sig = float(x.pow(2).sum())
    if err == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / err)
