// SPDX-License-Identifier: Apache-2.0
// kbit::gemv: y[M, n] = x[M, K] @ W^T for decode batches M <= 8, x/y fp16 or bf16, fp32
// accumulation. W[n, K] is read once, from the runtime tiled layout of docs/format.md (16x128
// tiles; per lane and bit plane 8 bytes; one E4M4 absmax per row and 32-column block).
//
// Design (one CTA of 16 warps per SM; one warp computes one 16x128 tile at a time):
//  * Tensor cores do the multiply: the tile bytes of a lane are exactly its A fragments of
//    mma.m16n8k16 (weights = A, 16 rows), x is B and the MMA's 8 columns carry the M <= 8 tokens.
//    Each weight is dequantized once and one MMA serves all tokens, so M=4 issues the same
//    instructions as M=1 (lanes whose token column is >= M read token M-1; their sums are dropped).
//  * Dequantization = one shared-memory load per PAIR of adjacent columns (= one A register):
//    the k bit planes are transposed with shift/LOP3 on whole 32-bit words so that the 2k bits of
//    a column pair sit in one byte, and T[idx] = half2(cb[lo], cb[hi]) is the pair. k=2 goes one
//    step further: one byte indexes the same pair in rows g and g+8, and one 8-byte load returns
//    two consecutive A registers.
//    The table is replicated 32 times (entry i of lane l at byte i*256 + l*4, resp. l*8), so the
//    32 random lookups of a warp always hit 32 different banks, and the address is a single PRMT
//    (table byte in bits 8-15, lane offset in bits 0-7). k=5 (10-bit pair index) uses rows of
//    128 B (64 B where shared memory is short) and a shift+LOP3 address.
//  * absmax: the MMA sums one 32-column block (two k16 steps) from zero; 4 FFMA then add it to
//    the fp32 accumulators times the block's absmax (decoded exactly as fp16 bits, value/16; the
//    16 is restored at the output). Per block only fp32 crosses blocks.
//  * Work split: a CTA owns a contiguous range of n-tiles and one range of K (split-K across CTAs
//    only where n-tiles alone cannot fill the GPU or x does not fit in shared memory: fp32
//    partials per split, the last CTA of the row group adds them in order). Inside the CTA the
//    (n-tile, k-tile) units are dealt to the warps in contiguous runs (all warps get the same
//    count +-1); each warp streams its run with kPrefetch tiles in registers and stores its
//    per-n-tile sums in shared memory, which the epilogue adds in a fixed order: no atomics on
//    data, the result is deterministic.
//
// Issue slots per tile and lane (64 weights), sm_90 SASS of the main loop, k=4: 32 LOP3/SHF/IMAD
// (bit-plane transpose), 32 PRMT (table addresses), 32 LDS.32 (pairs), 4 LDS.128 (x), 8 HMMA,
// 8 absmax ops + 8 HADD2.F32, 16 FFMA, 6 LDG, ~40 loop, address and bookkeeping = ~185, i.e.
// ~2.9 per weight, half of them on the half-rate integer ALU; no shuffles. k=2: ~140 (12
// LOP3/SHF per word, 16 PRMT + 16 LDS.64), k=3: ~180, k=5: ~280 (its addresses are SHF+LOP3).
// At ~1.75 GHz that is below the HBM time of every k on H100 (k=2 is the closest: ~9 us of
// issue vs ~11 us of bandwidth on Llama-3-8B gate_up). Shared memory: 2 B of table per weight
// (+x), ~64 weights/clk/SM. Measured (ncu, H100; benchmarks/results/gemv_streaming_h100_s9.md),
// the loop does not reach either bound: ptxas puts all of its global loads on one scoreboard, so
// the first use of a prefetched tile also waits for the loads issued after it (about one memory
// latency per tile and warp): 70B gate_up runs at ~55% of HBM bandwidth at k=2, ~76% at k=4.
// A cp.async ring with exact waits removed that stall but then hit shared-memory latency and the
// MIO queue, with no net gain, so the register ring stays.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "kbit_format.cuh"
#include "ops.h"

