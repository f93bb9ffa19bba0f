// SPDX-License-Identifier: Apache-2.0
// kbit::dequantize_tiled: runtime tiled layout (qweight int32 [Np*Kp*bits/32], absmax uint8
// [Np*Kp/32]) -> W[n, k] row-major fp16/bf16/fp32, bit-identical to reference.dequantize_tiled.
// The large-M path of kbit::linear (this, then cuBLAS), so it must run at memory bandwidth.
//
// Expected performance (H100 SXM, 28672 x 4096, fp16 out, k = 4): per 16x128 tile the kernel
// reads k * 256 + 64 bytes and writes 4096, 297 MB in all: ~100 us at ~3 TB/s. At 3 TB/s an
// SM must retire a tile every ~400 cycles (5.2 KB at ~13 B/cycle/SM); one tile is ~640 SASS
// instructions per warp for k = 4 (~690 for k = 5, sm_90), ~350 of them on the integer pipe
// (transpose and bit extraction: ~175 cycles at 2 warp-instructions/cycle/SM), 80 shuffles
// (codebook lookups + transpose), 72 FMULs, 32 pack conversions: under half of the budget,
// so the kernel is memory-bound for every k and dtype. Loads: one coalesced 8-byte load per
// lane and plane plus two 4-byte absmax loads, all issued up front. Stores: 16 bytes per
// lane, 64 contiguous bytes per row and quad (full 32-byte sectors). 8 warps per CTA, one
// tile each, 40-48 registers (5-6 CTAs per SM): far more loads in flight than the ~5 KB per
// SM that Little's law asks for at this bandwidth.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <type_traits>

#include "kbit_format.cuh"
#include "ops.h"

namespace kbit {
namespace {

constexpr int kWarpsPerCta = 8;
constexpr unsigned kFullMask = 0xffffffffu;

// A tile byte of lane (g, t) holds, in bits (2p, 2p + 1), columns 8p + 2t + {0, 1} of its
// block: column pairs strided by 8. To write 8 *consecutive* outputs (one 16-byte store) lane
// t needs columns 8t + 0..7, i.e. unit t of every byte of all 4 lanes of its quad. This swaps
// the 2-bit unit index p with the quad lane index t (a 4x4 transpose, applied to all 4 bytes
// of a word at once) in two butterfly stages s = 1, 2: each lane keeps the units whose bit s
// equals its own lane bit s and takes the others from lane t ^ s. The sender rotates its word
// so the partner's units land in place (rotate, not shift: the bits that wrap around are the
// ones the receiver masks off). Afterwards bit e of each byte is column 8t + e.
__device__ __forceinline__ uint32_t quad_transpose(uint32_t v, int t) {
#pragma unroll
    for (int s = 1; s <= 2; s <<= 1) {
        const uint32_t m = s == 1 ? 0xCCCCCCCCu : 0xF0F0F0F0u;  // units p with p & s
        const bool upper = t & s;
        // The lower lane (t & s == 0) takes the partner's units p (p & s == 0) into p + s: up
        // by 2s bits; the upper lane takes units p + s into p: down by 2s bits (rotl 32 - 2s).
        const uint32_t send = __funnelshift_l(v, v, upper ? 2 * s : 32 - 2 * s);
        const uint32_t recv = __shfl_xor_sync(kFullMask, send, s);
        const uint32_t keep = upper ? m : ~m;
        v = (v & keep) | (recv & ~keep);
    }
    return v;
}

// 8 consecutive outputs, rounded to nearest like torch's .to(dtype): one 16-byte store
// (two for fp32). dst is 16-byte aligned: the column is a multiple of 8 and k of 32.
__device__ __forceinline__ void store8(__half* dst, const float (&v)[8]) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(pack2<false>(v[0], v[1]), pack2<false>(v[2], v[3]),
                                                pack2<false>(v[4], v[5]), pack2<false>(v[6], v[7]));
}
__device__ __forceinline__ void store8(__nv_bfloat16* dst, const float (&v)[8]) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(pack2<true>(v[0], v[1]), pack2<true>(v[2], v[3]),
                                                pack2<true>(v[4], v[5]), pack2<true>(v[6], v[7]));
}
__device__ __forceinline__ void store8(float* dst, const float (&v)[8]) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// One warp per tile (the tiled order, N-tile-major); lane l = 4g + t outputs rows
// 16 nt + g (h = 0) and 16 nt + 8 + g (h = 1), columns 32b + 8t + 0..7 of each block b.
template <typename T, int BITS>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
dequantize_tiled_kernel(const uint2* __restrict__ qweight, const uint32_t* __restrict__ absmax,
                        const float* __restrict__ codebook, T* __restrict__ out, int64_t n,
                        int64_t k, int k_tiles, int n_tiles_total) {
    const int tile = blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
    if (tile >= n_tiles_total) return;  // warp-uniform: the shuffles below see full warps
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    // Every load up front so their latencies overlap: the lane's 8 bytes of each plane
    // (256 contiguous bytes per warp) and the 4 absmax bytes (blocks 0-3) of its two rows.
    uint2 p[BITS];
#pragma unroll
    for (int j = 0; j < BITS; ++j) p[j] = __ldg(qweight + (int64_t{tile} * BITS + j) * 32 + lane);
    const uint32_t amax[2] = {__ldg(absmax + int64_t{tile} * 16 + g),
                              __ldg(absmax + int64_t{tile} * 16 + 8 + g)};
    // Codebook in lane registers, looked up with a shuffle by code (lane i holds entry i).
    const float cb = cb_value(codebook, lane & ((1 << BITS) - 1));

    const int64_t nt = tile / k_tiles, kc = tile % k_tiles;
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // 32-bit word w of each plane: bytes of blocks 2w, 2w + 1
        uint32_t plane[BITS];
#pragma unroll
        for (int j = 0; j < BITS; ++j) plane[j] = quad_transpose(w ? p[j].y : p[j].x, t);
        // code[e], byte x: the code of column 8t + e in byte x of the word (block 2w + x / 2,
        // row half x % 2), all 4 bytes at once: bit e of each byte of plane j moved to bit j.
        uint32_t code[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            code[e] = 0;
#pragma unroll
            for (int j = 0; j < BITS; ++j)
                code[e] |= (j >= e ? plane[j] << (j - e) : plane[j] >> (e - j)) & (0x01010101u << j);
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const int b = 2 * w + (x >> 1), h = x & 1;
            const float scale = e4m4_to_float((amax[h] >> (8 * b)) & 0xFFu);
            float v[8];
            // __shfl_sync reads its source lane modulo 32, i.e. only the low 5 bits of
            // code >> 8x: exactly this byte's code (< 2^BITS, the byte's upper bits are 0).
#pragma unroll
            for (int e = 0; e < 8; ++e)
                v[e] = __fmul_rn(__shfl_sync(kFullMask, cb, code[e] >> (8 * x)), scale);
            const int64_t row = nt * kTileN + 8 * h + g, col = kc * kTileK + kBlock * b;
            if (row < n && col < k) store8(out + row * k + col + 8 * t, v);  // k % 32 == 0
        }
    }
}

}  // namespace

