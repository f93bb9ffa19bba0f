// SPDX-License-Identifier: Apache-2.0
// kbit::mma: y[M, n] = x[M, K] @ W^T for mid-size M (~5-64), fp16/bf16, fp32 accumulation, on
// tensor cores (mma.m16n8k16: W is the A operand, 16 output rows; x is B, 8 tokens). W comes in the
// runtime tiled layout (docs/format.md), whose tile bytes already are the A fragments.
//
// Design (per CTA: 8 warps, 16 n-tiles = 256 output rows, TM tokens, a range of 128-wide k-tiles):
//  * Data: cp.async ring of `stages` (2-4) k-tiles in shared memory, each holding the 16 weight
//    tiles (bits*256 B + 64 B absmax each) and the x tile [TM][128] (zero-filled past M and K).
//    Weights are used once by one lane, but the ring gives deep prefetch without registers.
//  * Warp w owns n-tiles 2w, 2w+1: every x fragment (ldmatrix) feeds 2 MMAs, which halves the
//    shared-memory reads of x; every dequantized A fragment feeds TM/8 MMAs. The 64-token tile
//    also comes with 4 n-tiles per warp (NT = 4: 512-row CTAs) for big layers (mma_tiles_per_warp).
//  * Dequantization (frag_dequant.cuh, shared with moe.cu), per lane and 2 adjacent columns
//    (= one A register): the k bit planes are
//    transposed in registers (shift/lop3 on 32-bit words) so that the 2k bits of a column pair
//    sit in one byte (k=5: 10 bits), then ONE shared-memory load from a half2 pair table
//    T[idx] = (cb[lo], cb[hi]) 2^S gives both values, and one HMUL2 applies the block's absmax
//    (single rounding: codebooks are bf16-exact, see frag_dequant.cuh).
//    T is replicated `copies` times (entry i of lane l at word i*copies + l % copies) so that
//    the 32 random lookups of a warp hit 32 different banks.
//  * Split-K over CTAs when n-tiles x token tiles do not fill the GPU (<= 8 splits): fp32
//    partials [S, M, n] plus a reduce kernel (PDL on sm_90); on sm_90 2 splits of one output tile
//    form a thread-block cluster and reduce through distributed shared memory (use_cluster).
//  * Stream-K (32- and 64-token tiles, where a cost model says it beats split-K): one wave of CTAs
//    with equal runs of (n-tile group, k-tile) units across group boundaries; partial tiles meet
//    through an fp32 workspace and per-CTA flags (see the stream-K helpers).
//  * What bounds the 64-token tile (H100, benchmarks/results/mma64_anatomy_h100_s19.md): the
//    HMMA issue rate (~28 of 62 us on 8B gate_up) plus the copy/barrier skeleton of the k-tile
//    loop (~30 us), which do not overlap; the dequantization is hidden behind the MMAs (~3 us).
//    Reordering lookups or copies within a k-tile does not change it; a faster M = 64 needs the
//    MMAs on wgmma with several groups in flight and no CTA-wide barrier per k-tile. It also runs
//    at the H100's 700 W cap (SM clock ~1770 of 1980 MHz, power_h100_s20.json): more SMs
//    (stream-K) or more warps (s20 C1q) gained ~nothing; 16 warps whose pairs split each k-tile
//    (no extra dequantization, 128 registers) were 1.04-1.11x slower on 8B qkv / gate_up
//    (probe_env_h100_s24_kw2.md, branch s24-kw2). Nor does x traffic bound it: NT = 4
//    halves the x copies and ldmatrix reads per weight and leaves 8B gate_up within -2..+7%
//    (probe_env_h100_s21_nt4big.md); it helps only the biggest layers (mma_tiles_per_warp).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "frag_dequant.cuh"
#include "kbit_format.cuh"
#include "ops.h"
#include "stream_k.cuh"

namespace kbit {
namespace {

using namespace frag;  // fragment dequantization, shared with moe.cu

struct Params {
    const uint8_t* x;      // [M, ldx] fp16/bf16, 16-byte aligned rows
    int64_t ldx_bytes;
    const uint8_t* qw;     // tiled planes
    const uint8_t* am;     // tiled absmax
    const float* cb;       // [2^bits]
    void* y;               // [M, n]
    float* ws;             // kWorkspace: [splits, M, n]; kStream: one partial tile per CTA
    int* flags;            // kStream: per CTA, "partial tile written" (0 between launches)
    int M, n, K, n_tiles, k_tiles, kchunk, splits, stages, mode, copies_log2;
    int ring_off;          // smem bytes before the ring: table + 64 (the table is 64-aligned)
    int pdl;               // launched with programmatic dependent launch (see the prologue)
};

// ------------------------------------------------------------------------- stream-K helpers
//
// kStream: CTAs run equal shares of all (n-tile group, k-tile) units across group boundaries, so
// every SM gets the same work where whole tiles per CTA would leave SMs idle (70B gate_up at
// M = 64: 224 groups on 132 SMs). Who runs what and who finishes which group: stream_k.cuh. Here:
//  * a first segment that ends inside its group: the CTA stores that partial tile (its fp32
//    accumulators, in register order) in its own workspace slot and raises its flag;
//  * a last segment that starts inside its group: the CTA waits for the flags of the lower CTAs
//    holding the group's first k-tiles, adds their partials (highest CTA first: a fixed order,
//    so the result is deterministic), writes y and lowers those flags again;
//  * segments covering a whole group write y directly.
// The partials are written early in each CTA's run and read at the end, so the wait is short.

__device__ __forceinline__ void flag_raise(int* flag) {  // after a barrier over the writers
    __threadfence();
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(1) : "memory");
}

__device__ __forceinline__ void flag_wait(const int* flag) {
    int v;
    for (;;) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
        if (v != 0) return;
        __nanosleep(64);
    }
}