namespace kbit {
namespace {

constexpr int kWarps = 16;  // one CTA per SM: the table is filled once per SM
constexpr int kThreads = kWarps * 32;
// Tiles per warp in registers (kPrefetch - 1 loads in flight while one is computed): per SM
// 16 warps x 3-5 tiles x 0.6-1.3 KB = 46-64 KB in flight, which covers HBM latency at full rate.
template <int kBits>
constexpr int kPrefetch = kBits == 2 ? 6 : kBits == 3 ? 5 : 4;
// Of those, loaded before the table fill (the rest after x is staged): with all kPrefetch in the
// prologue, a CTA's ~400 loads back up the memory pipe and the warps reach the barrier late
// (H100, 8B shapes, M=1: kEarly = 1 or 2 is 0.3-0.5 us per call faster than kPrefetch).
constexpr int kEarly = 2;
constexpr int kMaxM = 8;  // the MMA's N
constexpr int kTableRows = 256;
constexpr int kTableRows5 = 1024;
constexpr int kTableBytes = kTableRows * 256;  // k = 2..4: 64 KB
constexpr int kXPad = 64;  // x row stride = 64 mod 128 B: 2 token rows of an LDS.128 share no bank

struct Params {
    const uint32_t* qw;  // tiled bit planes
    const uint8_t* am;   // tiled absmax
    const float* cb;     // codebook [2^bits]
    const void* x;       // [M, K], row stride sx elements
    void* y;             // [M, n]
    float* ws;           // split-K only: fp32 partial sums [splits][M][n]
    unsigned* arrived;   // split-K only: CTAs done per row group (zeroed)
    int64_t sx;
    int M, K, n, n_tiles, k_tiles;
    int k_len;             // k-tiles per split (the last split may have fewer)
    int splits, groups;    // grid = groups x splits CTAs; a group owns a range of n-tiles
    int xrow;              // bytes per token row of staged x: k_len * 256 + kXPad
    int table_bytes;       // shared-memory offset of x
    int acc_off;           // shared-memory offset of the fp32 sums [CTA's n-tiles][16][M], then
                           // of the warps' partial sums [kWarps][2][16][M]
    int row_shift;         // k = 5: log2 of the table row size (7: 32 copies, 6: 16 copies)
    bool x_vec;            // x rows are 16-byte aligned
    bool pdl;              // launched with programmatic dependent launch: x only after pdl_wait
};

template <typename T>
struct Cvt;
template <>
struct Cvt<__half> {
    static __device__ __forceinline__ uint32_t pair(float lo, float hi) {
        return pack2<false>(lo, hi);
    }
    static __device__ __forceinline__ __half out(float v) { return __float2half_rn(v); }
};
template <>
struct Cvt<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pair(float lo, float hi) {
        return pack2<true>(lo, hi);
    }
    static __device__ __forceinline__ __nv_bfloat16 out(float v) { return __float2bfloat16_rn(v); }
};


// Weights are read exactly once: keep them out of L1.
__device__ __forceinline__ uint2 ld_stream_v2(const uint2* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint32_t ld_stream_u32(const uint32_t* p) {
    uint32_t v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
    return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ uint2 lds64(const uint8_t* p) {
    return *reinterpret_cast<const uint2*>(p);
}

// Bits of a where m is set, bits of b elsewhere: one LOP3 (written in PTX because the compiler
// otherwise folds the mask into a shift of b and spends two).
template <uint32_t kMask>
__device__ __forceinline__ uint32_t bsel(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "n"(kMask));
    return r;
}

// PRMT selector: byte q of the index word -> address bits 8-15, lane offset -> bits 0-7.
__device__ __forceinline__ constexpr uint32_t addr_sel(int q) { return 0x5504u | (q << 4); }

// fp16 bits of two absmax bytes at bits 0 and 16, as float: E4M4 placed at fp16 bit 6 is an fp16
// (e -> exponent, m -> top mantissa bits, e=0 -> subnormal) of exactly absmax / 16.
__device__ __forceinline__ float absmax_div16(uint32_t h2, int hi) {
    const __half2 h = *reinterpret_cast<const __half2*>(&h2);
    return hi ? __high2float(h) : __low2float(h);
}

template <int kBits>
struct Tile {
    uint2 q[kBits];  // bit plane j: this lane's 8 bytes; word w holds blocks 2w, 2w+1
    uint32_t am[2];  // absmax of rows g and g + 8, blocks 0..3
};

// A warp's stream of tiles: 32-bit element offsets of this lane's first plane word (8 B units)
// and row-g absmax word (4 B units) of the current tile; after k_len tiles it jumps to the same
// K range of the next n-tile.
template <int kBits>
struct TileStream {
    const uint2* q;
    const uint32_t* a;
    uint32_t qo, ao, q_jump, a_jump;
    int left, k_len;

    __device__ __forceinline__ Tile<kBits> load() const {
        Tile<kBits> r;
#pragma unroll
        for (int j = 0; j < kBits; ++j) r.q[j] = ld_stream_v2(q + qo + j * 32);  // 256 B per plane
        r.am[0] = ld_stream_u32(a + ao);
        r.am[1] = ld_stream_u32(a + ao + 8);  // row g + 8
        return r;
    }
    __device__ __forceinline__ void next() {
        qo += kBits * 32;
        ao += 16;
        if (--left == 0) left = k_len, qo += q_jump, ao += a_jump;
    }
};

// The A fragments of the two k16 steps of one 32-column block, a[s] = {row g cols c, c+1;
// row g+8 cols c, c+1; row g cols c+8, c+9; row g+8 cols c+8, c+9} with c = 2t + 16s. Byte
// 2b+h of a plane word holds block b, row half h; its bits 2i, 2i+1 are pair i = cols 2t+8i+{0,1}.
// `ix` are the index words of one plane word w (blocks 2w, 2w+1), bb = b - 2w.
template <int kBits>
struct Decoder {
    uint32_t ix[4];      // byte q of ix[i]: index of pair i of byte q (k=2: of bytes 2bb, 2bb+1)
    uint32_t ix5[4][2];  // k = 5: 10-bit indices as 16-bit fields, bytes (0, 2) and (1, 3)

    // Transpose k plane words (32 codes each) so that each pair index is one byte: bits 2j and
    // 2j+1 of the byte are plane j of the pair's two columns (k = 2: two 4-bit pair indices; k = 3:
    // bits 6-7 are don't-care, the table repeats over them, which saves the masks).
    __device__ __forceinline__ Decoder(const uint32_t (&p)[kBits]) {
        // Nibble n of a (b): planes 0, 1 of pair 0 (1) of byte n/2 for even n, else of pair 2 (3).
        const uint32_t a = bsel<0x33333333u>(p[0], p[1] << 2);
        const uint32_t b = bsel<0x33333333u>(p[0] >> 2, p[1]);
        if constexpr (kBits == 2) {
            // byte 2bb of ix[i] = pair i of rows g (low nibble, byte 2bb) and g+8 (byte 2bb+1).
            ix[0] = bsel<0x0F0F0F0Fu>(a, a >> 4);
            ix[1] = bsel<0x0F0F0F0Fu>(b, b >> 4);
            ix[2] = bsel<0x0F0F0F0Fu>(a >> 4, a >> 8);
            ix[3] = bsel<0x0F0F0F0Fu>(b >> 4, b >> 8);
        } else {
            if constexpr (kBits == 3) {
                ix[0] = bsel<0x0F0F0F0Fu>(a, p[2] << 4);
                ix[1] = bsel<0x0F0F0F0Fu>(b, p[2] << 2);
                ix[2] = bsel<0x0F0F0F0Fu>(a >> 4, p[2]);
                ix[3] = bsel<0x0F0F0F0Fu>(b >> 4, p[2] >> 2);
            } else {
                const uint32_t c = bsel<0x33333333u>(p[2], p[3] << 2);  // planes 2, 3
                const uint32_t d = bsel<0x33333333u>(p[2] >> 2, p[3]);
                ix[0] = bsel<0x0F0F0F0Fu>(a, c << 4);
                ix[1] = bsel<0x0F0F0F0Fu>(b, d << 4);
                ix[2] = bsel<0x0F0F0F0Fu>(a >> 4, c);
                ix[3] = bsel<0x0F0F0F0Fu>(b >> 4, d);
            }
            if constexpr (kBits == 5) {
                // plane 4 of pair i of byte q sits at bits 8q + 2i: move it to bits 8-9 of the
                // 16-bit field that holds the byte (bytes 0, 2 in ix5[i][0], bytes 1, 3 in [1]).
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    ix5[i][0] = bsel<0x00FF00FFu>(ix[i], p[4] << (8 - 2 * i));
                    ix5[i][1] = bsel<0x00FF00FFu>(ix[i] >> 8, p[4] >> (2 * i));
                }
            }
        }
    }

    __device__ __forceinline__ void frags(const uint8_t* table, uint32_t lane_off, int row_shift,
                                          int bb, uint32_t (&a)[2][4]) const {
        const int q0 = 2 * bb, q1 = 2 * bb + 1;  // bytes of rows g, g+8
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            if constexpr (kBits == 2) {  // one 8-byte load = a pair in rows g and g+8
                const uint2 p0 = lds64(table + __byte_perm(ix[2 * s], lane_off, addr_sel(q0)));
                const uint2 p1 = lds64(table + __byte_perm(ix[2 * s + 1], lane_off, addr_sel(q0)));
                a[s][0] = p0.x, a[s][1] = p0.y, a[s][2] = p1.x, a[s][3] = p1.y;
            } else if constexpr (kBits <= 4) {
                a[s][0] = lds32(table + __byte_perm(ix[2 * s], lane_off, addr_sel(q0)));
                a[s][1] = lds32(table + __byte_perm(ix[2 * s], lane_off, addr_sel(q1)));
                a[s][2] = lds32(table + __byte_perm(ix[2 * s + 1], lane_off, addr_sel(q0)));
                a[s][3] = lds32(table + __byte_perm(ix[2 * s + 1], lane_off, addr_sel(q1)));
            } else {
                // field of byte q: ix5[i][q & 1], half q >> 1 = bb; address = index << row_shift.
                const uint32_t mask = 0x3FFu << row_shift;
                auto at = [&](uint32_t f) {
                    const uint32_t v = bb ? f >> (16 - row_shift) : f << row_shift;
                    return table + ((v & mask) | lane_off);
                };
                a[s][0] = lds32(at(ix5[2 * s][0]));
                a[s][1] = lds32(at(ix5[2 * s][1]));
                a[s][2] = lds32(at(ix5[2 * s + 1][0]));
                a[s][3] = lds32(at(ix5[2 * s + 1][1]));
            }
        }
    }
};

