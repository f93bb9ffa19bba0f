// SPDX-License-Identifier: Apache-2.0
// CPU check of the pure index math of the warp-specialized wgmma kernel (csrc/wgmma_sm90.cuh,
// csrc/wgmma_gemm.cu): the functions the kernel and its host code call, run on the host against
// independent models of what the hardware does. No GPU needed:
//
//   nvcc -std=c++17 -Icsrc tools/wgmma_index_check.cu -o /tmp/wgmma_index_check && /tmp/wgmma_index_check
//
// (tests/test_index_math.py builds and runs it.) What it checks:
//  1. descriptor bit fields (PTX matrix-descriptor format, docs/wgmma-plan.md section 2);
//  2. the x tile: the plan's formula, a model of TMA SWIZZLE_128B (row-major box, then XOR of
//     address bits [4,7) with [7,10)) and a model of the wgmma reads through our descriptors
//     (canonical K-major 128B-swizzle layout: 8-row groups SBO apart, rows 128 B, the same XOR on
//     the final address) agree on every (token, k) of every k16 step, cover the tile once, and a
//     core matrix read hits 8 distinct 16-byte bank groups;
//  3. the stage layout and the producer's copies: alignment, disjointness, every live tile's
//     planes and absmax copied once, and expect_tx == the bytes issued;
//  4. the x box columns of K tails: in bounds, and a duplicated half only where weights are padding;
//  5. ring_plan on H100/H200 limits (the configuration table of the final report, C1/C2/C3/C1w/C2w)
//     and the epilogue tile fitting in the ring; the configuration shapes and the choice by M;
//  6. split_plan + k_range + the grid: every (row tile, k-tile, token) covered exactly once;
//  7. the mbarrier ring protocol (full/empty parities, arrival counts, release point) under a
//     model of mbarrier phases and random interleavings of the producer, 8 consumer warps and
//     the asynchronous copies: no deadlock, no read before landing, no overwrite before release.
// What it cannot check: that the hardware matches these models (that is the GPU tests' job).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <vector>

#include "host_check.h"
#include "wgmma_sm90.cuh"

using namespace kbit::wg;

// ------------------------------------------------------------------------------ 1. descriptor
static void check_descriptor() {
    for (uint32_t addr = 0; addr < (228u << 10); addr += 1024 + 32) {
        const uint64_t d = desc_sw128(addr);
        CHECK(((d & 0x3FFF) << 4) == (addr & 0x3FFF0), "start address field, addr %u", addr);
        CHECK(((d >> 16) & 0x3FFF) == 1, "LBO field");
        CHECK(((d >> 32) & 0x3FFF) == 1024 >> 4, "SBO field");
        CHECK(((d >> 49) & 7) == 0, "base offset");
        CHECK((d >> 62) == 1, "layout type 128B swizzle");
        const uint64_t used = 0x3FFFull | (0x3FFFull << 16) | (0x3FFFull << 32) | (7ull << 49) | (3ull << 62);
        CHECK((d & ~used) == 0, "reserved bits");
    }
}

// ------------------------------------------------------------------------------------ 2. x tile
static uint32_t sw128(uint32_t a) { return a ^ (((a >> 7) & 7) << 4); }

