// SPDX-License-Identifier: Apache-2.0
// Fragment dequantization on tensor cores, shared by the fused-dequant MMA kernels (mma.cu, moe.cu):
// a weight tile of the runtime layout (docs/format.md) is turned into mma.m16n8k16 A fragments in
// registers with one shared-memory table load per column pair, and multiplied with activations
// staged in shared memory (ldmatrix B fragments).
//
//  * Index words: per lane, the k bit planes of one 32-bit tile word are transposed in registers
//    (shift/lop3) so that the 2k bits of a column pair sit in one byte (k=5: 10 bits).
//  * Pair table: T[idx] = (cb[lo], cb[hi]) 2^S in fp16/bf16, lo/hi = the even/odd bits of idx.
//    Replicated `copies` times (entry i of lane l at word i*copies + l % copies) so that the 32
//    random lookups of a warp hit different banks.
//  * absmax: one HMUL2 multiplies the looked-up pair by the block's absmax (decoded from its
//    E4M4 bits with a shift). This rounds each weight once, to exactly the reference value
//    round(cb * absmax): codebooks are bf16-exact (8 significant bits, vllm_kbit/format.py) and
//    E4M4 has 5, so the product is exact before HMUL2's single rounding.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include <c10/cuda/CUDAException.h>

#include "kbit_format.cuh"
#include "wgmma.cuh"

