// SPDX-License-Identifier: Apache-2.0
// kbit::moe: the routed experts of one MoE layer (vLLM's fused_experts) on k-bit weights in the
// runtime tiled layout, one row of w13_* / w2_* per local expert (contract: reference_moe.py).
//
//   out[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)),  e = local expert of slot (t, j)
//
// Decode calls with few slots (moe_gemv_takes) go to moe_gemv.cu instead: two GEMV launches.
// On sm_90 (sm_90a builds), calls with >= 64 slots per local expert take run_moe_wgmma instead:
// the routing kernel below (tiles of 128 or 256 slots), a gather of the slots' x rows in expert
// order, gate_up (+ activation) and down as grouped wgmma GEMMs (moe_wgmma.cu), the combine.
// Launches (one per stage, all on the current stream, no host sync, CUDA-graph safe):
//  1. route (only when T * topk > 256): one CTA sorts the slots s = t * topk + j by local expert
//     (counting sort, shared-memory atomics) and lists the work tiles (expert, first sorted slot,
//     rows) of TM slots each. With <= 256 slots every GEMM CTA derives its own tile from
//     topk_ids instead (a histogram and a scan over the experts in shared memory): no extra
//     launch on the decode path.
//  2. gate_up GEMM, grid (I/128 column groups, K splits, max tiles): a CTA of 8 warps computes
//     128 gate and the matching 128 up rows of one expert for the TM slots of one tile, gathering
//     the token rows of x with cp.async, and applies the gated activation in its epilogue:
//     act_buf[s, :] = act(h_gate) * h_up, with h rounded to x.dtype and the product rounded once.
//  3. down GEMM, grid (H/256, K splits, max tiles), on act_buf rows; its epilogue either writes
//     fp32 per-slot rows (deterministic: 16 < T and T * topk * H * 4 <= 32 MB, or
//     KBIT_MOE_DETERMINISTIC=1) or adds w[t, j] * row to an fp32 [T, H] accumulator with atomics
//     (T <= 16: no split-K reduction step; large T: half the traffic).
//  4. combine: out[t] = sum_j w[t, j] * row(t, j) in slot order (or the accumulator), rounded once.
// Both GEMMs run the fused-dequant main loop of mma.cu (frag_dequant.cuh): a cp.async ring of
// k-tiles (16 weight tiles + the TM gathered activation rows), A fragments from the pair table,
// fp32 absmax per 32-column block. Only experts that received slots are read: the grid is sized
// for the worst case and CTAs without a tile exit at once. Split-K (decode: few slots per expert)
// reduces through distributed shared memory in a thread-block cluster on sm_90, through an fp32
// workspace elsewhere. On sm_90 the GEMMs and the combine are launched with programmatic
// dependent launch: the down GEMM builds its table, routes and prefetches its first weight
// k-tiles while the gate_up GEMM finishes, and waits (griddepcontrol.wait) before it reads
// act_buf.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>

#include "frag_dequant.cuh"
#include "kbit_format.cuh"
#include "ops.h"

namespace kbit {
namespace {

using namespace frag;

constexpr int kSmallSlots = kThreads;              // <= this many slots: routing inside the CTAs
constexpr int kRouteThreads = 1024;
constexpr int kMaxExperts = 4096;                  // routing histograms live in shared memory
constexpr int64_t kSlotsMaxBytes = int64_t{32} << 20;  // per-slot fp32 rows up to this size
constexpr int64_t kAtomicMaxT = 16;  // decode: atomics by default up to this many tokens
// sm_90: the grouped wgmma GEMMs (moe_wgmma.cu) from this many slots per local expert on.
constexpr double kWgMinSlots = 64;

enum Gemm : int { kGateUp = 0, kDown = 1 };
enum OutMode : int { kSlots = 0, kAtomic = 1 };

// Where the slots of a call go: the local expert of slot s, and (routing kernel) the sorted
// slots and tile list.
struct Routing {
    const int32_t* ids32;  // topk_ids [S] (one of ids32 / ids64 is set)
    const int64_t* ids64;
    const int32_t* emap;   // expert_map [emap_n] or null
    int emap_n;
    int S, topk, E;        // slots (T * topk), slots per token, local experts
    const int* sorted;     // [S] slots sorted by expert (null: the CTAs route themselves)
    const int4* tiles;     // [max_tiles] {expert, first sorted index, rows, 0}
    const int* num_tiles;  // [1]
};

struct GemmParams {
    Routing rt;
    const uint8_t* x;       // gate_up: x [T, ldx] (row = slot / topk); down: act_buf [S, I]
    int64_t ldx_bytes;
    const uint8_t* qw;      // [E][tiled planes]
    const uint8_t* am;      // [E][tiled absmax]
    int64_t qw_expert, am_expert;  // bytes per expert
    const float* cb;
    const float* topk_w;    // [S]
    void* out;              // gate_up: act_buf [S, I] dtype; down: fp32 [S, H] (kSlots) or [T, H]
    float* ws;              // kWorkspace: fp32 partials [splits][S][n_ws]
    float4* zero_buf;       // gate_up: the down GEMM's atomic accumulator, cleared here
    int64_t zero_count;     // float4 units
    int gemm, K, n_tiles, k_tiles, half_tiles, n_out, n_ws;
    int kchunk, splits, stages, mode, out_mode, act, weight_on_input, copies_log2, ring_off;
};


// ------------------------------------------------------------------------ device helpers

// Exclusive prefix sum over the block (blockDim.x a multiple of 32, <= 1024); `total` gets the
// sum. `ws` holds 33 ints of shared memory; contains barriers (all threads must call).
__device__ __forceinline__ int block_exclusive_scan(int v, int* ws, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xFFFFFFFFu, inc, o);
        if (lane >= o) inc += n;
    }
    if (lane == 31) ws[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < nw ? ws[lane] : 0;
        int wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int n = __shfl_up_sync(0xFFFFFFFFu, wi, o);
            if (lane >= o) wi += n;
        }
        ws[lane] = wi - w;
        if (lane == 31) ws[32] = wi;
    }
    __syncthreads();
    const int r = ws[warp] + inc - v;
    total = ws[32];
    __syncthreads();  // ws may be reused right away
    return r;
}

// The tile of CTA z: its expert (-1: none), rows, and the slots of its rows in s_slot[0, rows).
// Small calls (no routing kernel): counts per expert in `scratch` (E ints), tiles in expert
// order, slots of an expert in slot order. Contains barriers; the result is uniform per CTA.
template <int TM>
__device__ __forceinline__ void find_tile(const Routing& rt, int z, int* s_slot, int* s_misc,
                                          int* scan_ws, int* scratch, int& expert, int& rows) {
    const int tid = threadIdx.x;
    if (rt.sorted != nullptr) {
        if (tid == 0) {
            int e = -1, n = 0, first = 0;
            if (z < *rt.num_tiles) {
                const int4 t = rt.tiles[z];
                e = t.x, first = t.y, n = t.z;
            }
            s_misc[0] = e, s_misc[1] = n, s_misc[2] = first;
        }
        __syncthreads();
        expert = s_misc[0], rows = s_misc[1];
        if (expert >= 0 && tid < rows) s_slot[tid] = rt.sorted[s_misc[2] + tid];
        __syncthreads();
        return;
    }
    int* cnt = scratch;
    for (int e = tid; e < rt.E; e += kThreads) cnt[e] = 0;
    if (tid == 0) s_misc[0] = -1;
    __syncthreads();
    const int my_e = tid < rt.S ? local_expert(rt, tid) : -1;
    if (my_e >= 0) atomicAdd(&cnt[my_e], 1);
    __syncthreads();
    const int per = (rt.E + kThreads - 1) / kThreads, e0 = tid * per, e1 = min(rt.E, e0 + per);
    int mine = 0;
    for (int e = e0; e < e1; ++e) mine += (cnt[e] + TM - 1) / TM;
    int total;
    int start = block_exclusive_scan(mine, scan_ws, total);
    if (z >= start && z < start + mine) {
        for (int e = e0; e < e1; ++e) {
            const int t = (cnt[e] + TM - 1) / TM;
            if (z < start + t) {
                s_misc[0] = e, s_misc[1] = z - start;
                break;
            }
            start += t;
        }
    }
    __syncthreads();
    expert = s_misc[0];
    if (expert < 0) return;
    const int j = s_misc[1];
    rows = min(TM, cnt[expert] - j * TM);
    // rank of my slot among the expert's slots, in slot order
    const bool m = my_e == expert;
    const unsigned bal = __ballot_sync(0xFFFFFFFFu, m);
    const int lane = tid & 31, warp = tid >> 5;
    if (lane == 0) scan_ws[warp] = __popc(bal);
    __syncthreads();
    int rank = __popc(bal & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) rank += scan_ws[w];
    if (m && rank >= j * TM && rank < j * TM + TM) s_slot[rank - j * TM] = tid;
    __syncthreads();
}

