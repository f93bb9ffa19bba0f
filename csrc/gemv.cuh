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
//    data, the result is deterministic. Where n-tiles pair up without lengthening the busiest
//    warp's run (k=2, M <= 4, make_plan), a unit is two n-tiles at one k-tile (kDensePair): x is
//    read from shared memory once for both.
//
// Issue slots per tile and lane (64 weights), sm_90 SASS of the main loop, k=4: 32 LOP3/SHF/IMAD
// (bit-plane transpose), 32 PRMT (table addresses), 32 LDS.32 (pairs), 4 LDS.128 (x), 8 HMMA,
// 8 absmax ops + 8 HADD2.F32, 16 FFMA, 6 LDG, ~40 loop, address and bookkeeping = ~185, i.e.
// ~2.9 per weight, half of them on the half-rate integer ALU; no shuffles. k=2: ~140 (12
// LOP3/SHF per word, 16 PRMT + 16 LDS.64), k=3: ~180, k=5: ~280 (its addresses are SHF+LOP3).
// At ~1.75 GHz that is below the HBM time of every k on H100 (k=2 is the closest: ~9 us of
// issue vs ~11 us of bandwidth on Llama-3-8B gate_up). Shared memory: 2 B of table per weight
// (+x), ~64 weights/clk/SM. Measured (ncu, H100; benchmarks/results/gemv_streaming_h100_s9.md),
// the loop did not reach either bound: ptxas puts all of its global loads on one scoreboard, so
// the first use of a prefetched tile also waited for the loads issued after it (about one memory
// latency per tile and warp): 70B gate_up ran at ~55% of HBM bandwidth at k=2, ~76% at k=4 (the
// per-tile loop of then; 8B gate_up at M=1 now: 1.76 TB/s at k=2, 2.40 at k=4).
// A cp.async ring with exact waits removed that stall but then hit shared-memory latency and the
// MIO queue, with no net gain, so the register ring stays. It runs in whole rounds without a
// per-tile branch (two waits per round, see the main loop) and is short: 2 tiles (dense), 1 (MoE).
//
// MoE decode (kbit::moe with few slots, moe_gemv.cu): the same kernel, template kMode, runs the
// two GEMMs of an MoE layer as GEMVs over "virtual" weights whose tiles come from the experts the
// slots were routed to (each slot s = t * topk + j is an M=1 GEMV; the MMA's 8 columns all read
// the slot's token):
//  * kMoeGateUp: rows = S slots x 2I, K = H; n-tile v belongs to slot v / (2I/16) and reads that
//    slot's expert; x = the T token rows. Output h [S, 2I] in x.dtype (the reference's rounding).
//  * kMoeDown: rows = T tokens x H, K' = topk x I (each slot's I padded to whole k-tiles); k-tile
//    kt of token t reads expert of slot (t, kt / k-tiles-per-expert). x' = act(gate) * up of the
//    slots, computed from h while x' is staged; the router weight scales the slot's per-block
//    fp32 absmax factors, so the sum over the top-k slots is the K' reduction itself.
//  Slots whose expert is not local (expert_map -1) load and compute nothing (their tiles add 0).
#pragma once
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

#include "gemv_runs.cuh"
#include "kbit_format.cuh"
#include "ops.h"