namespace kbit {
namespace frag {

constexpr int kXRow = kTileK * 2 + 16;  // smem bytes per token row of an x tile: +16 B so that
                                        // the 8 rows of an ldmatrix hit 8 bank quads

// The CTA of a tile_step kernel: 8 warps, each owning kNT 16-row tiles (every x fragment feeds
// kNT MMAs), so one CTA covers kGroupTiles weight tiles = kGroupRows rows.
constexpr int kThreads = 256;
constexpr int kNT = 2;
// Weight tiles per CTA, and floats per token row of its epilogue tile (+4 so that the accumulator
// stores are conflict-free), for nt tiles per warp (mma.cu's 64-token kernel also runs nt = 4).
constexpr int group_tiles(int nt) { return kThreads / 32 * nt; }
constexpr int out_row_floats(int nt) { return group_tiles(nt) * kTileN + 4; }
constexpr int kGroupTiles = group_tiles(kNT);  // 16 tiles = 256 rows per CTA
constexpr int kGroupRows = kGroupTiles * kTileN;
constexpr int kOutRow = out_row_floats(kNT);
constexpr int kMaxSplits = 8;            // portable thread-block cluster size
constexpr int kMaxStages = 4;

// How the split-K partial sums of an output tile are combined. kStream (mma.cu only): stream-K,
// CTAs take equal runs of (tile, k-tile) units across tile boundaries.
enum Mode : int { kDirect = 0, kCluster = 1, kWorkspace = 2, kStream = 3 };

// Shared-memory bytes of one pipeline stage and of the epilogue tile (aliases the ring), for a
// CTA of 8 warps owning NT tiles each (mma.cu's 64-token kernel also runs NT = 4: 512 rows).
template <int BITS, int TM, int NT = kNT>
struct Layout {
    static constexpr int kTiles = group_tiles(NT);        // weight tiles per CTA
    static constexpr int kRows = kTiles * kTileN;         // output rows per CTA
    static constexpr int kOutRowF = out_row_floats(NT);   // floats per token of the epilogue tile
    static constexpr int kW = kTiles * BITS * 256;        // bit planes of the tiles
    static constexpr int kA = kTiles * 64;                // their absmax
    static constexpr int kStage = kW + kA + TM * kXRow;
    static constexpr int kOut = TM * kOutRowF * 4;
};

// threadIdx.x read once and kept in a register: under register pressure (mma.cu's 32- and
// 64-token tiles) the compiler otherwise re-reads it inside the k-tile loop (S2R, a variable-
// latency read the next instruction waits for: 6% of the stall samples of the 64-token kernel,
// benchmarks/results/ncu_mma_gate_up_m64_stalls_h100_s18.txt; 1-3% faster at M = 64,
// ab_thread_index_h100_s18.md). Volatile asm is never re-executed. Not used by moe.cu's grouped
// kernel (same A/B: Qwen3 k=2 M=16 -12% but M=64 +7%) nor wgmma_gemm.cuh (no change).
__device__ __forceinline__ int thread_index() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
    return t;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src-size 0 zero-fills without touching global memory.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Table lookup by 32-bit shared address (the smem base folded into the lane's base). Not
// volatile: the table is constant after the barrier that follows its construction.
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
    uint32_t v;
    asm("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

// Codebook entries are stored pre-multiplied by 2^S so that the absmax can be built from its
// E4M4 bits with one shift (absmax_pair): fp16 S = 4, bf16 S = 116 (exact power-of-two scalings
// of bf16-exact values).
template <bool BF16>
__device__ __forceinline__ uint16_t scaled_code(float v) {
    if constexpr (BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(v * 0x1p116f));
    else return __half_as_ushort(__float2half_rn(v * 16.0f));
}

// E4M4 (bias 11, IEEE-style subnormals) is an fp16 (bias 15) or bf16 (bias 127) number with the
// low mantissa bits zero: code c << 6 as fp16 bits = absmax / 16, c << 3 as bf16 = absmax / 2^116,
// subnormals included. From a row's 4 absmax bytes [c0 c1 c2 c3], returns the half2 pairs
// (c0, c2) (sel = 0) or (c1, c3) (sel = 1): 2 integer ops per 2 scales.
template <bool BF16>
__device__ __forceinline__ uint32_t absmax_pair(uint32_t a, int sel) {
    if constexpr (BF16) return (sel ? a >> 5 : a << 3) & 0x07F807F8u;
    else return (sel ? a >> 2 : a << 6) & 0x3FC03FC0u;
}

// v * broadcast(half `hi` of s): one HMUL2 whose second operand selects .H0_H0 / .H1_H1.
template <bool BF16>
__device__ __forceinline__ uint32_t mul_scale(uint32_t v, uint32_t s, bool hi) {
    uint32_t r;
    if constexpr (BF16) {
        const __nv_bfloat162 sv = *reinterpret_cast<const __nv_bfloat162*>(&s);
        const __nv_bfloat162 p = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                                         hi ? __high2bfloat162(sv) : __low2bfloat162(sv));
        r = *reinterpret_cast<const uint32_t*>(&p);
    } else {
        const __half2 sv = *reinterpret_cast<const __half2*>(&s);
        const __half2 p = __hmul2(*reinterpret_cast<const __half2*>(&v),
                                  hi ? __high2half2(sv) : __low2half2(sv));
        r = *reinterpret_cast<const uint32_t*>(&p);
    }
    return r;
}

// Index words of one lane and one 32-bit word of a tile (2 blocks x 2 row halves = 4 bytes q,
// each 4 column pairs p: bits 2p, 2p+1 of byte q are the columns 2p, 2p+1 of the A fragment
// order). Output: the 2k-bit pair index of (q, p) with plane j's two bits at bits 2j, 2j+1.
//  k=2: iw[p & 1], nibble 2q + p/2 (one stage of bit-field swaps).
//  k=3,4: iw[p], byte q (a 4x4 transpose of 2-bit fields: two stages of swaps, 16 ops/16 pairs).
//  k=5: as k=4 for planes 0-3; plane 4's bits are attached per lookup (pair_addr).
template <int BITS>
__device__ __forceinline__ void index_words(uint32_t (&iw)[5], const uint32_t (&pl)[BITS]) {
    if constexpr (BITS == 2) {
        iw[0] = (pl[0] & 0x33333333u) | ((pl[1] << 2) & 0xCCCCCCCCu);
        iw[1] = ((pl[0] >> 2) & 0x33333333u) | (pl[1] & 0xCCCCCCCCu);
    } else {
        const uint32_t a3 = BITS >= 4 ? pl[3] : 0u;
        const uint32_t b0 = (pl[0] & 0x0F0F0F0Fu) | ((pl[2] << 4) & 0xF0F0F0F0u);
        const uint32_t b2 = ((pl[0] >> 4) & 0x0F0F0F0Fu) | (pl[2] & 0xF0F0F0F0u);
        const uint32_t b1 = (pl[1] & 0x0F0F0F0Fu) | ((a3 << 4) & 0xF0F0F0F0u);
        const uint32_t b3 = ((pl[1] >> 4) & 0x0F0F0F0Fu) | (a3 & 0xF0F0F0F0u);
        iw[0] = (b0 & 0x33333333u) | ((b1 << 2) & 0xCCCCCCCCu);
        iw[1] = ((b0 >> 2) & 0x33333333u) | (b1 & 0xCCCCCCCCu);
        iw[2] = (b2 & 0x33333333u) | ((b3 << 2) & 0xCCCCCCCCu);
        iw[3] = ((b2 >> 2) & 0x33333333u) | (b3 & 0xCCCCCCCCu);
        if constexpr (BITS == 5) iw[4] = pl[4];
    }
}

// Shared address of this lane's copy of T[index of pair (q, p)]; `base` = table address +
// this lane's copy offset (64-byte aligned table).
template <int BITS>
__device__ __forceinline__ uint32_t pair_addr(const uint32_t (&iw)[5], int p, int q, uint32_t base,
                                              uint32_t stride) {
    if constexpr (BITS == 2) {  // 16 entries sit in 16 distinct banks: one copy, 4 idx | base
        const uint32_t d = iw[p & 1];
        const int nib = 2 * q + (p >> 1);
        return (nib == 0 ? (d << 2) & 0x3Cu : (d >> (4 * nib - 2)) & 0x3Cu) | base;
    } else if constexpr (BITS <= 4) {  // prmt: byte q, zero-extended
        return __byte_perm(iw[p], 0u, 0x4440u | q) * stride + base;
    } else {  // prmt: [byte q of iw[p], plane-4 bits of (q, p), 0, 0] = 10-bit index
        const uint32_t e = (iw[4] >> (16 * (q >> 1) + 2 * p)) & 0x0303u;
        return __byte_perm(iw[p], e, 0x6600u | ((4u + (q & 1)) << 4) | q) * stride + base;
    }
}

__device__ __forceinline__ uint32_t even_bits(uint32_t x) {  // bits 0,2,4,6,8 -> 0..4
    x &= 0x155u;
    x = (x | (x >> 1)) & 0x133u;
    x = (x | (x >> 2)) & 0x10Fu;
    return (x | (x >> 4)) & 0x1Fu;
}

// Builds the pair table at `tbl` (64-byte aligned) from cbh[2^BITS] (scaled_code values, in
// shared memory, visible to all threads): T[idx] = (cbh[lo], cbh[hi]), 2^copies_log2 copies.
// Consecutive threads write consecutive 16-byte groups of copies (conflict-free); 4 copies per
// store when copies >= 4, else one word per store. The caller synchronises before use.
template <int BITS>
__device__ __forceinline__ void build_pair_table(uint8_t* tbl, const uint16_t* cbh, int copies_log2,
                                                 int tid, int nthreads) {
    const int vec_log2 = copies_log2 >= 2 ? 2 : 0;
    const int stores = 1 << (2 * BITS + copies_log2 - vec_log2);
    for (int e = tid; e < stores; e += nthreads) {
        const uint32_t idx = static_cast<uint32_t>(e) << vec_log2 >> copies_log2;
        const uint32_t v =
            cbh[even_bits(idx)] | static_cast<uint32_t>(cbh[even_bits(idx >> 1)]) << 16;
        if (vec_log2 == 2) reinterpret_cast<uint4*>(tbl)[e] = make_uint4(v, v, v, v);
        else reinterpret_cast<uint32_t*>(tbl)[e] = v;
    }
}

// This lane's share of one weight tile in one k-tile: its 8 bytes of each bit plane (one
// coalesced 8-byte load per plane) and the absmax half2 pairs of its rows g and g + 8.
template <int BITS, bool BF16>
__device__ __forceinline__ void load_tile_frag(uint2 (&planes)[BITS], uint32_t (&sc)[2][2],
                                               const uint8_t* planes_s, const uint8_t* absmax_s,
                                               int lane) {
#pragma unroll
    for (int j = 0; j < BITS; ++j)
        planes[j] = *reinterpret_cast<const uint2*>(planes_s + j * 256 + lane * 8);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows g and g + 8: 4 bytes each (quad broadcast)
        const uint32_t a = *reinterpret_cast<const uint32_t*>(absmax_s + h * 32 + (lane >> 2) * 4);
        sc[h][0] = absmax_pair<BF16>(a, 0);  // [row half h][blocks (0,2) | (1,3)]
        sc[h][1] = absmax_pair<BF16>(a, 1);
    }
}

// Index words of plane word w (blocks 2w, 2w + 1) of a tile's planes (index_words).
template <int BITS>
__device__ __forceinline__ void tile_index_words(uint32_t (&iw)[5], const uint2 (&planes)[BITS],
                                                 int w) {
    uint32_t pl[BITS];
#pragma unroll
    for (int j = 0; j < BITS; ++j) pl[j] = w ? planes[j].y : planes[j].x;
    index_words<BITS>(iw, pl);
}

// The 4 A registers of k16 step kk (columns 16 kk .. 16 kk + 15 of the k-tile) of one tile,
// {row g, row g+8} x {cols 2t.., cols 2t+8..}: the mma.m16n8k16 A fragment, and the warp's slice
// of a wgmma m64 A operand. iw = the index words of plane word kk / 4; one table load and one
// HMUL2 per register. step_lookups + step_scale are its two halves: the wgmma kernel issues the
// loads of step kk + 1 while step kk's wgmma runs and writes the A registers only afterwards.
template <int BITS>
__device__ __forceinline__ void step_lookups(uint32_t (&v)[4], const uint32_t (&iw)[5], int kk,
                                             uint32_t tbl_lane, uint32_t stride) {
    const int b2 = (kk >> 1) & 1, s = kk & 1;  // block 2w + b2 = bytes q = 2 b2 + h
#pragma unroll
    for (int r = 0; r < 4; ++r)
        v[r] = lds32(pair_addr<BITS>(iw, 2 * s + (r >> 1), 2 * b2 + (r & 1), tbl_lane, stride));
}
template <bool BF16>
__device__ __forceinline__ void step_scale(uint32_t (&a)[4], const uint32_t (&v)[4],
                                           const uint32_t (&sc)[2][2], int kk) {
    const int w = kk >> 2, b2 = (kk >> 1) & 1;
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = mul_scale<BF16>(v[r], sc[r & 1][b2], w);
}
template <int BITS, bool BF16>
__device__ __forceinline__ void step_regs(uint32_t (&a)[4], const uint32_t (&iw)[5],
                                          const uint32_t (&sc)[2][2], int kk, uint32_t tbl_lane,
                                          uint32_t stride) {
    uint32_t v[4];
    step_lookups<BITS>(v, iw, kk, tbl_lane, stride);
    step_scale<BF16>(a, v, sc, kk);
}

// One k-tile (128 columns) of one warp owning NT consecutive 16-row tiles and TM tokens:
// NT x 8 k16 steps x TM/8 token fragments into acc.
//   planes_s: this warp's first tile's bit planes in shared memory (tile i at + i * BITS * 256);
//   absmax_s: its first tile's absmax (tile i at + i * 64);
//   x_lane: shared address of this lane's ldmatrix row of the x tile (k-tile column 0; token
//           rows kXRow bytes apart); WG: the x tile's shared address (wgmma.cuh layout);
//   tbl_lane / stride: this lane's table copy base and the entry stride (pair_addr).
// WG (sm_90a, wgmma.cuh): the 4 A registers of tile i feed one wgmma.m64nTMk16 of the warpgroup
// instead of TM/8 mma.sync; all 4 warps of a warpgroup must call it together.
template <int BITS, int TM, int NT, bool BF16, bool WG = false>
__device__ __forceinline__ void tile_step(float (&acc)[NT][TM / 8][4], const uint8_t* planes_s,
                                          const uint8_t* absmax_s, int lane, uint32_t tbl_lane,
                                          uint32_t stride, uint32_t x_lane) {
    uint2 planes[NT][BITS];  // this lane's 8 bytes of each plane: one coalesced 8-byte load
    uint32_t sc[NT][2][2];   // [tile][row half h][blocks (0,2) | (1,3)] absmax half2 pairs
#pragma unroll
    for (int i = 0; i < NT; ++i)
        load_tile_frag<BITS, BF16>(planes[i], sc[i], planes_s + i * BITS * 256, absmax_s + i * 64,
                                   lane);
    // WG: two sets of A registers. Step kk's wgmma runs asynchronously while step kk + 1's
    // fragments are dequantized into the other set; a set is rewritten only after the wait that
    // retires the wgmma reading it (wait_group 1 right after the next step's commit).
    uint32_t abuf[WG ? 2 : 1][NT][4];
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // plane word w = blocks 2w, 2w + 1
        uint32_t iw[NT][5];
#pragma unroll
        for (int i = 0; i < NT; ++i) tile_index_words<BITS>(iw[i], planes[i], w);
#pragma unroll
        for (int b2 = 0; b2 < 2; ++b2) {  // block 2w + b2 = bytes q = 2 b2 + h
#pragma unroll
            for (int s = 0; s < 2; ++s) {  // k16 step kk: columns 16 kk .. 16 kk + 15 of the tile
                const int kk = 4 * w + 2 * b2 + s;
                uint32_t(&a)[NT][4] = abuf[WG ? (kk & 1) : 0];
#pragma unroll
                for (int i = 0; i < NT; ++i)
                    step_regs<BITS, BF16>(a[i], iw[i], sc[i], kk, tbl_lane, stride);
                if constexpr (WG) {
                    wg_fence();
#pragma unroll
                    for (int i = 0; i < NT; ++i)
                        wgmma_rs<BF16, TM>(*reinterpret_cast<float(*)[TM / 2]>(&acc[i][0][0]), a[i],
                                           wg_desc(x_lane + kk * 2 * kWgLbo));
                    wg_commit();
                    wg_wait<1>();  // step kk - 1 is done: its A set is free for step kk + 1
                } else if constexpr (TM == 8) {
                    uint32_t b[2];
                    ldsm_x2(b, x_lane + kk * 32);
#pragma unroll
                    for (int i = 0; i < NT; ++i) mma_m16n8k16<BF16>(acc[i][0], a[i], b[0], b[1]);
                } else {
#pragma unroll
                    for (int f = 0; f < TM / 16; ++f) {  // tokens 16f .. 16f + 15: 2 B fragments
                        uint32_t b[4];
                        ldsm_x4(b, x_lane + f * 16 * kXRow + kk * 32);
#pragma unroll
                        for (int i = 0; i < NT; ++i) {
                            mma_m16n8k16<BF16>(acc[i][2 * f], a[i], b[0], b[1]);
                            mma_m16n8k16<BF16>(acc[i][2 * f + 1], a[i], b[2], b[3]);
                        }
                    }
                }
            }
        }
    }
    // The x slot read by the last wgmma is refilled after the caller's next barrier.
    if constexpr (WG) wg_wait<0>();
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {  // release/acquire: smem writes become visible
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n"
                 ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ float4 ld_dsmem(uint32_t local_addr, uint32_t rank) {
    uint32_t remote;
    float4 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                 : "=r"(remote)
                 : "r"(local_addr), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
    return v;
}
#endif

// Accumulators of warp `warp` (NT tiles) -> the epilogue tile out[token][row], out_row_floats(NT)
// floats per token row (c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8).
template <int TM, int NT = kNT>
__device__ __forceinline__ void store_acc_tile(float* out, const float (&acc)[NT][TM / 8][4],
                                               int warp, int lane) {
    constexpr int kRowF = out_row_floats(NT);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int f = 0; f < TM / 8; ++f) {
            const int row = (warp * NT + i) * kTileN + g, tok = f * 8 + 2 * t;
            out[tok * kRowF + row] = acc[i][f][0];
            out[(tok + 1) * kRowF + row] = acc[i][f][1];
            out[tok * kRowF + row + 8] = acc[i][f][2];
            out[(tok + 1) * kRowF + row + 8] = acc[i][f][3];
        }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Sum of the float4 at `local_addr` over the first `splits` CTAs of the cluster, in rank order
// (deterministic).
__device__ __forceinline__ float4 cluster_sum4(uint32_t local_addr, int splits) {
    float4 v = ld_dsmem(local_addr, 0);
    for (int src = 1; src < splits; ++src) {
        const float4 r = ld_dsmem(local_addr, src);
        v.x += r.x, v.y += r.y, v.z += r.z, v.w += r.w;
    }
    return v;
}
#endif

// ------------------------------------------------------- epilogue (mma.cu, wgmma_gemm.cu)

// 4 consecutive outputs (columns col..col+3 of token row `row`) in y's dtype.
template <bool BF16>
__device__ __forceinline__ void store_y(void* y, int row, int col, int n, float4 v) {
    if (col >= n) return;
    const uint2 o = make_uint2(pack2<BF16>(v.x, v.y), pack2<BF16>(v.z, v.w));
    uint16_t* dst = reinterpret_cast<uint16_t*>(y) + static_cast<int64_t>(row) * n + col;
    if ((n & 3) == 0) {  // 8-byte aligned: col % 4 == 0 and row * n % 4 == 0
        *reinterpret_cast<uint2*>(dst) = o;
    } else {
        dst[0] = static_cast<uint16_t>(o.x);
        if (col + 1 < n) dst[1] = static_cast<uint16_t>(o.x >> 16);
        if (col + 2 < n) dst[2] = static_cast<uint16_t>(o.y);
        if (col + 3 < n) dst[3] = static_cast<uint16_t>(o.y >> 16);
    }
}

// y[i] = v in y's dtype (round to nearest even).
template <bool BF16>
__device__ __forceinline__ void store_y1(void* y, int64_t i, float v) {
    if constexpr (BF16) static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v);
    else static_cast<__half*>(y)[i] = __float2half_rn(v);
}

__device__ __forceinline__ void store_ws(float* ws, int row, int col, int n, float4 v) {
    if (col >= n) return;
    float* dst = ws + static_cast<int64_t>(row) * n + col;
    if ((n & 3) == 0) {
        *reinterpret_cast<float4*>(dst) = v;
    } else {
        dst[0] = v.x;
        if (col + 1 < n) dst[1] = v.y;
        if (col + 2 < n) dst[2] = v.z;
        if (col + 3 < n) dst[3] = v.w;
    }
}

// y = sum over splits of ws[s] (fixed order s = 0, 1, ...: deterministic), cast to y's dtype.
// A thread takes 4 consecutive outputs (float4 partials where count % 4 == 0) and issues the loads
// of every split before the first add: the partials sit in L2, and one dependent L2 round trip
// per split made this kernel ~2 us per call at M = 64 (8B layers, 4-8 splits, H100). Launched with
// PDL after the GEMM (launch_splitk_reduce): it waits for the GEMM's partials in pdl_wait().
template <bool BF16>
__global__ void __launch_bounds__(256) splitk_reduce_kernel(const float* __restrict__ ws,
                                                            void* __restrict__ y, int64_t count,
                                                            int splits) {
    pdl_wait();
    const int64_t step = gridDim.x * int64_t{256}, units = ceil_div(count, 4);
    const bool vec = (count & 3) == 0;
    for (int64_t u = blockIdx.x * int64_t{256} + threadIdx.x; u < units; u += step) {
        const int64_t i = 4 * u;
        float4 part[kMaxSplits];
#pragma unroll
        for (int s = 0; s < kMaxSplits; ++s) {
            if (s >= splits) break;
            const float* src = ws + s * count + i;
            if (vec) {
                part[s] = *reinterpret_cast<const float4*>(src);
            } else {
                part[s].x = src[0];
                part[s].y = i + 1 < count ? src[1] : 0.f;
                part[s].z = i + 2 < count ? src[2] : 0.f;
                part[s].w = i + 3 < count ? src[3] : 0.f;
            }
        }
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < kMaxSplits; ++s) {
            if (s >= splits) break;
            v.x += part[s].x, v.y += part[s].y, v.z += part[s].z, v.w += part[s].w;
        }
        if (vec) {  // 8-byte aligned, as store_y assumes
            *reinterpret_cast<uint2*>(static_cast<uint16_t*>(y) + i) =
                make_uint2(pack2<BF16>(v.x, v.y), pack2<BF16>(v.z, v.w));
        } else {
            store_y1<BF16>(y, i, v.x);
            if (i + 1 < count) store_y1<BF16>(y, i + 1, v.y);
            if (i + 2 < count) store_y1<BF16>(y, i + 2, v.z);
            if (i + 3 < count) store_y1<BF16>(y, i + 3, v.w);
        }
    }
}

// ------------------------------------------------------------------- host (mma.cu, moe.cu)

// The split-K reduction of a kWorkspace GEMM launch (mma.cu, wgmma_gemm.cu): ws [splits, count]
// fp32 -> y. On sm_90 with PDL (`sm90`: the running SASS has griddepcontrol) it is launched while
// the GEMM drains: the GEMM calls pdl_trigger() after its k loop, and this kernel's pdl_wait()
// returns once the GEMM grid has finished and flushed its partials. That hides the launch gap of a
// second kernel per call. KBIT_MMA_NO_PDL=1: plain stream order (tuning hook).
template <bool BF16>
inline void launch_splitk_reduce(const float* ws, void* y, int64_t count, int splits, int64_t sms,
                                 bool sm90, cudaStream_t stream) {
    const bool pdl = sm90 && pdl_supported<splitk_reduce_kernel<BF16>>() &&
                     env_int("KBIT_MMA_NO_PDL", 0) == 0;
    const int blocks = static_cast<int>(std::min(ceil_div(ceil_div(count, 4), 256), sms * 4));
    launch_kernel(splitk_reduce_kernel<BF16>, dim3(blocks), 256, 0, stream, 1, pdl, ws, y, count,
                  splits);
}

// Launch configuration of a tile_step kernel on one device.
struct RingConfig {
    int smem = 0, stages = 0, copies_log2 = 0, table_bytes = 0, ctas_per_sm = 0, sms = 0;
    bool sm90 = false;    // the SASS that runs has the sm_90 paths (clusters, griddepcontrol)
    bool cluster = false;  // and the GPU co-schedules a cluster of `cluster_y` CTAs along y
    int clusters[kMaxSplits + 1] = {};  // clusters of s CTAs the GPU runs at once (s = 2..8)
};

// How many (1, cluster_y, 1) clusters of this kernel (the split-K CTAs of one output tile,
// reducing over DSMEM) the GPU runs at once; 0 = none (no clusters on this GPU / build).
template <typename Kernel>
inline int active_clusters(Kernel kernel, int threads, int smem, int cluster_y) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1, cluster_y, 1);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 1, attr.val.clusterDim.y = cluster_y, attr.val.clusterDim.z = 1;
    cfg.attrs = &attr, cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return clusters;
}

