// SPDX-License-Identifier: Apache-2.0
#pragma once
// The warp-specialized Hopper kernel of kbit::mma (wgmma_gemm.cu: dense launches, taken when
// KBIT_MMA_WGMMA=2 or by default for mid M on sm_90a builds on sm_90 GPUs) and of kbit::moe's
// many-tokens path (moe_wgmma.cu): y[M, n] = x[M, K] @ W^T for M ~ 64..1024, x fp16/bf16, W in
// the runtime tiled layout (docs/format.md), fp32 accumulation. Design and the hardware facts it
// rests on: docs/wgmma-plan.md, sections 2 and 4.
//
//  * 384 threads, 1 CTA per SM. Warpgroup 0 is the producer: it hands registers to the consumers
//    (setmaxnreg 40) and one of its warps issues every copy of a pipeline stage (one 128-column
//    k-tile): two 2-D TMA boxes of x (64 columns x TN tokens, 128B-swizzled, rows past M /
//    columns past K zero-filled) and the stage's weights: one TMA box of the bit planes of all the
//    CTA's weight tiles at that k-tile and one of their absmax (dense: the tiled layout as 3-D
//    [n-tile][k-tile][bytes]; grouped MoE: 5-D with the expert and the gate / up half; wmap /
//    amap). All complete on the stage's "full" mbarrier, armed with expect_tx = the bytes issued.
//  * Warpgroups 1 and 2 are consumers (setmaxnreg 232). Each owns RWG weight rows = RWG/64 wgmma
//    m64 blocks; warp w of the warpgroup dequantizes tile w of each block into registers
//    (frag::step_regs: the mma.sync A fragment, which is exactly the warp's slice of the wgmma
//    A operand) and the warpgroup issues wgmma.m64nTNk16 with A from registers and x as the B
//    descriptor (K-major, 128B swizzle). The A registers form a ring of kABufs sets: step j's
//    wgmma runs on the tensor cores while step j + 1 is dequantized (C2 / C2w: while steps j
//    and j + 1 run, k_loop's H). KBIT_WG_ABUFS=4 (64-token tiles, opt-in): 4 sets and wait_group 2,
//    which ptxas (CUDA 13.0) compiles with every wgmma waited for at once (C7513; see kPending).
//  * Each consumer warp arrives on the slot's "empty" mbarrier once the wgmmas that read it are
//    retired (wgmma.wait_group), which lets the producer refill it.
//  * Epilogue: accumulators -> shared tile [token][row] (reusing the ring) -> coalesced stores.
//    Split-K over grid y where the grid would not fill the GPU, reduced as mma.cu does: through
//    distributed shared memory in a cluster of the splits, else an fp32 workspace + reduce kernel.
// Configurations (rows = 2 RWG per CTA x TN tokens): C1 128 x 64 (M <= 64), C2 128 x 128,
// C3 256 x 128 (M <= 128), C1w 256 x 64 (M <= 64 with KBIT_WGMMA_C1W=1, or forced:
// KBIT_WGMMA_CONFIG=4), C2w 128 x 256 (M > 128).
// Grouped MoE variants (template GM, launched by moe_wgmma.cu for many tokens per expert): each
// CTA takes one entry {expert, first row, rows} of the routing tile list (grid z; entries past
// *num_tiles exit at once), x is the slots' rows in expert order, and the weights are that
// expert's. kMoeGateUp: the CTA's two warpgroups compute matching gate and up rows (gate tile g
// and up tile I/16 + g), and the epilogue writes act(gate) * up for its rows; kMoeDown: the
// epilogue adds w[slot] * row into an fp32 [T, H] accumulator (atomics) or writes the slot's fp32
// row. No split-K (many tiles fill the GPU).
// Device code exists only for sm_90a; other device passes compile a trap, and the host refuses
// (clear error) unless this build has sm_90a code and the GPU is sm_90.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes from the driver)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "frag_dequant.cuh"
#include "kbit_format.cuh"
#include "ops.h"
#include "wgmma_sm90.cuh"

