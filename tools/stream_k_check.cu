// SPDX-License-Identifier: Apache-2.0
// CPU check of kbit::mma's stream-K work split (csrc/stream_k.cuh): the functions the SK kernels
// of csrc/mma.cu call, run on the host against a model of the kernel's loops. No GPU:
//
//   nvcc -std=c++17 -Icsrc tools/stream_k_check.cu -o /tmp/stream_k_check && /tmp/stream_k_check
//
// (tests/test_index_math.py builds and runs it.) For every grid of up to 48 groups x 40 k-tiles and
// every CTA count up to 160 (and a sample of real shapes: 8B / 70B layers on 132 or 264 CTAs):
//  1. the runs tile [0, units) in CTA order, lengths differ by at most 1, none is empty, and
//     cta_of(u) is the CTA whose run holds u (brute force);
//  2. the load loop (l_seg, l_kt: a k-tile per load, next_segment when a segment ends and groups
//     remain) and the compute loop (c_seg, c_left) of the kernel, modelled line by line, visit the
//     same units in the same order, exactly the CTA's run: over all CTAs, every unit once;
//  3. the partial / finisher protocol: a CTA leaves a partial only for its first segment, and only
//     if that ends inside its group; a segment that starts inside its group and runs to its end
//     finishes the group, adding the partials of CTAs cta_of(group start) .. itself - 1, which are
//     exactly the CTAs that left a partial for that group, all lower-numbered; a CTA waits only in
//     its last segment, after its own partial (if any) is out: no cycle of waits. Segments that
//     hold a whole group write y directly; every group is written exactly once.
//  4. the split-K CTAs (one group's k-chunk, not stream-K) are one segment: [kbeg, kbeg + nk).
// What it cannot check: the kernel itself (tests/test_cuda_mma.py, stream-K tests).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "host_check.h"
#include "stream_k.cuh"

using namespace kbit;

struct Cta {
    std::vector<int> loads, computes;  // units in visit order
    int partial_group = -1;            // group of the partial tile it leaves (-1: none)
    int finished_group = -1;           // group it finishes from partials (-1: none)
    std::vector<int> waits;            // CTAs whose partials it adds, in the order added
    std::vector<int> direct_groups;    // groups it writes alone
    int partial_at = -1, wait_at = -1;  // segment index of the partial store / of the wait
    int segments = 0;
};

// mma_kernel's SK loops for CTA c, reduced to the units they visit and the epilogue decisions.
static Cta model(int c, int64_t units, int grid, int k_tiles) {
    Cta out;
    const int u0 = sk::run_begin(c, units, grid), u1 = sk::run_begin(c + 1, units, grid);
    const int nk = u1 - u0, g_low = u0 / k_tiles;
    sk::Segment l_seg = sk::first_segment(u0, u1, k_tiles);  // loads
    int l_kt = l_seg.lo;
    for (int i = 0; i < nk; ++i) {
        out.loads.push_back(l_seg.group * k_tiles + l_kt);
        if (++l_kt == l_seg.end && l_seg.group > g_low) {
            l_seg = sk::next_segment(l_seg, u0, k_tiles);
            l_kt = l_seg.lo;
        }
    }
    sk::Segment c_seg = sk::first_segment(u0, u1, k_tiles);  // compute + segment_done
    int c_left = c_seg.end - c_seg.lo, seg_index = 0, kt = c_seg.lo;
    for (int i = 0; i < nk; ++i) {
        out.computes.push_back(c_seg.group * k_tiles + kt++);
        if (--c_left == 0) {
            if (c_seg.end < k_tiles) {
                CHECK(out.partial_group < 0, "cta %d: a second partial", c);
                out.partial_group = c_seg.group, out.partial_at = seg_index;
            } else if (c_seg.lo > 0) {
                CHECK(out.finished_group < 0, "cta %d: finishes two groups", c);
                out.finished_group = c_seg.group, out.wait_at = seg_index;
                const int first = sk::cta_of(int64_t{c_seg.group} * k_tiles, units, grid);
                for (int w = c - 1; w >= first; --w) out.waits.push_back(w);
            } else {
                out.direct_groups.push_back(c_seg.group);
            }
            c_seg = sk::next_segment(c_seg, u0, k_tiles);
            c_left = c_seg.end - c_seg.lo, kt = c_seg.lo, ++seg_index;
        }
    }
    out.segments = seg_index;
    return out;
}