// The n-tile of the expert's weight that local tile i (0..15) of column group `grp` computes, or
// -1 past the weight's rows. gate_up: local tiles 0-7 are gate tiles 8 grp .. 8 grp + 7, tiles
// 8-15 the matching up tiles (I/16 + 8 grp ..); down: tiles 16 grp .. 16 grp + 15.
__device__ __forceinline__ int expert_tile(const GemmParams& p, bool gate_up, int grp, int i) {
    if (gate_up) {
        const int h = grp * 8 + (i & 7);
        return h < p.half_tiles ? (i < 8 ? h : p.half_tiles + h) : -1;
    }
    const int t = grp * kGroupTiles + i;
    return t < p.n_tiles ? t : -1;
}

// ------------------------------------------------------------------------------ kernels

// Grid (column groups, splits, max tiles); expert_tile() gives the n-tile of each local tile.
template <int BITS, int TM, bool BF16>
__global__ void __launch_bounds__(kThreads, TM <= 32 ? 2 : 1) moe_gemm_kernel(const GemmParams p) {
    using L = Layout<BITS, TM>;
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ uint16_t cbh[32];
    __shared__ int s_slot[TM];
    __shared__ int64_t s_row[TM];
    __shared__ int s_misc[4];
    __shared__ int scan_ws[33];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp = blockIdx.x, z = blockIdx.z;
    const int kbeg = blockIdx.y * p.kchunk, nk = min(p.kchunk, p.k_tiles - kbeg);
    const uint32_t s_base = smem_u32(smem);
    const bool gate_up = p.gemm == kGateUp;

    // gate_up reads the outputs of earlier kernels (x, topk_*): wait for them first (a no-op
    // without PDL), then let the down GEMM launch. The down GEMM reads only data that was complete
    // when the gate_up GEMM started (weights, codebook, topk_ids, routing lists) before its wait.
    if (gate_up) {
        pdl_wait();
        pdl_trigger();
    }
    if (tid < (1 << BITS)) cbh[tid] = scaled_code<BF16>(cb_value(p.cb, tid));
    __syncthreads();
    const uint32_t tbl_base = (s_base + 63u) & ~63u;  // 64-byte aligned, < s_base + 64
    build_pair_table<BITS>(smem + (tbl_base - s_base), cbh, p.copies_log2, tid, kThreads);

    if (gate_up) {
        if (p.zero_buf != nullptr) {  // clear the down GEMM's accumulator (it runs after us)
            const int64_t nb = int64_t{gridDim.x} * gridDim.y * gridDim.z;
            const int64_t b = (int64_t{blockIdx.z} * gridDim.y + blockIdx.y) * gridDim.x + grp;
            for (int64_t i = b * kThreads + tid; i < p.zero_count; i += nb * kThreads)
                p.zero_buf[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    int expert, rows = 0;
    find_tile<TM>(p.rt, z, s_slot, s_misc, scan_ws, reinterpret_cast<int*>(smem + p.ring_off),
                  expert, rows);
    if (expert < 0) {  // uniform per cluster: its CTAs share z
        // Down GEMM: wait for the gate_up GEMM even here, so that this grid never completes
        // before it (the combine's griddepcontrol.wait, and the next call's kernels through
        // it, then order after every kernel of this call; e.g. the gate_up GEMM's clearing of
        // the atomic accumulator when no CTA of this grid has a tile).
        if (!gate_up) pdl_wait();
        return;
    }

    // Copy roles, fixed per thread (sources advance by one k-tile per load):
    //  planes: 16-byte chunk (tid & 15) + 16 j of tile tid / 16; absmax: tid < 64, chunk tid & 3
    //  of tile tid / 4; x: rows tid / 16 + 16 i, columns 8 (tid & 15) .. + 7 of the k-tile.
    // Tiles past n are zero-filled from the (valid, never advanced) base address; so are rows
    // >= `rows` and columns >= K.
    const int w_tile = tid >> 4, a_tile = (tid >> 2) & (kGroupTiles - 1), x_row = tid >> 4;
    const int w_nt = expert_tile(p, gate_up, grp, w_tile), a_nt = expert_tile(p, gate_up, grp, a_tile);
    const bool w_ok = w_nt >= 0, a_ok = a_nt >= 0;
    const uint8_t* w_next =
        w_ok ? p.qw + expert * p.qw_expert + (int64_t{w_nt} * p.k_tiles + kbeg) * (BITS * 256) +
                   (tid & 15) * 16
             : p.qw;
    const uint8_t* a_next =
        a_ok ? p.am + expert * p.am_expert + (int64_t{a_nt} * p.k_tiles + kbeg) * 64 + (tid & 3) * 16
             : p.am;
    const int w_step = w_ok ? BITS * 256 : 0, a_step = a_ok ? 64 : 0;
    constexpr int kXJ = TM >= 16 ? TM / 16 : 1;  // x rows per thread
    const int x_col = (tid & 15) * 8;
    int x_k = kbeg * kTileK + x_col;
    // byte offset of each tile row's source row (gate_up: the token of the slot) in x, or -1
    if (tid < TM) {
        const int64_t src = tid < rows ? (gate_up ? s_slot[tid] / p.rt.topk : s_slot[tid]) : -1;
        s_row[tid] = src >= 0 ? src * p.ldx_bytes : int64_t{-1};
    }
    __syncthreads();
    int load_slot = 0;
    auto load_w = [&]() {  // weights of the next k-tile into the next ring slot
        const uint32_t st = s_base + p.ring_off + load_slot * L::kStage;
#pragma unroll
        for (int j = 0; j < BITS; ++j)
            cp_async16(st + w_tile * (BITS * 256) + (tid & 15) * 16 + j * 256, w_next + j * 256,
                       w_ok);
        if (tid < kGroupTiles * 4) cp_async16(st + L::kW + tid * 16, a_next, a_ok);
        w_next += w_step, a_next += a_step;
    };
    auto load_x = [&]() {  // the same k-tile's activation rows
        const uint32_t st = s_base + p.ring_off + load_slot * L::kStage;
        const bool k_ok = x_k < p.K;
#pragma unroll
        for (int i = 0; i < kXJ; ++i) {
            if (TM >= 16 || tid < TM * 16) {
                const int64_t row_off = s_row[x_row + 16 * i];
                const uint8_t* src = p.x;  // any valid address when nothing is copied
                bool ok = false;
                if (row_off >= 0 && k_ok) {
                    src = p.x + (row_off + 2 * static_cast<int64_t>(x_k));
                    ok = true;
                }
                cp_async16(st + L::kW + L::kA + (x_row + 16 * i) * kXRow + x_col * 2, src, ok);
            }
        }
        x_k += kTileK;
        load_slot = load_slot + 1 == p.stages ? 0 : load_slot + 1;
    };

    // Prologue: the first stages-1 k-tiles' weights, then (down GEMM: after waiting for the
    // gate_up GEMM) their activations, as one commit group.
    // Both loops have a compile-time trip count and a guard. Do not write them as `s < pre`:
    // ptxas of CUDA 13.0 compiled that loop (moe_gemm_kernel<2, 8, false>, sm_90) into a 4x
    // unrolled body whose entry test, a fused 3-way max (VIMNMX3), takes +stages where the
    // trip count needs -stages. The unrolled body then ran with a remaining count of 0 - 4k and
    // kept copying k-tiles until it left mapped memory (illegal address on H100).
    const int pre = min(p.stages - 1, nk);
    {
        const int keep = load_slot;
#pragma unroll
        for (int s = 0; s < kMaxStages - 1; ++s) {
            if (s < pre) {
                load_w();
                load_slot = load_slot + 1 == p.stages ? 0 : load_slot + 1;
            }
        }
        load_slot = keep;
    }
    if (!gate_up) pdl_wait();
#pragma unroll
    for (int s = 0; s < kMaxStages - 1; ++s)
        if (s < pre) load_x();
    cp_async_commit();

    const uint32_t tbl_lane = tbl_base + (lane & ((1 << p.copies_log2) - 1)) * 4;
    const uint32_t stride = 4u << p.copies_log2;
    const int x_tok = TM == 8 ? (lane & 7) : (lane & 7) + ((lane >> 4) << 3);
    const uint32_t x_lane0 = s_base + L::kW + L::kA + x_tok * kXRow + ((lane >> 3) & 1) * 16;
    const bool warp_busy = expert_tile(p, gate_up, grp, warp * kNT) >= 0;

    float acc[kNT][TM / 8][4];
#pragma unroll
    for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int f = 0; f < TM / 8; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][f][e] = 0.f;

    int slot = 0;
#pragma unroll 1
    for (int it = 0; it < nk; ++it) {
        // k-tile `it` has landed once at most min(it, stages-2) younger groups are pending (the
        // prologue is one group); the barrier also frees slot (it-1) % stages for the refill.
        const int allow = min(it, p.stages - 2);
        if (allow >= 2) cp_async_wait<2>();
        else if (allow == 1) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();
        if (it + p.stages - 1 < nk) {
            load_w();
            load_x();
        }
        cp_async_commit();
        const int stage = p.ring_off + slot * L::kStage;
        if (warp_busy)
            tile_step<BITS, TM, kNT, BF16>(acc, smem + stage + warp * kNT * BITS * 256,
                                           smem + stage + L::kW + warp * kNT * 64, lane, tbl_lane,
                                           stride, x_lane0 + stage);
        slot = slot + 1 == p.stages ? 0 : slot + 1;
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring and the table are dead: reuse them for the output tile

    float* out = reinterpret_cast<float*>(smem);
    store_acc_tile<TM>(out, acc, warp, lane);

    // Write-out in float4 units (4 rows of one token). gate_up: unit = (token, 4 gate rows), its
    // up rows are 128 further; down: unit = (token, 4 rows).
    const int unit_rows = gate_up ? kGroupRows / 2 : kGroupRows;
    const int row_units = unit_rows / 4, units = TM * row_units;
    const int c0 = grp * unit_rows;  // first output column of this CTA
    auto emit = [&](int u, auto fetch) {
        const int tok = u / row_units, r4 = (u - tok * row_units) * 4, c = c0 + r4;
        if (tok >= rows || c >= p.n_out) return;
        const int s = s_slot[tok];
        const int off = tok * kOutRow + r4;
        if (p.mode == kWorkspace) {  // raw fp32 partials of this split
            float* w = p.ws + (int64_t{blockIdx.y} * p.rt.S + s) * p.n_ws + c;
            *reinterpret_cast<float4*>(w) = fetch(off);
            if (gate_up) *reinterpret_cast<float4*>(w + p.n_out) = fetch(off + unit_rows);
            return;
        }
        if (gate_up) {
            const float wm = p.weight_on_input ? p.topk_w[s] : 1.0f;
            const uint2 v = act_mul4<BF16>(fetch(off), fetch(off + unit_rows), wm, p.act);
            *reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.out) +
                                      (int64_t{s} * p.n_out + c) * 2) = v;
        } else if (p.out_mode == kAtomic) {
            const float wm = p.weight_on_input ? 1.0f : p.topk_w[s];
            atomic_add4(static_cast<float*>(p.out) + int64_t{s / p.rt.topk} * p.n_out + c,
                        f4mul(fetch(off), wm));
        } else {
            *reinterpret_cast<float4*>(static_cast<float*>(p.out) + int64_t{s} * p.n_out + c) =
                fetch(off);
        }
    };
    if (p.mode == kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        // The splits of this tile are one cluster: rank r finishes units [r*per, (r+1)*per),
        // adding all ranks' partial tiles in rank order (deterministic); the second cluster
        // barrier keeps every CTA's shared memory alive until all remote reads are done.
        cluster_sync();
        const int rank = static_cast<int>(cluster_rank()), per = (units + p.splits - 1) / p.splits;
        const int nsplit = p.splits;
        for (int u = rank * per + tid; u < min(units, (rank + 1) * per); u += kThreads)
            emit(u, [&](int off) { return cluster_sum4(s_base + off * 4, nsplit); });
        cluster_sync();
#endif
        return;
    }
    __syncthreads();
    for (int u = tid; u < units; u += kThreads)
        emit(u, [&](int off) { return *reinterpret_cast<const float4*>(out + off); });
}

// Routing for T * topk > kSmallSlots: counting sort of the slots by local expert and the tile
// list (TM slots per tile, experts in order). Within an expert the order of the slots is
// arbitrary (atomics); every row's result is independent of its position.
//  * up to kRouteMultiMin slots: one CTA (moe_route_kernel);
//  * above: chunks of kRouteChunk slots per CTA in two launches. moe_route_count adds each
//    chunk's histogram into cnt[E] and the last CTA to finish scans it (offsets -> cur[E], the
//    tile list); moe_route_scatter takes each chunk's range of every expert from cur[] with one
//    atomic per (chunk, expert) and places the slots. One CTA spent 37.6 us on the 32768 slots of
//    Qwen3-30B-A3B at T = 4096 (moe_profile_h100_s11.log), the loop over the slots being
//    serial.
struct RouteParams {
    Routing rt;
    int* sorted;
    int4* tiles;
    int* num_tiles;
    int tile_m;  // TM
    int* cnt;    // multi-CTA: [E] histogram and [1] ticket (zeroed before), [E] cursors
};

// From the experts' slot counts (cnt, shared or global memory): the offsets (into cur) and the
// tile list. Called by every thread of one CTA.
__device__ void route_scan(const RouteParams& p, const int* cnt, int* cur, int* scan_ws) {
    const int tid = threadIdx.x, E = p.rt.E, nthreads = blockDim.x;
    const int per = (E + nthreads - 1) / nthreads, e0 = tid * per, e1 = min(E, e0 + per);
    int n = 0, nt = 0;
    for (int e = e0; e < e1; ++e) n += cnt[e], nt += (cnt[e] + p.tile_m - 1) / p.tile_m;
    int total, total_tiles;
    int off = block_exclusive_scan(n, scan_ws, total);
    int toff = block_exclusive_scan(nt, scan_ws, total_tiles);
    for (int e = e0; e < e1; ++e) {
        const int c = cnt[e];
        cur[e] = off;
        for (int j = 0; j * p.tile_m < c; ++j)
            p.tiles[toff++] = make_int4(e, off + j * p.tile_m, min(p.tile_m, c - j * p.tile_m), 0);
        off += c;
    }
    if (tid == 0) p.num_tiles[0] = total_tiles, p.num_tiles[1] = total;  // [1]: routed slots
}

__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const RouteParams p) {
    extern __shared__ int rsm[];  // cnt[E], cursor[E]
    __shared__ int scan_ws[33];
    const int tid = threadIdx.x, E = p.rt.E;
    int* cnt = rsm;
    int* cur = rsm + E;
    pdl_wait();
    pdl_trigger();
    for (int e = tid; e < E; e += kRouteThreads) cnt[e] = 0;
    __syncthreads();
    for (int s = tid; s < p.rt.S; s += kRouteThreads) {
        const int e = local_expert(p.rt, s);
        if (e >= 0) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    route_scan(p, cnt, cur, scan_ws);
    __syncthreads();
    for (int s = tid; s < p.rt.S; s += kRouteThreads) {
        const int e = local_expert(p.rt, s);
        if (e >= 0) p.sorted[atomicAdd(&cur[e], 1)] = s;
    }
}

constexpr int kRouteChunkThreads = 256, kRouteChunkPer = 4;
constexpr int kRouteChunk = kRouteChunkThreads * kRouteChunkPer;  // slots per CTA
// At most this many slots: one CTA. (At 8192 slots the memset and the two launches took 10.3 us
// against 11.6 us for one CTA, moe_profile_h100_s12.log; smaller counts were not measured.)
constexpr int kRouteMultiMin = 4 * kRouteChunk;

// This thread's experts of the chunk (slot blockIdx.x * kRouteChunk + tid + j * threads) and
// the chunk's histogram in shared memory h[E].
__device__ __forceinline__ void route_chunk(const RouteParams& p, int* h, int (&e)[kRouteChunkPer]) {
    const int tid = threadIdx.x;
    for (int i = tid; i < p.rt.E; i += kRouteChunkThreads) h[i] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRouteChunkPer; ++j) {
        const int s = blockIdx.x * kRouteChunk + tid + j * kRouteChunkThreads;
        e[j] = s < p.rt.S ? local_expert(p.rt, s) : -1;
    }
#pragma unroll
    for (int j = 0; j < kRouteChunkPer; ++j)
        if (e[j] >= 0) atomicAdd(&h[e[j]], 1);
    __syncthreads();
}