namespace kbit {
namespace {

using namespace frag;  // fragment dequantization (shared with mma.cu, moe.cu) and wgmma.cuh

// A-register sets in flight per consumer warpgroup: wgmma.wait_group<kABufs - 1> after each step.
// 2 = one wgmma group pending while the next step is dequantized; must divide the 8 k16 steps
// of a k-tile so that step kk of every k-tile uses set kk % kABufs.
constexpr int kABufs = 2;
static_assert(8 % kABufs == 0 && kABufs >= 2, "kABufs must divide 8");

struct WgParams {
    CUtensorMap xmap;  // x [M, K]: boxes of 64 columns x TN tokens, 128B swizzle (64-B aligned)
    const uint8_t* qw;  // tiled planes
    const uint8_t* am;  // tiled absmax
    const float* cb;    // [2^bits]
    void* y;            // [M, n]
    float* ws;          // [splits, M, n] (kWorkspace)
    int M, n, K, n_tiles, k_tiles, kchunk, splits, stages, mode, copies_log2, table_bytes;
    int pdl;            // dense: launched with programmatic dependent launch (see produce)
    // The tiled planes and absmax as tensors of u64 (chunk = BITS * 256 B, 64 B per tile), boxes
    // of one k-tile of the CTA's kTiles n-tiles; tiles past n_tiles are zero-filled. Dense: 3-D
    // [n_tiles][k_tiles][chunk / 8] (tile_tensor_map); grouped MoE: 5-D with the expert and the
    // gate / up half (expert_tile_map).
    CUtensorMap wmap, amap;
};

// Grouped MoE launches (GM != kDense). A second kernel parameter rather than more WgParams
// fields: the dense instantiations keep their parameter block and code.
enum GroupMode : int { kDense = 0, kMoeGateUp = 1, kMoeDown = 2 };
enum MoeOut : int { kMoeRows = 0, kMoeAtomic = 1 };
struct WgMoe {
    CUtensorMap xmap_q;     // x boxes of TN / 4 rows (narrow tiles, wg::narrow_tn)
    const int4* tiles;      // [max tiles] {local expert, first row of x, rows <= TN, 0}
    const int* num_tiles;   // [1]
    const int* sorted;      // row of x -> slot t * topk + j
    int64_t qw_expert, am_expert;  // bytes per expert
    const float* topk_w;    // [S]
    void* out;              // gate_up: act [S rows, I] in x.dtype; down: fp32 [T, H] or [S, H]
    float4* zero;           // gate_up: the down GEMM's atomic accumulator (or null), cleared here
    int64_t zero_count;     // its float4 units
    int topk, weight_on_input, act, out_mode;
    int tile_copies;  // 1: the weights as one bulk copy per tile (KBIT_WG_TILE_COPIES=1, A/B)
};

#if defined(KBIT_WG_DEVICE)
// The producer warp: for each k-tile of this CTA, wait until its ring slot is free, arm the slot's
// full barrier with the stage's byte count, then lane 0 issues the TMA boxes: planes, absmax, x
// (2, or 2 per TN / 4 rows of a narrowed MoE tile). MoE: the boxes of expert `expert`.
// Why boxes for the weights: the 2 kTiles bulk copies per stage of one tile each (MoE's until
// session 33; KBIT_WG_TILE_COPIES=1 still issues them) cost per instruction, not per byte. On 8B
// gate_up (M=64, 256 rows per CTA, 32 copies per stage) the kernel with neither dequantization
// nor wgmma took 46.8 us with them, 34.6 us without the 16 absmax copies, 34.6 us without the 16
// plane copies instead, 21.4 us without any weight copy, and 22.2 us with the two boxes (H100,
// k=2; benchmarks/results/probe_env_h100_s32_copies.md, _wmap64.md). With the boxes C1 / C1w take
// 0.73-0.93x the time (8B / 70B layers, M=64); grouped MoE 0.81-0.88x where the copies weighed
// most (Qwen3-30B-A3B at T = 1024, Mixtral at T = 256; benchmarks/results/moe_boxes_h100_s33/).
// GM == kMoeGateUp: nt0 is the CTA's first gate tile and p.n_tiles = I / 16; stage tile t < kTiles
// / 2 is gate tile nt0 + t, the others the matching up tiles (p.n_tiles further).
// x_rows: the token width of the tile (TN; MoE: wg::narrow_tn of its rows); a narrowed tile loads
// its x boxes as x_rows / (TN / 4) boxes of xmap_q (TN / 4 rows each) at the rows of the full box.
template <int BITS, int RWG, int TN, int GM>
__device__ __forceinline__ void produce(const WgParams& p, const void* xmap, const void* xmap_q,
                                        int x_rows, const uint8_t* qw, const uint8_t* am, int nt0,
                                        int m0, wg::KRange kr, uint32_t ring, uint32_t full0,
                                        uint32_t empty0, int lane, int expert, bool tile_copies) {
    using L = wg::StageLayout<BITS, RWG, TN>;
    constexpr int kQ = TN / 4;
    const int kind = wg::copy_kind(lane, L::kTiles), t = wg::copy_tile(lane, L::kTiles);
    int live, dt = t;  // live tiles of the stage (tiles past n are not copied nor read); lane's
    bool active;       // tile = nt0 + dt
    if constexpr (GM == kMoeGateUp) {
        constexpr int kHalf = L::kTiles / 2;
        const int live_half = min(kHalf, p.n_tiles - nt0);
        live = 2 * live_half;
        active = kind != wg::kNone && t % kHalf < live_half;
        dt = t % kHalf + (t < kHalf ? 0 : p.n_tiles);
    } else {
        live = min(L::kTiles, p.n_tiles - nt0);
        active = kind != wg::kNone && t < live;
    }
    const bool boxes = GM == kDense || !tile_copies;  // the weights as 2 TMA boxes (see above)
    const uint32_t bytes = kind == wg::kPlanesCopy ? L::kPlanes : 64;
    const uint32_t dst = kind == wg::kPlanesCopy ? L::kWOff + t * L::kPlanes : L::kAOff + t * 64;
    // A tile's k-tiles are contiguous: the source advances by `bytes` per k-tile.
    const int64_t tk = static_cast<int64_t>(nt0 + (active ? dt : 0)) * p.k_tiles + kr.begin;
    // (Dense: straight from the parameter block, the code the dense kernel was measured with.)
    const uint8_t* src = (GM == kDense ? (kind == wg::kPlanesCopy ? p.qw : p.am)
                                       : (kind == wg::kPlanesCopy ? qw : am)) + tk * bytes;
    if (lane == 0) wg::prefetch_tensormap(x_rows < TN ? xmap_q : xmap);
    if (boxes && lane == 0) wg::prefetch_tensormap(&p.wmap), wg::prefetch_tensormap(&p.amap);
    // Arms k-tile `it`'s full barrier (arrive + expect_tx in one, so the phase cannot complete
    // before every byte counted here has landed) and copies its weights; x_tile its x boxes.
    auto weights = [&](int it) {
        const int slot = wg::ring_slot(it, p.stages);
        const uint32_t full = full0 + 8 * slot;
        if (boxes) {  // every tile of a box counts, zero-filled ones past n_tiles too
            if (lane == 0) {
                const uint32_t st = ring + slot * L::kBytes;
                const int kt = kr.begin + it;
                const uint32_t tx = wg::stage_tx_bytes<BITS, RWG, TN>(L::kTiles, x_rows);
                wg::mbar_arrive_expect_tx(full, tx);
                if constexpr (GM == kDense) {
                    wg::tma_load_3d(st + L::kWOff, &p.wmap, 0, kt, nt0, full);
                    wg::tma_load_3d(st + L::kAOff, &p.amap, 0, kt, nt0, full);
                } else {  // nt0: the first gate tile (gate_up) / n-tile (down) of the CTA
                    wg::tma_load_5d(st + L::kWOff, &p.wmap, 0, kt, nt0, 0, expert, full);
                    wg::tma_load_5d(st + L::kAOff, &p.amap, 0, kt, nt0, 0, expert, full);
                }
            }
            return;
        }
        if (lane == 0) wg::mbar_arrive_expect_tx(full, wg::stage_tx_bytes<BITS, RWG, TN>(live, x_rows));
        __syncwarp();
        if (active) wg::bulk_g2s(ring + slot * L::kBytes + dst, src, bytes, full);
        src += bytes;
    };
    auto x_tile = [&](int it) {
        const int slot = wg::ring_slot(it, p.stages), kt = kr.begin + it;
        const uint32_t full = full0 + 8 * slot, st = ring + slot * L::kBytes;
        if (lane == 0) {
            if (x_rows == TN) {
                wg::tma_load_2d(st, xmap, wg::x_box_col(kt, 0, p.K), m0, full);
                wg::tma_load_2d(st + L::kXHalf, xmap, wg::x_box_col(kt, 1, p.K), m0, full);
            } else {
                for (int r = 0; r < x_rows; r += kQ) {
                    wg::tma_load_2d(st + r * wg::kSwizzle, xmap_q, wg::x_box_col(kt, 0, p.K), m0 + r, full);
                    wg::tma_load_2d(st + L::kXHalf + r * wg::kSwizzle, xmap_q, wg::x_box_col(kt, 1, p.K),
                                    m0 + r, full);
                }
            }
        }
    };
    // PDL (dense, p.pdl): this grid may start while the previous kernel drains. The first
    // k-tile's weights (constant data) are copied at once (its slot is free), its x, the previous
    // kernel's output, only after pdl_wait(); then the loop as usual (x queued behind several
    // stages' weights would land later). The consumers' global writes follow the x they read.
    int pre = 0;
    if (GM == kDense && p.pdl && kr.count > 0) {
        pre = 1;
        weights(0);
        pdl_wait();
        x_tile(0);
    }
#pragma unroll 1
    for (int it = pre; it < kr.count; ++it) {
        const int slot = wg::ring_slot(it, p.stages);
        wg::mbar_wait(empty0 + 8 * slot, wg::empty_parity(it, p.stages), 0, it);
        weights(it);
        x_tile(it);
    }
}
#endif

// Epilogue of the grouped MoE variants, from the CTA's fp32 tile out[token][row] (kOutRow floats
// per token) of rows x TN; m_valid rows of x from m0 belong to this CTA's expert.
//  kMoeGateUp: rows [0, rows/2) are gate columns n0.. of h, rows/2.. the matching up columns:
//    act[m0 + tok, n0 + r] = act(gate) * up (act_mul4: h rounded to the dtype).
//  kMoeDown: slot s = sorted[m0 + tok]; w[s] * row added into out[s / topk] (kMoeAtomic) or the
//    row stored as out[s] (kMoeRows, the combine kernel weights and sums them).
#if defined(KBIT_WG_DEVICE)
// kMoeGateUp: this CTA's share of clearing the down GEMM's atomic accumulator (every CTA of the
// grid takes an equal slice, those without a routing tile too), by threads [t0, t0 + nt) of it.
// The gate_up GEMM is compute bound: the 32 MB (Qwen3-30B-A3B, T = 4096) of stores cost nothing
// there, where in the gather kernel they ran at its store bandwidth (~12 us: gather 79.5 -> 67.9
// us when moved here, benchmarks/results/moe_profile_h100_s16.log).
__device__ __forceinline__ void clear_slice(const WgMoe& mo, int t0, int nt) {
    const int64_t ctas = int64_t{gridDim.x} * gridDim.y * gridDim.z;
    const int64_t cta = blockIdx.x + int64_t{gridDim.x} * (blockIdx.y + int64_t{gridDim.y} * blockIdx.z);
    const int64_t per = (mo.zero_count + ctas - 1) / ctas, end = min(mo.zero_count, (cta + 1) * per);
    for (int64_t u = cta * per + threadIdx.x - t0; u < end; u += nt) mo.zero[u] = make_float4(0.f, 0.f, 0.f, 0.f);
}

template <bool BF16, int GM, int ROWS, int TN, int OUT_ROW>
__device__ __forceinline__ void moe_epilogue(const WgParams& p, const WgMoe& mo, const float* out,
                                             int ctid, int n0, int m0, int m_valid) {
    // Per row of x: the output row and the factor, read once into shared memory. (Loaded per
    // float4 in the store loop, the dependent global load of sorted[] made the Qwen3-30B-A3B
    // down GEMM at T = 4096 take 535 instead of 383 us on an H100: moe_profile_h100_s11.log.)
    __shared__ int s_row[TN];
    __shared__ float s_w[TN];
    for (int r = ctid; r < m_valid; r += 256) {
        const int s = mo.sorted[m0 + r];
        if constexpr (GM == kMoeGateUp) {
            s_row[r] = m0 + r;  // act rows stay in expert order
            s_w[r] = mo.weight_on_input ? mo.topk_w[s] : 1.0f;
        } else {
            const bool atomic = mo.out_mode == kMoeAtomic;
            s_row[r] = atomic ? s / mo.topk : s;
            s_w[r] = atomic && !mo.weight_on_input ? mo.topk_w[s] : 1.0f;
        }
    }
    wg::named_barrier(1, 256);
    constexpr int kCols = GM == kMoeGateUp ? ROWS / 2 : ROWS, kRowUnits = kCols / 4;
    for (int u = ctid; u < m_valid * kRowUnits; u += 256) {
        const int tok = u / kRowUnits, r4 = (u % kRowUnits) * 4, col = n0 + r4;
        if (col >= p.n) continue;  // p.n % 4 == 0: whole float4 units
        const float* o = out + tok * OUT_ROW + r4;
        const int64_t dst = static_cast<int64_t>(s_row[tok]) * p.n + col;
        if constexpr (GM == kMoeGateUp) {
            *reinterpret_cast<uint2*>(static_cast<uint8_t*>(mo.out) + dst * 2) =
                act_mul4<BF16>(*reinterpret_cast<const float4*>(o),
                               *reinterpret_cast<const float4*>(o + kCols), s_w[tok], mo.act);
        } else {
            const float4 v = *reinterpret_cast<const float4*>(o);
            float* y = static_cast<float*>(mo.out) + dst;
            if (mo.out_mode == kMoeAtomic) atomic_add4(y, f4mul(v, s_w[tok]));
            else *reinterpret_cast<float4*>(y) = v;
        }
    }
}

#endif

// Grid (row blocks of 2 RWG rows, splits, token tiles of TN or MoE tile-list entries).
// AB: A-register sets (kABufs by default; the dense 64-token tiles also build 4, KBIT_WG_ABUFS).
template <int BITS, int RWG, int TN, bool BF16, int GM = kDense, int AB = kABufs>
__global__ void __launch_bounds__(wg::kThreads, 1)
    wgmma_gemm_kernel(const __grid_constant__ WgParams p, const __grid_constant__ WgMoe mo) {
#if defined(KBIT_WG_DEVICE)
    using L = wg::StageLayout<BITS, RWG, TN>;
    constexpr int NB = RWG / 64;  // wgmma m64 blocks per consumer warpgroup = tiles per warp
    constexpr int kHalf = L::kTiles / 2;  // kMoeGateUp: gate tiles per CTA
    extern __shared__ __align__(1024) uint8_t smem[];
    __shared__ uint16_t cbh[32];
    __shared__ __align__(8) uint64_t full_bar[wg::kMaxStages], empty_bar[wg::kMaxStages];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int nt0 = blockIdx.x * (GM == kMoeGateUp ? kHalf : L::kTiles);
    int m0 = blockIdx.z * TN, m_rows = 0;  // MoE: the tile's rows of x (dense: p.M - m0, below)
    const uint8_t *qw = p.qw, *am = p.am;
    int expert = 0;  // MoE: the local expert of this CTA's tile
    if constexpr (GM != kDense) {  // this CTA's tile-list entry (the whole CTA exits together)
        if (static_cast<int>(blockIdx.z) >= *mo.num_tiles) {
            if (GM == kMoeGateUp && mo.zero != nullptr) clear_slice(mo, 0, wg::kThreads);
            return;
        }
        const int4 tl = mo.tiles[blockIdx.z];
        m0 = tl.y, m_rows = tl.z, expert = tl.x;
        qw += tl.x * mo.qw_expert, am += tl.x * mo.am_expert;
    }
    const wg::KRange kr = wg::k_range(blockIdx.y, p.kchunk, p.k_tiles);
    const int S = p.stages;
    // Shared memory: pair table (64-B aligned, pair_addr ORs k=2 indices into its address), then
    // the ring, 1024-B aligned so that the x boxes start on swizzle atoms (descriptor base 0).
    const uint32_t s_base = smem_u32(smem);
    const uint32_t tbl = (s_base + 63u) & ~63u;
    const uint32_t ring = (s_base + p.table_bytes + 64u + wg::kAtom - 1u) & ~(wg::kAtom - 1u);
    const uint32_t full0 = smem_u32(full_bar), empty0 = smem_u32(empty_bar);  // slot s: + 8 s

    if (tid == 0) {
        for (int s = 0; s < S; ++s) {
            wg::mbar_init(full0 + 8 * s, 1);  // the producer's arrive.expect_tx (+ the bytes)
            wg::mbar_init(empty0 + 8 * s, wg::kConsumerWarps);
        }
        wg::fence_mbar_init();
    }
    if (tid < (1 << BITS)) cbh[tid] = scaled_code<BF16>(cb_value(p.cb, tid));
    __syncthreads();
    build_pair_table<BITS>(smem + (tbl - s_base), cbh, p.copies_log2, tid, wg::kThreads);
    __syncthreads();  // table and barriers visible to every role

    if (warp < 4) {  // ------------------------------------------------------------ producer
        wg::setmaxnreg_dec<wg::kProducerRegs>();
        if (warp == 0)
            produce<BITS, RWG, TN, GM>(p, &p.xmap, &mo.xmap_q, GM == kDense ? TN : wg::narrow_tn(TN, m_rows),
                                       qw, am, nt0, m0, kr, ring, full0, empty0, lane, expert,
                                       mo.tile_copies != 0);
        else if (GM == kMoeGateUp && mo.zero != nullptr)  // warps 1-3 are idle otherwise
            clear_slice(mo, 32, 96);
        if (p.mode == kCluster) {  // the consumers' two cluster barriers count every thread
            cluster_sync();
            cluster_sync();
        }
        return;
    }

    // --------------------------------------------------------------------------- consumers
    wg::setmaxnreg_inc<wg::kConsumerRegs>();
    const int cw = (warp >> 2) - 1, wq = warp & 3;  // consumer warpgroup 0/1, warp in it
    int tile[NB];   // CTA-local tile of block b: row 16 tile .. +15 of the CTA
    bool live[NB];  // tile holds rows < n (else it is neither copied nor read: A = 0)
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        tile[b] = cw * (RWG / 16) + 4 * b + wq;
        live[b] = nt0 + (GM == kMoeGateUp ? tile[b] % kHalf : tile[b]) < p.n_tiles;
    }
    const uint32_t tbl_lane = tbl + (lane & ((1 << p.copies_log2) - 1)) * 4;  // own table copy
    const uint32_t stride = 4u << p.copies_log2;
    const uint8_t* ring_p = smem + (ring - s_base);

