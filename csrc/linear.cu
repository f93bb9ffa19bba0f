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

// Path choice from the H100 runs of benchmarks/bench_linear.py (benchmarks/results/
// bench_linear_h100.md), the same for every k:
// - gemv up to M=8: one weight pass, no token-tile padding; it wins 6-7 of the 8 Llama shapes
//   at M=8 and loses the others by <= 3%.
// - mma while the k-bit read saving beats dequantize + cuBLAS, whose fixed cost is one
//   k-bit read plus one 16-bit write and read of W (~110 us for 8B gate_up). Small layers hit
//   that crossover first (8B o_proj, 16.8M weights: M=64 dequant 24.8 vs mma 26.8 us) and
//   K-heavy ones last (8B down_proj at M=256: mma 104.8 vs dequant 115.7 us).
constexpr int64_t kGemvMaxM = 8;

// Above M=4 at k=5 the gemv's 128 KB pair table leaves too little shared memory to stage
// x for very wide layers (70B gate_up, M=8: gemv 290 vs mma 169 us); mma serves those.
bool use_gemv(int64_t m, int64_t n, int64_t bits) {
    if (m <= 4) return true;
    return m <= kGemvMaxM && !(bits == 5 && n >= 16384);
}

bool use_mma(int64_t m, int64_t n, int64_t k) {
    const int64_t weights = n * k;
    // Up to M = 64 mma wins on every Llama-3.1 8B / 70B layer since split-K stopped packing
    // clusters into extra waves (8B o_proj, M = 64: 16.8 vs 25 us for dequant + cuBLAS;
    // benchmarks/results/bench_linear_h100__s6_cluster.md).
    if (m <= 64) return true;
    if (m <= 128) return weights >= (int64_t{32} << 20);
    // Up to M = 256, mma also wins on K-heavy layers and, through its wgmma variant on sm_90a
    // builds (mma.cu, use_wgmma), on very wide ones (70B gate_up, M = 256: 718 vs 793 us).
    if (m <= 256) return (k >= 8192 && n <= 8192) || n >= 32768;
    return false;
}

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

bool linear_uses_gemv(int64_t m, int64_t n, int64_t bits) {
    const Path path = forced_path();
    return path == Path::kAuto ? use_gemv(m, n, bits) : path == Path::kGemv && m <= kGemvMaxM;
}

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
        // On sm_90 GPUs kbit::mma's warp-specialized kernel wins over dequantize + cuBLAS for
        // 64 < M <= 256, and up to M = 1024 on big layers (512 at k=5), and over mma.sync for
        // 32 < M <= 64 on small layers (mma.cu, wgmma2_by_default); elsewhere the mma.sync kernel
        // by shape.
        path = use_gemv(m, n, bits)                                      ? Path::kGemv
               : use_mma(m, n, k) || wgmma2_by_default(x, m, n, bits) ? Path::kMma
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