__global__ void __launch_bounds__(kRouteChunkThreads) moe_route_count(const RouteParams p) {
    extern __shared__ int h[];  // [E]
    __shared__ int scan_ws[33];
    __shared__ bool last;
    pdl_wait();
    pdl_trigger();
    int e[kRouteChunkPer];
    route_chunk(p, h, e);
    for (int i = threadIdx.x; i < p.rt.E; i += kRouteChunkThreads)
        if (h[i]) atomicAdd(&p.cnt[i], h[i]);
    __threadfence();  // this CTA's counts before its ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&p.cnt[p.rt.E], 1) == static_cast<int>(gridDim.x) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < p.rt.E; i += kRouteChunkThreads) h[i] = __ldcg(&p.cnt[i]);
    __syncthreads();
    route_scan(p, h, p.cnt + p.rt.E + 1, scan_ws);
}

__global__ void __launch_bounds__(kRouteChunkThreads) moe_route_scatter(const RouteParams p) {
    extern __shared__ int h[];  // [E] chunk histogram, then [E] the chunk's next position
    pdl_wait();
    pdl_trigger();
    int e[kRouteChunkPer];
    route_chunk(p, h, e);
    for (int i = threadIdx.x; i < p.rt.E; i += kRouteChunkThreads)
        if (h[i]) h[i] = atomicAdd(&p.cnt[p.rt.E + 1 + i], h[i]);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRouteChunkPer; ++j)
        if (e[j] >= 0)
            p.sorted[atomicAdd(&h[e[j]], 1)] = blockIdx.x * kRouteChunk + threadIdx.x + j * kRouteChunkThreads;
}