    float acc[NB][TN / 2];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int v = 0; v < TN / 2; ++v) acc[b][v] = 0.f, wg::pin(acc[b][v]);
    static_assert(AB == 2 || AB == 4, "AB: 2 or 4 A-register sets");
    // wgmma groups left in flight after each commit: AB - 1 with 2 sets; with 4 sets, 2 (set
    // (kk + 1) % 4 was read by step kk - 3). ptxas of CUDA 13.0 does not follow the 4-set ring: it
    // warns C7513 and follows every wgmma with WARPGROUP.DEPBAR 0 (sm_90a SASS, session 26), so
    // AB = 4 runs the wgmmas one at a time. Measured, that C1w is still ~5% faster than with 2 sets
    // on 8B gate_up / down at M = 48 / 64, ~1% on qkv, equal on o (probe_env_h100_s26_m64_base.md).
    // What makes ptxas give up is the branch around the slot release below (lane == 0, it > 0)
    // between a wgmma and the wait that retires it: with that arrive predicated instead (branch
    // s31-exp), 4 and 8 sets compile to 3 and 7 groups in flight (DEPBAR.LE 3 / 7), and C1 / C1w
    // then ran no faster than with 2 sets (8B layers, M = 40 / 64, k = 2 / 4, within 1-2%;
    // probe_env_h100_s31_ab8.md): the depth of the wgmma pipeline is not what bounds these tiles.
    // Nor is the wgmma itself: mma.sync consumers and A through shared memory (stmatrix + SS
    // wgmma) were no faster (probe_env_h100_s31_{ms,ss}.md). With neither dequantization nor
    // wgmma the kernel took 0.72-0.84x its time (probe_env_h100_s31_diag.md): the floor was the
    // producer's 32 bulk copies per stage, now two TMA boxes (see produce).
    constexpr int kPending = AB == 2 ? 1 : 2;
    uint32_t a[AB][NB][4];  // A-register ring
    uint2 planes[NB][BITS];     // this lane's plane bytes of the current k-tile
    uint32_t sc[NB][2][2];      // its absmax pairs
    uint32_t iw[NB][5];         // index words of the current plane word