// One 16x128 tile into acc (rows g, g+8 x token columns 2t, 2t+1); xs = this lane's x chunk of
// the k-tile in shared memory (4 blocks x 64 B, this lane's 16 B at +t*16 already added).
template <int kBits, typename T>
__device__ __forceinline__ void tile_mma(const Tile<kBits>& tl, const uint8_t* table,
                                         uint32_t lane_off, int row_shift, const uint8_t* xs,
                                         float (&acc)[4]) {
    // absmax/16 as fp16 bits: [row][0] = blocks (0, 2), [row][1] = blocks (1, 3).
    const uint32_t sc[2][2] = {{(tl.am[0] << 6) & 0x3FC03FC0u, (tl.am[0] >> 2) & 0x3FC03FC0u},
                               {(tl.am[1] << 6) & 0x3FC03FC0u, (tl.am[1] >> 2) & 0x3FC03FC0u}};
#pragma unroll
    for (int w = 0; w < 2; ++w) {
        uint32_t pl[kBits];
#pragma unroll
        for (int j = 0; j < kBits; ++j) pl[j] = w ? tl.q[j].y : tl.q[j].x;
        const Decoder<kBits> dec(pl);
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            uint32_t a[2][4];
            dec.frags(table, lane_off, row_shift, bb, a);
            // x pairs (cols 2t + 8i) of this block, i = 0..3, staged contiguously per lane.
            const uint4 xv = *reinterpret_cast<const uint4*>(xs + (2 * w + bb) * 64);
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            mma_m16n8k16<std::is_same_v<T, __nv_bfloat16>>(d, a[0], xv.x, xv.y);
            mma_m16n8k16<std::is_same_v<T, __nv_bfloat16>>(d, a[1], xv.z, xv.w);
            const float s0 = absmax_div16(sc[0][bb], w), s1 = absmax_div16(sc[1][bb], w);
            acc[0] = fmaf(d[0], s0, acc[0]);
            acc[1] = fmaf(d[1], s0, acc[1]);
            acc[2] = fmaf(d[2], s1, acc[2]);
            acc[3] = fmaf(d[3], s1, acc[3]);
        }
    }
}

