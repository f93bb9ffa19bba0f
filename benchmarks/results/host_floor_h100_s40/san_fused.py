# SPDX-License-Identifier: Apache-2.0
"""A representative, small set of calls of every kbit CUDA op, for compute-sanitizer
(memcheck, racecheck): every k, both dtypes, awkward shapes (tails in N, K and M), every
path of kbit::linear. Also checks each result against the reference so a run that
'passes' the sanitizer also computed the right thing."""

import os
import sys

import torch

import vllm_kbit._ops as ops
from vllm_kbit import reference as ref
from vllm_kbit.format import default_codebook

assert ops.load() == "compiled", "vllm_kbit._C is not built"
K_OPS = torch.ops.kbit
torch.manual_seed(0)
dev = "cuda"
QUICK = "quick" in sys.argv[1:]  # racecheck is slow: fewer cases, every kernel still covered
BITS = (3, 5) if QUICK else (2, 3, 4, 5)
DTYPES = (torch.float16,) if QUICK else (torch.float16, torch.bfloat16)
MS = (1, 17, 300) if QUICK else (1, 3, 5, 17, 64, 300)
# kbit::linear_add_rms_norm / linear_silu_mul: the GEMV with the op in its x staging (M <= 8,
# single and split-K, the residual written by group 0's CTAs) and the separate kernels (M > 8)
for bits in BITS:
    cb = default_codebook(bits).to(dev)
    for n, k in ((17, 4128), (1000, 96), (4096, 14336)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        qt, at = K_OPS.repack(*K_OPS.quantize(w, cb, bits), bits)
        for dtype in DTYPES:
            nw = torch.rand(k, device=dev, dtype=dtype) + 0.5
            for m in (1, 8, 17) if k < 14336 else (1, 8):
                x, r = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(m, k, device=dev, dtype=dtype)
                y, r_out = K_OPS.linear_add_rms_norm(x, r, nw, 1e-5, qt, at, cb, bits, n)
                xn, r_ref = ref.add_rms_norm(x, r, nw, 1e-5)
                want = K_OPS.linear(xn, qt, at, cb, bits, n).float()
                err = ((y.float() - want).norm() / want.norm()).item()
                assert torch.equal(r_out, r_ref) and err < 2e-2, f"add_rms_norm {bits} {n} {k} {m}: {err}"
                h = torch.randn(m, 2 * k, device=dev, dtype=dtype)
                want = K_OPS.linear(ref.silu_mul(h), qt, at, cb, bits, n).float()
                err = ((K_OPS.linear_silu_mul(h, qt, at, cb, bits, n).float() - want).norm()
                       / want.norm()).item()  # fmt: skip
                assert err < 2e-2, f"silu_mul {bits} {n} {k} {m}: {err}"

print("fused sanitize cases ok")