    // Waits for k-tile `it` and loads this lane's share of its weights (index words of word 0).
    auto load_stage = [&](int it) {
        const int slot = wg::ring_slot(it, S);
        wg::mbar_wait(full0 + 8 * slot, wg::full_parity(it, S), 1, it);
        const uint8_t* st = ring_p + slot * L::kBytes;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (live[b]) {
                load_tile_frag<BITS, BF16>(planes[b], sc[b], st + L::kWOff + tile[b] * L::kPlanes,
                                           st + L::kAOff + tile[b] * 64, lane);
            } else {  // absmax 0: every A value is +-0 (table entries are finite)
#pragma unroll
                for (int j = 0; j < BITS; ++j) planes[b][j] = make_uint2(0u, 0u);
                sc[b][0][0] = sc[b][0][1] = sc[b][1][0] = sc[b][1][1] = 0u;
            }
            tile_index_words<BITS>(iw[b], planes[b], 0);
        }
    };
    auto plane_word = [&](int kk) {  // steps 4..7 read plane word 1
        if (kk == 4) {
#pragma unroll
            for (int b = 0; b < NB; ++b) tile_index_words<BITS>(iw[b], planes[b], 1);
        }
    };
    // A registers of k16 step kk (a compile-time constant once the loops are unrolled).
    auto dequant = [&](int kk, uint32_t(&dst)[NB][4]) {
        plane_word(kk);
#pragma unroll
        for (int b = 0; b < NB; ++b)
            step_regs<BITS, BF16>(dst[b], iw[b], sc[b], kk, tbl_lane, stride);
    };
    // The same in two halves that the hoisted loop issues apart: table loads into v, then scaling.
    uint32_t v[NB][4];
    auto lookups = [&](int kk) {
        plane_word(kk);
#pragma unroll
        for (int b = 0; b < NB; ++b) step_lookups<BITS>(v[b], iw[b], kk, tbl_lane, stride);
    };
    auto scale = [&](int kk, uint32_t(&dst)[NB][4]) {
#pragma unroll
        for (int b = 0; b < NB; ++b) step_scale<BF16>(dst[b], v[b], sc[b], kk);
    };

    // The k loop at token width NE (dense: TN; MoE: wg::narrow_tn of the tile's rows, the
    // accumulator prefix of NE / 2 values per block, the x boxes keep the TN-row layout).
    // H (hoisted): the wide-token dense tiles (C2 128 x 128, C2w 128 x 256: one m64 block per
    // warpgroup, a long wgmma per step) issue step kk + 1's table loads before the wait for step
    // kk - 1: they write v, not the A registers, so ptxas keeps the wgmmas asynchronous (no C7513)
    // and, renaming the A registers over 3 sets, runs the whole lookup + scaling of step kk + 1
    // while steps kk - 1 and kk are in flight (sm_90 SASS: the HMUL2s before the
    // WARPGROUP.DEPBAR). H100, 3 alternating rounds against the loop without H
    // (benchmarks/results/probe_env_h100_s26_hoist.md): 70B
    // layers at M = 256 / 512 1-13% faster (but down at k=4, M=512 1-6% slower), 8B down 1-9%
    // faster, 8B gate_up -4% .. +1%, qkv / o 0-2% slower; a layer's four 0.92-1.00x. The
    // 64-token tiles (C1, C1w) were 1-5% slower with it and C3 (M = 128) mixed, so they run
    // without H, and so does the grouped MoE kernel (not measured with it).
    auto k_loop = [&](auto ne, auto hoist) {
        constexpr int NE = decltype(ne)::value;
        constexpr bool H = decltype(hoist)::value;
        static_assert(!H || AB == 2, "the hoisted loop rotates 2 A sets");
        load_stage(0);
        if constexpr (H) lookups(0), scale(0, a[0]);
        else dequant(0, a[0]);
#pragma unroll 1
        for (int it = 0; it < kr.count; ++it) {
            const int slot = wg::ring_slot(it, S);
            const uint64_t desc = wg::desc_sw128(ring + slot * L::kBytes);
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                wg_fence();  // the A registers were written by ordinary instructions
#pragma unroll
                for (int b = 0; b < NB; ++b)
                    wgmma_rs<BF16, NE>(acc[b], a[kk % AB][b], desc + (wg::b_step_offset<TN>(kk) >> 4));
                wg_commit();
                if constexpr (H) {
                    const bool more = kk < 7 || it + 1 < kr.count;
                    if (kk < 7) lookups(kk + 1);
                    else if (more) load_stage(it + 1), lookups(0);
                    wg_wait<1>();  // step kk - 1 retired: set (kk + 1) % 2 is free
                    if (kk == 0 && it > 0 && lane == 0)  // k-tile it - 1's step 7 retired
                        wg::mbar_arrive(empty0 + 8 * wg::ring_slot(it - 1, S));
                    if (more) scale((kk + 1) % 8, a[(kk + 1) % 2]);
                    continue;
                }
                wg_wait<kPending>();  // step kk - kPending retired: set (kk + 1) % AB is free
                // k-tile it - 1's last wgmma (step 7) is retired once kPending steps of this
                // k-tile have been committed after it: release its slot (one arrival per warp).
                if (kk == kPending - 1 && it > 0 && lane == 0)
                    wg::mbar_arrive(empty0 + 8 * wg::ring_slot(it - 1, S));
                if (kk < 7) {
                    dequant(kk + 1, a[(kk + 1) % AB]);
                } else if (it + 1 < kr.count) {  // next k-tile's planes while step 7 runs
                    load_stage(it + 1);
                    dequant(0, a[0]);
                }
            }
        }
    };
    using Hoist = std::integral_constant<bool, GM == kDense && AB == 2 && RWG == 64 && TN >= 128>;
    if constexpr (GM == kDense) {
        k_loop(std::integral_constant<int, TN>{}, Hoist{});
    } else {
        const int x_rows = wg::narrow_tn(TN, m_rows);  // the width the producer loads
        if (x_rows == TN / 4) k_loop(std::integral_constant<int, TN / 4>{}, Hoist{});
        else if (x_rows == TN / 2) k_loop(std::integral_constant<int, TN / 2>{}, Hoist{});
        else k_loop(std::integral_constant<int, TN>{}, Hoist{});
    }
    wg_wait<0>();
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int v = 0; v < TN / 2; ++v) wg::pin(acc[b][v]);
    // kWorkspace: the reduce kernel (launched with PDL) may be scheduled now (the producer warps
    // have exited); it waits in pdl_wait() for this grid's partials.
    if (GM == kDense && (p.mode == kWorkspace || p.pdl)) pdl_trigger();

    // ----------------------------------------------------------------------------- epilogue
    // Both consumer warpgroups are past their last wgmma (whose completion also orders its
    // shared-memory reads before our stores) and every copy has landed: the ring is free.
    wg::named_barrier(1, 256);
    float* out = reinterpret_cast<float*>(smem + (ring - s_base));
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int v = 0; v < TN / 2; ++v) {  // wgmma D fragment: row g (+8), token 2t (+1) per n8
            const int row = cw * RWG + 64 * b + 16 * wq + g + 8 * ((v >> 1) & 1);
            const int tok = 8 * (v >> 2) + 2 * t + (v & 1);
            out[tok * L::kOutRow + row] = acc[b][v];
        }
    // Write-out in float4 units (4 rows of one token): coalesced along n.
    constexpr int kRowUnits = L::kRows / 4, kUnits = TN * kRowUnits;
    const int ctid = tid - 128, n0 = nt0 * kTileN, m_valid = min(TN, GM == kDense ? p.M - m0 : m_rows);  // (dense: its measured code)
    if constexpr (GM != kDense) {
        wg::named_barrier(1, 256);
        moe_epilogue<BF16, GM, L::kRows, TN, L::kOutRow>(p, mo, out, ctid, n0, m0, m_valid);
        return;
    }
    if (p.mode == kCluster) {
        // The splits of this output tile are one cluster: rank r sums units [r*per, (r+1)*per)
        // over all ranks' tiles in rank order (deterministic); the second cluster barrier keeps
        // every CTA's shared memory alive until the remote reads are done.
        cluster_sync();
        const int rank = static_cast<int>(cluster_rank()), per = (kUnits + p.splits - 1) / p.splits;
        for (int u = rank * per + ctid; u < min(kUnits, (rank + 1) * per); u += 256) {
            const int tok = u / kRowUnits, r4 = (u % kRowUnits) * 4;
            if (tok >= m_valid) continue;
            const float4 v = cluster_sum4(ring + (tok * L::kOutRow + r4) * 4, p.splits);
            store_y<BF16>(p.y, m0 + tok, n0 + r4, p.n, v);
        }
        cluster_sync();
        return;
    }
    wg::named_barrier(1, 256);
    float* ws = p.mode == kWorkspace ? p.ws + static_cast<int64_t>(blockIdx.y) * p.M * p.n : nullptr;
    for (int u = ctid; u < kUnits; u += 256) {
        const int tok = u / kRowUnits, r4 = (u % kRowUnits) * 4;
        if (tok >= m_valid) continue;
        const float4 v = *reinterpret_cast<const float4*>(out + tok * L::kOutRow + r4);
        if (p.mode == kDirect) store_y<BF16>(p.y, m0 + tok, n0 + r4, p.n, v);
        else store_ws(ws, m0 + tok, n0 + r4, p.n, v);
    }