template <typename Kernel>
inline bool cluster_fits(Kernel kernel, int threads, int smem, int cluster_y) {
    return active_clusters(kernel, threads, smem, cluster_y) > 0;
}

// Fills clusters[s] for s = 2..max_splits (host, once per kernel and device).
template <typename Kernel>
inline void count_clusters(int (&clusters)[kMaxSplits + 1], Kernel kernel, int threads, int smem,
                           int max_splits) {
    for (int s = 2; s <= std::min(max_splits, kMaxSplits); ++s)
        clusters[s] = active_clusters(kernel, threads, smem, s);
}

// Split-K reduction of `tiles` output tiles in `splits` CTAs each: through DSMEM in clusters only
// for 2 splits, and only where the clusters run in as few waves as the plain CTAs would. A
// cluster needs all its CTAs on SMs of one GPC at once; with 1-2 big CTAs per SM the GPCs hold
// fewer clusters than SMs / splits (H100, 8B o_proj at M = 64 on the wgmma kernel's C1, 32 tiles
// x 4 splits: cluster 26.2 us, workspace 14.8; benchmarks/probe_splitk.py,
// results/probe_splitk_h100_s6*), and the waves that adds cost more than the workspace's fp32
// partials. Where 8-CTA clusters did fit (mma.sync: 8B o at M = 8-32, 8B down at M = 8-16, 70B o
// and down at M = 8, k=2), the workspace with its PDL-launched reduce kernel took 0.65-0.80x their
// time (results/probe_env_h100_s23_small.md); 2-CTA clusters (8B gate_up, M = 16-32) were 1-2%
// faster than it.
// KBIT_MMA_NO_CLUSTER=1 / KBIT_MMA_FORCE_CLUSTER=1 override (tests, the probe);
// KBIT_MMA_CLUSTER_SPLITS=s allows clusters of up to s splits (8: the rule before session 23).
inline bool use_cluster(const int (&clusters)[kMaxSplits + 1], double tiles, int splits,
                        int64_t slots) {
    if (splits < 2 || splits > kMaxSplits || clusters[splits] <= 0) return false;
    if (env_int("KBIT_MMA_NO_CLUSTER", 0) != 0) return false;
    if (env_int("KBIT_MMA_FORCE_CLUSTER", 0) != 0) return true;
    if (splits > env_int("KBIT_MMA_CLUSTER_SPLITS", 2)) return false;
    return std::ceil(tiles / clusters[splits]) <= std::ceil(tiles * splits / static_cast<double>(slots));
}

