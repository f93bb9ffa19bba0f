// SPDX-License-Identifier: Apache-2.0
// Hopper (sm_90a) building blocks of the warp-specialized wgmma kernel (wgmma_gemm.cu): the
// shared-memory layout and descriptor math (host + device, checked on the CPU by
// tools/wgmma_index_check.cu), and thin PTX wrappers for mbarriers, bulk / tensor (TMA) copies,
// register reallocation and named barriers. No torch headers: the CPU check includes this file.
// Design and sources: docs/wgmma-plan.md (sections 2 and 4).
#pragma once
#include <cstdint>
#include <cstdio>

namespace kbit {
namespace wg {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WG_DEVICE 1  // sm_90a device pass: the only one that has the kernel's instructions
#endif

constexpr int kThreads = 384;       // WG0 = producer, WG1 and WG2 = consumers
constexpr int kConsumerWarps = 8;   // arrivals per "empty" barrier phase (one per consumer warp)
constexpr int kMaxStages = 8;       // mbarrier pairs in static shared memory
constexpr int kProducerRegs = 40;   // setmaxnreg: 128 x 40 + 256 x 232 = 65,536 = the register
constexpr int kConsumerRegs = 232;  // file, i.e. 168 per thread at launch (__launch_bounds__)
constexpr int kSwizzle = 128;       // x rows in shared memory: 64 halves = 128 B, 128B swizzle
constexpr int kAtom = 1024;         // swizzle atom (8 rows x 128 B): the alignment of every x box

// ------------------------------------------------------------------ layout (host + device)

__host__ __device__ constexpr int align_up(int v, int a) { return (v + a - 1) / a * a; }

// One pipeline stage = one 128-column k-tile of the CTA: the x tile as two TMA boxes (K halves,
// TN tokens x 128 B each, 128B-swizzled, 1024-B aligned), then the bit planes of the CTA's
// `tiles` weight tiles (bits x 256 B each) and their absmax (64 B each), as docs/format.md
// stores them. `rows` = 2 consumer warpgroups x rwg weight rows.
template <int BITS, int RWG, int TN>
struct StageLayout {
    static constexpr int kRows = 2 * RWG;
    static constexpr int kTiles = kRows / 16;
    static constexpr int kXHalf = TN * kSwizzle;              // one box: TN rows x 128 B
    static constexpr int kX = 2 * kXHalf;
    static constexpr int kPlanes = BITS * 256;                // one tile's planes
    static constexpr int kWOff = kX;                          // planes of tile i at + i * kPlanes
    static constexpr int kAOff = kWOff + kTiles * kPlanes;    // absmax of tile i at + i * 64
    static constexpr int kBytes = align_up(kAOff + kTiles * 64, kAtom);  // keeps x boxes aligned
    static constexpr int kOutRow = kRows + 4;  // floats per token of the epilogue tile; +4: the
                                               // accumulator stores of a warp hit 32 banks
    static constexpr int kOut = TN * kOutRow * 4;
    static_assert(TN % 8 == 0 && TN <= 256, "TMA box height and wgmma N");
    static_assert(kXHalf % kAtom == 0, "x boxes must stay on swizzle-atom boundaries");
};

// Producer lane roles (one warp issues every copy of a stage): lanes [0, tiles) copy a tile's
// planes, lanes [tiles, 2 tiles) its absmax; lane 0 also issues the TMA boxes of x.
enum CopyKind : int { kNone = 0, kPlanesCopy = 1, kAbsmaxCopy = 2 };
__host__ __device__ constexpr int copy_kind(int lane, int tiles) {
    return lane < tiles ? kPlanesCopy : lane < 2 * tiles ? kAbsmaxCopy : kNone;
}
__host__ __device__ constexpr int copy_tile(int lane, int tiles) {
    return lane < tiles ? lane : lane - tiles;
}

// Column of x where TMA box `half` (0, 1) of k-tile kt starts. K % 32 == 0, so the last k-tile
// may end after one or two blocks, leaving its second half wholly past K: that box is loaded
// from the first half's (in-bounds) columns instead. Its weights are padding (absmax 0, exactly
// zero), so the products are +-0 for finite x, and every stage keeps the same two boxes, byte
// count and wgmma sequence, without relying on TMA for boxes wholly out of bounds. (A non-finite
// x in those 64 columns turns that token's +-inf outputs into NaN.)
__host__ __device__ constexpr int x_box_col(int kt, int half, int K) {
    return half && kt * 128 + 64 >= K ? kt * 128 : kt * 128 + 64 * half;
}

// Bytes one stage's copies deliver (the full barrier's expect_tx): the planes and absmax of the
// live tiles (tiles past n are not copied) and the two x boxes of x_rows rows, which TMA counts
// in full (rows past M, columns past K zero-filled included).
template <int BITS, int RWG, int TN>
__host__ __device__ constexpr uint32_t stage_tx_bytes(int live_tiles, int x_rows = TN) {
    using L = StageLayout<BITS, RWG, TN>;
    return static_cast<uint32_t>(live_tiles * (L::kPlanes + 64) + 2 * x_rows * kSwizzle);
}

// Grouped MoE: the token width a routing tile of `rows` <= TN rows is computed with: TN / 4,
// TN / 2 or TN. An expert's last tile holds its count mod TN rows; at full width it would cost as
// much as a full tile (same wgmma N, same x boxes), so narrow tiles issue narrower wgmmas and load
// only TN / 4-row boxes of x. (Qwen3-30B-A3B at T = 4096: ~256 +- 16 slots per expert, so about
// half of the experts end in a tile of a few rows.)
__host__ __device__ constexpr int narrow_tn(int tn, int rows) {
    return rows <= tn / 4 ? tn / 4 : rows <= tn / 2 ? tn / 2 : tn;
}

// Where TMA's SWIZZLE_128B puts element (tok, k) of a stage's x tile (k < 128), relative to the
// stage: box k / 64, row tok at tok * 128, 16-byte chunk c = (k % 64) / 8 stored at chunk
// c ^ (tok % 8) (docs/wgmma-plan.md section 2: the XOR of address bits [4,7) with [7,10)).
template <int TN>
__host__ __device__ constexpr int x_swizzled(int tok, int k) {
    return (k >> 6) * TN * kSwizzle + tok * kSwizzle + 16 * (((k >> 3) & 7) ^ (tok & 7)) + 2 * (k & 7);
}

// Byte offset, from the stage's x tile, of the B operand of k16 step kk (0..7): box kk / 4 and
// 32 B per step inside the 128-B row. The hardware applies the swizzle to the full address, so
// advancing the start address inside the atom is how K steps are taken (as CUTLASS/DeepGEMM do).
template <int TN>
__host__ __device__ constexpr int b_step_offset(int kk) {
    return (kk >> 2) * TN * kSwizzle + (kk & 3) * 32;
}

// wgmma shared-memory matrix descriptor for a K-major, 128B-swizzled operand: start address >> 4
// (bits 0-13), leading byte offset >> 4 (16-29; unused for swizzled K-major, 1 by convention),
// stride byte offset >> 4 (32-45: 1024 B between 8-row groups), base offset 0 (49-51: the atoms
// are 1024-B aligned), layout 1 = 128B swizzle (62-63).
__host__ __device__ constexpr uint64_t desc_sw128(uint32_t smem_addr) {
    return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) |
           (static_cast<uint64_t>(kAtom >> 4) << 32) | (uint64_t{1} << 62);
}

// Ring bookkeeping: k-tile `it` of a CTA uses slot it % S; the full barrier of that slot
// completes its phase number it / S when the tile has landed, so consumers wait for parity
// (it / S) & 1. The producer refills the slot after the consumers' release of k-tile it - S,
// the empty barrier's phase (it / S) - 1: parity ((it / S) & 1) ^ 1, which for it < S is the
// parity of the phase "before" the barrier's first one and returns at once (PTX mbarrier).
__host__ __device__ constexpr int ring_slot(int it, int stages) { return it % stages; }
__host__ __device__ constexpr uint32_t full_parity(int it, int stages) {
    return static_cast<uint32_t>(it / stages) & 1u;
}
__host__ __device__ constexpr uint32_t empty_parity(int it, int stages) {
    return full_parity(it, stages) ^ 1u;
}

// Tile configurations (KBIT_WGMMA_CONFIG), rows x tokens per CTA = 2 RWG x TN:
// C1 = 128 x 64, C2 = 128 x 128, C3 = 256 x 128, C1w = 256 x 64, C2w = 128 x 256
// (docs/wgmma-plan.md, section 4). C2n = 128 x 224 is the grouped MoE kernel's wide tile at k = 5
// only (moe_wgmma.cu), not a dense configuration.
enum TileConfig : int { kC1 = 1, kC2 = 2, kC3 = 3, kC1w = 4, kC2w = 5, kNumConfigs = 5, kC2n = 6 };
__host__ __device__ constexpr int config_rwg(int c) { return c == kC3 || c == kC1w ? 128 : 64; }
__host__ __device__ constexpr int config_tn(int c) {
    return c == kC1 || c == kC1w ? 64 : c == kC2w ? 256 : c == kC2n ? 224 : 128;
}

// The configuration for M tokens and k_tiles 128-column k-tiles. forced (1..5, KBIT_WGMMA_CONFIG)
// wins; 0 = by M: up to 64 tokens C1, or C1w where c1w (layers of > 16M weights, or
// KBIT_WGMMA_C1W=1: 256 rows read each x tile once for twice the weights, half the CTAs, and a
// small layer's 128-row blocks fill more SMs); up to 128 tokens C3, whose 256 rows
// halve the x bytes per weight. From the H100 runs of every configuration side by side
// (benchmarks/results/bench_linear_h100__s6_cluster.md): M = 96..128 C3 is within 4% of the best
// configuration on the 8 Llama-3.1 8B / 70B shapes but 70B gate_up (C2 4-11% faster).
// Above 128 tokens C2w: one m64n256 wgmma per k16 step and warp instead of two m64n128 ones in two
// token tiles, so every weight is dequantized once per 256 tokens, not per 128, and each wgmma
// is twice as long for the same fence/commit/wait chain: with C2/C3 at M = 192..256 both CTAs
// of a row block repeat the dequantization and the kernel ran at the M = 128 time twice
// (bench_linear_h100__s6_dispatch.md: 8B layer k=4 158 us at M = 128, 318 us at M = 192).
// Except for 192 < M <= 256 on K < 8192 (the 8B shapes but down): there C2w's one 256-token
// tile per row block leaves too few CTAs or a bad last wave, and C2's two 128-token tiles win
// (bench_linear_h100__s7_c2w.md, M = 256, k=4: 8B gate_up 171 vs 195 us, qkv 51 vs 62; at
// M = 192 C2w still wins the layer, 300 vs 319 us). Those C2w times had 4 splits of K through
// the fp32 workspace; with split-K priced (wgmma_gemm.cu) C2w runs 8B gate_up unsplit in 109 us
// against C2's 159 (probe_env_h100_s34_nosplit.md), so C2 is kept only where C2w's 128-row
// blocks alone do not fill the GPU (wide_fill false: 8B qkv 36 vs 48 us, 8B o level). Where
// C2w's ring would be shallow (c2w_deep false: fewer than 3 stages fit shared memory, k=5 on
// sm_90; wgmma_gemm.cu, c2w_ring_deep) C3 takes its place.
__host__ __device__ constexpr int pick_config(long long m, long long k_tiles, int forced, bool c1w,
                                              bool wide_fill = false, bool c2w_deep = true) {
    return forced                                          ? forced
           : m <= 64                                       ? (c1w ? kC1w : kC1)
           : m <= 128                                      ? kC3
           : m > 192 && m <= 256 && k_tiles < 64 && !wide_fill ? kC2
           : c2w_deep                                      ? kC2w
                                                            : kC3;
}

// Split-K: CTA y of `splits` takes k-tiles [y * kchunk, y * kchunk + count); the host makes
// every split non-empty (splits = ceil(k_tiles / kchunk)).
struct KRange {
    int begin, count;
};
__host__ __device__ constexpr KRange k_range(int y, int kchunk, int k_tiles) {
    return {y * kchunk, (k_tiles - y * kchunk) < kchunk ? (k_tiles - y * kchunk) : kchunk};
}

// Split-K plan: at most `want` splits of kchunk k-tiles, none empty (an empty split would wait
// forever for its first stage).
struct SplitPlan {
    int kchunk, splits;
};
__host__ __device__ constexpr SplitPlan split_plan(int k_tiles, int want) {
    const int w = want < 1 ? 1 : want > k_tiles ? k_tiles : want;
    const int kchunk = (k_tiles + w - 1) / w;
    return {kchunk, (k_tiles + kchunk - 1) / kchunk};
}

// Shared memory of a CTA: the pair table (4 << (2 bits + copies_log2) bytes, 64-B aligned), then
// the ring (1024-B aligned) of `stages` stages, which the epilogue tile reuses. Prefers >= 3
// stages, then the most table copies (fewest bank conflicts on the 32 lookups of a warp), then
// the most stages (<= max_stages). copies_log2_forced >= 0 fixes the copies. stages == 0: no fit.
struct RingPlan {
    int stages, copies_log2, table_bytes, smem;
};
__host__ __device__ constexpr RingPlan ring_plan(int bits, int stage_bytes, int out_bytes,
                                                 int budget, int max_stages,
                                                 int copies_log2_forced) {
    const int lc_max = bits == 2 ? 0 : 5;  // k=2: 16 entries already sit in 16 banks
    for (int min_stages = 3; min_stages >= 2; --min_stages)
        for (int lc = lc_max; lc >= 0; --lc) {
            if (copies_log2_forced >= 0 &&
                lc != (copies_log2_forced < lc_max ? copies_log2_forced : lc_max))
                continue;
            const int table = 4 << (2 * bits + lc);
            const int fixed = table + 64 + kAtom;  // table alignment + ring alignment slack
            int stages = (budget - fixed) / stage_bytes;
            stages = stages > max_stages ? max_stages : stages;
            const int ring = stages * stage_bytes > out_bytes ? stages * stage_bytes : out_bytes;
            if (stages >= min_stages && fixed + ring <= budget) return {stages, lc, table, fixed + ring};
        }
    return {0, 0, 0, 0};
}

// ---------------------------------------------------------------------- PTX (sm_90a device)
#if defined(KBIT_WG_DEVICE)

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA complete_tx) and other threads.
__device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives (pending count - 1) and raises the phase's transaction count by `bytes`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
// Waits for the phase of parity `parity` to complete (acquire: the data it guards is visible).
// A wait that lasts 20 s is a protocol bug (a wrong byte count or parity): it traps ("unspecified
// launch failure") instead of hanging the GPU. The timer is read only once the first try_wait
// has failed. All in one asm block: written as a C++ loop around __trap(), ptxas (CUDA 13.0) no
// longer let the consumers use the registers of setmaxnreg.inc (spills, serialized wgmma).
// KBIT_WGMMA_DEBUG builds print the waiter first (slow: printf is a call).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, int role, int it) {
#if defined(KBIT_WGMMA_DEBUG)
    const uint64_t t0 = global_timer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (global_timer_ns() - t0 > 20000000000ull) {
            printf("kbit wgmma_gemm: mbarrier wait timed out (block %d,%d,%d thread %d, %s, "
                   "k-tile %d, parity %u)\n",
                   blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x,
                   role ? "consumer/full" : "producer/empty", it, parity);
            __trap();
        }
    }