namespace kbit {
namespace {

constexpr int kThreads = kWarps * 32;
// kDensePair: kDense with units of two vertically adjacent n-tiles at the same k-tile, so that
// each lane's x chunk (4 LDS.128 per tile, 4 shared-memory wavefronts each although at M=1 the
// warp reads only 64 distinct bytes: ncu source counters) is read once for two tiles. An H100
// probe (x read once per round of 2 tiles, 8B / 70B layers, k=2, M = 1 / 4,
// benchmarks/results/probe_env_h100_s27_xprobe.md) took 0.92-0.97x the time; never reading x
// again 0.89-0.95x. ncu (k=2, 8B gate_up, M=1): 2.39 shared wavefronts per LDS, 20 LDS per tile,
// MIO-queue stalls the first stall reason (19%). The host picks it where n-tiles pair up without
// a longer critical path (make_plan).
enum Mode : int { kDense = 0, kMoeGateUp = 1, kMoeDown = 2, kDensePair = 3 };
// Tiles per warp in registers. The main loop drains all of a warp's loads once per round of
// kPrefetch tiles (see there); the other 15 warps of the SM keep the memory system busy meanwhile
// (dense, 2 tiles: 16 x 2 x 0.6-1.3 KB = 18-42 KB per SM in flight). Measured on an H100 (8B shapes,
// M = 1 and 4, benchmarks/results/ab_gemv_depth_h100_s17.md): dense 2 tiles is faster than 3, 4
// or the earlier 4-6 for every k (an 8B layer's four GEMVs at M=1 12% faster at k = 2, 3 and 5,
// 6% at k=4, against 6 / 5 / 4 / 4 tiles); 1 tile is faster still on the smallest layers (8B o,
// qkv) but 3-12% slower on gate_up. The MoE modes (a slot check in every load) are 2.5-6% faster
// at M = 1 with 1 tile than with 2-6 (Qwen3-30B-A3B, Mixtral), and the same at M = 4. Why the
// deeper rings lose was not isolated (the longer unrolled round costs registers, up to 128 with
// spills at 5-6 tiles, and instruction fetch); the bytes in flight were not the limit.
template <int kMode>
constexpr int kPrefetch = kMode == kDense || kMode == kDensePair ? 2 : 1;
constexpr int kMaxM = 8;  // the MMA's N
constexpr int kTableRows = 256;
constexpr int kTableRows5 = 1024;
constexpr int kTableBytes = kTableRows * 256;  // k = 2..4: 64 KB
constexpr int kXPad = 64;  // x row stride = 64 mod 128 B: 2 token rows of an LDS.128 share no bank

constexpr int kMoeMaxSlots = 64;  // MoE decode: T * topk slots, one shared-memory entry each

// MoE modes only (see the header comment). A kernel parameter of its own: folded into Params, the
// larger struct changes the dense kernel's sm_90 code (the measured one).
struct MoeArgs {
    const int32_t* ids32;  // topk_ids [S] (one of ids32 / ids64 is set)
    const int64_t* ids64;
    const int32_t* emap;   // expert_map [emap_n] or null
    const float* topk_w;   // [S]
    const void* h;         // kMoeDown: the gate_up output [S, 2I]
    uint32_t q_expert;     // per-expert stride of qw (8-byte units) and of am (4-byte units)
    uint32_t a_expert;
    int emap_n, S, topk, E, I;
    int nte;  // n-tiles per slot (gate_up: 2I/16) or per token (down: H/16)
    int kte;  // k-tiles per expert (gate_up: k_tiles; down: I padded to 128, / 128)
    int act;
    bool weight_on_input;  // topk == 1: the router weight scales h (before rounding) instead
};

struct Params {
    const uint32_t* qw;  // tiled bit planes (MoE: of expert 0; experts follow at q_expert)
    const uint8_t* am;   // tiled absmax
    const float* cb;     // codebook [2^bits]
    const void* x;       // [M, K], row stride sx elements
    void* y;             // [M, n]
    float* ws;           // split-K only: fp32 partial sums [splits][M][n]
    unsigned* arrived;   // split-K only: CTAs done per row group (zeroed)
    int64_t sx;
    int M, K, n, n_tiles, k_tiles;  // MoE: M = 1, n and n_tiles virtual (rows over slots/tokens)
    int k_len;             // k-tiles per split (the last split may have fewer)
    int splits, groups;    // grid = groups x splits CTAs; a group owns a range of n-tiles
    int xrow;              // bytes per token row of staged x: k_len * 256 + kXPad
    int table_bytes;       // shared-memory offset of x
    int acc_off;           // shared-memory offset of the fp32 sums [CTA's n-tiles][16][M], then
                           // of the warps' partial sums [kWarps][2][16][M]
    int row_shift;         // k = 5: log2 of the table row size (7: 32 copies, 6: 16 copies)
    bool x_vec;            // x rows are 16-byte aligned
    bool pdl;              // launched with programmatic dependent launch: x only after pdl_wait
    int Mx;                // token rows of x staged in shared memory (dense: M; MoE: T)
};

// Dense modes only: what the kernel stages as x (kbit::linear_add_rms_norm / linear_silu_mul,
// fused_linear.cu). The fused forms replace the elementwise kernel that would run before the
// GEMV: at M <= 8 that kernel and its launch gap cost about as much as a small layer's weights
// (8B qkv at k=2: ~2.5 us of norm + gap before ~6 us of GEMV), and without it the GEMV follows
// the previous kbit kernel directly, so programmatic dependent launch overlaps the two.
enum XIn : int { kXPlain = 0, kXAddNorm = 1, kXSiluMul = 2 };
struct XPro {
    int mode = kXPlain;
    // kXAddNorm: v = x + res (fp32), x' = T(T(v * rsqrt(mean_K(v^2) + eps)) * nw), as vLLM's
    // fused_add_rms_norm; res_out = T(v) [M, K] contiguous, written by the CTAs of group 0.
    const void* res = nullptr;
    void* res_out = nullptr;
    const void* nw = nullptr;  // norm weight [K]
    int64_t sres = 0;          // row stride of res
    float eps = 0.f;
    bool kb1 = false;  // stage_xpro's single-job form where it applies (KBIT_GEMV_XPRO_KB1=0: never)
    // kXSiluMul: x = h [M, 2K] (row stride Params::sx), x' = T(T(silu(h[:, :K])) * h[:, K:]).
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
    int xo;          // MoE: byte offset of the tile's x in shared memory (-1: slot not local)
    float w;         // kMoeDown: the slot's router weight
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

    // dq, da: kDensePair's second tile, one n-tile further (k_tiles tiles on).
    __device__ __forceinline__ Tile<kBits> load(uint32_t dq = 0, uint32_t da = 0) const {
        Tile<kBits> r;
        // (qo + dq) in 32 bits, then one pointer add: as q + qo + dq (two 64-bit adds per load)
        // the paired loop was 1.01-1.11x slower than single n-tiles, with it 0.93-0.98x at k=2
        // (benchmarks/results/probe_env_h100_s27_ptr.md)
#pragma unroll
        for (int j = 0; j < kBits; ++j) r.q[j] = ld_stream_v2(q + (qo + dq) + j * 32);  // 256 B per plane
        r.am[0] = ld_stream_u32(a + (ao + da));
        r.am[1] = ld_stream_u32(a + (ao + da) + 8);  // row g + 8
        return r;
    }
    __device__ __forceinline__ void next() {
        qo += kBits * 32;
        ao += 16;
        if (--left == 0) left = k_len, qo += q_jump, ao += a_jump;
    }
};

// MoE modes: a warp's stream over virtual tiles. Tile (v, kt) of the run: gate_up v = slot *
// nte + nt, kt = k-tile of H; down v = token * nte + nt, kt = j * kte + lk (slot token * topk + j).
// Its bytes are those of tile (nt, lk) of the slot's expert. Positions advance by counters (no
// divisions in the loop); the slot's local expert and router weight come from shared memory.
template <int kBits, bool kDown>
struct MoeStream {
    const uint2* q;
    const uint32_t* a;
    const int* s_e;      // local expert per slot, -1: not on this rank
    const float* s_w;    // router weight per slot
    uint32_t q_expert, a_expert, lane_q, lane_a;
    int nte, kte, topk, k_len, xrow;
    int left;            // k-tiles of the current n-tile still to load
    int nt, lk, j;       // n-tile within the slot / token; k-tile within the expert; slot of token
    int lk0, j0;         // lk, j at the CTA's first k-tile
    int slot0;           // first slot of the current n-tile (gate_up: the slot; down: t * topk)
    int jj;              // gate_up: slot0 - token * topk
    int xrow_off;        // byte offset of the current token's staged x row