// The wgmma path's inputs (moe_wgmma.cu reads x by TMA, which cannot gather rows): xs[i] =
// x[sorted[i] / topk] for the *count routed slots; rows past them (slots of other ranks' experts)
// are zero in xs and in the act buffer, so that the tiles reaching past the last expert's rows
// read zeros, not stale memory (their products are never stored). (The down GEMM's atomic
// accumulator is cleared by the gate_up GEMM's idle producer warps: wgmma_gemm.cuh clear_slice.)
struct GatherParams {
    const uint8_t* x;
    int64_t ldx_bytes;
    const int* sorted;
    const int* count;  // route kernel: [1] = routed slots
    uint8_t *xs, *act;
    int S, topk, row16, act16;  // row16 / act16: 16-byte chunks per row of xs / act
};

// One warp per xs row (row i of the grid-stride loop over the CTAs' warps), kGatherChunks
// 16-byte chunks per lane loaded before any is stored, no index divided. It runs no faster than
// the flat loop over S * H / 8 units it replaced (a 64-bit division per unit): both are bound by
// the store bandwidth (~2 TB/s on an H100: Qwen3-30B-A3B, T = 4096, 134 MB of rows in ~68 us;
// benchmarks/results/moe_profile_h100_s16.log).
constexpr int kGatherChunks = 8;
__global__ void __launch_bounds__(256) moe_gather_kernel(const GatherParams p) {
    const int count = *p.count, lane = threadIdx.x & 31;
    const int warps = gridDim.x * 8;
    for (int i = blockIdx.x * 8 + (threadIdx.x >> 5); i < p.S; i += warps) {
        uint4* dst = reinterpret_cast<uint4*>(p.xs) + int64_t{i} * p.row16;
        const uint4* src = i < count
            ? reinterpret_cast<const uint4*>(p.x + int64_t{p.sorted[i] / p.topk} * p.ldx_bytes)
            : nullptr;  // a row past the routed slots: zeros
        for (int c0 = lane; c0 < p.row16; c0 += 32 * kGatherChunks) {
            uint4 v[kGatherChunks];
#pragma unroll
            for (int j = 0; j < kGatherChunks; ++j) {
                const int c = c0 + 32 * j;
                v[j] = src != nullptr && c < p.row16 ? src[c] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int j = 0; j < kGatherChunks; ++j)
                if (c0 + 32 * j < p.row16) dst[c0 + 32 * j] = v[j];
        }
    }
    const int64_t stride = int64_t{gridDim.x} * 256;
    const int64_t zero_units = int64_t{p.S - count} * p.act16;
    for (int64_t u = blockIdx.x * int64_t{256} + threadIdx.x; u < zero_units; u += stride)
        *reinterpret_cast<uint4*>(p.act + (int64_t{count} * p.act16 + u) * 16) = make_uint4(0u, 0u, 0u, 0u);
}