static void check_grid(int groups, int k_tiles, int grid) {
    const int64_t units = int64_t{groups} * k_tiles;
    std::vector<int> seen(units, 0), written(groups, 0), partial_of(grid, -1), finisher(groups, -1);
    std::vector<Cta> ctas;
    int prev_end = 0;
    for (int c = 0; c < grid; ++c) {
        const int b = sk::run_begin(c, units, grid), e = sk::run_begin(c + 1, units, grid);
        CHECK(b == prev_end && e > b, "grid %dx%d/%d: run %d = [%d, %d)", groups, k_tiles, grid, c,
              b, e);
        const int64_t lo = units / grid;
        CHECK(e - b == lo || e - b == lo + 1, "run %d length %d", c, e - b);
        for (int u = b; u < e; ++u)
            CHECK(sk::cta_of(u, units, grid) == c, "cta_of(%d) = %d, not %d", u,
                  sk::cta_of(u, units, grid), c);
        prev_end = e;
        ctas.push_back(model(c, units, grid, k_tiles));
        const Cta& m = ctas.back();
        CHECK(m.loads == m.computes, "grid %dx%d/%d cta %d: loads and computes differ", groups,
              k_tiles, grid, c);
        const std::vector<int>& v = m.computes;
        for (size_t i = 1; i < v.size(); ++i)  // within a segment, k-tiles ascend one by one
            if (v[i] / k_tiles == v[i - 1] / k_tiles)
                CHECK(v[i] == v[i - 1] + 1, "cta %d: k-tiles out of order", c);
        for (int u : m.computes) {
            CHECK(u >= b && u < e, "cta %d visits unit %d outside its run", c, u);
            ++seen[u];
        }
        if (m.partial_group >= 0) {
            CHECK(m.partial_at == 0, "cta %d: partial not in its first segment", c);
            partial_of[c] = m.partial_group;
        }
        if (m.finished_group >= 0) {
            CHECK(m.wait_at == m.segments - 1, "cta %d waits in segment %d of %d", c, m.wait_at,
                  m.segments);
            CHECK(finisher[m.finished_group] < 0, "group %d finished twice", m.finished_group);
            finisher[m.finished_group] = c;
            ++written[m.finished_group];
            CHECK(m.partial_group < 0 || m.partial_at < m.wait_at,
                  "cta %d waits before its partial", c);
        }
        for (int g : m.direct_groups) ++written[g];
    }
    CHECK(prev_end == units, "runs end at %d, not %lld", prev_end, static_cast<long long>(units));
    for (int64_t u = 0; u < units; ++u)
        CHECK(seen[u] == 1, "unit %lld seen %d times", static_cast<long long>(u), seen[u]);
    for (int g = 0; g < groups; ++g)
        CHECK(written[g] == 1, "group %d written %d times", g, written[g]);
    // every partial is added by exactly its group's finisher, once; finishers add only partials
    // of their group from lower CTAs, highest first
    std::vector<int> added(grid, 0);
    for (int c = 0; c < grid; ++c) {
        const Cta& m = ctas[c];
        int last = c;
        for (int w : m.waits) {
            CHECK(w < last, "cta %d adds cta %d out of order", c, w);
            last = w;
            CHECK(partial_of[w] == m.finished_group, "cta %d adds cta %d's partial of group %d", c,
                  w, partial_of[w]);
            ++added[w];
        }
    }
    for (int c = 0; c < grid; ++c)
        CHECK((partial_of[c] >= 0) == (added[c] == 1) && added[c] <= 1,
              "grid %dx%d/%d: cta %d partial %d added %d times", groups, k_tiles, grid, c,
              partial_of[c], added[c]);
}

int main() {
    int grids = 0;
    for (int groups = 1; groups <= 48; ++groups)
        for (int k_tiles = 1; k_tiles <= 40; ++k_tiles)
            for (int grid = 1; grid <= 160 && grid <= groups * k_tiles; ++grid) {
                check_grid(groups, k_tiles, grid);
                ++grids;
            }
    // Llama-3.1 8B / 70B layers (256-row groups x 128-column k-tiles) on 132 and 264 CTAs, and the
    // lm_head (128256 rows)
    const int real[][2] = {{24, 32}, {16, 32}, {112, 32}, {16, 112}, {40, 64},
                           {32, 64}, {224, 64}, {32, 224}, {501, 32}};
    for (const auto& r : real)
        for (int grid : {132, 264}) {
            check_grid(r[0], r[1], grid);
            ++grids;
        }
    // split-K CTAs (not stream-K): one group's k-chunk is one segment
    for (int k_tiles = 1; k_tiles <= 64; ++k_tiles)
        for (int kchunk = 1; kchunk <= k_tiles; ++kchunk)
            for (int g = 0; g < 3; ++g)
                for (int kbeg = 0; kbeg < k_tiles; kbeg += kchunk) {
                    const int u0 = g * k_tiles + kbeg;
                    const int nk = kchunk < k_tiles - kbeg ? kchunk : k_tiles - kbeg;
                    const sk::Segment s = sk::first_segment(u0, u0 + nk, k_tiles);
                    CHECK(s.group == g && s.lo == kbeg && s.end == kbeg + nk,
                          "split-K chunk g=%d kbeg=%d nk=%d -> (%d, %d, %d)", g, kbeg, nk, s.group,
                          s.lo, s.end);
                }
    std::printf("%d grids checked\n", grids);
    if (g_fail) {
        std::printf("%d failures\n", g_fail);
        return 1;
    }
    std::printf("all ok\n");
    return 0;
}