// Accumulators -> y directly (no shared memory: the ring may still be loading the next
// segment). c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8.
template <int TM, bool BF16, int NT>
__device__ __forceinline__ void store_acc_y(void* y, const float (&acc)[NT][TM / 8][4], int n0,
                                            int m0, int m_valid, int n, int warp, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int f = 0; f < TM / 8; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = n0 + (warp * NT + i) * kTileN + g + (e >> 1) * 8;
                const int tok = f * 8 + 2 * t + (e & 1);
                if (tok < m_valid && row < n)
                    store_y1<BF16>(y, static_cast<int64_t>(m0 + tok) * n + row, acc[i][f][e]);
            }
}

// ------------------------------------------------------------------------------ kernels

// CTAs per SM the kernel is built for: 2 where shared memory and registers allow (TM <= 32 with
// 2 tiles per warp), else 1. Used by __launch_bounds__ and by pick_config.
constexpr int mma_ctas_per_sm(int tm, int nt) { return tm <= 32 && nt == kNT ? 2 : 1; }

// Grid (n-tile groups, splits, token tiles); SK (stream-K, mode kStream): (CTAs, 1, 1), one
// token tile. 2 CTAs/SM where shared memory allows (mma_ctas_per_sm).
// WG: wgmma (sm_90a, wgmma.cuh) instead of mma.sync; the x tile is stored in its layout.
template <int BITS, int TM, bool BF16, bool WG, bool SK, int NT>
__global__ void __launch_bounds__(kThreads, mma_ctas_per_sm(TM, NT)) mma_kernel(const Params p) {
    static_assert(!(SK && WG), "stream-K is built for the mma.sync kernel only");
    static_assert(NT == kNT || (NT == 2 * kNT && !WG), "NT: 2, or 4 for mma.sync");
    using L = Layout<BITS, TM, NT>;
    constexpr int kGT = L::kTiles, kGR = L::kRows, kWH = NT / kNT;  // kWH: planes copies / thread
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ uint16_t cbh[32];
    const int tid = thread_index(), lane = tid & 31, warp = tid >> 5;
    const int m0 = blockIdx.z * TM, kt_n = p.k_tiles;
    const uint32_t s_base = smem_u32(smem);

    // This CTA's units [u0, u1), u = group * k_tiles + k-tile: one group's k-chunk blockIdx.y, or
    // (SK) an equal share of all groups' units.
    const int64_t units = ceil_div(p.n_tiles, kGT) * static_cast<int64_t>(kt_n);
    int u0, u1;
    if constexpr (SK) {
        u0 = sk::run_begin(blockIdx.x, units, gridDim.x);
        u1 = sk::run_begin(blockIdx.x + 1, units, gridDim.x);
    } else {
        u0 = blockIdx.x * kt_n + blockIdx.y * p.kchunk;
        u1 = min(u0 + p.kchunk, static_cast<int>(blockIdx.x + 1) * kt_n);
    }
    const int nk = u1 - u0, g_low = u0 / kt_n;

    // Copy roles, fixed per thread; the sources advance by one k-tile per load (loop-carried, so
    // they stay in registers instead of 64-bit address math per k-tile):
    //  planes: 16-byte chunk (tid & 15) + 16 j of tiles tid / 16 + 16 h, h < NT / 2 (16 threads =
    //          one 256-byte plane),
    //  absmax: threads < 32 NT, chunk tid & 3 of tile tid / 4,
    //  x: token rows tid / 16 + 16 j, columns 8 (tid & 15) .. + 7 of the k-tile; WG: token rows
    //     (tid & 7) + 8 (tid >> 7) + 16 j, columns 8 ((tid >> 3) & 15) .. + 7, so that a warp
    //     fills 512 contiguous bytes of the wgmma layout (conflict-free shared-memory writes).
    // Tiles past n read the (valid) last tile and are zero-filled; so are tokens >= M, cols >= K.
    const int w_tile = tid >> 4, a_tile = (tid >> 2) & (kGT - 1);
    const int x_row = WG ? (tid & 7) | ((tid >> 7) << 3) : tid >> 4;
    const int x_chunk = WG ? (tid >> 3) & 15 : tid & 15;
    const int x_col = x_chunk * 8;
    const uint8_t* x_row_ptr = p.x + static_cast<int64_t>(min(m0 + x_row, p.M - 1)) * p.ldx_bytes;
    bool w_ok[kWH], a_ok;
    const uint8_t *w_next[kWH], *a_next, *x_next;
    int x_k;  // x column of this thread's next chunk
    auto seek = [&](int group, int kt) {  // the sources of k-tile kt of n-tile group `group`
        const int nt0 = group * kGT;
#pragma unroll
        for (int h = 0; h < kWH; ++h) {
            const int wt = nt0 + w_tile + 16 * h;
            w_ok[h] = wt < p.n_tiles;
            const int64_t w_tk = static_cast<int64_t>(min(wt, p.n_tiles - 1)) * kt_n + kt;
            w_next[h] = p.qw + w_tk * (BITS * 256) + (tid & 15) * 16;
        }
        a_ok = nt0 + a_tile < p.n_tiles;
        const int64_t a_tk = static_cast<int64_t>(min(nt0 + a_tile, p.n_tiles - 1)) * kt_n + kt;
        a_next = p.am + a_tk * 64 + (tid & 3) * 16;
        x_k = kt * kTileK + x_col;
        x_next = x_row_ptr + x_k * 2;
    };
    // Segments (one per group) from the highest group down; the first ends at u1.
    sk::Segment l_seg = sk::first_segment(u0, u1, kt_n);
    int l_kt = l_seg.lo;
    seek(l_seg.group, l_kt);
    int load_slot = 0;

    // This thread's x chunks of the k-tile at column xk (source row pointer src) into stage st.
    auto load_x = [&](uint32_t st, const uint8_t* src, int xk) {
#pragma unroll
        for (int j = 0; j < (TM * 16 + kThreads - 1) / kThreads; ++j) {
            if (TM * 16 >= kThreads || tid < TM * 16) {
                const bool ok = xk < p.K && m0 + x_row + 16 * j < p.M;
                const int tok = x_row + 16 * j;
                cp_async16(st + L::kW + L::kA +
                               (WG ? wg_x_offset(tok, x_chunk) : tok * kXRow + x_col * 2),
                           ok ? src + j * 16 * p.ldx_bytes : p.x, ok);
            }
        }
    };
    // The next k-tile of this CTA into the next ring slot; with_x = false leaves its x to load_x.
    auto load_next = [&](bool with_x) {
        const uint32_t st = s_base + p.ring_off + load_slot * L::kStage;
#pragma unroll
        for (int h = 0; h < kWH; ++h)
#pragma unroll
            for (int j = 0; j < BITS; ++j)
                cp_async16(st + (w_tile + 16 * h) * (BITS * 256) + (tid & 15) * 16 + j * 256,
                           w_next[h] + j * 256, w_ok[h]);
        if (tid < kGT * 4) cp_async16(st + L::kW + tid * 16, a_next, a_ok);
        if (with_x) load_x(st, x_next, x_k);
#pragma unroll
        for (int h = 0; h < kWH; ++h) w_next[h] += BITS * 256;
        a_next += 64, x_next += kTileK * 2, x_k += kTileK;
        load_slot = load_slot + 1 == p.stages ? 0 : load_slot + 1;
        if constexpr (SK) {
            if (++l_kt == l_seg.end && l_seg.group > g_low) {  // on to the next group down
                l_seg = sk::next_segment(l_seg, u0, kt_n);
                l_kt = l_seg.lo;
                seek(l_seg.group, l_kt);
            }
        }
    };

    // Prologue first, so that building the table overlaps the first loads' latency. With PDL
    // (p.pdl) this kernel may start while the previous one drains: only the first stage's
    // weights and the table (constant data) come before pdl_wait(), its x (the previous
    // kernel's output) and the other stages after it (x queued behind several stages' weights
    // would land later), and every global write of this kernel follows it.
    const bool pdl = p.pdl != 0;
    for (int s = 0; s < (pdl ? 1 : p.stages - 1); ++s) {
        if (s < nk) load_next(!pdl);
        if (!pdl) cp_async_commit();
    }
    if (tid < (1 << BITS)) cbh[tid] = scaled_code<BF16>(cb_value(p.cb, tid));
    __syncthreads();
    const uint32_t tbl_base = (s_base + 63u) & ~63u;  // < s_base + 64
    // T[idx] = (cb[lo], cb[hi]) 2^S; visible after the main loop's first barrier.
    build_pair_table<BITS>(smem + (tbl_base - s_base), cbh, p.copies_log2, tid, kThreads);
    if (pdl) {
        pdl_wait();
        if (nk > 0) {  // stage 0 = the first k-tile of the CTA's first segment
            const int xk = sk::first_segment(u0, u1, kt_n).lo * kTileK + x_col;
            load_x(s_base + p.ring_off, x_row_ptr + xk * 2, xk);
        }
        cp_async_commit();  // with stage 0's weights
        for (int s = 1; s < p.stages - 1; ++s) {
            if (s < nk) load_next(true);
            cp_async_commit();
        }
    }

    const uint32_t tbl_lane = tbl_base + (lane & ((1 << p.copies_log2) - 1)) * 4;  // own copy
    const uint32_t stride = 4u << p.copies_log2;
    // ldmatrix row addresses: lane -> token (lane & 7) + 8 (lane >> 4), k + 8 ((lane >> 3) & 1)
    const int x_tok = TM == 8 ? (lane & 7) : (lane & 7) + ((lane >> 4) << 3);
    const uint32_t x_lane0 = s_base + L::kW + L::kA + x_tok * kXRow + ((lane >> 3) & 1) * 16;

    float acc[NT][TM / 8][4];
    auto clear_acc = [&]() {
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int f = 0; f < TM / 8; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][f][e] = 0.f;
    };
    clear_acc();

    // The segment being computed, c_left k-tiles still to do.
    sk::Segment c_seg = sk::first_segment(u0, u1, kt_n);
    int c_left = c_seg.end - c_seg.lo;
    bool warp_busy = c_seg.group * kGT + warp * NT < p.n_tiles;

    // SK: the segment is complete (see the stream-K helpers above).
    auto segment_done = [&]() {
        constexpr int kRegs4 = NT * TM / 8;  // float4 accumulators per thread
        // CTA c's partial tile, [kRegs4][kThreads] float4: this thread's first one
        auto partial = [&](int c) {
            return reinterpret_cast<float4*>(p.ws) + static_cast<int64_t>(c) * kRegs4 * kThreads +
                   tid;
        };
        const int cta = blockIdx.x;
        if (c_seg.end < kt_n) {  // the group goes on in the next CTA: leave a partial tile
            float4* mine = partial(cta);
#pragma unroll
            for (int i = 0; i < NT; ++i)
#pragma unroll
                for (int f = 0; f < TM / 8; ++f)
                    mine[(i * (TM / 8) + f) * kThreads] =
                        make_float4(acc[i][f][0], acc[i][f][1], acc[i][f][2], acc[i][f][3]);
            __syncthreads();
            if (tid == 0) flag_raise(p.flags + cta);
        } else {
            if (c_seg.lo > 0) {  // the group's first k-tiles are partials of the CTAs below
                const int first = sk::cta_of(int64_t{c_seg.group} * kt_n, units, gridDim.x);
                if (tid == 0)
                    for (int c = first; c < cta; ++c) flag_wait(p.flags + c);
                __syncthreads();
                for (int c = cta - 1; c >= first; --c) {
                    const float4* src = partial(c);
#pragma unroll
                    for (int i = 0; i < NT; ++i)
#pragma unroll
                        for (int f = 0; f < TM / 8; ++f) {
                            const float4 v = __ldcg(src + (i * (TM / 8) + f) * kThreads);
                            acc[i][f][0] += v.x, acc[i][f][1] += v.y;
                            acc[i][f][2] += v.z, acc[i][f][3] += v.w;
                        }
                }
                if (tid == 0)  // zero again for the next launch, which runs after this one
                    for (int c = first; c < cta; ++c) p.flags[c] = 0;
            }
            store_acc_y<TM, BF16, NT>(p.y, acc, c_seg.group * kGR, m0, min(TM, p.M - m0), p.n,
                                      warp, lane);
        }
        clear_acc();
        c_seg = sk::next_segment(c_seg, u0, kt_n);
        c_left = c_seg.end - c_seg.lo;
        warp_busy = c_seg.group * kGT + warp * NT < p.n_tiles;
    };

    int slot = 0;