// Table entry of a pair index: half2(cb[c0], cb[c1]), where bit j of code c0 (c1) is bit
// e + 2j (e + 1 + 2j) of idx: plane j of the pair sits at bits 2j, 2j+1 (e = 4: k=2, row g+8).
template <int kBits, typename T>
__device__ __forceinline__ uint32_t pair_value(const float* cb_s, int idx, int e) {
    int c0 = 0, c1 = 0;
#pragma unroll
    for (int j = 0; j < kBits; ++j) {
        c0 |= ((idx >> (e + 2 * j)) & 1) << j;
        c1 |= ((idx >> (e + 1 + 2 * j)) & 1) << j;
    }
    return Cvt<T>::pair(cb_s[c0], cb_s[c1]);
}

// Table of dequantized pairs (k=2: a pair of rows g and g+8), 32 copies per entry (k=5: 1 <<
// (row_shift - 2)), from the codebook in shared memory (cb_s, already rounded by cb_value). At
// k=3 index bits 6-7 are don't-care: the entry repeats over them. k=2..4 has 256 rows: two threads
// share a row, each writing half of its 16-byte chunks. The chunks go in rotated order, so that
// the 8 threads of a store phase (8 consecutive rows) hit 8 different bank groups.
template <int kBits, typename T>
__device__ __forceinline__ void fill_table(uint8_t* table, const float* cb_s, int row_shift) {
    constexpr int kRows = kBits == 5 ? kTableRows5 : kTableRows;
    constexpr int kParts = kRows < kThreads ? kThreads / kRows : 1;
    const int row_bytes = kBits == 5 ? 1 << row_shift : 256;
    const int chunks = (kBits == 2 || kBits == 5 ? row_bytes : 128) / 16;  // k=3,4: 128 B used
    const int per_part = chunks / kParts;
    for (int job = threadIdx.x; job < kRows * kParts; job += kThreads) {
        const int idx = job % kRows, c0 = job / kRows * per_part;
        uint4 v;
        if constexpr (kBits == 2) {  // 8-byte entries: rows g (nibble 0), g+8 (nibble 1)
            v.x = v.z = pair_value<kBits, T>(cb_s, idx, 0);
            v.y = v.w = pair_value<kBits, T>(cb_s, idx, 4);
        } else {
            v.x = v.y = v.z = v.w = pair_value<kBits, T>(cb_s, idx, 0);
        }
        uint8_t* row = table + idx * row_bytes;
        for (int c = c0; c < c0 + per_part; ++c)
            *reinterpret_cast<uint4*>(row + ((c + idx) & (chunks - 1)) * 16) = v;
    }
}