#else
    (void)p;
    __trap();  // never launched: the host requires sm_90a code and an sm_90 GPU
#endif
}

// --------------------------------------------------------------------------------- host

#if defined(KBIT_SM90A)

struct WgConfig {
    int smem = 0, stages = 0, copies_log2 = 0, table_bytes = 0, sms = 0;
    int clusters[kMaxSplits + 1] = {};  // clusters of s CTAs it runs at once (s = 2..8; all 0
                                        // unless a cluster of kMaxSplits fits: no DSMEM split-K)
};

// Per device and kernel (cached): table copies, stages and shared memory (wg::ring_plan).
// KBIT_WGMMA_STAGES caps the stages, KBIT_WGMMA_COPIES_LOG2 fixes the table copies (tuning hooks,
// read once per process and kernel).
template <int BITS, int RWG, int TN, bool BF16, int GM = kDense, int AB = kABufs>
WgConfig configure(int dev) {
    static std::mutex mu;
    static std::unordered_map<int, WgConfig> cache;
    const std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(dev); it != cache.end()) return it->second;
    using L = wg::StageLayout<BITS, RWG, TN>;
    const auto kernel = wgmma_gemm_kernel<BITS, RWG, TN, BF16, GM, AB>;
    cudaDeviceProp prop;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    cudaFuncAttributes fa;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    TORCH_CHECK(fa.binaryVersion == 90, "kbit::mma (KBIT_MMA_WGMMA=2): the kernel that would run is "
                "compiled for sm_", fa.binaryVersion, ", not sm_90a");
    const int budget = static_cast<int>(prop.sharedMemPerBlockOptin) - static_cast<int>(fa.sharedSizeBytes);
    const int max_stages = std::clamp(env_int("KBIT_WGMMA_STAGES", wg::kMaxStages), 2, wg::kMaxStages);
    const wg::RingPlan r = wg::ring_plan(BITS, L::kBytes, L::kOut, budget, max_stages,
                                         env_int("KBIT_WGMMA_COPIES_LOG2", -1));
    TORCH_CHECK(r.stages, "kbit::mma (KBIT_MMA_WGMMA=2): not enough shared memory for bits=", BITS,
                ", ", 2 * RWG, "x", TN, " tiles (", budget, " B available)");
    WgConfig c;
    c.smem = r.smem, c.stages = r.stages, c.copies_log2 = r.copies_log2, c.table_bytes = r.table_bytes;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
    int ctas = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, wg::kThreads, c.smem));
    TORCH_CHECK(ctas >= 1, "kbit::mma (KBIT_MMA_WGMMA=2): the kernel does not fit on this GPU");
    c.sms = prop.multiProcessorCount;
    if (cluster_fits(kernel, wg::kThreads, c.smem, kMaxSplits))  // split-K over DSMEM?
        count_clusters(c.clusters, kernel, wg::kThreads, c.smem, kMaxSplits);
    cache.emplace(dev, c);
    return c;
}