    __device__ __forceinline__ Tile<kBits> load() const {
        Tile<kBits> r;
        const int slot = slot0 + (kDown ? j : 0);
        const int e = s_e[slot];
        r.xo = -1;
        r.w = 0.f;
        if (e >= 0) {
            const uint32_t tile = static_cast<uint32_t>(nt * kte + lk);
            const uint2* qp = q + e * q_expert + tile * (kBits * 32) + lane_q;
            const uint32_t* ap = a + e * a_expert + tile * 16 + lane_a;
#pragma unroll
            for (int i = 0; i < kBits; ++i) r.q[i] = ld_stream_v2(qp + i * 32);
            r.am[0] = ld_stream_u32(ap);
            r.am[1] = ld_stream_u32(ap + 8);
            r.xo = xrow_off + (k_len - left) * (kTileK * 2);
            if constexpr (kDown) r.w = s_w[slot];
        }
        return r;
    }
    __device__ __forceinline__ void next() {
        if (--left == 0) {
            left = k_len, lk = lk0, j = j0;
            if (++nt == nte) {
                nt = 0;
                if constexpr (kDown) {
                    slot0 += topk, xrow_off += xrow;
                } else {
                    ++slot0;
                    if (++jj == topk) jj = 0, xrow_off += xrow;
                }
            }
        } else if (++lk == kte && kDown) {
            lk = 0, ++j;
        }
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
// kScaled (kMoeDown): the block factors also carry the slot's router weight tl.w.
// kXr (kDensePair): 1 = also keep the x chunk in xr, 2 = take it from xr (no shared-memory read).
template <int kBits, typename T, bool kScaled = false, int kXr = 0>
__device__ __forceinline__ void tile_mma(const Tile<kBits>& tl, const uint8_t* table,
                                         uint32_t lane_off, int row_shift, const uint8_t* xs,
                                         float (&acc)[4], uint4 (&xr)[4]) {
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
            if (kXr != 2) xr[2 * w + bb] = *reinterpret_cast<const uint4*>(xs + (2 * w + bb) * 64);
            const uint4 xv = xr[2 * w + bb];
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            mma_m16n8k16<std::is_same_v<T, __nv_bfloat16>>(d, a[0], xv.x, xv.y);
            mma_m16n8k16<std::is_same_v<T, __nv_bfloat16>>(d, a[1], xv.z, xv.w);
            float s0 = absmax_div16(sc[0][bb], w), s1 = absmax_div16(sc[1][bb], w);
            if constexpr (kScaled) s0 *= tl.w, s1 *= tl.w;
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

// Sum over 8 columns of (x + res)^2 in fp32 (x, res: 16 bytes of T each).
template <typename T>
__device__ __forceinline__ float sum_sq(const uint4& xa, const uint4& ra) {
    constexpr bool kBF16 = std::is_same_v<T, __nv_bfloat16>;
    const uint32_t xw[4] = {xa.x, xa.y, xa.z, xa.w}, rw[4] = {ra.x, ra.y, ra.z, ra.w};
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 u = unpack2<kBF16>(xw[i]), v = unpack2<kBF16>(rw[i]);
        ss = fmaf(u.x + v.x, u.x + v.x, ss);
        ss = fmaf(u.y + v.y, u.y + v.y, ss);
    }
    return ss;
}

// The fused x prologues (XPro, dense modes), after pdl_wait: x' of the CTA's K range, stored as
// store_x does. The host guarantees 16-byte aligned rows of x, res, res_out and nw, so every
// access is 8 elements wide. `writer`: this CTA writes its K range of res_out (the CTAs of group
// 0 together cover K once). s_ss: the per-token sums of squares, zeroed by the caller before a
// __syncthreads.
//
// Jobs: one per token and 8-column chunk (16 bytes of each input), dealt to all threads, each
// thread's jobs taken kB (4, or 1 where no thread has more than one) at a time with all their
// loads issued first. With a 32-column block per job an 8B qkv / gate_up CTA at M=1 (128
// blocks) ran its norm on a quarter of the threads, 32 dependent columns each; with single chunk
// jobs the 8B down CTA (1792 chunks at M=1) waited for ~4 L2 round trips in a row
// (benchmarks/results/bench_fused_chain_h100_s37_*.md).
//
// The norm divides by the rms over all of K, whatever K range this CTA multiplies: every CTA
// sums the whole rows itself (fp32, in no fixed order: not bit-identical to the reference's sum,
// within its rounding). Where the CTA's K range is all of K and its jobs fit in one batch of kB
// per thread (8B and 70B shapes at M <= 4 resp. 2, no split-K), the batch's loads serve both the
// sum and x' (one pass: every CTA reads x, res and nw once, 24 KB at K = 4096, all 132 CTAs at
// once from the same L2 lines). Otherwise a first pass sums the rows, four tokens per round with
// their loads issued together, and the batches re-read them.
template <typename T, int kB>
__device__ __forceinline__ void stage_xpro(uint8_t* xs, const Params& p, const XPro& xp, int k_begin,
                                        int nblk, bool writer, float* s_ss) {
    constexpr bool kBF16 = std::is_same_v<T, __nv_bfloat16>;
    const T* x = static_cast<const T*>(p.x);
    const T* res = static_cast<const T*>(xp.res);
    const T* nw = static_cast<const T*>(xp.nw);
    const bool norm = xp.mode == kXAddNorm;
    const int nch = nblk * 4;
    const bool one_pass = norm && p.splits == 1 && p.M * nch <= kB * kThreads;
    if (norm && !one_pass) {
        for (int m0 = 0; m0 < p.M; m0 += 4) {
            float ss[4] = {0.f, 0.f, 0.f, 0.f};
            for (int c = threadIdx.x * 8; c < p.K; c += kThreads * 8) {
                uint4 xa[4], ra[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (m0 + j < p.M) {
                        xa[j] = *reinterpret_cast<const uint4*>(x + (m0 + j) * p.sx + c);
                        ra[j] = *reinterpret_cast<const uint4*>(res + (m0 + j) * xp.sres + c);
                    }
                }
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (m0 + j < p.M) ss[j] += sum_sq<T>(xa[j], ra[j]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) ss[j] = warp_sum(ss[j]);
            if ((threadIdx.x & 31) == 0) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (m0 + j < p.M) atomicAdd(s_ss + m0 + j, ss[j]);
            }
        }
        __syncthreads();
    }
    const T* src0 = norm ? res : x;  // the second input: res, or the gate half of h
    int m = 0, ch = threadIdx.x;
    while (ch >= nch) ch -= nch, ++m;  // nch < kThreads under split-K
    // At least one batch per thread, also where it has no job: the one-pass batch has a barrier.
    do {
        int jm[kB], jc[kB];
        uint4 in[kB][3];  // x (or up), res (or gate), norm weight
#pragma unroll
        for (int r = 0; r < kB; ++r) {
            jm[r] = m, jc[r] = ch;
            const int c = (k_begin * kBlocksPerTile + (ch >> 2)) * kBlock + 8 * (ch & 3);
            in[r][0] = in[r][1] = make_uint4(0u, 0u, 0u, 0u);  // no job: adds 0 to the one-pass sums
            if (m < p.M && c < p.K) {
                in[r][0] = *reinterpret_cast<const uint4*>(x + m * p.sx + (norm ? c : c + p.K));
                in[r][1] = *reinterpret_cast<const uint4*>(src0 + m * (norm ? xp.sres : p.sx) + c);
                if (norm) in[r][2] = *reinterpret_cast<const uint4*>(nw + c);
            }
            ch += kThreads;
            while (ch >= nch) ch -= nch, ++m;
        }
        if (one_pass) {  // the sums of this (only) batch: per job slot, one add per warp and token
#pragma unroll
            for (int r = 0; r < kB; ++r) {
                const float ss = sum_sq<T>(in[r][0], in[r][1]);
                const int m0 = __shfl_sync(0xffffffffu, jm[r], 0);
                if (__all_sync(0xffffffffu, jm[r] == m0)) {  // nch % 32 == 0: always
                    const float warp_ss = warp_sum(ss);
                    if ((threadIdx.x & 31) == 0 && m0 < p.M) atomicAdd(s_ss + m0, warp_ss);
                } else if (jm[r] < p.M) {
                    atomicAdd(s_ss + jm[r], ss);
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int r = 0; r < kB; ++r) {
            if (jm[r] >= p.M) break;
            const int bl = jc[r] >> 2, j = jc[r] & 3;  // block of the CTA's K range, its chunk
            const int c = (k_begin * kBlocksPerTile + bl) * kBlock + 8 * j;
            uint32_t w[4] = {0u, 0u, 0u, 0u};  // columns >= K stay 0 (as in load_x)
            if (c < p.K) {
                const uint32_t bw[4] = {in[r][0].x, in[r][0].y, in[r][0].z, in[r][0].w};
                const uint32_t aw[4] = {in[r][1].x, in[r][1].y, in[r][1].z, in[r][1].w};
                float o[8];
                if (norm) {
                    const uint32_t ww[4] = {in[r][2].x, in[r][2].y, in[r][2].z, in[r][2].w};
                    const float rinv = rsqrtf(s_ss[jm[r]] / static_cast<float>(p.K) + xp.eps);
                    uint32_t v[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 xf = unpack2<kBF16>(bw[i]), rf = unpack2<kBF16>(aw[i]);
                        const float2 wf = unpack2<kBF16>(ww[i]);
                        const float s0 = rf.x + xf.x, s1 = rf.y + xf.y;
                        v[i] = pack2<kBF16>(s0, s1);
                        // rounded once more by pack2 below
                        o[2 * i] = round_to<kBF16>(s0 * rinv) * wf.x;
                        o[2 * i + 1] = round_to<kBF16>(s1 * rinv) * wf.y;
                    }
                    if (writer)
                        *reinterpret_cast<uint4*>(static_cast<T*>(xp.res_out) + jm[r] * p.K + c) =
                            make_uint4(v[0], v[1], v[2], v[3]);
                } else {
                    // Every CTA computes the activation of its whole K range (at M=4 and 8B down
                    // 57k values per CTA): fast exp and division (~2 ulp in fp32, below the
                    // rounding to x.dtype) instead of expf and an IEEE divide.
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 u = unpack2<kBF16>(bw[i]), g = unpack2<kBF16>(aw[i]);
                        o[2 * i] = round_to<kBF16>(__fdividef(g.x, 1.0f + __expf(-g.x))) * u.x;
                        o[2 * i + 1] = round_to<kBF16>(__fdividef(g.y, 1.0f + __expf(-g.y))) * u.y;
                    }
                }
#pragma unroll
                for (int t = 0; t < 4; ++t) w[t] = pack2<kBF16>(o[2 * t], o[2 * t + 1]);
            }
            // store_x's layout: pair 4j + t of the block is word j of lane t's 16 bytes
            uint8_t* dst = xs + jm[r] * p.xrow + bl * 64 + j * 4;
#pragma unroll
            for (int t = 0; t < 4; ++t) *reinterpret_cast<uint32_t*>(dst + t * 16) = w[t];
        }
    } while (m < p.M);
}

// kMoeDown: half h (columns 16h .. 16h + 15) of block bl of the CTA's K' range for token m, =
// act(gate) * up of slot (m, j) at those columns of I, computed from h (x.dtype) in fp32 and
// rounded once, as the reference does, and stored where store_x puts them: pairs 8h + 4q + i =
// words w[2h + q][i] of the block, i.e. 8 bytes at +16 t + 8 h for lane t. Columns >= I (the
// expert's padding to whole k-tiles) and slots not on this rank are 0.
template <typename T>
__device__ __forceinline__ void stage_act(uint8_t* xs, const Params& p, const MoeArgs& mo,
                                          const int* s_e, int k_begin, int m, int bl, int h) {
    uint32_t w[2][4] = {};
    const int gb = k_begin * kBlocksPerTile + bl, per_expert = mo.kte * kBlocksPerTile;
    const int j = gb / per_expert, col = (gb - j * per_expert) * kBlock;
    const int slot = m * mo.topk + j;
    if (col < mo.I && s_e[slot] >= 0) {
        // 16-byte aligned: h rows are 2I elements, I % 32 == 0
        const uint4* g4 = reinterpret_cast<const uint4*>(static_cast<const T*>(mo.h) +
                                                         int64_t{slot} * 2 * mo.I + col + 16 * h);
        const uint4* u4 = g4 + mo.I / 8;
        constexpr bool kBF16 = std::is_same_v<T, __nv_bfloat16>;
#pragma unroll
        for (int q = 0; q < 2; ++q) {  // 8 columns = pairs 4q .. 4q + 3 of the half
            const uint4 gv = g4[q], uv = u4[q];
            const uint32_t gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 gf = unpack2<kBF16>(gw[i]), uf = unpack2<kBF16>(uw[i]);
                w[q][i] = pack2<kBF16>(act_fn(gf.x, mo.act) * uf.x, act_fn(gf.y, mo.act) * uf.y);
            }
        }
    }
    uint8_t* dst = xs + m * p.xrow + bl * 64 + h * 8;
#pragma unroll
    for (int t = 0; t < 4; ++t) *reinterpret_cast<uint2*>(dst + t * 16) = make_uint2(w[0][t], w[1][t]);
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

template <int kBits, typename T, int kMode = kDense>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_kernel(const Params p, const MoeArgs mo, const XPro xp) {
    constexpr bool kMoe = kMode == kMoeGateUp || kMode == kMoeDown, kDown = kMode == kMoeDown;
    constexpr bool kPair = kMode == kDensePair;
    constexpr int kNU = kPair ? 2 : 1;       // n-tiles per unit (the host keeps n_tiles even)
    constexpr int kRows = kTileN * kNU;       // output rows per unit
    extern __shared__ __align__(16) uint8_t smem[];  // [table][x rows][sums][warp partials]
    __shared__ int is_last;
    __shared__ float s_ss[kMaxM];  // kXAddNorm: sum of (x + res)^2 per token
    // MoE: local expert (-1: none) and router weight of each slot
    __shared__ int s_e[kMoe ? kMoeMaxSlots : 1];
    __shared__ float s_w[kMoe ? kMoeMaxSlots : 1];
    // Dense modes let the next PDL kernel launch now rather than after the main loop: its CTAs
    // cannot start before ours leave their SMs (one CTA per SM: 512 threads x 128 registers),
    // but they are then placed as each SM frees, without waiting for the launch of a grid, and
    // start copying their table and first tiles. That kernel reads our output only after its
    // pdl_wait(), which returns when this whole grid has completed, and writes nothing before it
    // (the rule of kbit_format.cuh), so our reads of x after this point stay safe even where it
    // reuses x's memory. H100, 32 8B layers' linears in one CUDA graph
    // (benchmarks/results/chain_trigger_h100_s39/README.md): 0.97-0.99x the time per layer at
    // k = 2 / 4, M = 1 / 2 (k=2, M=1: 44.1-44.4 -> 43.5-43.7 us). Two CTAs per SM (12 warps, 80
    // registers) so that the next kernel's CTA could wait beside ours took 1.5-1.8x. The MoE modes
    // keep the trigger after the loop (not measured).
    if constexpr (!kMoe) pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // Integer divisions are ~100-cycle dependent chains (no hardware divider): none where a
    // quotient is known, and none in the epilogue.
    const int group = p.splits == 1 ? blockIdx.x : blockIdx.x / p.splits;
    const int split = blockIdx.x - group * p.splits;
    // 32-bit: the host checks n_tiles * groups < 2^32 (a 64-bit division is a ~100-instruction
    // call, and this runs on the latency chain before the first weight is used).
    const unsigned n_rows = p.n_tiles / kNU, gr = p.groups;  // units along n: n-tiles or pairs
    const int n_begin = kNU * static_cast<int>(group * n_rows / gr);
    const int n_cta = kNU * static_cast<int>((group + 1) * n_rows / gr) - n_begin;
    const int k_begin = split * p.k_len, k_len = min(p.k_len, p.k_tiles - k_begin);
    // (n-tile or pair, k-tile) units, n-major: consecutive in memory
    const int units = n_cta / kNU * k_len;
    const int u0 = run_begin(warp, units), u1 = run_begin(warp + 1, units);  // host: no overflow

    // What the CTA reads before its first MMA is requested at once, in the order it is needed:
    // the codebook, x (unless PDL: x is the previous kernel's output), each warp's first D
    // tiles. Issued after the weight loads, the codebook and x reads would queue behind the
    // weight stream in the memory system (~2-5k cycles measured on H100 at 8B shapes).
    __shared__ float cb_s[1 << kBits];
    float cbv = 0.f;
    if (threadIdx.x < (1 << kBits)) cbv = cb_value(p.cb, threadIdx.x);
    int se = -1;  // MoE: the slots' experts, needed for the first weight address
    float sw = 0.f;
    if constexpr (kMoe) {
        if (threadIdx.x < mo.S) {
            se = local_expert(mo, threadIdx.x);
            sw = mo.topk_w[threadIdx.x];
        }
    }
    const int nblk = k_len * kBlocksPerTile;
    const bool has_x = threadIdx.x < nblk;  // token 0, block threadIdx.x
    XJob xj;
    if (!kDown && !p.pdl && xp.mode == kXPlain && has_x) xj = load_x<T>(p, k_begin, 0, threadIdx.x);

    constexpr int D = kPrefetch<kMode>;
    std::conditional_t<kMoe, MoeStream<kBits, kDown>, TileStream<kBits>> ts;
    ts.q = reinterpret_cast<const uint2*>(p.qw);
    ts.a = reinterpret_cast<const uint32_t*>(p.am);
    if constexpr (kMoe) {  // the warp's first tile: virtual n-tile v, k-tile kk
        const int v = n_begin + u0 / k_len, kk = k_begin + u0 % k_len, grp = v / mo.nte;
        ts.s_e = s_e, ts.s_w = s_w;
        ts.q_expert = mo.q_expert, ts.a_expert = mo.a_expert, ts.lane_q = lane, ts.lane_a = g;
        ts.nte = mo.nte, ts.kte = mo.kte, ts.topk = mo.topk, ts.xrow = p.xrow;
        ts.nt = v - grp * mo.nte;
        if constexpr (kDown) {  // grp = token
            ts.slot0 = grp * mo.topk, ts.jj = 0, ts.xrow_off = grp * p.xrow;
            ts.j = kk / mo.kte, ts.lk = kk - ts.j * mo.kte;
            ts.j0 = k_begin / mo.kte, ts.lk0 = k_begin - ts.j0 * mo.kte;
        } else {  // grp = slot
            const int tok = grp / mo.topk;
            ts.slot0 = grp, ts.jj = grp - tok * mo.topk, ts.xrow_off = tok * p.xrow;
            ts.j = ts.j0 = 0, ts.lk = kk, ts.lk0 = k_begin;
        }
    } else {
        const int64_t first =
            int64_t{n_begin + u0 / k_len * kNU} * p.k_tiles + k_begin + u0 % k_len;
        ts.qo = static_cast<uint32_t>(first * (kBits * 32) + lane);
        ts.ao = static_cast<uint32_t>(first * 16 + g);
        ts.q_jump = static_cast<uint32_t>(kNU * p.k_tiles - k_len) * (kBits * 32);
        ts.a_jump = static_cast<uint32_t>(kNU * p.k_tiles - k_len) * 16;
    }
    ts.k_len = k_len;
    ts.left = k_len - u0 % k_len;
    Tile<kBits> buf[D];
    // kDensePair: the second tile of a unit, one n-tile (k_tiles tiles) after the first
    const uint32_t pair_q = static_cast<uint32_t>(p.k_tiles) * (kBits * 32);
    const uint32_t pair_a = static_cast<uint32_t>(p.k_tiles) * 16;
    auto load_ring = [&] {  // the warp's first D tiles, in stream order
        if constexpr (kPair) {
            if (u0 < u1) {
                buf[0] = ts.load();
                buf[1] = ts.load(pair_q, pair_a);
                ts.next();
            }
        } else {
#pragma unroll
            for (int i = 0; i < D; ++i) {
                if (u0 + i < u1) {
                    buf[i] = ts.load();
                    ts.next();
                }
            }
        }
    };
    if constexpr (!kMoe) load_ring();

    if (threadIdx.x < (1 << kBits)) cb_s[threadIdx.x] = cbv;
    if (!kMoe && threadIdx.x < kMaxM) s_ss[threadIdx.x] = 0.f;  // stage_xpro's sums
    if (kMoe && threadIdx.x < mo.S) s_e[threadIdx.x] = se, s_w[threadIdx.x] = sw;
    __syncthreads();
    if constexpr (kMoe) load_ring();  // MoE: the first addresses needed the slots' experts
    fill_table<kBits, T>(smem, cb_s, p.row_shift);
    // Up to here only constant data (weights, codebook) was read, unless x was: with PDL this
    // prologue overlaps the previous kernel's tail; x is that kernel's output.
    pdl_wait();
    uint8_t* xs_s = smem + p.table_bytes;
    if constexpr (kDown) {
        // x' = act(gate) * up of the slots, from h (the previous kernel's output), one half block
        // of one token per job, the jobs (token m, half block hb) dealt to all threads: at T = 1
        // Qwen3's 192 blocks were 192 jobs of ~30 dependent instructions per column on 6 warps,
        // 320 threads idle (and each further token another such round), right before the loop.
        const int halves = 2 * nblk;
        for (int m = 0, hb = threadIdx.x; m < p.Mx;) {  // job m * halves + hb, by counters
            if (hb < halves) {
                stage_act<T>(xs_s, p, mo, s_e, k_begin, m, hb >> 1, hb & 1);
                hb += kThreads;
            } else {
                hb -= halves, ++m;
            }
        }
    } else if (!kMoe && xp.mode != kXPlain) {
        // At most one job per thread (8B qkv / gate_up at M=1: 512 jobs): batches of one job, not
        // four. The kB = 4 form ran its three empty slots (sums, warp sums) and ~4x the unrolled
        // code, once per CTA from a cold instruction cache; which of the two cost more was not
        // isolated. H100, 32 8B layers' linears in one CUDA graph, M=1: 42.49 instead of 43.75 us
        // per layer at k=2, 54.9 instead of 56.2 at k=4 (M=2 unchanged: 1024 jobs);
        // benchmarks/results/e2e_h100_s43/.
        if (xp.kb1 && p.M * nblk * 4 <= kThreads)
            stage_xpro<T, 1>(xs_s, p, xp, k_begin, nblk, group == 0, s_ss);
        else
            stage_xpro<T, 4>(xs_s, p, xp, k_begin, nblk, group == 0, s_ss);
    } else {
        if (p.pdl && has_x) xj = load_x<T>(p, k_begin, 0, threadIdx.x);
        if (has_x) store_x(xs_s, p, 0, threadIdx.x, xj);
        // dense: Mx == M; reading M there keeps the measured dense code (a new field read
        // changes its sm_90a schedule)
        for (int m = 0; m < (kMoe ? p.Mx : p.M); ++m)
            for (int bl = threadIdx.x + (m == 0 ? kThreads : 0); bl < nblk; bl += kThreads)
                store_x(xs_s, p, m, bl, load_x<T>(p, k_begin, m, bl));
    }
    float* acc_s = reinterpret_cast<float*>(smem + p.acc_off);
    float* part_s = acc_s + n_cta * kTileN * p.M;
    __syncthreads();

    // x of this lane's token column (lanes past M repeat token M-1) and 16-byte chunk t.
    const uint8_t* xs0 = smem + p.table_bytes + min(g, p.M - 1) * p.xrow + t * 16;
    const uint8_t* xs = xs0 + (u0 % k_len) * (kTileK * 2);
    const uint8_t* xs_lane = smem + p.table_bytes + t * 16;  // MoE: + the tile's offset
    const uint32_t lane_off = kBits == 2   ? lane * 8
                              : kBits == 5 ? (lane & ((1 << (p.row_shift - 2)) - 1)) * 4
                                           : lane * 4;
    // A warp adds up one n-tile (kDensePair: pair) segment of its run at a time. A segment
    // spanning the whole K range is this warp's alone and goes to acc_s; only the first and the
    // last segment of a run can be partial, they go to the warp's part_s slots 0 and 1 (kRows rows
    // each), and the epilogue adds the slots of a row in warp order (gemv_runs.cuh): no atomics,
    // deterministic.
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float acc2[4] = {0.f, 0.f, 0.f, 0.f};  // kDensePair: the pair's second n-tile
    uint4 xr[4];                           // kDensePair: the unit's x chunk
    float* acc_tile = acc_s + (u0 / k_len) * kRows * p.M;  // this n-tile's (pair's) sums
    float* part = part_s + warp * 2 * kRows * p.M;
    int left = k_len - u0 % k_len;  // k-tiles left in this n-tile
    bool whole = left == k_len;     // the segment started at k-tile 0
    // After unit u's MMAs: where its n-tile (pair) or the warp's run ends, the segment's sums leave
    // the registers; x and the sums move on to the next unit.
    auto unit_done = [&](int u) {
        const bool tile_end = --left == 0;
        if (tile_end || u + 1 == u1) {
            float* dst = tile_end && whole ? acc_tile : part;
            store_sums(acc, dst, g, t, p.M);
            if constexpr (kPair) store_sums(acc2, dst + kTileN * p.M, g, t, p.M);
            part = part_s + (warp * 2 + 1) * kRows * p.M;
            whole = true;
        }
        if constexpr (!kMoe) xs += kTileK * 2;
        if (tile_end) {
            left = k_len, acc_tile += kRows * p.M;
            if constexpr (!kMoe) xs = xs0;
        }
    };
    // kDensePair, unit u: tile A (slot 0) reads x from shared memory and keeps it for tile B
    // (slot 1); each slot is refilled right after its MMA, as in the single-tile round below.
    auto step_pair = [&](int u) {
        if constexpr (kPair) {
            tile_mma<kBits, T, false, 1>(buf[0], smem, lane_off, p.row_shift, xs, acc, xr);
            if (u + 1 < u1) buf[0] = ts.load();
            tile_mma<kBits, T, false, 2>(buf[1], smem, lane_off, p.row_shift, xs, acc2, xr);
            if (u + 1 < u1) {
                buf[1] = ts.load(pair_q, pair_a);
                ts.next();
            }
            unit_done(u);
        }
    };
    // Tile u (ring slot i = (u - u0) % D): its MMA, the slot's refill with tile u + D, the sums.
    auto step = [&](int i, int u) {
        if constexpr (kMoe) {
            if (buf[i].xo >= 0)
                tile_mma<kBits, T, kDown>(buf[i], smem, lane_off, p.row_shift,
                                          xs_lane + buf[i].xo, acc, xr);
        } else {
            tile_mma<kBits, T>(buf[i], smem, lane_off, p.row_shift, xs, acc, xr);
        }
        if (u + D < u1) {  // refill the slot just consumed (a predicated load, no branch)
            buf[i] = ts.load();
            ts.next();
        }
        unit_done(u);
    };
    // Whole rounds of D tiles first, with no per-tile "tile exists" branch. ptxas puts every
    // weight load on one scoreboard, and the first use of a tile waits until that scoreboard is
    // empty (global loads complete out of order: it cannot count). Behind a branch that may skip
    // the previous tile, it must assume that tile's wait did not happen, so every tile waited for
    // the refill issued one tile earlier: about one memory latency per tile and warp
    // (benchmarks/results/gemv_streaming_h100_s9.md). Without the branch, the wait of slot 0 also
    // covers slots 1..D-1, which were loaded before it: two waits per round (sm_90 SASS), and the
    // 15 other warps of the SM compute meanwhile. The tail round keeps the branch.
    // kDensePair: every unit is one whole round of its 2 tiles (no tail).
    if constexpr (kPair) {
        for (int u = u0; u < u1; ++u) step_pair(u);
    } else {
        int u = u0;
        for (; u + D <= u1; u += D) {
#pragma unroll
            for (int i = 0; i < D; ++i) step(i, u + i);
        }
#pragma unroll
        for (int i = 0; i < D; ++i)  // the last < D tiles
            if (u + i < u1) step(i, u + i);
    }
    if constexpr (kMoe) pdl_trigger();  // the weights are streamed: the next kernel may start
    __syncthreads();

    // Output rows [16 n_begin, 16 (n_begin + n_cta)) of every token; padding rows >= n are skipped.
    // Which warps summed a row follows from the deal (gemv_runs.cuh): two divisions, no table and
    // no search. This code runs once per CTA, usually by one or a few warps, from a cold
    // instruction cache (the kernel's other ~5k instructions went through it since the last
    // call): kept short and rolled. An unrolled compare against all 32 slots stalled on
    // instruction fetch every ~48 instructions (benchmarks/results/ncu_moe_m1_stalls_h100_s13_*).
    const int rows = min(n_cta * kTileN, p.n - n_begin * kTileN), row0 = n_begin * kTileN;
    T* y = static_cast<T*>(p.y);
    for (int r = threadIdx.x; r < rows; r += kThreads) {
        // unsigned (r >= 0): / and % by 16 (32) are a shift and a mask; a = the row's first unit
        const unsigned ur = r, rr = ur % kRows, a = ur / kRows * k_len;
        const unsigned w_lo = warp_of(a, units), w_hi = warp_of(a + k_len - 1, units);
        float sw = 1.f;
        if (kMode == kMoeGateUp && mo.weight_on_input)  // topk == 1: row / 2I = slot
            sw = s_w[(row0 + r) / (mo.nte * kTileN)];
#pragma unroll 1
        for (int m = 0; m < p.M; ++m) {
            float v = 0.f;
            if (w_lo == w_hi) {
                v = acc_s[r * p.M + m];  // one warp summed the whole n-tile (pair)
            } else {
                // A counted loop (a `w <= w_hi` loop on unsigned has no trip count for ptxas, which
                // then checks the exit after every load and serialises them).
                const int n_w = static_cast<int>(w_hi - w_lo) + 1;
#pragma unroll 4
                for (int i = 0; i < n_w; ++i) {
                    const unsigned w = w_lo + i;
                    // Loaded unconditionally (an empty run's slot is in bounds, never written,
                    // and not added): the unrolled loads then issue back to back.
                    const float s = part_s[(partial_slot(w, a, units) * kRows + rr) * p.M + m];
                    if (!run_empty(w, units)) v += s;
                }
            }
            v *= 16.f;  // the absmax were applied as absmax/16
            if (kMode == kMoeGateUp && mo.weight_on_input) v *= sw;
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
    bool pair = false;  // launch kDensePair: units of two n-tiles
    int64_t xrow = 0, smem = 0;
};

// kNever: kDense / MoE; kAuto: kDensePair where make_plan's cost is lower (k=2, M <= 4); kAlways:
// wherever n_tiles is even (KBIT_GEMV_PAIR=0 / 1 force the first / last for dense GEMVs).
enum class PairMode { kNever, kAuto, kAlways };

// Time of a tile in kDensePair relative to kDense, plus a fixed price per call, in single-tile
// times (H100, k=2, M = 1 / 4, benchmarks/results/probe_env_h100_s27_ptr.md): 0.93-0.98x on
// 8B gate_up / down and 70B o / gate_up / down, where a warp has 14-56 tiles, but 1.00 / 1.05x on
// 8B o, where it has 4 (the price keeps that one single). kAuto pairs k=2 at M <= 4 only: forced
// on o / gate_up / down at M = 1 / 4 the pairs took 0.97-1.03x at k=3 and 1.02-1.08x at k=5
// (benchmarks/results/probe_env_h100_s28_pair_k35.md), 0.98-1.04x at k=4 (x is a smaller share
// of the loop's shared-memory reads), and at M = 8 70B gate_up took 1.12x, 8B down 1.02x
// (benchmarks/results/probe_env_h100_s28_pair.md).
constexpr double kPairTile = 0.95, kPairPrice = 0.5;
constexpr int64_t kPairMaxM = 4;

// Picks the K split, the table size and (pair_mode) single or paired n-tiles: minimise the tile
// times of the busiest warp (+ a fixed price for split-K: workspace traffic, the counter memset
// and the last-CTA pass), within shared memory. M = token columns of the sums (MoE: 1), Mx = token
// rows of x staged (dense: M; MoE: T).
Plan make_plan(int64_t M, int64_t Mx, int64_t n_tiles, int64_t k_tiles, int64_t bits,
               int64_t sms, int64_t smem_max, PairMode pair_mode = PairMode::kNever) {
    constexpr double kSplitPrice = 3.0;  // in tiles per warp, ~1.5-2 us
    Plan best;
    double best_cost = 0.0;
    const int shifts5[2] = {7, 6};  // k = 5: 32 copies (128 KB), else 16 copies (64 KB)
    const bool can_pair = n_tiles % 2 == 0 && (pair_mode == PairMode::kAlways ||
                                               (pair_mode == PairMode::kAuto && bits == 2 &&
                                                M <= kPairMaxM));
    for (int pair = can_pair && pair_mode == PairMode::kAlways; pair <= int{can_pair}; ++pair) {
        const int64_t nu = pair ? 2 : 1;  // n-tiles per unit
        const int64_t n_units = n_tiles / nu;
        const double unit_cost = pair ? 2 * kPairTile : 1.0;  // in single-tile times
        const double price = pair ? kPairPrice : 0.0;
        for (int v = 0; v < (bits == 5 ? 2 : 1); ++v) {
            const int row_shift = bits == 5 ? shifts5[v] : 8;
            const int64_t table = bits == 5 ? int64_t{kTableRows5} << row_shift : kTableBytes;
            const double slow = bits == 5 && row_shift == 6 ? 1.3 : 1.0;  // 2-way bank conflicts
            for (int64_t s = 1; s <= k_tiles; ++s) {
                const int64_t k_len = ceil_div(k_tiles, s);
                if (ceil_div(k_tiles, k_len) != s) continue;  // same split as a smaller s
                const int64_t xrow = k_len * kTileK * 2 + kXPad;
                const int64_t per_unit = nu * kTileN * M * 4;  // sum bytes per unit row
                const int64_t room = smem_max - table - Mx * xrow - 2 * kWarps * per_unit;
                if (room < per_unit) continue;
                int64_t groups = std::min(n_units, std::max<int64_t>(1, sms / s));
                groups = std::max(groups, ceil_div(n_units, room / per_unit));
                const int64_t n_cta = ceil_div(n_units, groups);  // unit rows per CTA
                const int64_t waves = ceil_div(groups * s, sms);
                const double cost =
                    double(waves * ceil_div(n_cta * k_len, kWarps)) * slow * unit_cost +
                    (s > 1 ? kSplitPrice : 0.0) + price;
                if (best.splits == 0 || cost < best_cost) {
                    best_cost = cost;
                    best.splits = static_cast<int>(s);
                    best.k_len = static_cast<int>(k_len);
                    best.groups = static_cast<int>(groups);
                    best.table_bytes = static_cast<int>(table);
                    best.row_shift = row_shift;
                    best.pair = pair != 0;
                    best.xrow = xrow;
                    best.smem = table + Mx * xrow + (n_cta + 2 * kWarps) * per_unit;
                }
            }
        }
    }
    return best;
}

struct GemvDevice {
    int device = 0, sms = 0;
    int64_t smem_max = 0;  // dynamic shared memory per CTA
};

inline GemvDevice gemv_device(const at::Tensor& x, const char* op) {
    GemvDevice d;
    d.device = x.get_device();
    TORCH_CHECK(d.device < 64, "kbit::", op, ": device index ", d.device, " >= 64");
    int smem_optin = 0;
    d.sms = device_sms(d.device);
    C10_CUDA_CHECK(
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, d.device));
    d.smem_max = smem_optin - 2048;  // leaves room for the static shared memory (<= 1.8 KB)
    return d;
}

// The plan's fields of p (p.M, p.Mx, p.n set), and for split-K the fp32 partial sums and the
// zeroed arrival counters, allocated in ws / arrived (alive until the launch is enqueued).
inline void apply_plan(Params& p, const Plan& plan, const at::Tensor& x, at::Tensor& ws,
                       at::Tensor& arrived) {
    p.k_len = plan.k_len;
    p.splits = plan.splits;
    p.groups = plan.groups;
    p.xrow = static_cast<int>(plan.xrow);
    p.table_bytes = plan.table_bytes;
    p.acc_off = static_cast<int>(plan.table_bytes + p.Mx * plan.xrow);
    p.row_shift = plan.row_shift;
    if (plan.splits > 1) {
        ws = at::empty({int64_t{plan.splits} * p.M * p.n}, x.options().dtype(at::kFloat));
        arrived = at::zeros({plan.groups}, x.options().dtype(at::kInt));
        p.ws = ws.data_ptr<float>();
        p.arrived = reinterpret_cast<unsigned*>(arrived.data_ptr<int32_t>());
    }
}

// pdl: launch with programmatic dependent launch where the kernel supports it (sm_90 code).
template <int kBits, typename T, int kMode>
void launch(const Params& p, const MoeArgs& mo, const XPro& xp, const Plan& plan,
            const GemvDevice& d, bool pdl, cudaStream_t stream) {
    auto kernel = gemv_kernel<kBits, T, kMode>;
    static std::once_flag configured[64];
    std::call_once(configured[d.device], [&] {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(d.smem_max)));
    });
    Params q = p;
    q.pdl = pdl && pdl_supported<gemv_kernel<kBits, T, kMode>>();
    launch_kernel(kernel, dim3(plan.groups * plan.splits), kThreads, static_cast<int>(plan.smem),
                  stream, 1, q.pdl, q, mo, xp);
}

template <typename T, int kMode>
void launch_bits(int64_t bits, const Params& p, const MoeArgs& mo, const XPro& xp, const Plan& plan,
                 const GemvDevice& d, bool pdl, cudaStream_t stream) {
    switch (bits) {
        case 2: return launch<2, T, kMode>(p, mo, xp, plan, d, pdl, stream);
        case 3: return launch<3, T, kMode>(p, mo, xp, plan, d, pdl, stream);
        case 4: return launch<4, T, kMode>(p, mo, xp, plan, d, pdl, stream);
        default: return launch<5, T, kMode>(p, mo, xp, plan, d, pdl, stream);
    }
}

}  // namespace
}  // namespace kbit