// x[:, K range] -> shared memory, per token row and 32-column block 64 B holding, for t = 0..3,
// the 16 B that lane t needs: pairs (cols 2t + 8i, +1), i = 0..3. Columns >= K become 0 (the
// padded weights are 0 too, and 0 * 0 keeps garbage out). One (token m, block bl) is a thread's
// job; load and store are separate so that the loads of token 0 can be issued before the weight
// stream starts (they would otherwise queue behind it in the memory system, ~1 us).
struct XJob {
    uint32_t w[4][4];  // w[j][t] = column pair 4j + t of the block
};

template <typename T>
__device__ __forceinline__ XJob load_x(const Params& p, int k_begin, int m, int bl) {
    XJob r = {};
    const int col = (k_begin * kBlocksPerTile + bl) * kBlock;
    if (col < p.K) {
        const T* src = static_cast<const T*>(p.x) + m * p.sx + col;
        if (p.x_vec) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 v = *reinterpret_cast<const uint4*>(src + 8 * j);
                r.w[j][0] = v.x, r.w[j][1] = v.y, r.w[j][2] = v.z, r.w[j][3] = v.w;
            }
        } else {
            const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
#pragma unroll
            for (int c = 0; c < 16; ++c)
                r.w[c >> 2][c & 3] = s16[2 * c] | static_cast<uint32_t>(s16[2 * c + 1]) << 16;
        }
    }
    return r;
}

__device__ __forceinline__ void store_x(uint8_t* xs, const Params& p, int m, int bl,
                                        const XJob& v) {
    uint4* dst = reinterpret_cast<uint4*>(xs + m * p.xrow + bl * 64);
#pragma unroll
    for (int t = 0; t < 4; ++t) dst[t] = make_uint4(v.w[0][t], v.w[1][t], v.w[2][t], v.w[3][t]);
}

// Stores a warp's sums for one n-tile (rows g, g+8; tokens 2t, 2t+1) into rows[16][M].
__device__ __forceinline__ void store_sums(float (&acc)[4], float* rows, int g, int t, int M) {
    if (2 * t < M) {
        rows[g * M + 2 * t] = acc[0];
        rows[(g + 8) * M + 2 * t] = acc[2];
    }
    if (2 * t + 1 < M) {
        rows[g * M + 2 * t + 1] = acc[1];
        rows[(g + 8) * M + 2 * t + 1] = acc[3];
    }
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
}

