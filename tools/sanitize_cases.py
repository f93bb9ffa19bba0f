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


def fused_cases() -> None:
    # kbit::linear_add_rms_norm / linear_silu_mul: the GEMV with the op in its x staging (M <= 8,
    # single and split-K, the residual written by group 0's CTAs) and the separate kernels (M > 8)
    # K = 4096 at M = 1: 512 prologue jobs, one per thread (the single-job form)
    for bits in BITS:
        cb = default_codebook(bits).to(dev)
        for n, k in ((17, 4128), (1000, 96), (48, 4096), (4096, 14336)):
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


# `fused`: only these cases (the fused ops' prologues)
if "fused" in sys.argv[1:]:
    fused_cases()
    print("sanitize cases ok (fused)")
    sys.exit(0)

for bits in BITS:
    cb = default_codebook(bits).to(dev)
    for n, k in ((17, 4128), (1000, 96), (8, 32)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        q, a = K_OPS.quantize(w, cb, bits)
        q_ref, a_ref = ref.quantize(w.cpu(), bits)
        assert torch.equal(q.cpu(), q_ref) and torch.equal(a.cpu(), a_ref), "quantize"
        qt, at = K_OPS.repack(q, a, bits)
        w_deq = K_OPS.dequantize_tiled(qt, at, cb, bits, n, k, torch.float16)
        assert torch.equal(w_deq.cpu(), ref.dequantize(q_ref, a_ref, cb.cpu(), bits)), "dequant"
        for dtype in DTYPES:
            for m in MS:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                want = x.float() @ w_deq.float().t()
                paths = ["gemv", "mma", "dequant"] if m <= 8 else ["mma", "dequant"]
                for path in paths:
                    os.environ["KBIT_FORCE_KERNEL"] = path
                    y = K_OPS.linear(x, qt, at, cb, bits, n).float()
                    err = ((y - want).norm() / want.norm()).item()
                    assert err < 2e-2, f"{path} bits={bits} n={n} k={k} m={m} {dtype}: rel err {err}"
os.environ.pop("KBIT_FORCE_KERNEL", None)


def check_op(what: str, shapes: tuple, ms: tuple, op: str = "mma") -> None:
    """kbit::mma (or kbit::``op``), as the KBIT_* environment selects it, against x @ the
    dequantized W."""
    for bits in BITS:
        cb = default_codebook(bits).to(dev)
        for n, k in shapes:
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            qt, at = K_OPS.repack(*K_OPS.quantize(w, cb, bits), bits)
            w_deq = K_OPS.dequantize_tiled(qt, at, cb, bits, n, k, torch.float16).float()
            for dtype in DTYPES:
                for m in ms:
                    x = torch.randn(m, k, device=dev, dtype=dtype)
                    want = x.float() @ w_deq.t()
                    y = getattr(K_OPS, op)(x, qt, at, cb, bits, n).float()
                    err = ((y - want).norm() / want.norm()).item()
                    assert err < 2e-2, f"{what} bits={bits} n={n} k={k} m={m} {dtype}: rel err {err}"


# the GEMV with units of two n-tiles (KBIT_GEMV_PAIR=1: wherever n_tiles is even; by default k=2,
# M <= 4, large layers): one pair, 3 pairs (split-K: too few units for the SMs), runs across pairs,
# odd n_tiles (single), x too large for one CTA at M=8 (split-K)
os.environ["KBIT_GEMV_PAIR"] = "1"
check_op("gemv pairs", ((34, 4128), (96, 4128), (1040, 96), (4096, 14336)), (1, 3, 8), op="gemv")
os.environ.pop("KBIT_GEMV_PAIR")


# stream-K of kbit::mma (KBIT_MMA_STREAMK=1, M = 17..64): CTAs whose runs cross n-tile groups, the
# partial tiles and flags between them, a last group of 3 n-tiles, a K tail
os.environ["KBIT_MMA_STREAMK"] = "1"
check_op("stream-K", ((4144, 1024), (1000, 4128)), (17, 64))
os.environ.pop("KBIT_MMA_STREAMK")

# the 64-token mma.sync kernel with 4 n-tiles per warp (KBIT_MMA_NT=4: 512-row CTAs, the default on
# big layers): a partial last 512-row group, K tails; its split-K (by shape) and stream-K
os.environ.update({"KBIT_MMA_NT": "4", "KBIT_MMA_WGMMA": "0"})
check_op("NT=4", ((520, 1056), (1000, 4128)), (33, 64))
os.environ["KBIT_MMA_STREAMK"] = "1"
check_op("NT=4 stream-K", ((1040, 2080),), (64,))
for var in ("KBIT_MMA_NT", "KBIT_MMA_WGMMA", "KBIT_MMA_STREAMK"):
    os.environ.pop(var)

# programmatic dependent launch is on by default (sm_90: the GEMV, the mma.sync kernel and the
# warp-specialized kernel copy their first weights before pdl_wait()), so every other section runs
# with it; this one runs the same kernels with it off (KBIT_PDL=0: plain launches, the whole
# prologue, x included, copied at once): direct, split-K, stream-K, warp-specialized
from vllm_kbit import _C

os.environ["KBIT_PDL"] = "0"
check_op("no PDL", ((17, 4128), (1000, 96), (4144, 1024)), (1, 17, 64), op="linear")
os.environ["KBIT_MMA_STREAMK"] = "1"
check_op("no PDL stream-K", ((4144, 1024),), (17, 64))
os.environ.pop("KBIT_MMA_STREAMK")
if getattr(_C, "sm90a", 0) == 1 and torch.cuda.get_device_capability() == (9, 0):
    os.environ["KBIT_MMA_WGMMA"] = "2"
    check_op("no PDL wgmma_gemm", ((17, 4128), (1000, 96)), (40, 64, 200))
    os.environ.pop("KBIT_MMA_WGMMA")
os.environ.pop("KBIT_PDL")

# the wgmma variant of kbit::mma (KBIT_MMA_WGMMA=1 takes it for M > 32 on sm_90a builds): both
# tile widths (M 64 -> TM 64, M 300 -> TM 128), a tail in N and K, every k in BITS
if getattr(_C, "sm90a", 0) == 1 and torch.cuda.get_device_capability() == (9, 0):
    os.environ["KBIT_MMA_WGMMA"] = "1"
    check_op("wgmma", ((17, 4128), (1000, 96)), (40, 300))
    os.environ.pop("KBIT_MMA_WGMMA")

    # the warp-specialized kernel (KBIT_MMA_WGMMA=2, csrc/wgmma_gemm.cu): every configuration
    # (KBIT_WGMMA_CONFIG 1..5, 4 = C1w 256 rows x 64 tokens, 5 = C2w 128 x 256; and C1w chosen by M through
    # KBIT_WGMMA_C1W=1), tails in N, K and M (tiles past n zero-filled by the weight boxes), and
    # split-K through the cluster (DSMEM) and workspace reductions. Not in the quick (racecheck)
    # run: its shared memory is written by TMA (and bulk copies in MoE) and read by wgmma (the
    # async proxy) and ordered by mbarriers, which
    # racecheck is not known to model [unverified]; memcheck covers its loads and stores.
    os.environ["KBIT_MMA_WGMMA"] = "2"
    for bits in () if QUICK else BITS:
        cb = default_codebook(bits).to(dev)
        for n, k in ((17, 4128), (1000, 96), (300, 640)):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            qt, at = K_OPS.repack(*K_OPS.quantize(w, cb, bits), bits)
            w_deq = K_OPS.dequantize_tiled(qt, at, cb, bits, n, k, torch.float16).float()
            for dtype in DTYPES:
                for config, m, env in (("1", 40, {}), ("2", 100, {"KBIT_MMA_SPLITS": "3", "KBIT_MMA_FORCE_CLUSTER": "1"}),
                                       ("3", 300, {"KBIT_MMA_SPLITS": "2", "KBIT_MMA_NO_CLUSTER": "1"}),
                                       ("3", 65, {}), ("4", 40, {}),
                                       ("4", 64, {"KBIT_MMA_SPLITS": "3", "KBIT_MMA_FORCE_CLUSTER": "1"}),
                                       ("4", 17, {"KBIT_MMA_SPLITS": "2", "KBIT_MMA_NO_CLUSTER": "1"}),
                                       ("5", 300, {"KBIT_MMA_SPLITS": "3", "KBIT_MMA_FORCE_CLUSTER": "1"}),
                                       ("5", 129, {"KBIT_MMA_SPLITS": "2", "KBIT_MMA_NO_CLUSTER": "1"}),
                                       ("", 200, {}),
                                       # "": no forced configuration (empty = unset), by M
                                       ("", 64, {"KBIT_WGMMA_C1W": "1"}),
                                       # 4 A-register sets (64-token tiles), workspace split-K
                                       ("4", 64, {"KBIT_WG_ABUFS": "4", "KBIT_MMA_SPLITS": "3", "KBIT_MMA_NO_CLUSTER": "1"}),
                                       ("1", 33, {"KBIT_WG_ABUFS": "4"})):  # fmt: skip
                    os.environ.update(env, KBIT_WGMMA_CONFIG=config)
                    x = torch.randn(m, k, device=dev, dtype=dtype)
                    want = x.float() @ w_deq.t()
                    y = K_OPS.mma(x, qt, at, cb, bits, n).float()
                    err = ((y - want).norm() / want.norm()).item()
                    assert err < 2e-2, (f"wgmma_gemm config {config} {env} bits={bits} n={n} k={k} "
                                        f"m={m} {dtype}: rel err {err}")  # fmt: skip
                    for var in (*env, "KBIT_WGMMA_CONFIG"):
                        os.environ.pop(var)
    os.environ.pop("KBIT_MMA_WGMMA")

fused_cases()

# kbit::moe: the GEMV decode path, in-CTA routing and the routing kernels, the wgmma path (sm_90),
# cluster / workspace split-K, per-slot rows and atomics, an expert map with -1, a partial
# column group (I = 96) and k-tile (H = 160).
# (skipped under KBIT_MOE_REFERENCE=1, where kbit::moe is the reference on CUDA)
if hasattr(K_OPS, "moe") and "moe" not in getattr(ops, "_cuda_reference_ops", ["moe"]):
    from vllm_kbit import reference_moe

    E, H, I = 8, 160, 96
    for bits in BITS:
        cb = default_codebook(bits).to(dev)
        exp = []
        for n, k in ((2 * I, H), (H, I)):
            qa = [K_OPS.repack(*K_OPS.quantize(torch.randn(n, k, device=dev) * 0.05, cb, bits), bits)
                  for _ in range(E)]
            exp += [torch.stack([q for q, _ in qa]), torch.stack([a for _, a in qa])]
        emap = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, 6, 7], dtype=torch.int32, device=dev)
        for dtype in DTYPES:
            # T <= 16 takes atomics by default; DETERMINISTIC keeps the cluster / workspace
            # split-K reductions covered there
            det = {"KBIT_MOE_DETERMINISTIC": "1"}
            grouped = {"KBIT_MOE_GEMV_MAX_SLOTS": "0"}  # else T * topk <= 16 takes the GEMV
            gemv = {"KBIT_MOE_GEMV_MAX_SLOTS": "64"}
            for t, topk, env in ((1, 2, gemv), (3, 2, gemv), (8, 8, gemv), (1, 2, grouped),
                                 (3, 2, {"KBIT_MOE_SPLITS": "2", **det, **grouped}),
                                 (5, 2, {"KBIT_MOE_SPLITS": "2", "KBIT_MOE_NO_CLUSTER": "1",
                                         **det, **grouped}),
                                 (150, 2, {}), (40, 8, {"KBIT_MOE_ATOMIC": "1"}),
                                 (64, 1, {"KBIT_MOE_TM": "64"}),
                                 # the sm_90 grouped wgmma path (elsewhere: the grouped kernels),
                                 # every token tile and narrowed width, per-slot rows and atomics
                                 (3, 2, {"KBIT_MOE_WGMMA": "1", **grouped}),
                                 (300, 2, {"KBIT_MOE_WGMMA": "1", "KBIT_MOE_WG_TN": "128", **det}),
                                 (300, 4, {"KBIT_MOE_WGMMA": "1"}),
                                 # its weights as one bulk copy per tile instead of 2 TMA boxes
                                 (300, 2, {"KBIT_MOE_WGMMA": "1", "KBIT_WG_TILE_COPIES": "1"}),
                                 (40, 2, {"KBIT_MOE_WGMMA": "1", "KBIT_MOE_WG_TN": "256"}),
                                 (2100, 2, {}),  # > 4096 slots: the multi-CTA routing
                                 (600, 2, {"KBIT_MOE_WGMMA": "1", "KBIT_MOE_WG_TN": "256",
                                           "KBIT_MOE_ATOMIC": "1"})):
                for k, v in env.items():
                    os.environ[k] = v
                x = torch.randn(t, H, device=dev, dtype=dtype)
                tw = torch.rand(t, topk, device=dev)
                ids = torch.randint(0, 10, (t, topk), device=dev, dtype=torch.int32)
                y = K_OPS.moe(x, *exp[:2], *exp[2:], cb, tw, ids, emap, bits, I, "silu", False)
                want = reference_moe.moe_tiled(x, *exp[:2], *exp[2:], cb, tw, ids, emap, bits, I,
                                               "silu", False)
                err = ((y.float() - want.float()).norm() / want.float().norm().clamp_min(1e-9)).item()
                assert err < 2e-2, f"moe bits={bits} t={t} {env} {dtype}: rel err {err}"
                for k in env:
                    os.environ.pop(k)
torch.cuda.synchronize()
print("sanitize cases ok")
