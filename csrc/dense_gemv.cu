// SPDX-License-Identifier: Apache-2.0
// kbit::dense_linear: y[M, n] = x[M, K] @ W^T for an UNQUANTIZED fp16 / bf16 weight W[n, K]:
// a streaming GEMV for decode batches (M <= 4), at::linear (cuBLAS) for anything else. The
// plugin serves vLLM's lm_head with it where kbit leaves the lm_head unquantized (the default):
// at batch 1 the Llama-3 lm_head (128256 x 4096 fp16, 1.05 GB) is a quarter of what a k=2 decode
// step reads, and cuBLAS's GEMV kernel streams it at ~2.8 TB/s of the H100's 3.35.
//
// Design:
//  * Every warp owns a contiguous range of R-row groups (ranges differ by at most one group, so
//    an SM's share of the matrix is the same within R rows) and reads its rows over all of K.
//  * A step loads, per lane, 16 B at U column chunks of 256 (32 lanes x 8 values) from each of
//    the R rows, all loads issued before the first use. No register ring across steps: ptxas
//    waits for global loads on one scoreboard, so the first use of a ring slot would also wait
//    for the slots loaded after it (gemv.cuh, main loop). The latency is hidden by the SM's other
//    warps instead: 100-124 registers give 2 CTAs of 8 warps per SM, 16 x R x U x 512 B =
//    64-128 KB in flight per SM, where HBM needs ~25-40 KB (3.35 TB/s / 132 SMs x ~1-1.5 us).
//  * R, U per M (H100, 4 lm_head shapes x fp16/bf16, mean time vs cuBLAS over the 8 points,
//    benchmarks/results/dense_head_h100_s41/): M=1 (R, U) = (8, 2) 0.935x [(4, 2) 0.948x,
//    (4, 4) 0.934x, (2, 4) 0.942x, (8, 1) 0.956x, (2, 2) 0.942x]; M=2 (8, 1) 0.937x [(4, 2)
//    0.955x, others 0.960-0.973x]; M = 3, 4 (4, 2), not varied.
//  * Weights bypass L1 (read once); x (M x K x 2 B, re-read by every warp) comes through L1.
//  * fp32 accumulation, one chain per (row, token); per row group the 32 lanes' sums meet in a
//    butterfly of shuffles, and lane (r * M + m) writes y[m, row + r].
#include <type_traits>

#include "kbit_format.cuh"
#include "ops.h"

namespace kbit {
namespace {

constexpr int kDlWarps = 8;
constexpr int kDlThreads = kDlWarps * 32;
constexpr int kDlChunk = 256;  // columns of one warp-wide 16-byte load
// M <= 4 only: on an H100 (benchmarks/results/dense_head_h100_s41/) the first version, (R, U) =
// (4, 2) for every M, took 0.92-0.99x cuBLAS's time at M = 1, 2, 4 on 7 lm_head shapes but
// 1.01-1.10x at M = 8.
constexpr int kDlMaxM = 4;
constexpr int kDlRows = 4;     // R: rows per group (default; M = 1, 2 pick their own)
constexpr int kDlChunks = 2;   // U: column chunks per step

__device__ __forceinline__ uint4 ld_weight16(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// acc + the dot product of 8 weights and 8 x values, both packed in a uint4.
template <bool BF16>
__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
    const uint32_t wa[4] = {w.x, w.y, w.z, w.w}, xa[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 a = unpack2<BF16>(wa[i]), b = unpack2<BF16>(xa[i]);
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
    }
    return acc;
}

template <typename T, int M, int R = kDlRows, int U = kDlChunks>
__global__ void __launch_bounds__(kDlThreads, 2)
    dense_gemv_kernel(const T* __restrict__ x, int64_t sx, const T* __restrict__ w,
                      T* __restrict__ y, int n, int K) {
    constexpr bool BF16 = std::is_same_v<T, __nv_bfloat16>;
    const int lane = threadIdx.x & 31;
    const int64_t warps = int64_t{gridDim.x} * kDlWarps;
    const int64_t gw = int64_t{blockIdx.x} * kDlWarps + (threadIdx.x >> 5);
    const int64_t groups = (n + R - 1) / R;
    const int g_end = static_cast<int>((gw + 1) * groups / warps);
    const int steps = (K + kDlChunk * U - 1) / (kDlChunk * U);
    for (int g = static_cast<int>(gw * groups / warps); g < g_end; ++g) {
        const int row0 = g * R;
        const T* wr[R];
        bool row_ok[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            row_ok[r] = row0 + r < n;  // only the matrix's last group can be partial
            wr[r] = w + int64_t{row_ok[r] ? row0 + r : row0} * K + lane * 8;
        }
        float acc[R][M];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
        for (int s = 0; s < steps; ++s) {
            const int c0 = s * (kDlChunk * U) + lane * 8;  // this lane's first column
            uint4 wv[R][U];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int u = 0; u < U; ++u)
                    wv[r][u] = row_ok[r] && c0 + u * kDlChunk < K
                                   ? ld_weight16(wr[r] + s * (kDlChunk * U) + u * kDlChunk)
                                   : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * kDlChunk;
                if (c < K) {  // K % 8 == 0 (host): a lane's 8 columns are all in or all out
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + m * sx + c));
#pragma unroll
                        for (int r = 0; r < R; ++r) acc[r][m] = dot8<BF16>(wv[r][u], xv, acc[r][m]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float v = warp_sum(acc[r][m]);
                if (lane == r * M + m && row_ok[r]) y[int64_t{m} * n + row0 + r] = T(v);
            }
    }
}

// Resident CTAs per SM of one instantiation (its registers decide: 2 or 3), asked once.
template <typename T, int M, int R, int U>
int dense_gemv_ctas_per_sm() {
    static const int v = [] {
        int b = 0;
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &b, dense_gemv_kernel<T, M, R, U>, kDlThreads, 0));
        return std::max(b, 1);
    }();
    return v;
}