#pragma unroll 1
    for (int it = 0; it < nk; ++it) {
        // k-tile `it` has landed once at most stages-2 younger groups are pending; the barrier
        // also tells every warp that slot (it-1) % stages, refilled next, is no longer read.
        if (p.stages >= 4) cp_async_wait<2>();
        else if (p.stages == 3) cp_async_wait<1>();
        else cp_async_wait<0>();
        if constexpr (WG) fence_proxy_async();
        __syncthreads();
        if (it + p.stages - 1 < nk) load_next(true);  // into slot (it - 1) % stages
        cp_async_commit();  // possibly empty: keeps the group count uniform
        const int stage = p.ring_off + slot * L::kStage;
        if constexpr (WG)  // every warp: wgmma is warpgroup-wide (tiles past n are zeros)
            tile_step<BITS, TM, NT, BF16, true>(acc, smem + stage + warp * NT * BITS * 256,
                                                smem + stage + L::kW + warp * NT * 64, lane,
                                                 tbl_lane, stride, s_base + stage + L::kW + L::kA);
        else if (warp_busy)
            tile_step<BITS, TM, NT, BF16>(acc, smem + stage + warp * NT * BITS * 256,
                                          smem + stage + L::kW + warp * NT * 64, lane, tbl_lane,
                                          stride, x_lane0 + stage);
        slot = slot + 1 == p.stages ? 0 : slot + 1;
        if constexpr (SK)
            if (--c_left == 0) segment_done();
    }
    // The next kernel, if launched with PDL (kWorkspace: the reduce kernel; with p.pdl also the
    // next GEMM), may be scheduled now; it waits in pdl_wait() for this grid's writes, so its
    // launch and prologue overlap our epilogue.
    if (p.pdl || p.mode == kWorkspace) pdl_trigger();
    if constexpr (SK) return;
    cp_async_wait<0>();
    __syncthreads();  // the ring and the table are dead: reuse them for the output tile

    float* out = reinterpret_cast<float*>(smem);
    store_acc_tile<TM, NT>(out, acc, warp, lane);

    // Write-out in float4 units (4 rows of one token): coalesced along n.
    constexpr int kRowUnits = kGR / 4, kUnits = TM * kRowUnits;
    const int n0 = blockIdx.x * kGR, m_valid = min(TM, p.M - m0);
    if (p.mode == kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        // The splits of this output tile are one cluster: rank r sums units [r*per, (r+1)*per)
        // over all ranks' tiles, in rank order (deterministic), then a second cluster barrier
        // keeps every CTA's shared memory alive until all remote reads are done.
        cluster_sync();
        const int rank = static_cast<int>(cluster_rank()), per = (kUnits + p.splits - 1) / p.splits;
        for (int u = rank * per + tid; u < min(kUnits, (rank + 1) * per); u += kThreads) {
            const int tok = u / kRowUnits, r4 = (u % kRowUnits) * 4;
            if (tok >= m_valid) continue;
            const float4 v = cluster_sum4(s_base + (tok * L::kOutRowF + r4) * 4, p.splits);
            store_y<BF16>(p.y, m0 + tok, n0 + r4, p.n, v);
        }
        cluster_sync();
#endif
        return;
    }
    __syncthreads();
    float* ws =  // this split's fp32 partials
        p.mode == kWorkspace ? p.ws + static_cast<int64_t>(blockIdx.y) * p.M * p.n : nullptr;
    for (int u = tid; u < kUnits; u += kThreads) {
        const int tok = u / kRowUnits, r4 = (u % kRowUnits) * 4;
        if (tok >= m_valid) continue;
        const float4 v = *reinterpret_cast<const float4*>(out + tok * L::kOutRowF + r4);
        if (p.mode == kDirect) store_y<BF16>(p.y, m0 + tok, n0 + r4, p.n, v);
        else store_ws(ws, m0 + tok, n0 + r4, p.n, v);
    }
}

