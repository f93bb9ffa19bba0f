// SPDX-License-Identifier: Apache-2.0
// kbit::repack: checkpoint layout (qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]) ->
// runtime tiled layout (qweight int32 [Np*Kp*bits/32], absmax uint8 [Np*Kp/32]); exactly
// reference.repack, padding rows and blocks included (code 0, absmax 0). Load-time op.
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

// The tile byte of lane t (= lane % 4) from one checkpoint plane word of a block: bit e of
// the byte is bit col(t, e) = 2t + (e & 1) + 8 (e >> 1) of the word, i.e. after a shift by
// 2t the bit pairs (0,1), (8,9), (16,17), (24,25) packed together.
__device__ __forceinline__ uint32_t tile_byte(uint32_t word, int t) {
    const uint32_t x = word >> (2 * t);
    return (x & 0x3u) | ((x >> 6) & 0xCu) | ((x >> 12) & 0x30u) | ((x >> 18) & 0xC0u);
}

// One warp per tile (nt, kc) (the tiled order: N-tile-major), lane l = 4g + t. Per plane j
// the lane builds its 8 bytes (byte 2b + h = block b, row 16 nt + 8h + g) and the warp stores
// the plane's 256 contiguous bytes with one coalesced 8-byte store per lane. Reads are
// 4-byte gathers (8 rows per warp, the 4 lanes of a quad share a word); the 4*bits words a
// lane reads per row are contiguous, so L1 serves most of them.
template <int BITS>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
repack_kernel(const uint32_t* __restrict__ qweight, const uint8_t* __restrict__ absmax,
              uint2* __restrict__ qtiled, uint16_t* __restrict__ atiled, int64_t n, int64_t kb,
              int k_tiles, int n_tiles_total) {
    const int tile = blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
    if (tile >= n_tiles_total) return;  // warp-uniform
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t nt = tile / k_tiles, kc = tile % k_tiles;

    uint32_t lo[BITS] = {}, hi[BITS] = {};  // bytes 0-3 (blocks 0, 1) and 4-7 (blocks 2, 3)
#pragma unroll
    for (int b = 0; b < kBlocksPerTile; ++b) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t row = nt * kTileN + 8 * h + g, blk = kc * kBlocksPerTile + b;
            const bool valid = row < n && blk < kb;  // else padding: code 0
            const uint32_t* src = qweight + (valid ? (row * kb + blk) * BITS : 0);
            const int shift = 8 * ((2 * b + h) & 3);
#pragma unroll
            for (int j = 0; j < BITS; ++j) {
                const uint32_t byte = valid ? tile_byte(src[j], t) : 0u;
                if (b < 2) lo[j] |= byte << shift; else hi[j] |= byte << shift;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < BITS; ++j)
        qtiled[(int64_t{tile} * BITS + j) * 32 + lane] = make_uint2(lo[j], hi[j]);

    // absmax tile: 64 bytes [row r < 16][block b < 4]; lane l writes bytes 2l, 2l + 1
    // (row l / 2, blocks 2 (l % 2) and 2 (l % 2) + 1) as one 2-byte store.
    const int64_t row = nt * kTileN + lane / 2, blk = kc * kBlocksPerTile + 2 * (lane & 1);
    const uint32_t a0 = row < n && blk < kb ? absmax[row * kb + blk] : 0u;
    const uint32_t a1 = row < n && blk + 1 < kb ? absmax[row * kb + blk + 1] : 0u;
    atiled[int64_t{tile} * 32 + lane] = static_cast<uint16_t>(a0 | (a1 << 8));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& qweight, const at::Tensor& absmax,
                                          int64_t bits) {
    check_bits(bits, "repack");
    TORCH_CHECK(absmax.is_cuda() && absmax.scalar_type() == at::kByte && absmax.dim() == 2,
                "kbit::repack: weight_absmax must be a 2-D CUDA uint8 tensor, got ",
                absmax.scalar_type(), " ", absmax.sizes());
    const int64_t n = absmax.size(0), kb = absmax.size(1);
    TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.dim() == 2 &&
                    qweight.size(0) == n && qweight.size(1) == kb * bits,
                "kbit::repack: qweight must be CUDA int32 [", n, ", ", kb * bits,
                "] to match weight_absmax ", absmax.sizes(), " at bits=", bits, ", got ",
                qweight.scalar_type(), " ", qweight.sizes());
    TORCH_CHECK(qweight.device() == absmax.device(),
                "kbit::repack: qweight and weight_absmax are on different devices");
    const c10::cuda::CUDAGuard guard(qweight.device());
    const TiledShape s(n, kb * kBlock, bits);
    at::Tensor qt = at::empty({s.words}, qweight.options());
    at::Tensor at_ = at::empty({s.absmax_bytes}, absmax.options());
    const int64_t tiles = s.n_tiles * s.k_tiles;
    if (tiles == 0) return {qt, at_};
    TORCH_CHECK(tiles < (int64_t{1} << 31) - kWarpsPerCta, "kbit::repack: weight too large");
    const at::Tensor q = qweight.contiguous(), a = absmax.contiguous();
    const auto* src_q = reinterpret_cast<const uint32_t*>(q.data_ptr<int32_t>());
    auto* dst_q = reinterpret_cast<uint2*>(qt.data_ptr<int32_t>());
    auto* dst_a = reinterpret_cast<uint16_t*>(at_.data_ptr<uint8_t>());
    const int grid = static_cast<int>(ceil_div(tiles, kWarpsPerCta));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int kt = static_cast<int>(s.k_tiles), total = static_cast<int>(tiles);
    auto launch = [&](auto bits_c) {
        repack_kernel<decltype(bits_c)::value><<<grid, kWarpsPerCta * 32, 0, stream>>>(
            src_q, a.data_ptr<uint8_t>(), dst_q, dst_a, n, kb, kt, total);
    };
    switch (bits) {
        case 2: launch(std::integral_constant<int, 2>{}); break;
        case 3: launch(std::integral_constant<int, 3>{}); break;
        case 4: launch(std::integral_constant<int, 4>{}); break;
        default: launch(std::integral_constant<int, 5>{}); break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {qt, at_};
}

}  // namespace kbit