template <int kBits, typename T>
__global__ void __launch_bounds__(kThreads, 1) gemv_kernel(const Params p) {
    extern __shared__ __align__(16) uint8_t smem[];  // [table][x rows][sums][warp partials]
    __shared__ int is_last;
    // slot_tile[2w + s]: offset in acc_s of the n-tile whose partial sums warp w's slot s holds
    __shared__ __align__(16) int slot_tile[kWarps * 2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // Integer divisions are ~100-cycle dependent chains (no hardware divider): none where a
    // quotient is known, and none in the epilogue.
    const int group = p.splits == 1 ? blockIdx.x : blockIdx.x / p.splits;
    const int split = blockIdx.x - group * p.splits;
    // 32-bit: the host checks n_tiles * groups < 2^32 (a 64-bit division is a ~100-instruction
    // call, and this runs on the latency chain before the first weight is used).
    const unsigned n_tiles = p.n_tiles, gr = p.groups;
    const int n_begin = static_cast<int>(group * n_tiles / gr);
    const int n_cta = static_cast<int>((group + 1) * n_tiles / gr) - n_begin;
    const int k_begin = split * p.k_len, k_len = min(p.k_len, p.k_tiles - k_begin);
    const int units = n_cta * k_len;  // (n-tile, k-tile) pairs, n-major: consecutive in memory
    const int u0 = warp * units / kWarps, u1 = (warp + 1) * units / kWarps;  // host: no overflow

    // What the CTA reads before its first MMA is requested at once, in the order it is needed:
    // the codebook, x (unless PDL: x is the previous kernel's output), each warp's first kEarly
    // tiles. Issued after the weight loads, the codebook and x reads would queue behind the
    // weight stream in the memory system (~2-5k cycles measured on H100 at 8B shapes).
    __shared__ float cb_s[1 << kBits];
    float cbv = 0.f;
    if (threadIdx.x < (1 << kBits)) cbv = cb_value(p.cb, threadIdx.x);
    const int nblk = k_len * kBlocksPerTile;
    const bool has_x = threadIdx.x < nblk;  // token 0, block threadIdx.x
    XJob xj;
    if (!p.pdl && has_x) xj = load_x<T>(p, k_begin, 0, threadIdx.x);

    constexpr int D = kPrefetch<kBits>;
    const int64_t first = int64_t{n_begin + u0 / k_len} * p.k_tiles + k_begin + u0 % k_len;
    TileStream<kBits> ts;
    ts.q = reinterpret_cast<const uint2*>(p.qw);
    ts.a = reinterpret_cast<const uint32_t*>(p.am);
    ts.qo = static_cast<uint32_t>(first * (kBits * 32) + lane);
    ts.ao = static_cast<uint32_t>(first * 16 + g);
    ts.q_jump = static_cast<uint32_t>(p.k_tiles - k_len) * (kBits * 32);
    ts.a_jump = static_cast<uint32_t>(p.k_tiles - k_len) * 16;
    ts.k_len = k_len;
    ts.left = k_len - u0 % k_len;
    Tile<kBits> buf[D];
    auto load_tile = [&](int i) {  // slot i of the warp's first D tiles, in stream order
        if (u0 + i < u1) {
            buf[i] = ts.load();
            ts.next();
        }
    };
#pragma unroll
    for (int i = 0; i < kEarly; ++i) load_tile(i);

    if (threadIdx.x < (1 << kBits)) cb_s[threadIdx.x] = cbv;
    __syncthreads();
    fill_table<kBits, T>(smem, cb_s, p.row_shift);
    // Up to here only constant data (weights, codebook) was read, unless x was: with PDL this
    // prologue overlaps the previous kernel's tail; x is that kernel's output.
    pdl_wait();
    uint8_t* xs_s = smem + p.table_bytes;
    if (p.pdl && has_x) xj = load_x<T>(p, k_begin, 0, threadIdx.x);
    if (has_x) store_x(xs_s, p, 0, threadIdx.x, xj);
    for (int m = 0; m < p.M; ++m)
        for (int bl = threadIdx.x + (m == 0 ? kThreads : 0); bl < nblk; bl += kThreads)
            store_x(xs_s, p, m, bl, load_x<T>(p, k_begin, m, bl));
    float* acc_s = reinterpret_cast<float*>(smem + p.acc_off);
    float* part_s = acc_s + n_cta * kTileN * p.M;
    __syncthreads();
#pragma unroll
    for (int i = kEarly; i < D; ++i) load_tile(i);

    // x of this lane's token column (lanes past M repeat token M-1) and 16-byte chunk t.
    const uint8_t* xs0 = smem + p.table_bytes + min(g, p.M - 1) * p.xrow + t * 16;
    const uint8_t* xs = xs0 + (u0 % k_len) * (kTileK * 2);
    const uint32_t lane_off = kBits == 2   ? lane * 8
                              : kBits == 5 ? (lane & ((1 << (p.row_shift - 2)) - 1)) * 4
                                           : lane * 4;
    // A warp adds up one n-tile segment of its run at a time. A segment spanning the n-tile's
    // whole K range is this warp's alone and goes to acc_s; only the first and the last segment
    // of a run can be partial, they go to the warp's part_s slots 0 and 1 (slot_tile says for
    // which n-tile, as the offset of its sums in acc_s), and the epilogue adds the slots of an
    // n-tile in warp order: no atomics, deterministic.
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float* acc_tile = acc_s + (u0 / k_len) * kTileN * p.M;  // this n-tile's sums
    float* part = part_s + warp * 2 * kTileN * p.M;
    int left = k_len - u0 % k_len;  // k-tiles left in this n-tile
    bool whole = left == k_len;     // the segment started at k-tile 0
    for (int u = u0; u < u1; u += D) {
#pragma unroll
        for (int i = 0; i < D; ++i) {
            if (u + i < u1) {
                tile_mma<kBits, T>(buf[i], smem, lane_off, p.row_shift, xs, acc);
                if (u + i + D < u1) {  // refill the slot just consumed
                    buf[i] = ts.load();
                    ts.next();
                }
                const bool tile_end = --left == 0;
                if (tile_end || u + i + 1 == u1) {
                    store_sums(acc, tile_end && whole ? acc_tile : part, g, t, p.M);
                    part = part_s + (warp * 2 + 1) * kTileN * p.M;
                    whole = true;
                }
                xs += kTileK * 2;
                if (tile_end) left = k_len, xs = xs0, acc_tile += kTileN * p.M;
            }
        }
    }
    pdl_trigger();  // the weights are streamed: the next kernel may start its prologue
    if (lane == 0) {  // the loop's choices, for the epilogue: which n-tile each slot holds
        const int f = u0 / k_len, l = (u1 - 1) / k_len;  // first and last n-tile of the run
        const bool first_whole = u0 == f * k_len && u1 >= (f + 1) * k_len;
        const bool last_part = l != f && u1 != (l + 1) * k_len;
        slot_tile[warp * 2] = u0 < u1 && !first_whole ? f * kTileN * p.M : -1;
        slot_tile[warp * 2 + 1] = u0 < u1 && last_part ? l * kTileN * p.M : -1;
    }
    __syncthreads();

    // Output rows [16 n_begin, 16 (n_begin + n_cta)) of every token; padding rows >= n are skipped.
    const int rows = min(n_cta * kTileN, p.n - n_begin * kTileN), row0 = n_begin * kTileN;
    int st[kWarps * 2];
#pragma unroll
    for (int j = 0; j < kWarps * 2; j += 4) {  // 8 vector loads, not 32 dependent ones
        const int4 v = *reinterpret_cast<const int4*>(slot_tile + j);
        st[j] = v.x, st[j + 1] = v.y, st[j + 2] = v.z, st[j + 3] = v.w;
    }
    T* y = static_cast<T*>(p.y);
    for (int m = 0; m < p.M; ++m) {
        for (int r = threadIdx.x; r < rows; r += kThreads) {
            // No division here: each is a ~100-cycle dependent chain on the critical path.
            const int tile_off = r / kTileN * kTileN * p.M, rr = r % kTileN;
            float v = 0.f;
            bool shared = false;
#pragma unroll
            for (int j = 0; j < kWarps * 2; ++j) {
                if (st[j] == tile_off) {
                    v += part_s[(j * kTileN + rr) * p.M + m];
                    shared = true;
                }
            }
            if (!shared) v = acc_s[r * p.M + m];  // one warp summed the whole n-tile
            v *= 16.f;  // the absmax were applied as absmax/16
            if (p.splits == 1)
                y[int64_t{m} * p.n + row0 + r] = Cvt<T>::out(v);
            else
                p.ws[(int64_t{split} * p.M + m) * p.n + row0 + r] = v;
        }
    }
    if (p.splits == 1) return;

    // Split-K: the last CTA of the row group to finish adds the splits in order and writes y.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(p.arrived + group, 1u) == p.splits - 1u;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int m = 0; m < p.M; ++m) {
        for (int r = threadIdx.x; r < rows; r += kThreads) {
            float v = 0.f;
            for (int sp = 0; sp < p.splits; ++sp)  // L2 loads: other CTAs' stores are not in our L1
                v += __ldcg(p.ws + (int64_t{sp} * p.M + m) * p.n + row0 + r);
            y[int64_t{m} * p.n + row0 + r] = Cvt<T>::out(v);
        }
    }
}