// --------------------------------------------------------------------------------- host

// Per device and kernel (cached): table copies, stages, shared memory, cluster support.
template <int BITS, int TM, bool BF16, bool WG, bool SK, int NT>
RingConfig pick_config(int dev) {
    static std::mutex mu;
    static std::unordered_map<int, RingConfig> cache;
    const std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(dev); it != cache.end()) return it->second;
    using L = Layout<BITS, TM, NT>;
    const RingConfig c = configure_ring(mma_kernel<BITS, TM, BF16, WG, SK, NT>, dev, BITS, kThreads,
                                        L::kStage, L::kOut, 128, mma_ctas_per_sm(TM, NT),
                                        kMaxStages, kMaxSplits, "mma");
    cache.emplace(dev, c);
    return c;
}

// kStream flags, per device and stream: kernels of one stream run one after the other and each
// launch leaves its flags zero again; two streams never share flags. Allocated and zeroed on
// first use, also while `stream` is being captured into a CUDA graph (neither is a stream
// operation; relaxed capture mode allows them on this thread). Never freed (16 KB each).
constexpr int kMaxStreamCtas = 4096;

int* stream_flags(int dev, cudaStream_t stream) {
    static std::mutex mu;
    static std::map<std::pair<int, cudaStream_t>, int*> flags;
    const std::lock_guard<std::mutex> lock(mu);
    if (auto it = flags.find({dev, stream}); it != flags.end()) return it->second;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    int* f = nullptr;
    cudaStream_t side = nullptr;
    cudaError_t err = cudaMalloc(&f, kMaxStreamCtas * sizeof(int));
    if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaMemsetAsync(f, 0, kMaxStreamCtas * sizeof(int), side);
    if (err == cudaSuccess) err = cudaStreamSynchronize(side);
    if (side != nullptr) (void)cudaStreamDestroy(side);
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    C10_CUDA_CHECK(err);
    flags.emplace(std::make_pair(dev, stream), f);
    return f;
}