at::Tensor dequantize_tiled(const at::Tensor& qweight, const at::Tensor& absmax,
                            const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                            at::ScalarType dtype) {
    const TiledShape s = check_tiled(qweight, absmax, bits, n, k, "dequantize_tiled");
    check_codebook(codebook, bits, "dequantize_tiled");
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
                     "kbit::dequantize_tiled: dtype must be float16, bfloat16 or float32, got ",
                     dtype);
    TORCH_CHECK(qweight.device() == absmax.device() && codebook.device() == qweight.device(),
                "kbit::dequantize_tiled: qweight, weight_absmax and codebook are on different "
                "devices");
    const c10::cuda::CUDAGuard guard(qweight.device());
    at::Tensor out = at::empty({n, k}, qweight.options().dtype(dtype));
    const int64_t tiles = s.n_tiles * s.k_tiles;
    TORCH_CHECK(tiles < (int64_t{1} << 31) - kWarpsPerCta, "kbit::dequantize_tiled: weight too large");
    const auto* q = reinterpret_cast<const uint2*>(qweight.data_ptr<int32_t>());
    const auto* a = reinterpret_cast<const uint32_t*>(absmax.data_ptr<uint8_t>());
    const float* cb = codebook.data_ptr<float>();
    const int grid = static_cast<int>(ceil_div(tiles, kWarpsPerCta));
    const int kt = static_cast<int>(s.k_tiles), total = static_cast<int>(tiles);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

    auto launch = [&](auto* tag, auto bits_c) {
        using T = std::remove_pointer_t<decltype(tag)>;
        dequantize_tiled_kernel<T, decltype(bits_c)::value><<<grid, kWarpsPerCta * 32, 0, stream>>>(
            q, a, cb, reinterpret_cast<T*>(out.data_ptr()), n, k, kt, total);
    };
    auto launch_bits = [&](auto* tag) {
        switch (bits) {
            case 2: launch(tag, std::integral_constant<int, 2>{}); break;
            case 3: launch(tag, std::integral_constant<int, 3>{}); break;
            case 4: launch(tag, std::integral_constant<int, 4>{}); break;
            default: launch(tag, std::integral_constant<int, 5>{}); break;
        }
    };
    if (dtype == at::kHalf) launch_bits(static_cast<__half*>(nullptr));
    else if (dtype == at::kBFloat16) launch_bits(static_cast<__nv_bfloat16*>(nullptr));
    else launch_bits(static_cast<float*>(nullptr));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}

}  // namespace kbit