template <int TN>
static void check_x_tile() {
    const uint32_t stage = 5 * 1024 * 8;  // any 1024-aligned stage address
    std::vector<int> hits(2 * TN * kSwizzle / 2, 0);
    for (int kk = 0; kk < 8; ++kk) {
        // what the descriptor of step kk makes wgmma read: start = stage + b_step_offset(kk)
        const uint64_t d = desc_sw128(stage + b_step_offset<TN>(kk));
        const uint32_t start = static_cast<uint32_t>((d & 0x3FFF) << 4);
        const uint32_t sbo = static_cast<uint32_t>(((d >> 32) & 0x3FFF) << 4);
        for (int n = 0; n < TN; ++n)
            for (int k = 0; k < 16; ++k) {
                const uint32_t logical = start + (n >> 3) * sbo + (n & 7) * 128 + (k >> 3) * 16 + (k & 7) * 2;
                const uint32_t read = sw128(logical);
                const int kt = 16 * kk + k;  // column of the k-tile
                // TMA: box kt / 64 at + (kt / 64) * TN * 128, row-major 128-B rows, then swizzled
                const uint32_t tma = sw128(stage + (kt >> 6) * TN * 128 + n * 128 + (kt & 63) * 2);
                const uint32_t plan = stage + (kt >> 6) * TN * 128 + n * 128 +
                                      16 * (((kt & 63) >> 3) ^ (n & 7)) + 2 * (kt & 7);
                const uint32_t ours = stage + x_swizzled<TN>(n, kt);
                CHECK(read == tma && tma == plan && plan == ours,
                      "TN=%d kk=%d n=%d k=%d: wgmma %u tma %u plan %u ours %u", TN, kk, n, k, read, tma,
                      plan, ours);
                const uint32_t off = read - stage;
                CHECK(off < static_cast<uint32_t>(2 * TN * kSwizzle) && off % 2 == 0, "in the x tile");
                if (off < static_cast<uint32_t>(2 * TN * kSwizzle)) ++hits[off / 2];
            }
    }
    for (size_t i = 0; i < hits.size(); ++i) CHECK(hits[i] == 1, "x slot %zu read %d times", i, hits[i]);
    // a core matrix (8 rows x 16 B at logical chunk c) lands in 8 distinct 16-B bank groups
    for (int c = 0; c < 8; ++c)
        for (int g = 0; g < TN / 8; ++g) {
            std::set<uint32_t> quads;
            for (int r = 0; r < 8; ++r) quads.insert((x_swizzled<TN>(8 * g + r, 8 * c) / 16) % 8);
            CHECK(quads.size() == 8, "bank conflict chunk %d group %d", c, g);
        }
}

// ----------------------------------------------------------------- 3. stage layout and copies
template <int BITS, int RWG, int TN>
static void check_stage() {
    using L = StageLayout<BITS, RWG, TN>;
    CHECK(L::kBytes % kAtom == 0 && L::kXHalf % kAtom == 0, "alignment");
    CHECK(L::kAOff + L::kTiles * 64 <= L::kBytes, "absmax inside the stage");
    CHECK(2 * L::kTiles <= 32, "one producer warp has a lane per copy");
    for (int live = 1; live <= L::kTiles; ++live) {
        uint32_t bytes = 2 * L::kXHalf;  // lane 0's two TMA boxes
        std::vector<int> planes(L::kTiles, 0), absmax(L::kTiles, 0);
        std::vector<std::pair<uint32_t, uint32_t>> ranges = {{0, L::kX}};
        for (int lane = 0; lane < 32; ++lane) {
            const int kind = copy_kind(lane, L::kTiles), t = copy_tile(lane, L::kTiles);
            if (kind == kNone || t >= live) continue;
            const uint32_t size = kind == kPlanesCopy ? L::kPlanes : 64;
            const uint32_t dst = kind == kPlanesCopy ? L::kWOff + t * L::kPlanes : L::kAOff + t * 64;
            CHECK(dst % 16 == 0 && size % 16 == 0 && dst + size <= static_cast<uint32_t>(L::kBytes),
                  "bulk copy alignment/bounds");
            ranges.push_back({dst, dst + size});
            (kind == kPlanesCopy ? planes : absmax)[t]++;
            bytes += size;
        }
        for (int t = 0; t < L::kTiles; ++t)
            CHECK(planes[t] == (t < live) && absmax[t] == (t < live), "tile %d copied once", t);
        const uint32_t tx = stage_tx_bytes<BITS, RWG, TN>(live);
        CHECK(bytes == tx, "expect_tx %u vs %u bytes issued", tx, bytes);
        for (size_t i = 0; i < ranges.size(); ++i)
            for (size_t j = i + 1; j < ranges.size(); ++j)
                CHECK(ranges[i].second <= ranges[j].first || ranges[j].second <= ranges[i].first,
                      "copies overlap");
    }
}

// ------------------------------------------------------------------------------ 4. K tail boxes
static void check_x_boxes() {
    for (int K = 32; K <= 1024; K += 32)
        for (int kt = 0; kt * 128 < K; ++kt) {
            CHECK(x_box_col(kt, 0, K) == kt * 128, "box 0");
            const int c1 = x_box_col(kt, 1, K);
            CHECK(c1 < K, "box 1 starts in bounds (K=%d kt=%d)", K, kt);
            if (c1 != kt * 128 + 64) CHECK(kt * 128 + 64 >= K, "duplicated half must be padding");
        }
}