struct Plan {
    int splits = 0, k_len = 0, groups = 0, table_bytes = 0, row_shift = 0;
    int64_t xrow = 0, smem = 0;
};

// Picks the K split and the table size: minimise the tiles of the busiest warp (+ a fixed price
// for split-K: workspace traffic, the counter memset and the last-CTA pass), within shared memory.
Plan make_plan(int64_t M, int64_t n_tiles, int64_t k_tiles, int64_t bits, int64_t sms,
               int64_t smem_max) {
    constexpr double kSplitPrice = 3.0;  // in tiles per warp, ~1.5-2 us
    Plan best;
    double best_cost = 0.0;
    const int shifts5[2] = {7, 6};  // k = 5: 32 copies (128 KB), else 16 copies (64 KB)
    for (int v = 0; v < (bits == 5 ? 2 : 1); ++v) {
        const int row_shift = bits == 5 ? shifts5[v] : 8;
        const int64_t table = bits == 5 ? int64_t{kTableRows5} << row_shift : kTableBytes;
        const double slow = bits == 5 && row_shift == 6 ? 1.3 : 1.0;  // 2-way bank conflicts
        for (int64_t s = 1; s <= k_tiles; ++s) {
            const int64_t k_len = ceil_div(k_tiles, s);
            if (ceil_div(k_tiles, k_len) != s) continue;  // same split as a smaller s
            const int64_t xrow = k_len * kTileK * 2 + kXPad;
            const int64_t per_tile = kTileN * M * 4;  // sum bytes per n-tile
            const int64_t room = smem_max - table - M * xrow - 2 * kWarps * per_tile;
            if (room < per_tile) continue;
            int64_t groups = std::min(n_tiles, std::max<int64_t>(1, sms / s));
            groups = std::max(groups, ceil_div(n_tiles, room / per_tile));
            const int64_t n_cta = ceil_div(n_tiles, groups);
            const int64_t waves = ceil_div(groups * s, sms);
            const double cost = double(waves * ceil_div(n_cta * k_len, kWarps)) * slow +
                                (s > 1 ? kSplitPrice : 0.0);
            if (best.splits == 0 || cost < best_cost) {
                best_cost = cost;
                best.splits = static_cast<int>(s);
                best.k_len = static_cast<int>(k_len);
                best.groups = static_cast<int>(groups);
                best.table_bytes = static_cast<int>(table);
                best.row_shift = row_shift;
                best.xrow = xrow;
                best.smem = table + M * xrow + (n_cta + 2 * kWarps) * per_tile;
            }
        }
    }
    return best;
}