// Stream-K where it shortens the longest CTA enough. Split-K costs waves x (k-tiles per CTA + 1)
// (as in choose_splits); stream-K its one wave plus ~4 k-tiles for the fp32 partial tiles written,
// waited for and added through L2 (the same in every shape of the H100 A/B in
// benchmarks/results/ab_streamk_h100_s18.md: M = 64, 70B gate_up 262 -> 211 us (224 tiles on
// 132 SMs); M = 24, 8B down 38 -> 33; but 8B o 16.9 -> 21.4, where 8-CTA clusters reduce over
// DSMEM). Needs one token tile (M <= TM: always so up to M = 64).
// KBIT_MMA_STREAMK=0 never, =1 wherever it applies; KBIT_MMA_SPLITS=n turns it off.
bool use_stream(int64_t units, int64_t grid, int64_t split_ctas, int64_t slots, int kchunk,
                int m_tiles) {
    const int mode = env_int("KBIT_MMA_STREAMK", -1);
    if (mode == 0 || m_tiles != 1 || units < 2) return false;
    if (mode == 1) return true;
    if (env_int("KBIT_MMA_SPLITS", 0) > 0) return false;
    const double split_cost = std::ceil(split_ctas / static_cast<double>(slots)) * (kchunk + 1);
    return static_cast<double>(ceil_div(units, grid) + 4) < split_cost;
}