// --------------------------------------------------------------------------- 5. ring planning
template <int BITS, int RWG, int TN>
static void report_plan(const char* name, int optin) {
    using L = StageLayout<BITS, RWG, TN>;
    const int budget = optin - 1024;  // ptxas: 1024 B static shared memory (barriers, aligned)
    const RingPlan r = ring_plan(BITS, L::kBytes, L::kOut, budget, kMaxStages, -1);
    CHECK(r.stages >= 2 && r.stages <= kMaxStages, "%s k=%d: stages %d", name, BITS, r.stages);
    CHECK(r.smem <= budget, "%s k=%d: smem", name, BITS);
    CHECK(r.smem >= r.table_bytes + 64 + kAtom + r.stages * L::kBytes && r.smem >= L::kOut,
          "%s: ring and epilogue tile fit", name);
    std::printf("  %-3s k=%d  stage %6d B  stages %d  table copies %2d (%6d B)  out %6d B  smem %6d B\n",
                name, BITS, L::kBytes, r.stages, 1 << r.copies_log2, r.table_bytes, L::kOut, r.smem);
}
template <int BITS>
static void report_plans(int optin) {
    report_plan<BITS, config_rwg(kC1), config_tn(kC1)>("C1", optin);
    report_plan<BITS, config_rwg(kC2), config_tn(kC2)>("C2", optin);
    report_plan<BITS, config_rwg(kC3), config_tn(kC3)>("C3", optin);
    report_plan<BITS, config_rwg(kC1w), config_tn(kC1w)>("C1w", optin);
    report_plan<BITS, config_rwg(kC2w), config_tn(kC2w)>("C2w", optin);
}

// ------------------------------------------------------------- 5b. configurations by M
// The table of section 4: C1 128 x 64, C2 128 x 128, C3 256 x 128, C1w 256 x 64, C2w 128 x 256;
// the choice by M (C1w at M <= 64 only when switched on) and forcing.
static void check_configs() {
    const int want[kNumConfigs + 1][2] = {{0, 0}, {64, 64}, {64, 128}, {128, 128}, {128, 64}, {64, 256}};
    for (int c = 1; c <= kNumConfigs; ++c)
        CHECK(config_rwg(c) == want[c][0] && config_tn(c) == want[c][1], "config %d shape", c);
    for (const long long k_tiles : {1LL, 32LL, 63LL, 64LL, 224LL})
        for (long long m = 1; m <= 1100; m += (m < 140 ? 1 : 37))
            for (const bool c1w : {false, true})
            for (const bool wide : {false, true})
            for (const bool deep : {false, true}) {
                const int c = pick_config(m, k_tiles, 0, c1w, wide, deep);
                const int ref = m <= 64                                     ? (c1w ? 4 : 1)
                                : m <= 128                                    ? 3
                                : m > 192 && m <= 256 && k_tiles < 64 && !wide ? 2
                                : deep                                         ? 5
                                                                               : 3;
                CHECK(c == ref,
                      "pick_config(M=%lld, k_tiles=%lld, c1w=%d, wide=%d, deep=%d) = %d, want %d",
                      m, k_tiles, int(c1w), int(wide), int(deep), c, ref);
                CHECK(config_tn(c) >= (m <= 64 ? 64 : 128) || m > 128, "token tile too narrow");
                for (int f = 1; f <= kNumConfigs; ++f)
                    CHECK(pick_config(m, k_tiles, f, c1w, wide, deep) == f, "forced %d", f);
            }
}