// Table copies, ring stages and dynamic shared memory: prefers a conflict-free table (32 copies),
// then `max_ctas` CTAs/SM (16 warps hide LDS/MMA latency), then >= 3 stages. `stage_bytes` is one
// ring slot, `out_bytes` the epilogue tile (it reuses the ring), `static_bytes` the kernel's
// static shared memory. Also sets the kernel's dynamic shared memory limit.
template <typename Kernel>
RingConfig configure_ring(Kernel kernel, int dev, int bits, int threads, int stage_bytes,
                          int out_bytes, int static_bytes, int max_ctas, int max_stages,
                          int cluster_y, const char* op) {
    cudaDeviceProp prop;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    const int per_sm = static_cast<int>(prop.sharedMemPerMultiprocessor);
    const int optin = static_cast<int>(prop.sharedMemPerBlockOptin);
    const int reserved = static_cast<int>(prop.reservedSharedMemPerBlock);
    RingConfig c;
    for (int min_stages = 3; min_stages >= 2 && !c.stages; --min_stages)
        for (int lc = bits == 2 ? 0 : 5; lc >= 0 && !c.stages; --lc)
            for (int ctas = max_ctas; ctas >= 1 && !c.stages; --ctas) {
                const int budget = std::min(optin, per_sm / ctas - reserved) - static_bytes;
                const int table = 4 << (2 * bits + lc);
                const int stages = std::min(max_stages, (budget - table - 64) / stage_bytes);
                const int smem = std::max(table + 64 + stages * stage_bytes, out_bytes);
                if (stages >= min_stages && smem <= budget) {
                    c.smem = smem, c.stages = stages, c.copies_log2 = lc, c.table_bytes = table;
                }
            }
    TORCH_CHECK(c.stages, "kbit::", op, ": not enough shared memory on this GPU for bits=", bits);
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
    C10_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c.ctas_per_sm, kernel, threads, c.smem));
    TORCH_CHECK(c.ctas_per_sm >= 1, "kbit::", op, ": kernel does not fit on this GPU (bits=", bits,
                ")");
    cudaFuncAttributes fa;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    c.sms = prop.multiProcessorCount;
    c.sm90 = fa.binaryVersion >= 90 && fa.ptxVersion >= 90;
    // can the GPU co-schedule the largest cluster (one GPC)? how many of each size at once?
    if (c.sm90) {
        c.cluster = cluster_fits(kernel, threads, c.smem, cluster_y);
        if (c.cluster) count_clusters(c.clusters, kernel, threads, c.smem, cluster_y);
    }
    return c;
}

// Split-K count: minimises waves x (k-tiles per CTA + 1 tile of fill/epilogue), <= max_splits,
// plus ws_per_split (in the same k-tile units) per split where s > 1: the fp32 partial sums' cost.
inline int choose_splits(double ctas, int k_tiles, int64_t slots, int max_splits,
                         double ws_per_split = 0.0) {
    int best = 1;
    double best_cost = 1e300;
    for (int s = 1; s <= std::min(max_splits, k_tiles); ++s) {
        const int64_t chunk = ceil_div(k_tiles, s);
        if (ceil_div(k_tiles, chunk) != s) continue;  // same chunks as a smaller s
        const double cost = std::ceil(ctas * s / static_cast<double>(slots)) * (chunk + 1) +
                            (s > 1 ? s * ws_per_split : 0.0);
        if (cost < best_cost) best = s, best_cost = cost;
    }
    return best;
}

}  // namespace frag
}  // namespace kbit