// cuTensorMapEncodeTiled from the driver, looked up through the runtime once per process (no
// -lcuda link: the driver library is whatever libcudart loaded).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void* f = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
        C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                        cudaEnableDefault, &q));
#else
        C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &q));
#endif
        TORCH_CHECK(q == cudaDriverEntryPointSuccess && f != nullptr,
                    "kbit::mma (KBIT_MMA_WGMMA=2): the CUDA driver has no cuTensorMapEncodeTiled");
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
    }();
    return fn;
}

// TMA descriptor of x [M, K] (row stride ldx): boxes of 64 columns (128 B, the 128B-swizzle
// span) x tn rows, elements outside [0, K) x [0, M) read as zero.
CUtensorMap x_tensor_map(const at::Tensor& x, int tn) {
    const int64_t M = x.size(0), K = x.size(1);
    // TMA wants 16-B aligned rows; with one row the stride is never used (any multiple of 16).
    const int64_t ld_bytes = M == 1 ? ceil_div(K * 2, 16) * 16 : x.stride(0) * 2;
    TORCH_CHECK(aligned(x, 16) && ld_bytes % 16 == 0,
                "kbit::mma (KBIT_MMA_WGMMA=2): x rows must be 16-byte aligned");
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(M)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld_bytes)};
    const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(tn)};
    const cuuint32_t elem_strides[2] = {1, 1};
    CUtensorMap map;
    const CUresult r = tensor_map_encoder()(
        &map, x.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        2, x.data_ptr(), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(r == CUDA_SUCCESS, "kbit::mma (KBIT_MMA_WGMMA=2): cuTensorMapEncodeTiled failed (",
                static_cast<int>(r), ") for x ", x.sizes(), " with row stride ", ld_bytes, " B");
    return map;
}