// ---------------------------------------------------------------------------- 6. coverage
template <int RWG, int TN>
static void check_coverage(int n_tiles, int k_tiles, int M, int want) {
    constexpr int kTiles = 2 * RWG / 16;
    const SplitPlan sp = split_plan(k_tiles, want);
    CHECK(sp.splits >= 1 && sp.splits <= want + (want < 1) && sp.splits <= k_tiles, "splits");
    const int n_groups = (n_tiles + kTiles - 1) / kTiles, m_tiles = (M + TN - 1) / TN;
    std::vector<int> cov(static_cast<size_t>(n_tiles) * k_tiles * m_tiles, 0);
    std::vector<int> tok(M, 0);
    for (int z = 0; z < m_tiles; ++z)
        for (int m = z * TN; m < z * TN + TN && m < M; ++m) tok[m]++;
    for (int m = 0; m < M; ++m) CHECK(tok[m] == 1, "token %d", m);
    for (int x = 0; x < n_groups; ++x)
        for (int y = 0; y < sp.splits; ++y) {
            const KRange kr = k_range(y, sp.kchunk, k_tiles);
            CHECK(kr.count >= 1, "empty split y=%d (k_tiles %d, want %d)", y, k_tiles, want);
            for (int z = 0; z < m_tiles; ++z)
                for (int t = x * kTiles; t < x * kTiles + kTiles && t < n_tiles; ++t)
                    for (int k = kr.begin; k < kr.begin + kr.count; ++k) {
                        CHECK(k >= 0 && k < k_tiles, "k-tile range");
                        if (k >= 0 && k < k_tiles) cov[(static_cast<size_t>(t) * k_tiles + k) * m_tiles + z]++;
                    }
        }
    for (size_t i = 0; i < cov.size(); ++i)
        CHECK(cov[i] == 1, "cover %zu = %d (n_tiles %d k_tiles %d M %d want %d)", i, cov[i], n_tiles,
              k_tiles, M, want);
}

// ------------------------------------------------------------------- 7. mbarrier ring protocol
// PTX mbarrier model: `phase` completed phases so far; the current phase completes when its
// pending arrivals and its transaction count are both 0. try_wait.parity(P) succeeds iff the
// current phase's parity differs from P (the phase of parity P is the preceding, completed one).
struct MBar {
    int phase = 0, count = 0, pending = 0;
    long tx = 0;
    void init(int c) { count = pending = c, tx = 0, phase = 0; }
    void complete_if_done() {
        if (pending == 0 && tx == 0) ++phase, pending = count;
    }
    void arrive() { --pending, complete_if_done(); }
    void arrive_expect_tx(long b) { tx += b, --pending, complete_if_done(); }
    void complete_tx(long b) { tx -= b, complete_if_done(); }
    bool try_wait(uint32_t parity) const { return static_cast<uint32_t>(phase & 1) != parity; }
};

struct Copy {
    int slot, it, pieces;
    long bytes;
};

static bool simulate(int S, int nk, int pieces, std::mt19937& rng) {
    constexpr int W = kConsumerWarps, kSteps = 8, kBufs = 2;  // kABufs of the kernel
    std::vector<MBar> full(S), empty(S);
    for (int s = 0; s < S; ++s) full[s].init(1), empty[s].init(W);
    std::vector<int> slot_tag(S, -1);        // k-tile whose data the slot holds (-1: none)
    std::vector<int> readers(S, 0);          // consumer warps between full wait and release
    std::vector<Copy> inflight;
    int p_it = 0, p_state = 0;               // producer: 0 = wait empty, 1 = issue
    struct Warp { int it = 0, kk = -1; };    // kk = -1: waiting for full[slot(it)]
    std::vector<Warp> warps(W);
    const long piece_bytes = 1000;
    for (long guard = 0; guard < 1000000; ++guard) {
        std::vector<int> runnable;  // 0 = producer, 1..W = warps, W+1.. = copy completions
        if (p_it < nk) {
            const int slot = ring_slot(p_it, S);
            if (p_state == 1 || empty[slot].try_wait(empty_parity(p_it, S))) runnable.push_back(0);
        }
        for (int w = 0; w < W; ++w) {
            const Warp& c = warps[w];
            if (c.it >= nk) continue;
            if (c.kk >= 0 || full[ring_slot(c.it, S)].try_wait(full_parity(c.it, S))) runnable.push_back(1 + w);
        }
        for (size_t i = 0; i < inflight.size(); ++i) runnable.push_back(W + 1 + static_cast<int>(i));
        if (runnable.empty()) {
            bool done = p_it >= nk && inflight.empty();
            for (const Warp& c : warps) done = done && c.it >= nk;
            CHECK(done, "deadlock: S=%d nk=%d producer it %d", S, nk, p_it);
            return done;
        }
        const int a = runnable[rng() % runnable.size()];
        if (a == 0) {
            const int slot = ring_slot(p_it, S);
            if (p_state == 0) {
                CHECK(readers[slot] == 0, "producer refills slot %d while it is read", slot);
                p_state = 1;
            } else {  // arm, then issue the pieces (they land later, in any order)
                full[slot].arrive_expect_tx(piece_bytes * pieces);
                for (int q = 0; q < pieces; ++q) inflight.push_back({slot, p_it, 1, piece_bytes});
                p_state = 0, ++p_it;
            }
        } else if (a <= W) {
            Warp& c = warps[a - 1];
            const int slot = ring_slot(c.it, S);
            if (c.kk < 0) {  // full wait passed: the data must be this k-tile's, complete
                CHECK(slot_tag[slot] == c.it, "warp reads slot %d holding k-tile %d, wants %d", slot,
                      slot_tag[slot], c.it);
                ++readers[slot];
                c.kk = 0;
            } else {  // one k16 step; at step kBufs - 2 the previous k-tile's slot is released
                if (c.kk == kBufs - 2 && c.it > 0) {
                    const int prev = ring_slot(c.it - 1, S);
                    CHECK(slot_tag[prev] == c.it - 1, "released slot was overwritten");
                    --readers[prev];
                    empty[prev].arrive();
                }
                if (++c.kk == kSteps) {
                    ++c.it, c.kk = -1;
                    if (c.it == nk) --readers[slot];  // the last k-tile is never released
                }
            }
        } else {
            const size_t i = static_cast<size_t>(a - W - 1);
            const Copy cp = inflight[i];
            inflight.erase(inflight.begin() + static_cast<long>(i));
            CHECK(readers[cp.slot] == 0, "copy lands in slot %d while it is read", cp.slot);
            slot_tag[cp.slot] = cp.it;  // (every piece of k-tile it carries the same tag)
            full[cp.slot].complete_tx(cp.bytes);
        }
    }
    CHECK(false, "simulation did not finish");
    return false;
}