template <int BITS, int TM, bool BF16, bool WG, int NT>
void run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
         const at::Tensor& codebook, at::Tensor& y, const TiledShape& s) {
    // Stream-K is built for the 32- and 64-token tiles (M = 17..64: compute-bound, so SMs left
    // idle by whole tiles cost the most).
    constexpr bool kStreamBuilt = !WG && TM >= 32;
    const RingConfig c = pick_config<BITS, TM, BF16, WG, false, NT>(x.get_device());
    const int M = static_cast<int>(x.size(0));
    const int n_groups = static_cast<int>(ceil_div(s.n_tiles, Layout<BITS, TM, NT>::kTiles));
    const int m_tiles = static_cast<int>(ceil_div(M, TM)), k_tiles = static_cast<int>(s.k_tiles);
    const int64_t slots = int64_t{c.sms} * c.ctas_per_sm;
    int splits = choose_splits(double(n_groups) * m_tiles, k_tiles, slots, kMaxSplits);
    if (const int forced = env_int("KBIT_MMA_SPLITS", 0); forced > 0)
        splits = std::min({forced, kMaxSplits, k_tiles});
    const int kchunk = static_cast<int>(ceil_div(k_tiles, splits));
    splits = static_cast<int>(ceil_div(k_tiles, kchunk));
    const int64_t units = int64_t{n_groups} * k_tiles;
    const int64_t grid = std::min({slots, units, int64_t{kMaxStreamCtas}});
    bool use_sk = false;
    if constexpr (kStreamBuilt) {
        if (use_stream(units, grid, int64_t{n_groups} * m_tiles * splits, slots, kchunk, m_tiles)) {
            // The plan assumed the split-K kernel's launch shape; a GPU or build where the
            // stream-K kernel fits differently (registers, shared memory) keeps split-K.
            const RingConfig cs = pick_config<BITS, TM, BF16, WG, true, NT>(x.get_device());
            use_sk = cs.smem == c.smem && cs.ctas_per_sm == c.ctas_per_sm;
        }
    }
    int mode = kDirect;
    if (use_sk) mode = kStream;
    else if (splits > 1)
        mode = use_cluster(c.clusters, double(n_groups) * m_tiles, splits, slots) ? kCluster
                                                                                  : kWorkspace;
    at::Tensor ws;
    if (mode == kWorkspace) ws = at::empty({splits, M, s.n}, x.options().dtype(at::kFloat));
    if (mode == kStream)  // one partial tile (NT x TM/8 float4 per thread) per CTA
        ws = at::empty({grid * kThreads * NT * TM / 2}, x.options().dtype(at::kFloat));

    Params p{};
    p.x = static_cast<const uint8_t*>(x.data_ptr());
    p.ldx_bytes = x.stride(0) * 2;
    p.qw = reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>());
    p.am = absmax.data_ptr<uint8_t>();
    p.cb = codebook.data_ptr<float>();
    p.y = y.data_ptr();
    p.ws = ws.defined() ? ws.data_ptr<float>() : nullptr;
    p.M = M, p.n = static_cast<int>(s.n), p.K = static_cast<int>(s.k);
    p.n_tiles = static_cast<int>(s.n_tiles), p.k_tiles = k_tiles;
    p.kchunk = kchunk, p.splits = splits, p.stages = c.stages, p.mode = mode;
    p.copies_log2 = c.copies_log2, p.ring_off = c.table_bytes + 64;

    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if constexpr (kStreamBuilt) {
        if (mode == kStream) {
            p.pdl = pdl_requested() && pdl_supported<mma_kernel<BITS, TM, BF16, WG, true, NT>>();
            p.flags = stream_flags(x.get_device(), stream);
            launch_kernel(mma_kernel<BITS, TM, BF16, WG, true, NT>,
                          dim3(static_cast<unsigned>(grid)), kThreads, c.smem, stream, 1, p.pdl, p);
            return;
        }
    }
    p.pdl = pdl_requested() && pdl_supported<mma_kernel<BITS, TM, BF16, WG, false, NT>>();
    launch_kernel(mma_kernel<BITS, TM, BF16, WG, false, NT>, dim3(n_groups, splits, m_tiles),
                  kThreads, c.smem, stream, mode == kCluster ? splits : 1, p.pdl, p);
    if (mode == kWorkspace)
        launch_splitk_reduce<BF16>(ws.data_ptr<float>(), y.data_ptr(), int64_t{M} * s.n, splits,
                                   c.sms, c.sm90, stream);
}

