# SPDX-License-Identifier: Apache-2.0
"""Diagnostic (session 24): would prefetching the next layer's k-bit weights into L2 while the GPU
runs kernels that read little from HBM (attention, norms at batch 1; here a clock-spin kernel of
T us on every SM) make the next GEMV faster? Per 8B layer shape and k, a CUDA graph over weight
copies (> 3x L2) of
    [spin(T)] + kbit::linear(x[1, K], W_i)   against   [prefetch(W_i), spin(T)] + kbit::linear(...)
timed as the median us per iteration over 20 replays. prefetch issues cp.async.bulk.prefetch.L2
(sm_90) in 64 KB chunks from 66 CTAs. Needs an sm_90 GPU and the built extension; writes
$OUT/l2_prefetch_h100_s24.json. Result (H100): every iteration with the prefetch kernel took 12-18 us
longer, spin or not (benchmarks/results/l2_prefetch_h100_s24.md).
"""
import json
import os
import statistics

import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from timing import capture_graph, copies_needed, l2_cache_bytes

import vllm_kbit._ops as ops
from vllm_kbit.format import default_codebook
assert ops.load() == "compiled"
K = torch.ops.kbit
src = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
__global__ void spin_k(long long cycles) {
  long long t0 = clock64(); while (clock64() - t0 < cycles) {}
}
__global__ void pf_k(const char* p, long long bytes, int chunk) {
  long long i = (long long)(blockIdx.x * blockDim.x + threadIdx.x) * chunk;
  for (; i < bytes; i += (long long)gridDim.x * blockDim.x * chunk) {
    long long n = bytes - i < chunk ? bytes - i : chunk;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + i), "r"((unsigned)n) : "memory");
  }
}
void spin(long long cycles, int64_t sms) { spin_k<<<sms, 32, 0, c10::cuda::getCurrentCUDAStream()>>>(cycles); }
void prefetch(torch::Tensor t, int64_t chunk, int64_t blocks) {
  pf_k<<<blocks, 32, 0, c10::cuda::getCurrentCUDAStream()>>>((const char*)t.data_ptr(), t.numel() * t.element_size(), (int)chunk);
}
'''
m = load_inline("l2pf", cpp_sources="void spin(long long, int64_t); void prefetch(torch::Tensor, int64_t, int64_t);",
                cuda_sources=src, functions=["spin", "prefetch"], extra_cuda_cflags=["-arch=sm_90a", "-O3"], verbose=False)
SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336)}
SMS = torch.cuda.get_device_properties(0).multi_processor_count  # spin on every SM
rows = []
for bits in (2, 4):
    cb = default_codebook(bits).cuda()
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        q, a = K.quantize(w, cb, bits)
        qt, at = K.repack(q, a, bits)
        nbytes = qt.numel() * qt.element_size() + at.numel()
        copies = max(2, copies_needed(nbytes, l2_cache_bytes()))  # >= 3x L2
        W = [(qt.clone(), at.clone()) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        for spin_us in (0, 8, 16):
            cyc = int(spin_us * 1.755e3)  # the H100 SM clock under load, ~1.755 GHz
            res = {}
            for mode in ("none", "pf"):
                def body():
                    for qq, aa in W:
                        if mode == "pf":
                            m.prefetch(qq, 65536, 66)
                            m.prefetch(aa, 65536, 2)
                        if spin_us: m.spin(cyc, SMS)
                        K.linear(x, qq, aa, cb, bits, n)
                g = capture_graph([body])  # after one warm-up pass
                ts = []
                for _ in range(25):
                    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
                    s.record(); g.replay(); e.record(); e.synchronize()
                    ts.append(s.elapsed_time(e) * 1e3 / copies)
                res[mode] = statistics.median(ts[5:])
            r = dict(shape=name, bits=bits, mbytes=round(nbytes / 2**20, 1), spin_us=spin_us, **{f"{k_}_us": round(v, 2) for k_, v in res.items()})
            r["gain_us"] = round(res["none"] - res["pf"], 2)
            rows.append(r); print(json.dumps(r), flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(f"{out}/l2_prefetch_h100_s24.json", "w"), indent=1)
