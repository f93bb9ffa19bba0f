// SPDX-License-Identifier: Apache-2.0
// kbit::linear: y[M, n] = x[M, K] @ W^T, x fp16/bf16 (unit stride along K), W[n, K] in the
// runtime tiled layout. Host-only dispatcher: gemv (small M), mma (mid M), or dequantize_tiled
// + cuBLAS (large M); KBIT_FORCE_KERNEL=gemv|mma|dequant overrides. (.cu: kbit_format.cuh.)
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <string_view>

#include "kbit_format.cuh"
#include "ops.h"

namespace kbit {
namespace {

enum class Path { kAuto, kGemv, kMma, kDequant };

// Largest M each fused kernel serves, per bits (index bits - 2), from the H100 runs of
// benchmarks/bench_linear.py (benchmarks/results/): gemv beats mma at every 8B shape up to
// M=4 (one weight pass, no token-tile padding); mma beats dequantize+cuBLAS on every 8B
// shape through M=64 (k=4 gate_up: 61 vs 202 us) and loses by M=256 (qkv: 79 vs 48 us),
// where the fp16 GEMM turns compute-bound and the 16-bit copy of W costs little next to it.
constexpr int64_t kGemvMaxM[4] = {4, 4, 4, 4};
constexpr int64_t kMmaMaxM[4] = {128, 128, 128, 128};

// Read per call (not cached) so tests and benchmarks can switch paths in one process.
Path forced_path() {
    const char* env = std::getenv("KBIT_FORCE_KERNEL");
    if (env == nullptr) return Path::kAuto;
    const std::string_view v(env);
    if (v.empty() || v == "auto") return Path::kAuto;
    if (v == "gemv") return Path::kGemv;
    if (v == "mma") return Path::kMma;
    TORCH_CHECK(v == "dequant", "kbit::linear: KBIT_FORCE_KERNEL='", v,
                "' is not one of gemv, mma, dequant, auto (or unset)");
    return Path::kDequant;
}

}  // namespace

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& absmax,
                  const at::Tensor& codebook, int64_t bits, int64_t n) {
    TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2,
                "kbit::linear: x must be a 2-D CUDA tensor [M, K], got ", x_in.sizes());
    const c10::cuda::CUDAGuard guard(x_in.device());
    // Every path takes any row stride (a slice of a wider activation is used as is; gemv and
    // mma copy rows that are not 16-byte aligned themselves) but needs unit stride along K:
    // only a transposed x is copied here.
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    check_activation(x, qweight, "linear");
    const int64_t m = x.size(0), k = x.size(1);
    check_tiled(qweight, absmax, bits, n, k, "linear");
    check_codebook(codebook, bits, "linear");
    TORCH_CHECK(codebook.device() == qweight.device(),
                "kbit::linear: codebook and qweight are on different devices");
    if (m == 0) return at::empty({0, n}, x.options());

    Path path = forced_path();
    if (path == Path::kAuto) {
        path = m <= kGemvMaxM[bits - 2] ? Path::kGemv
             : m <= kMmaMaxM[bits - 2]  ? Path::kMma
                                        : Path::kDequant;
    }
    switch (path) {
        case Path::kGemv: return gemv(x, qweight, absmax, codebook, bits, n);
        case Path::kMma: return mma(x, qweight, absmax, codebook, bits, n);
        default: {
            // The weight is read once as k bits and written + read once as 16 bits; at large M
            // that is small next to the GEMM, which cuBLAS runs at tensor-core peak.
            const at::Tensor w =
                dequantize_tiled(qweight, absmax, codebook, bits, n, k, x.scalar_type());
            return at::mm(x, w.t());
        }
    }
}

}  // namespace kbit