// gate_up split-K through the workspace (no clusters): sum the splits, then the activation.
template <bool BF16>
__global__ void __launch_bounds__(256) moe_act_kernel(const Routing rt, const float* ws, int splits,
                                                      int I, const float* topk_w,
                                                      int weight_on_input, int act, void* act_buf) {
    const int64_t units = int64_t{rt.S} * (I / 4), stride = int64_t{gridDim.x} * 256;
    for (int64_t u = blockIdx.x * int64_t{256} + threadIdx.x; u < units; u += stride) {
        const int s = static_cast<int>(u / (I / 4)), c = static_cast<int>(u % (I / 4)) * 4;
        if (local_expert(rt, s) < 0) continue;
        float4 gs = make_float4(0.f, 0.f, 0.f, 0.f), us = gs;
        for (int sp = 0; sp < splits; ++sp) {
            const float* row = ws + (int64_t{sp} * rt.S + s) * (2 * I);
            gs = f4add(gs, *reinterpret_cast<const float4*>(row + c));
            us = f4add(us, *reinterpret_cast<const float4*>(row + I + c));
        }
        const float wm = weight_on_input ? topk_w[s] : 1.0f;
        *reinterpret_cast<uint2*>(static_cast<uint8_t*>(act_buf) + (int64_t{s} * I + c) * 2) =
            act_mul4<BF16>(gs, us, wm, act);
    }
}

// out[t] = sum_j w'[t, j] * sum_splits rows[split][t * topk + j] over local slots (kSlots), or
// the atomic accumulator (kAtomic); rounded once to the dtype.
struct CombineParams {
    Routing rt;
    const float* rows;  // kSlots: [splits][S][H]; kAtomic: [T][H]
    const float* topk_w;
    void* out;          // [T][H]
    int T, H, splits, out_mode, weight_on_input;
};

// Grid (T token rows, 256-float4 column chunks), one float4 per thread and no loop: a
// grid-stride loop here made each thread wait one memory latency per token (its load follows the
// previous token's store) and no index is divided (the flat version divided 64-bit indices).
template <bool BF16>
__global__ void __launch_bounds__(256) moe_combine_kernel(const CombineParams p) {
    pdl_wait();
    const int c4 = blockIdx.y * 256 + threadIdx.x, tok = blockIdx.x;
    if (c4 >= p.H / 4) return;
    const int c = 4 * c4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (p.out_mode == kAtomic) {
        v = *reinterpret_cast<const float4*>(p.rows + int64_t{tok} * p.H + c);
    } else {
        for (int j = 0; j < p.rt.topk; ++j) {
            const int s = tok * p.rt.topk + j;
            if (local_expert(p.rt, s) < 0) continue;
            float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int sp = 0; sp < p.splits; ++sp)
                r = f4add(r, *reinterpret_cast<const float4*>(
                                 p.rows + (int64_t{sp} * p.rt.S + s) * p.H + c));
            v = f4add(v, f4mul(r, p.weight_on_input ? 1.0f : p.topk_w[s]));
        }
    }
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.out) + (int64_t{tok} * p.H + c) * 2) =
        make_uint2(pack2<BF16>(v.x, v.y), pack2<BF16>(v.z, v.w));
}

// --------------------------------------------------------------------------------- host

// Per device and kernel (cached, as mma.cu): table copies, stages, shared memory, clusters; the
// sm_90 SASS also has the griddepcontrol (PDL) paths.
template <int BITS, int TM, bool BF16>
RingConfig pick_config(int dev) {
    static std::mutex mu;
    static std::unordered_map<int, RingConfig> cache;
    const std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(dev); it != cache.end()) return it->second;
    using L = Layout<BITS, TM>;
    constexpr int kStatic = 64 + 12 * TM + 16 + 33 * 4 + 128;  // cbh, s_slot/row, s_misc, scan_ws
    const RingConfig c = configure_ring(moe_gemm_kernel<BITS, TM, BF16>, dev, BITS, kThreads,
                                        L::kStage, L::kOut, kStatic, TM <= 32 ? 2 : 1,
                                        kMaxStages, kMaxSplits, "moe");
    cache.emplace(dev, c);
    return c;
}

bool pdl_enabled() { return env_int("KBIT_MOE_NO_PDL", 0) == 0; }

struct Call {  // everything the host knows about one kbit::moe call
    at::Tensor x, y, ids, tw, emap;
    const at::Tensor *w13q, *w13a, *w2q, *w2a, *cb;
    int64_t T, H, I, S, topk, E;
    int act;
    bool weight_on_input, bf16;
    TiledShape s13{0, 0, 2}, s2{0, 0, 2};
};

// Expected tiles of TM slots: ~1 per active expert plus the slots beyond, for uniform routing.
double expected_tiles(const Call& c, int tm, int64_t max_tiles, double local_frac) {
    const double slots = c.S * local_frac;
    const double active = c.E * (1.0 - std::pow(1.0 - 1.0 / c.E, slots));
    return std::min<double>(max_tiles, std::max(active, slots / tm + 0.5 * active));
}

Routing routing(const Call& c) {
    Routing rt{};
    if (c.ids.scalar_type() == at::kLong) rt.ids64 = c.ids.data_ptr<int64_t>();
    else rt.ids32 = c.ids.data_ptr<int32_t>();
    rt.emap = c.emap.defined() ? c.emap.data_ptr<int32_t>() : nullptr;
    rt.emap_n = c.emap.defined() ? static_cast<int>(c.emap.numel()) : 0;
    rt.S = static_cast<int>(c.S), rt.topk = static_cast<int>(c.topk), rt.E = static_cast<int>(c.E);
    return rt;
}

// Does the down GEMM add w[t, j] * row into an fp32 [T, H] accumulator with atomics (else
// per-slot fp32 rows and an ordered combine)? Atomics let the split-K partials go straight into
// the accumulator (no cluster/workspace reduction, no per-slot rows): at decode sizes that saves a
// reduction step on a latency-bound chain (H100, Qwen3-30B-A3B k=4, T=1: 24.3 vs 29.5 us,
// moe_env_h100_s5.txt), at large T half the output traffic. The order of the fp32 adds varies
// from run to run; KBIT_MOE_DETERMINISTIC=1 keeps the per-slot rows (bit-reproducible).
bool use_atomic(const Call& c) {
    const bool deterministic = env_int("KBIT_MOE_DETERMINISTIC", 0) != 0;
    return env_int("KBIT_MOE_ATOMIC", 0) != 0 ||
           (!deterministic && (c.T <= kAtomicMaxT || c.S * c.H * 4 > kSlotsMaxBytes));
}

// The routing kernel into buf (allocated here): sorted slots, the tile list, [num tiles, routed
// slots].
RouteParams route(const Call& c, const Routing& rt, int tile_m, int64_t max_tiles, bool pdl,
                  at::Tensor& buf) {
    const int64_t sorted_n = ceil_div(c.S, 4) * 4;
    const bool multi = c.S > kRouteMultiMin;
    buf = at::empty({sorted_n + 4 * max_tiles + 4 + (multi ? 2 * c.E + 1 : 0)}, c.x.options().dtype(at::kInt));
    int* base = buf.data_ptr<int32_t>();
    RouteParams rp{};
    rp.rt = rt;
    rp.sorted = base;
    rp.tiles = reinterpret_cast<int4*>(base + sorted_n);
    rp.num_tiles = base + sorted_n + 4 * max_tiles;
    rp.tile_m = tile_m;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if (!multi) {
        launch_kernel(moe_route_kernel, dim3(1), kRouteThreads, static_cast<int>(2 * c.E * 4), stream, 1,
                      pdl, rp);
        return rp;
    }
    rp.cnt = rp.num_tiles + 4;
    C10_CUDA_CHECK(cudaMemsetAsync(rp.cnt, 0, (c.E + 1) * 4, stream));  // counts and ticket
    const dim3 grid(static_cast<unsigned>(ceil_div(c.S, kRouteChunk)));
    launch_kernel(moe_route_count, grid, kRouteChunkThreads, static_cast<int>(c.E * 4), stream, 1, false, rp);
    launch_kernel(moe_route_scatter, grid, kRouteChunkThreads, static_cast<int>(c.E * 4), stream, 1, pdl, rp);
    return rp;
}