// nt: tiles per warp of the mma.sync kernel (2; 4 = 512-row CTAs, built for the 64-token tile).
template <int BITS>
void run_bits(int tm, bool wg, int nt, bool bf16, const at::Tensor& x, const at::Tensor& q,
              const at::Tensor& a, const at::Tensor& cb, at::Tensor& y, const TiledShape& s) {
    auto go = [&](auto tm_tag, auto wg_tag, auto nt_tag) {
        constexpr int TM = decltype(tm_tag)::value, NT = decltype(nt_tag)::value;
        constexpr bool WG = decltype(wg_tag)::value;
        if (bf16) run<BITS, TM, true, WG, NT>(x, q, a, cb, y, s);
        else run<BITS, TM, false, WG, NT>(x, q, a, cb, y, s);
    };
    using no = std::false_type;
    using nt2 = std::integral_constant<int, kNT>;
    using nt4 = std::integral_constant<int, 2 * kNT>;
    if (wg) {
#if defined(KBIT_SM90A)
        if (tm <= 64) go(std::integral_constant<int, 64>{}, std::true_type{}, nt2{});
        else go(std::integral_constant<int, 128>{}, std::true_type{}, nt2{});
        return;
#endif
    }
    switch (tm) {
        case 8: go(std::integral_constant<int, 8>{}, no{}, nt2{}); break;
        case 16: go(std::integral_constant<int, 16>{}, no{}, nt2{}); break;
        case 32: go(std::integral_constant<int, 32>{}, no{}, nt2{}); break;
        default:
            if (nt == 2 * kNT) go(std::integral_constant<int, 64>{}, no{}, nt4{});
            else go(std::integral_constant<int, 64>{}, no{}, nt2{});
            break;
    }
}

// The wgmma path, only where this build has sm_90a code (setup.py defines KBIT_SM90A for a 9.0a
// arch) and the GPU is sm_90, whose SASS it then runs. KBIT_MMA_WGMMA: unset = by shape, 0 = never,
// 1 = for every M > 32 (2 = the warp-specialized kernel of wgmma_gemm.cu, see mma()). By shape, from the H100 runs in benchmarks/results/
// bench_linear_h100__s4_wgmma_db.md: its 128-token tile wins where one tile of tokens already
// gives >= 64 CTAs of 256 rows without split-K (8B gate_up, M = 96: 88 vs 158 us for mma.sync; 70B
// gate_up, M = 256: 718 vs 805). On narrow layers it needs split-K, whose 128-token fp32 partial
// tiles cost more than they save (70B down, M = 128: 335 vs 201 us), and up to M = 64 the two tie.
// Is x on an sm_90 GPU and this build carrying sm_90a code (cached per device)?
bool sm90a_device(const at::Tensor& x) {
#if defined(KBIT_SM90A)
    static std::atomic<int> sm90[64];  // per device: 0 = not asked yet, 1 = sm_90, 2 = other
    const int dev = x.get_device();
    if (dev < 0 || dev >= 64) return false;
    if (sm90[dev].load(std::memory_order_relaxed) == 0) {
        int major = 0, minor = 0;
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        sm90[dev].store(major == 9 && minor == 0 ? 1 : 2, std::memory_order_relaxed);
    }
    return sm90[dev].load(std::memory_order_relaxed) == 1;
#else
    (void)x;
    return false;
#endif
}

// Tiles per warp of the 64-token mma.sync kernel: 4 (512-row CTAs: every x fragment feeds 4 tiles'
// MMAs: half the x copies and ldmatrix reads per weight) on layers of >= 128M weights that are
// wide (n >= 32K) or deep (K >= 16K), else 2. H100, M = 33..64, against 2 tiles per warp
// (benchmarks/results/probe_env_h100_s21_rule_r{1,2}.md, time ratios): 70B gate_up k=2
// 0.92-0.93, k=4 0.98-0.99; 70B down k=2 0.91-0.92, k=4 0.97, k=5 0.93-0.94; an 8B-shaped lm_head
// (128256 x 4096) k=2 0.93-0.94, k=4 0.98-0.99; k=5 on gate_up / lm_head 0.99-1.00. Not on 70B
// gate_up at TP=2 (28672 x 8192: k=2 0.95-0.98 but k=4 1.01-1.02, k=5 1.03-1.04) nor on 8B
// gate_up (k=4 1.02-1.07, probe_env_h100_s21_nt4big.md): their 56 groups of 512 rows need a
// split-K reduction that 112 groups of 256 rows avoid. Narrow layers get too few groups to fill
// the GPU (8B down 1.5x slower). KBIT_MMA_NT=2 / 4 overrides. Not built for the 32-token tile:
// there it won only at k=5 (70B gate_up / down, lm_head 0.94-0.96) and lost at k=4 (1.01-1.07,
// probe_env_h100_s21_nt4_m32.md).
int mma_tiles_per_warp(int64_t n, int64_t K) {
    const int forced = env_int("KBIT_MMA_NT", 0);
    if (forced == kNT || forced == 2 * kNT) return forced;
    const bool big = n * K >= (int64_t{1} << 27) && (n >= 32768 || K >= 16384);
    return big ? 2 * kNT : kNT;
}

bool use_wgmma(const at::Tensor& x, int64_t M, int64_t n) {
    const int mode = env_int("KBIT_MMA_WGMMA", -1);
    if (mode == 0 || M <= 32) return false;
    if (mode != 1 && !(M > 64 && ((M <= 128 && n >= 16384) || (M <= 256 && n >= 32768))))
        return false;
    return sm90a_device(x);
}

}  // namespace