template <int kBits, typename T>
void launch(const Params& p, const Plan& plan, int device, int64_t smem_max, cudaStream_t stream) {
    auto kernel = gemv_kernel<kBits, T>;
    static std::once_flag configured[64];
    std::call_once(configured[device], [&] {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem_max)));
    });
    // sm_90, opt-in (KBIT_PDL=1): programmatic dependent launch, so that the table fill and the
    // first weight loads overlap the previous kernel's tail (see pdl_wait). Measured on H100: a
    // chain of GEMVs gets ~9% faster (8B layer, M=1, k=4), but vLLM decode of an 8B model is not
    // (one run: kbit4 batch 1 300 vs 303 tok/s, benchmarks/results/bench_e2e_h100_s9.md): there
    // the GEMV follows vLLM's kernels, which do not trigger early. Off by default.
    static const bool pdl = env_int("KBIT_PDL", 0) != 0 && pdl_supported(kernel);
    Params q = p;
    q.pdl = pdl;
    launch_kernel(kernel, dim3(plan.groups * plan.splits), kThreads, static_cast<int>(plan.smem),
                  stream, 1, pdl, q);
}

template <typename T>
void launch_bits(int64_t bits, const Params& p, const Plan& plan, int device, int64_t smem_max,
                 cudaStream_t stream) {
    switch (bits) {
        case 2: return launch<2, T>(p, plan, device, smem_max, stream);
        case 3: return launch<3, T>(p, plan, device, smem_max, stream);
        case 4: return launch<4, T>(p, plan, device, smem_max, stream);
        default: return launch<5, T>(p, plan, device, smem_max, stream);
    }
}

}  // namespace

at::Tensor gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
                const at::Tensor& codebook, int64_t bits, int64_t n) {
    check_activation(x, qweight, "gemv");
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK(M <= kMaxM, "kbit::gemv: x has M=", M, " rows, the GEMV kernel takes at most ",
                kMaxM, " (use kbit::mma or kbit::linear for larger batches)");
    const TiledShape shape = check_tiled(qweight, absmax, bits, n, K, "gemv");
    check_codebook(codebook, bits, "gemv");
    TORCH_CHECK(absmax.device() == qweight.device() && codebook.device() == qweight.device(),
                "kbit::gemv: qweight, weight_absmax and codebook must be on the same device");
    // The kernel keeps 32-bit offsets in 8-byte units and 32-bit unit counters.
    TORCH_CHECK(shape.n_tiles * shape.k_tiles * bits * 32 < (int64_t{1} << 32), "kbit::gemv: ",
                n, " x ", K, " weight is too large");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(absmax.data_ptr()) % 4 == 0,
                "kbit::gemv: qweight must be 8-byte and weight_absmax 4-byte aligned");
    at::Tensor y = at::empty({M, n}, x.options());
    if (M == 0) return y;

    const c10::cuda::CUDAGuard guard(x.device());
    const int device = x.get_device();
    TORCH_CHECK(device < 64, "kbit::gemv: device index ", device, " >= 64");
    int sms = 0, smem_optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    const int64_t smem_max = smem_optin - 1024;  // leaves room for the static shared memory
    const Plan plan = make_plan(M, shape.n_tiles, shape.k_tiles, bits, sms, smem_max);
    TORCH_CHECK(plan.splits > 0, "kbit::gemv: not enough shared memory (", smem_max,
                " B per block) for M=", M);
    // The kernel splits n-tiles over groups in 32-bit arithmetic.
    TORCH_CHECK(shape.n_tiles * plan.groups < (int64_t{1} << 32), "kbit::gemv: n=", n,
                " is too large");

    Params p{};
    p.qw = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
    p.am = absmax.data_ptr<uint8_t>();
    p.cb = codebook.data_ptr<float>();
    p.x = x.data_ptr();
    p.y = y.data_ptr();
    p.sx = x.stride(0);
    p.M = static_cast<int>(M);
    p.K = static_cast<int>(K);
    p.n = static_cast<int>(n);
    p.n_tiles = static_cast<int>(shape.n_tiles);
    p.k_tiles = static_cast<int>(shape.k_tiles);
    p.k_len = plan.k_len;
    p.splits = plan.splits;
    p.groups = plan.groups;
    p.xrow = static_cast<int>(plan.xrow);
    p.table_bytes = plan.table_bytes;
    p.acc_off = static_cast<int>(plan.table_bytes + M * plan.xrow);
    p.row_shift = plan.row_shift;
    p.x_vec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
              (M == 1 || x.stride(0) % 8 == 0);
    at::Tensor ws, arrived;
    if (plan.splits > 1) {  // fp32 partial sums per split, and zeroed arrival counters
        ws = at::empty({plan.splits * M * n}, x.options().dtype(at::kFloat));
        arrived = at::zeros({plan.groups}, x.options().dtype(at::kInt));
        p.ws = ws.data_ptr<float>();
        p.arrived = reinterpret_cast<unsigned*>(arrived.data_ptr<int32_t>());
    }
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if (x.scalar_type() == at::kHalf)
        launch_bits<__half>(bits, p, plan, device, smem_max, stream);
    else
        launch_bits<__nv_bfloat16>(bits, p, plan, device, smem_max, stream);
    return y;
}

}  // namespace kbit