// The combine kernel: y = sum over the top-k of the down rows (splits x [S, H] fp32 rows, or the
// atomic [T, H] accumulator), rounded once.
void launch_combine(const Call& c, const Routing& rt, const at::Tensor& rows, int splits, bool atomic,
                    bool pdl) {
    CombineParams p{};
    p.rt = rt;
    p.rows = rows.data_ptr<float>();
    p.topk_w = c.tw.data_ptr<float>();
    p.out = c.y.data_ptr();
    p.T = static_cast<int>(c.T), p.H = static_cast<int>(c.H);
    p.splits = splits;
    p.out_mode = atomic ? kAtomic : kSlots;
    p.weight_on_input = c.weight_on_input;
    launch_kernel(c.bf16 ? moe_combine_kernel<true> : moe_combine_kernel<false>,
                  dim3(static_cast<unsigned>(c.T), static_cast<unsigned>(ceil_div(c.H / 4, 256))), 256, 0,
                  c10::cuda::getCurrentCUDAStream(), 1, pdl, p);
}

template <int BITS, int TM, bool BF16>
void run_moe(const Call& c) {
    const int dev = c.x.get_device();
    const RingConfig cfg = pick_config<BITS, TM, BF16>(dev);
    const bool pdl = cfg.sm90 && pdl_enabled();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const auto opts = c.x.options();
    const double local_frac =
        c.emap.defined() ? std::min(1.0, double(c.E) / std::max<int64_t>(1, c.emap.numel())) : 1.0;
    const int64_t max_tiles = std::min<int64_t>(c.E, c.S) + c.S / TM;
    const double est_tiles = expected_tiles(c, TM, max_tiles, local_frac);
    const int64_t slots_gpu = int64_t{cfg.sms} * cfg.ctas_per_sm;

    Routing rt = routing(c);

    // Route inside the GEMM CTAs when the slots fit one per thread and the histogram fits the
    // ring; else one routing CTA.
    const bool small = c.S <= kSmallSlots && c.E * 4 <= int64_t{2} * Layout<BITS, TM>::kStage &&
                       env_int("KBIT_MOE_ROUTE_KERNEL", 0) == 0;
    TORCH_CHECK_VALUE(max_tiles <= 65535, "kbit::moe: too many token tiles (T * topk = ", c.S,
                      ", TM = ", TM, ")");
    at::Tensor route_buf;
    if (!small) {
        const RouteParams rp = route(c, rt, TM, max_tiles, pdl, route_buf);
        rt.sorted = rp.sorted, rt.tiles = rp.tiles, rt.num_tiles = rp.num_tiles;
    }

    const int forced = env_int("KBIT_MOE_SPLITS", 0);
    const bool cluster_ok = cfg.cluster && env_int("KBIT_MOE_NO_CLUSTER", 0) == 0;
    auto plan_splits = [&](int groups, int k_tiles, int& kchunk) {
        int s = choose_splits(groups * est_tiles, k_tiles, slots_gpu, kMaxSplits);
        if (forced > 0) s = std::min({forced, kMaxSplits, k_tiles});
        kchunk = static_cast<int>(ceil_div(k_tiles, s));
        return static_cast<int>(ceil_div(k_tiles, kchunk));
    };

    GemmParams base{};
    base.rt = rt;
    base.cb = c.cb->data_ptr<float>();
    base.topk_w = c.tw.data_ptr<float>();
    base.stages = cfg.stages;
    base.copies_log2 = cfg.copies_log2;
    base.ring_off = cfg.table_bytes + 64;
    base.act = c.act;
    base.weight_on_input = c.weight_on_input;

    // Down GEMM output: per-slot rows (deterministic) or the atomic accumulator.
    const int g2 = static_cast<int>(ceil_div(c.s2.n_tiles, kGroupTiles));
    int kchunk2 = 0;
    const int splits2 = plan_splits(g2, static_cast<int>(c.s2.k_tiles), kchunk2);
    const bool atomic = use_atomic(c);
    const int mode2 = atomic || splits2 == 1 ? kDirect : cluster_ok ? kCluster : kWorkspace;
    at::Tensor rows2 = at::empty({atomic ? c.T * c.H : (mode2 == kWorkspace ? splits2 : 1) * c.S * c.H},
                                 opts.dtype(at::kFloat));

    // gate_up GEMM.
    const int half_tiles = static_cast<int>(c.I / kTileN);
    const int g1 = static_cast<int>(ceil_div(half_tiles, kGroupTiles / 2));
    int kchunk1 = 0;
    const int splits1 = plan_splits(g1, static_cast<int>(c.s13.k_tiles), kchunk1);
    const int mode1 = splits1 == 1 ? kDirect : cluster_ok ? kCluster : kWorkspace;
    at::Tensor act_buf = at::empty({c.S, c.I}, opts);
    at::Tensor ws1;
    if (mode1 == kWorkspace) ws1 = at::empty({splits1, c.S, 2 * c.I}, opts.dtype(at::kFloat));
    {
        GemmParams p = base;
        p.gemm = kGateUp;
        p.x = static_cast<const uint8_t*>(c.x.data_ptr());
        p.ldx_bytes = c.x.stride(0) * 2;
        p.qw = reinterpret_cast<const uint8_t*>(c.w13q->data_ptr<int32_t>());
        p.am = c.w13a->data_ptr<uint8_t>();
        p.qw_expert = c.s13.words * 4, p.am_expert = c.s13.absmax_bytes;
        p.out = act_buf.data_ptr();
        p.ws = mode1 == kWorkspace ? ws1.data_ptr<float>() : nullptr;
        p.zero_buf = atomic ? reinterpret_cast<float4*>(rows2.data_ptr<float>()) : nullptr;
        p.zero_count = atomic ? c.T * c.H / 4 : 0;
        p.K = static_cast<int>(c.H);
        p.n_tiles = static_cast<int>(c.s13.n_tiles), p.k_tiles = static_cast<int>(c.s13.k_tiles);
        p.half_tiles = half_tiles;
        p.n_out = static_cast<int>(c.I), p.n_ws = static_cast<int>(2 * c.I);
        p.kchunk = kchunk1, p.splits = splits1, p.mode = mode1, p.out_mode = kSlots;
        launch_kernel(moe_gemm_kernel<BITS, TM, BF16>, dim3(g1, splits1, static_cast<unsigned>(max_tiles)), kThreads, cfg.smem,
               stream, mode1 == kCluster ? splits1 : 1, pdl, p);
        if (mode1 == kWorkspace) {
            const int64_t units = c.S * c.I / 4;
            const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(units, 256), slots_gpu * 4));
            moe_act_kernel<BF16><<<blocks, 256, 0, stream>>>(
                rt, ws1.data_ptr<float>(), splits1, static_cast<int>(c.I), base.topk_w,
                base.weight_on_input, c.act, act_buf.data_ptr());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
    }
    // down GEMM.
    {
        GemmParams p = base;
        p.gemm = kDown;
        p.x = static_cast<const uint8_t*>(act_buf.data_ptr());
        p.ldx_bytes = c.I * 2;
        p.qw = reinterpret_cast<const uint8_t*>(c.w2q->data_ptr<int32_t>());
        p.am = c.w2a->data_ptr<uint8_t>();
        p.qw_expert = c.s2.words * 4, p.am_expert = c.s2.absmax_bytes;
        p.out = rows2.data_ptr<float>();
        p.ws = mode2 == kWorkspace ? rows2.data_ptr<float>() : nullptr;
        p.K = static_cast<int>(c.I);
        p.n_tiles = static_cast<int>(c.s2.n_tiles), p.k_tiles = static_cast<int>(c.s2.k_tiles);
        p.half_tiles = 0;
        p.n_out = static_cast<int>(c.H), p.n_ws = static_cast<int>(c.H);
        p.kchunk = kchunk2, p.splits = splits2, p.mode = mode2;
        p.out_mode = atomic ? kAtomic : kSlots;
        launch_kernel(moe_gemm_kernel<BITS, TM, BF16>, dim3(g2, splits2, static_cast<unsigned>(max_tiles)), kThreads, cfg.smem,
               stream, mode2 == kCluster ? splits2 : 1, pdl && mode1 != kWorkspace, p);
    }
    launch_combine(c, rt, rows2, mode2 == kWorkspace ? splits2 : 1, atomic, pdl);
}