template <typename T, int M, int R = kDlRows, int U = kDlChunks>
void launch_dense_gemv(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
    const int64_t n = w.size(0), K = w.size(1);
    const int64_t full =
        int64_t{device_sms(x.get_device())} * dense_gemv_ctas_per_sm<T, M, R, U>();
    const int grid = static_cast<int>(std::min(full, ceil_div(ceil_div(n, R), kDlWarps)));
    dense_gemv_kernel<T, M, R, U><<<grid, kDlThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const T*>(x.data_ptr()), x.stride(0),
        reinterpret_cast<const T*>(w.data_ptr()), reinterpret_cast<T*>(y.data_ptr()),
        static_cast<int>(n), static_cast<int>(K));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dense_gemv_dispatch(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
    switch (x.size(0)) {
        case 1: return launch_dense_gemv<T, 1, 8, 2>(x, w, y);
        case 2: return launch_dense_gemv<T, 2, 8, 1>(x, w, y);
        case 3: return launch_dense_gemv<T, 3>(x, w, y);
        default: return launch_dense_gemv<T, 4>(x, w, y);
    }
}

}  // namespace

bool dense_gemv_takes(const at::Tensor& x, const at::Tensor& weight) {
    const int64_t M = x.size(0), n = weight.size(0), K = weight.size(1);
    return M >= 1 && M <= kDlMaxM && K % 8 == 0 && x.stride(1) == 1 && rows_aligned16(x) &&
           weight.is_contiguous() && aligned(weight, 16) &&
           // row0 + r and a lane's columns (up to K + 4 chunks) stay in int for every (R, U)
           n < (int64_t{1} << 31) - 64 && K < (int64_t{1} << 31) - 4 * kDlChunk &&
           env_int("KBIT_DENSE_GEMV", 1) != 0;
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, "kbit::dense_linear: x must be a 2-D CUDA tensor, got ",
                x.sizes());
    TORCH_CHECK(weight.dim() == 2, "kbit::dense_linear: weight must be 2-D [n, K], got ",
                weight.sizes());
    TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
                "kbit::dense_linear: x must be float16 or bfloat16, got ", x.scalar_type());
    TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "kbit::dense_linear: weight (",
                weight.scalar_type(), ") and x (", x.scalar_type(), ") must have one dtype");
    TORCH_CHECK(weight.size(1) == x.size(1), "kbit::dense_linear: x has K=", x.size(1),
                " columns, weight ", weight.sizes(), " has ", weight.size(1));
    TORCH_CHECK(weight.device() == x.device(), "kbit::dense_linear: x and weight are on different "
                "devices (", x.device(), ", ", weight.device(), ")");
    if (x.size(0) == 0 || !dense_gemv_takes(x, weight)) return at::linear(x, weight);
    const c10::cuda::CUDAGuard guard(x.device());
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    if (x.scalar_type() == at::kHalf) dense_gemv_dispatch<__half>(x, weight, y);
    else dense_gemv_dispatch<__nv_bfloat16>(x, weight, y);
    return y;
}

}  // namespace kbit