// A TMA map of tiled planes / absmax as u64 (no swizzle, out-of-bounds boxes zero-filled):
// dims[0] = chunk / 8 u64 per tile, dims[1] = k_tiles; strides[i] (bytes) of dims[i + 1].
static CUtensorMap u64_tile_map(const void* base, int rank, const cuuint64_t* dims,
                                const cuuint64_t* strides, const cuuint32_t* box, const char* what) {
    TORCH_CHECK(aligned(base, 16), "kbit (wgmma): ", what,
                " must be 16-byte aligned");
    const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
    CUtensorMap map;
    const CUresult r = tensor_map_encoder()(
        &map, CU_TENSOR_MAP_DATA_TYPE_UINT64, rank, const_cast<void*>(base), dims, strides, box,
        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(r == CUDA_SUCCESS, "kbit (wgmma): cuTensorMapEncodeTiled failed (",
                static_cast<int>(r), ") for ", what, ": ", dims[rank - 1], " x ... x ", dims[1],
                " tiles of ", dims[0] * 8, " B");
    return map;
}

// The tiled planes (chunk = BITS * 256 B per tile) or absmax (chunk = 64 B) of docs/format.md as a
// 3-D tensor [n_tiles][k_tiles][chunk / 8] of u64, box {chunk / 8, 1, box_tiles}: one k-tile of
// box_tiles consecutive n-tiles, landing in shared memory as [tile][chunk], the stage layout.
// Rows past n_tiles are zero-filled; L2 promotion 256 B also brings the next k-tiles' absmax of a
// tile (64 B each, contiguous).
CUtensorMap tile_tensor_map(const void* base, int64_t n_tiles, int64_t k_tiles, int64_t chunk,
                            int box_tiles, const char* what) {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(chunk / 8), static_cast<cuuint64_t>(k_tiles),
                                static_cast<cuuint64_t>(n_tiles)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(chunk),
                                   static_cast<cuuint64_t>(chunk * k_tiles)};
    const cuuint32_t box[3] = {static_cast<cuuint32_t>(chunk / 8), 1, static_cast<cuuint32_t>(box_tiles)};
    return u64_tile_map(base, 3, dims, strides, box, what);
}