template <int BITS>
void run_bits(int tm, const Call& c) {
    auto go = [&](auto tm_tag) {
        constexpr int TM = decltype(tm_tag)::value;
        if (c.bf16) run_moe<BITS, TM, true>(c);
        else run_moe<BITS, TM, false>(c);
    };
    switch (tm) {
        case 8: go(std::integral_constant<int, 8>{}); break;
        case 16: go(std::integral_constant<int, 16>{}); break;
        case 32: go(std::integral_constant<int, 32>{}); break;
        default: go(std::integral_constant<int, 64>{}); break;
    }
}

// Many slots per expert on sm_90 (moe_wgmma.cu): route into tiles of tn slots, gather the slots'
// x rows in expert order, gate_up (+ activation) and down as grouped wgmma GEMMs, combine.
void run_moe_wgmma(const Call& c, int64_t bits, int tn) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const auto opts = c.x.options();
    const int sms = device_sms(c.x.get_device());
    const Routing rt = routing(c);
    const int64_t max_tiles = std::min<int64_t>(c.E, c.S) + c.S / tn;
    TORCH_CHECK_VALUE(max_tiles <= 65535, "kbit::moe: too many token tiles (T * topk = ", c.S,
                      ", tile = ", tn, ")");
    at::Tensor route_buf;
    const RouteParams rp = route(c, rt, tn, max_tiles, false, route_buf);

    at::Tensor xs = at::empty({c.S, c.H}, opts), act = at::empty({c.S, c.I}, opts);
    const bool atomic = use_atomic(c);
    at::Tensor rows2 = at::empty({atomic ? c.T : c.S, c.H}, opts.dtype(at::kFloat));
    {
        GatherParams gp{};
        gp.x = static_cast<const uint8_t*>(c.x.data_ptr());
        gp.ldx_bytes = c.T == 1 ? 0 : c.x.stride(0) * 2;
        gp.sorted = rp.sorted, gp.count = rp.num_tiles + 1;
        gp.xs = static_cast<uint8_t*>(xs.data_ptr()), gp.act = static_cast<uint8_t*>(act.data_ptr());
        gp.S = static_cast<int>(c.S), gp.topk = static_cast<int>(c.topk);
        gp.row16 = static_cast<int>(c.H / 8), gp.act16 = static_cast<int>(c.I / 8);
        const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(c.S * c.H / 8, 256), int64_t{sms} * 8));
        moe_gather_kernel<<<blocks, 256, 0, stream>>>(gp);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    MoeWgGemm g{};
    g.codebook = c.cb, g.bits = bits;
    g.tiles = rp.tiles, g.num_tiles = rp.num_tiles, g.max_tiles = max_tiles, g.sorted = rp.sorted;
    g.topk_w = c.tw.data_ptr<float>();
    g.topk = static_cast<int>(c.topk), g.act = c.act, g.tn = tn;
    g.weight_on_input = c.weight_on_input, g.atomic = atomic;
    MoeWgGemm g1 = g;  // gate_up + activation: xs [S, H] -> act [S, I]
    g1.x = xs, g1.qweight = c.w13q, g1.absmax = c.w13a, g1.n = c.I, g1.gate_up = true;
    g1.out = act.data_ptr();
    if (atomic) g1.zero = rows2.data_ptr<float>(), g1.zero_count = c.T * c.H;
    moe_wgmma_gemm(g1);
    MoeWgGemm g2 = g;  // down: act [S, I] -> rows2
    g2.x = act, g2.qweight = c.w2q, g2.absmax = c.w2a, g2.n = c.H, g2.gate_up = false;
    g2.out = rows2.data_ptr();
    moe_wgmma_gemm(g2);

    launch_combine(c, rt, rows2, 1, atomic, false);
}

// The wgmma path's token tile for this call, or 0 when the call does not take that path.
// KBIT_MOE_WGMMA=0 never takes it, =1 always (where usable); KBIT_MOE_WG_TN fixes the tile:
// <= 128 the narrow one, else the wide one (moe_wide_tile: 256 slots, 224 at k = 5). Default,
// from the H100 crossovers at k = 4 (bench_moe_h100_s11.md, s11d_*.md): from kWgMinSlots slots
// per local expert on (uniform routing; below, the mma.sync grouped kernels win: Qwen3-30B-A3B
// T = 256, 16 per expert: 223 vs 384 us; Mixtral T = 256, 64 per expert: 1174 vs 756 us for the
// wgmma path), tiles of 128 slots x 256 rows up to 192 per expert (Qwen3 T = 1024 / 2048: 426 /
// 670 us vs 621 / 693 with 256 slots), the wide tile x 128 rows above (Qwen3 T = 4096: 1082 vs
// 1158 us; Mixtral T = 1024: 1728 vs 1948).
int wgmma_tile(const Call& c, int bits, double per_expert) {
    if (!moe_wgmma_usable(c.x)) return 0;
    const int mode = env_int("KBIT_MOE_WGMMA", -1);
    if (mode == 0 || (mode < 0 && per_expert < kWgMinSlots)) return 0;
    const int forced = env_int("KBIT_MOE_WG_TN", 0);
    if (forced > 0) return forced <= 128 ? 128 : moe_wide_tile(bits);
    // k = 5's wide tile (224) wins clearly only with many slots per expert (H100, k = 5, kbit::moe
    // alone, 128 vs 224: Mixtral T = 4096, 1024 per expert, 6211 vs 5617 us; Qwen3 T = 4096, 256
    // per expert, 1146 vs 1176 us; Mixtral T = 1024, 256 per expert, 1994 vs 1900 us:
    // bench_moe_h100_s12_k5_tn{128,224}.md).
    return per_expert < (bits == 5 ? 384 : 192) ? 128 : moe_wide_tile(bits);
}

void check_experts(const at::Tensor& q, const at::Tensor& a, int64_t E, const TiledShape& s,
                   const char* qn, const char* an, const at::Tensor& x) {
    TORCH_CHECK_VALUE(q.is_cuda() && q.scalar_type() == at::kInt && q.dim() == 2 &&
                          q.size(0) == E && q.size(1) == s.words && q.is_contiguous(),
                      "kbit::moe: ", qn, " must be contiguous CUDA int32 [E=", E, ", ", s.words,
                      "] (tiled layout, n=", s.n, ", k=", s.k, "), got ", q.scalar_type(), " ",
                      q.sizes());
    TORCH_CHECK_VALUE(a.is_cuda() && a.scalar_type() == at::kByte && a.dim() == 2 &&
                          a.size(0) == E && a.size(1) == s.absmax_bytes && a.is_contiguous(),
                      "kbit::moe: ", an, " must be contiguous CUDA uint8 [E=", E, ", ",
                      s.absmax_bytes, "] (tiled layout, n=", s.n, ", k=", s.k, "), got ",
                      a.scalar_type(), " ", a.sizes());
    TORCH_CHECK_VALUE(q.get_device() == x.get_device() && a.get_device() == x.get_device(),
                      "kbit::moe: ", qn, " and ", an, " must be on x's device");
    TORCH_CHECK_VALUE(aligned(q, 16) && aligned(a, 16),
                      "kbit::moe: ", qn, " and ", an, " must be 16-byte aligned");
}

}  // namespace