static void check_protocol() {
    std::mt19937 rng(1234);
    int runs = 0;
    for (int S = 2; S <= kMaxStages; ++S)
        for (int nk : {1, 2, 3, 5, 8, 17})
            for (int pieces : {1, 3, 34})
                for (int rep = 0; rep < 6; ++rep, ++runs) simulate(S, nk, pieces, rng);
    std::printf("  protocol: %d randomized runs\n", runs);
}

int main() {
    check_descriptor();
    check_x_tile<64>();
    check_x_tile<128>();
    check_x_tile<256>();
    check_stage<2, 64, 64>(), check_stage<3, 64, 64>(), check_stage<4, 64, 64>(), check_stage<5, 64, 64>();
    check_stage<2, 64, 128>(), check_stage<3, 64, 128>(), check_stage<4, 64, 128>(), check_stage<5, 64, 128>();
    check_stage<2, 128, 128>(), check_stage<3, 128, 128>(), check_stage<4, 128, 128>(), check_stage<5, 128, 128>();
    check_stage<2, 128, 64>(), check_stage<3, 128, 64>(), check_stage<4, 128, 64>(), check_stage<5, 128, 64>();
    check_stage<2, 64, 256>(), check_stage<3, 64, 256>(), check_stage<4, 64, 256>(), check_stage<5, 64, 256>();
    check_configs();
    check_x_boxes();
    for (const int optin : {232448 /* H100, H200: 227 KB */}) {
        std::printf("ring plans (opt-in shared memory %d B):\n", optin);
        report_plans<2>(optin), report_plans<3>(optin), report_plans<4>(optin), report_plans<5>(optin);
    }
    const int shapes[][3] = {{1, 1, 1},     {1, 33, 65},   {7, 4, 127},  {17, 33, 200},
                             {256, 32, 64}, {272, 112, 300}, {40, 9, 1000}, {3, 2, 129},
                             {19, 13, 416}, {1792, 32, 64}, {256, 112, 33}};
    for (const auto& sh : shapes)
        for (int want = 1; want <= 8; ++want) {
            check_coverage<64, 64>(sh[0], sh[1], sh[2], want);
            check_coverage<64, 128>(sh[0], sh[1], sh[2], want);
            check_coverage<128, 128>(sh[0], sh[1], sh[2], want);
            check_coverage<128, 64>(sh[0], sh[1], sh[2], want);
            check_coverage<64, 256>(sh[0], sh[1], sh[2], want);
        }
    check_protocol();
    if (g_fail) {
        std::printf("wgmma index check: %d FAILED\n", g_fail);
        return 1;
    }
    std::printf("wgmma index check: all ok\n");
    return 0;
}