// The warp-specialized wgmma kernel (wgmma_gemm.cu) by default on sm_90 GPUs (sm_90a builds) for
// 64 < M <= 256, up to M = 1024 on layers of >= 32M weights (n x K), and for 32 < M <= 64 on
// layers of <= 16M weights (its 128 x 64 tile, C1) and on larger ones (its 256 x 64 tile, C1w)
// but the few where mma.sync's stream-K wins (kbit_format.cuh's c1w_by_size / c1w_beats_sync).
// On the 8 Llama-3.1 8B / 70B shapes it is the fastest kbit kernel for 64 < M <= 256 (H100, k=4,
// one decoder layer's linears: 8B M=128 155 us against 225 for the mma.sync / dequant paths, fp16
// 182; benchmarks/results/bench_linear_h100__s6_cluster.md). With its 128 x 256 configuration
// (C2w) it also beats dequantize + cuBLAS on the big layers up to M = 1024 (70B layer, k=4,
// M=512: 0.90x fp16 against 0.67x; 8B 0.74x against 0.64x), while on small ones (8B qkv, o)
// cuBLAS's fixed cost of a 16-bit weight pass is small enough to win from M = 320
// (bench_linear_h100__s7_c2w.md). For 32 < M <= 64, C1 beats the 64-token mma.sync kernel on
// every layer of <= 16M weights measured, at M = 40 / 48 / 64 and k = 2..5
// (bench_linear_h100__s20_smallmid.md, k=4 M=64: 8B o 14.9 vs 16.8 us, Qwen3-30B-A3B o 10.8 vs
// 14.1 and qkv 13.5 vs 15.8; k = 3 / 5 in bench_linear_h100__s20_smallmid_k35.md): mma.sync's
// 256-row blocks are few there and split K up to 8 ways. On larger layers C1w wins since its
// weights come as two TMA boxes per stage (session 32), except on the shapes c1w_beats_sync
// excludes (the measurements are there). k=5 keeps the big layers only up to M = 512: it runs C3
// there (256 x 128, wgmma_gemm.cu), dequantizing each weight once per 128 tokens, and at M = 768 /
// 1024 dequantize + cuBLAS took 0.87 / 0.85x its time on 8B gate_up and 0.83 / 0.88x on down
// (H100, interleaved, two rounds: benchmarks/results/k5_c3_h100_s44/, bench_linear_h100__s44_large;
// at M = 512 gate_up level, down 0.88x the dequant path's time). KBIT_MMA_WGMMA=0/1/2 overrides.
bool wgmma2_by_default(const at::Tensor& x, int64_t M, int64_t n, int64_t bits) {
    const int64_t K = x.size(1), weights = n * K;
    const bool big = weights >= (int64_t{32} << 20);
    if (env_int("KBIT_MMA_WGMMA", -1) != -1 || !sm90a_device(x)) return false;
    if (M > 64) return M <= 256 || (M <= (bits == 5 ? 512 : 1024) && big);
    return M > 32 && (!c1w_by_size(n, K) || c1w_beats_sync(n, K, device_sms(x.get_device())));
}

at::Tensor mma(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& absmax,
               const at::Tensor& codebook, int64_t bits, int64_t n) {
    check_activation(x_in, qweight, "mma");
    const int64_t M = x_in.size(0), K = x_in.size(1);
    const TiledShape s = check_tiled(qweight, absmax, bits, n, K, "mma");
    check_codebook(codebook, bits, "mma");
    TORCH_CHECK(absmax.device() == qweight.device() && codebook.device() == qweight.device(),
                "kbit::mma: qweight, weight_absmax and codebook are on different devices");
    TORCH_CHECK_VALUE(M <= int64_t{65535} * 64 && n < (int64_t{1} << 31) && K < (int64_t{1} << 30),
                      "kbit::mma: shape too large (M=", M, ", n=", n, ", K=", K, ")");
    TORCH_CHECK_VALUE(aligned(qweight, 16) && aligned(absmax, 16),
                      "kbit::mma: qweight and weight_absmax must be 16-byte aligned");
    const c10::cuda::CUDAGuard guard(x_in.device());
    at::Tensor y = at::empty({M, n}, x_in.options());
    if (M == 0) return y;
    // cp.async moves 16-byte chunks: rows must start 16-byte aligned, else copy x once.
    const at::Tensor x = rows_aligned16(x_in) ? x_in : x_in.clone(at::MemoryFormat::Contiguous);
    // the warp-specialized kernel
    if (env_int("KBIT_MMA_WGMMA", -1) == 2 || wgmma2_by_default(x, M, n, bits)) {
        wgmma_gemm(x, qweight, absmax, codebook, bits, y);
        return y;
    }
    const bool wg = use_wgmma(x, M, n);
    const int tm = wg ? (M <= 64 ? 64 : 128) : M <= 8 ? 8 : M <= 16 ? 16 : M <= 32 ? 32 : 64;
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const int nt = tm == 64 && !wg ? mma_tiles_per_warp(n, K) : kNT;  // tm 64: M > 32
    switch (bits) {
        case 2: run_bits<2>(tm, wg, nt, bf16, x, qweight, absmax, codebook, y, s); break;
        case 3: run_bits<3>(tm, wg, nt, bf16, x, qweight, absmax, codebook, y, s); break;
        case 4: run_bits<4>(tm, wg, nt, bf16, x, qweight, absmax, codebook, y, s); break;
        default: run_bits<5>(tm, wg, nt, bf16, x, qweight, absmax, codebook, y, s); break;
    }
    return y;
}

}  // namespace kbit