at::Tensor moe(const at::Tensor& x_in, const at::Tensor& w13_qweight, const at::Tensor& w13_absmax,
               const at::Tensor& w2_qweight, const at::Tensor& w2_absmax,
               const at::Tensor& codebook, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids, const std::optional<at::Tensor>& expert_map,
               int64_t bits, int64_t inter_size, c10::string_view activation,
               bool apply_router_weight_on_input) {
    check_bits(bits, "moe");
    TORCH_CHECK_VALUE(x_in.is_cuda() && x_in.dim() == 2,
                      "kbit::moe: x must be a 2-D CUDA tensor [T, H], got ", x_in.sizes());
    TORCH_CHECK_VALUE(x_in.scalar_type() == at::kHalf || x_in.scalar_type() == at::kBFloat16,
                      "kbit::moe: x must be float16 or bfloat16, got ", x_in.scalar_type());
    const int64_t T = x_in.size(0), H = x_in.size(1), I = inter_size;
    TORCH_CHECK_VALUE(H > 0 && H % kBlock == 0, "kbit::moe: x has hidden size ", H,
                      ", not a positive multiple of 32");
    TORCH_CHECK_VALUE(I > 0 && I % kBlock == 0,
                      "kbit::moe: inter_size must be a positive multiple of 32, got ", I);
    TORCH_CHECK_VALUE(w13_qweight.dim() == 2, "kbit::moe: w13_qweight must be 2-D [E, words], got ",
                      w13_qweight.sizes());
    const int64_t E = w13_qweight.size(0);
    TORCH_CHECK_VALUE(E > 0 && E <= kMaxExperts, "kbit::moe: between 1 and ", kMaxExperts,
                      " local experts supported, got ", E);
    const TiledShape s13(2 * I, H, bits), s2(H, I, bits);
    check_experts(w13_qweight, w13_absmax, E, s13, "w13_qweight", "w13_absmax", x_in);
    check_experts(w2_qweight, w2_absmax, E, s2, "w2_qweight", "w2_absmax", x_in);
    check_codebook(codebook, bits, "moe");
    TORCH_CHECK_VALUE(codebook.get_device() == x_in.get_device(),
                      "kbit::moe: codebook must be on x's device");
    TORCH_CHECK_VALUE(topk_weights.is_cuda() && topk_weights.scalar_type() == at::kFloat &&
                          topk_weights.dim() == 2 && topk_weights.size(0) == T &&
                          topk_weights.size(1) >= 1,
                      "kbit::moe: topk_weights must be CUDA float32 [T=", T, ", topk], got ",
                      topk_weights.scalar_type(), " ", topk_weights.sizes());
    TORCH_CHECK_VALUE(topk_ids.is_cuda() &&
                          (topk_ids.scalar_type() == at::kInt ||
                           topk_ids.scalar_type() == at::kLong) &&
                          topk_ids.sizes() == topk_weights.sizes(),
                      "kbit::moe: topk_ids must be CUDA int32 or int64 with the shape of "
                      "topk_weights ",
                      topk_weights.sizes(), ", got ", topk_ids.scalar_type(), " ",
                      topk_ids.sizes());
    TORCH_CHECK_VALUE(topk_ids.get_device() == x_in.get_device() &&
                          topk_weights.get_device() == x_in.get_device(),
                      "kbit::moe: topk_ids and topk_weights must be on x's device");
    if (expert_map.has_value()) {
        const at::Tensor& m = *expert_map;
        TORCH_CHECK_VALUE(m.is_cuda() && m.scalar_type() == at::kInt && m.dim() == 1 &&
                              m.get_device() == x_in.get_device(),
                          "kbit::moe: expert_map must be a CUDA int32 [global_E] tensor on x's "
                          "device, got ",
                          m.scalar_type(), " ", m.sizes());
    }
    const int64_t topk = topk_weights.size(1);
    TORCH_CHECK_VALUE(!apply_router_weight_on_input || topk == 1,
                      "kbit::moe: apply_router_weight_on_input needs topk == 1, got topk ", topk);
    int act = -1;
    const std::string_view a(activation.data(), activation.size());
    if (a == "silu") act = kSilu;
    else if (a == "gelu") act = kGelu;
    else if (a == "gelu_tanh") act = kGeluTanh;
    TORCH_CHECK_VALUE(act >= 0, "kbit::moe: activation must be one of gelu, gelu_tanh, silu, got '",
                      std::string(a), "'");
    TORCH_CHECK_VALUE(T * topk < (int64_t{1} << 24) && H < (int64_t{1} << 20) &&
                          I < (int64_t{1} << 20),
                      "kbit::moe: shape too large (T=", T, ", topk=", topk, ", H=", H, ", I=", I,
                      ")");

    const c10::cuda::CUDAGuard guard(x_in.device());
    at::Tensor y = at::empty({T, H}, x_in.options());
    if (T == 0) return y;
    // cp.async moves 16-byte chunks: rows must start 16-byte aligned, else copy x once.
    Call c;
    c.x = x_in.stride(1) == 1 && rows_aligned16(x_in)
              ? x_in
              : x_in.contiguous().clone(at::MemoryFormat::Contiguous);
    c.y = y;
    c.ids = topk_ids.contiguous();
    c.tw = topk_weights.contiguous();
    if (expert_map.has_value()) c.emap = expert_map->contiguous();
    c.w13q = &w13_qweight, c.w13a = &w13_absmax, c.w2q = &w2_qweight, c.w2a = &w2_absmax;
    c.cb = &codebook;
    c.T = T, c.H = H, c.I = I, c.S = T * topk, c.topk = topk, c.E = E;
    c.act = act;
    c.weight_on_input = apply_router_weight_on_input;
    c.bf16 = x_in.scalar_type() == at::kBFloat16;
    c.s13 = s13, c.s2 = s2;
    // Decode (few slots): two GEMV launches over the slots' experts (moe_gemv.cu).
    if (moe_gemv_takes(T, topk, c.emap.defined() ? c.emap.numel() : E)) {
        moe_gemv(c.x, y, c.ids, c.tw, c.emap, w13_qweight, w13_absmax, w2_qweight, w2_absmax,
                 codebook, bits, I, act, apply_router_weight_on_input);
        return y;
    }

    // Token tile: the expected slots per active expert (uniform routing), KBIT_MOE_TM overrides.
    const double local_frac =
        c.emap.defined() ? std::min(1.0, double(E) / std::max<int64_t>(1, c.emap.numel())) : 1.0;
    const double per_expert = c.S * local_frac / E;
    if (const int tn = wgmma_tile(c, bits, per_expert); tn > 0) {
        run_moe_wgmma(c, bits, tn);
        return y;
    }
    int tm = per_expert <= 6 ? 8 : per_expert <= 14 ? 16 : per_expert <= 28 ? 32 : 64;
    if (const int f = env_int("KBIT_MOE_TM", 0); f > 0) tm = f <= 8 ? 8 : f <= 16 ? 16 : f <= 32 ? 32 : 64;
    switch (bits) {
        case 2: run_bits<2>(tm, c); break;
        case 3: run_bits<3>(tm, c); break;
        case 4: run_bits<4>(tm, c); break;
        default: run_bits<5>(tm, c); break;
    }
    return y;
}

}  // namespace kbit