// Grouped MoE: the experts' tiled planes / absmax as a 5-D tensor [E][halves][n_half][k_tiles]
// [chunk / 8] (expert_bytes apart; gate_up: halves = 2, the gate tiles then the up tiles), box
// {chunk / 8, 1, box_tiles, halves, 1}: one k-tile of box_tiles n-tiles of each half of one
// expert, landing as [half][tile][chunk] = the stage's tiles t < kTiles / 2 (gate), then up.
// Tiles past n_half are zero-filled, within each half: never the next half's or expert's.
CUtensorMap expert_tile_map(const void* base, int64_t experts, int64_t expert_bytes, int halves,
                            int64_t n_half, int64_t k_tiles, int64_t chunk, int box_tiles,
                            const char* what) {
    const cuuint64_t dims[5] = {static_cast<cuuint64_t>(chunk / 8), static_cast<cuuint64_t>(k_tiles),
                                static_cast<cuuint64_t>(n_half), static_cast<cuuint64_t>(halves),
                                static_cast<cuuint64_t>(experts)};
    const cuuint64_t strides[4] = {
        static_cast<cuuint64_t>(chunk), static_cast<cuuint64_t>(chunk * k_tiles),
        static_cast<cuuint64_t>(chunk * k_tiles * n_half), static_cast<cuuint64_t>(expert_bytes)};
    const cuuint32_t box[5] = {static_cast<cuuint32_t>(chunk / 8), 1,
                               static_cast<cuuint32_t>(box_tiles), static_cast<cuuint32_t>(halves), 1};
    return u64_tile_map(base, 5, dims, strides, box, what);
}

// Is the GPU an sm_90 (the build's sm_90a code runs only there)? Cached per device.
bool is_sm90(int dev) {
    static std::mutex mu;
    static std::unordered_map<int, bool> cache;
    const std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(dev);
    if (it == cache.end()) {
        int major = 0, minor = 0;
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        it = cache.emplace(dev, major == 9 && minor == 0).first;
    }
    return it->second;
}

void check_sm90(int dev) {
    TORCH_CHECK(is_sm90(dev), "kbit::mma: KBIT_MMA_WGMMA=2 (the warp-specialized wgmma kernel) "
                "needs an sm_90 GPU (H100/H200); device ", dev, " is not one");
}

#endif  // KBIT_SM90A

}  // namespace
}  // namespace kbit