#else
    (void)role, (void)it;
    asm volatile(
        "{\n.reg .pred p;\n.reg .u64 t0, t1;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@p bra DONE;\n"
        "mov.u64 t0, %%globaltimer;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@p bra DONE;\n"
        "mov.u64 t1, %%globaltimer;\n"
        "sub.u64 t1, t1, t0;\n"
        "setp.gt.u64 p, t1, 20000000000;\n"
        "@p trap;\n"
        "bra WAIT;\n"
        "DONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}

// Bulk copy global -> this CTA's shared memory (contiguous, 16-B aligned, size % 16 == 0); its
// bytes count against `bar`'s transaction count when they land.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}
// 2-D TMA load of the box at (c0 = column, c1 = row) of the tensor map at generic address `map`
// (a __grid_constant__ kernel parameter); out-of-bounds elements are written as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void* map, int c0, int c1, int c2,
                                            int c3, int c4, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void prefetch_tensormap(const void* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// Register reallocation between warpgroups (all 4 warps of the warpgroup execute it).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Barrier `id` (1..15; 0 is __syncthreads) over `count` threads (whole warps).
__device__ __forceinline__ void named_barrier(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Pins a value in its register across the surrounding code (no instruction is emitted): keeps
// the compiler from moving accumulator accesses into the window of an in-flight wgmma.
__device__ __forceinline__ void pin(float& v) { asm volatile("" : "+f"(v)::"memory"); }

#endif  // KBIT_WG_DEVICE

}  // namespace wg
}  // namespace kbit
