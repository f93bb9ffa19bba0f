// SPDX-License-Identifier: Apache-2.0
// CPU check of kbit::gemv's work split and epilogue index math (csrc/gemv_runs.cuh): the functions
// the kernel (csrc/gemv.cuh) calls, run on the host against a model of its main loop. No GPU:
//
//   nvcc -std=c++17 -Icsrc tools/gemv_runs_check.cu -o /tmp/gemv_runs_check && /tmp/gemv_runs_check
//
// (tests/test_index_math.py builds and runs it.) For every CTA shape (n_cta n-tiles x k_len
// k-tiles) up to 48 x 96 and a sample of larger ones:
//  1. the runs run_begin(w) .. run_begin(w + 1) tile [0, units) in warp order, lengths differ by
//     at most 1, and warp_of(u) is the warp whose run holds u (brute force);
//  2. a model of the main loop's segment stores (the `left` / `whole` / `part` logic of
//     gemv_kernel, line by line) writes each unit's sum exactly once, each part_s slot at most
//     once, and the n-tile's acc_s rows only when one warp covered the whole n-tile;
//  3. the epilogue's reads (acc_s when warp_of(a) == warp_of(a + k_len - 1), else partial_slot(w)
//     for the non-empty runs w in between, ascending) are exactly the stores of that n-tile, in
//     ascending warp order: every unit counted once, nothing unwritten added, the order fixed;
//  4. they equal what the epilogue of commit 013866f selected (each warp published the n-tile of
//     its slots, slot_tile[2w + s], and every output row compared all 32): same slots, same
//     order, so the kernel's sums are bit-identical to that version's.
// What it cannot check: the kernel itself (tests/test_cuda_gemv.py, tests/test_cuda_moe.py).
#include <cstdio>
#include <vector>

#include "gemv_runs.cuh"
#include "host_check.h"

using namespace kbit;

// A store of the main loop: `units` k-tiles of n-tile `tile`, from warp `w`, into acc_s (slot -1)
// or into part_s slot 2w + s.
struct Store {
    int tile, w, slot, units;
};

// gemv_kernel's loop, per warp, reduced to its store decisions (the names are the kernel's).
static std::vector<Store> model_loop(int n_cta, int k_len) {
    const int units = n_cta * k_len;
    std::vector<Store> out;
    for (int warp = 0; warp < kWarps; ++warp) {
        const int u0 = run_begin(warp, units), u1 = run_begin(warp + 1, units);
        int left = k_len - u0 % k_len;
        bool whole = left == k_len;
        int part = 2 * warp, tile = u0 / k_len, seg = 0;
        for (int u = u0; u < u1; ++u) {  // one tile_mma per unit
            ++seg;
            const bool tile_end = --left == 0;
            if (tile_end || u + 1 == u1) {
                out.push_back({tile, warp, tile_end && whole ? -1 : part, seg});
                part = 2 * warp + 1;
                whole = true;
                seg = 0;
            }
            if (tile_end) left = k_len, ++tile;
        }
    }
    return out;
}

// The previous epilogue's choice for n-tile `tile`: the slots whose published n-tile is `tile`,
// in slot order, or {-1} (acc_s) when there are none.
static std::vector<int> old_epilogue(int n_cta, int k_len, int tile) {
    const int units = n_cta * k_len;
    int slot_tile[kWarps * 2];
    for (int warp = 0; warp < kWarps; ++warp) {
        const int u0 = run_begin(warp, units), u1 = run_begin(warp + 1, units);
        const int f = u0 / k_len, l = (u1 - 1) / k_len;
        const bool first_whole = u0 == f * k_len && u1 >= (f + 1) * k_len;
        const bool last_part = l != f && u1 != (l + 1) * k_len;
        slot_tile[warp * 2] = u0 < u1 && !first_whole ? f : -1;
        slot_tile[warp * 2 + 1] = u0 < u1 && last_part ? l : -1;
    }
    std::vector<int> r;
    for (int j = 0; j < kWarps * 2; ++j)
        if (slot_tile[j] == tile) r.push_back(j);
    if (r.empty()) r.push_back(-1);
    return r;
}

// The current epilogue's reads for n-tile `tile` (the kernel's code, with the loads recorded).
static std::vector<int> new_epilogue(int n_cta, int k_len, int tile) {
    const unsigned units = n_cta * k_len, a = tile * k_len;
    const unsigned w_lo = warp_of(a, units), w_hi = warp_of(a + k_len - 1, units);
    std::vector<int> r;
    if (w_lo == w_hi) return {-1};
    const int n_w = static_cast<int>(w_hi - w_lo) + 1;
    for (int i = 0; i < n_w; ++i) {
        const unsigned w = w_lo + i;
        if (!run_empty(w, units)) r.push_back(static_cast<int>(partial_slot(w, a, units)));
    }
    return r;
}

static void check_shape(int n_cta, int k_len) {
    const int units = n_cta * k_len;
    // 1. runs and warp_of
    int prev = 0, lo = units, hi = 0;
    for (int w = 0; w < kWarps; ++w) {
        const int b = run_begin(w, units), e = run_begin(w + 1, units);
        CHECK(b == prev && e >= b, "runs not contiguous, units %d warp %d", units, w);
        CHECK(run_begin(unsigned(w), unsigned(units)) == unsigned(b), "int / unsigned differ");
        CHECK(run_empty(w, units) == (b == e), "run_empty, units %d warp %d", units, w);
        lo = e - b < lo ? e - b : lo, hi = e - b > hi ? e - b : hi;
        for (int u = b; u < e; ++u) CHECK(int(warp_of(u, units)) == w, "warp_of(%d, %d)", u, units);
        prev = e;
    }
    CHECK(prev == units && hi - lo <= 1, "runs: end %d, lengths %d..%d, units %d", prev, lo, hi, units);

    // 2. the loop's stores
    const std::vector<Store> st = model_loop(n_cta, k_len);
    std::vector<int> covered(n_cta, 0), acc_writes(n_cta, 0), slot_writes(2 * kWarps, 0);
    for (const Store& s : st) {
        CHECK(s.tile >= 0 && s.tile < n_cta && s.units > 0, "store out of range");
        covered[s.tile] += s.units;
        if (s.slot < 0) {
            ++acc_writes[s.tile];
            CHECK(s.units == k_len, "acc_s store of a partial segment, tile %d", s.tile);
        } else {
            ++slot_writes[s.slot];
            CHECK(s.slot / 2 == s.w, "slot of another warp");
        }
    }
    for (int j = 0; j < 2 * kWarps; ++j) CHECK(slot_writes[j] <= 1, "slot %d written twice", j);
    for (int t = 0; t < n_cta; ++t) {
        CHECK(covered[t] == k_len, "n-tile %d: %d of %d k-tiles summed", t, covered[t], k_len);
        // 3. the epilogue reads exactly this n-tile's stores, in warp order
        std::vector<int> want;
        for (const Store& s : st)
            if (s.tile == t) want.push_back(s.slot);
        if (acc_writes[t]) CHECK(want.size() == 1, "n-tile %d: acc_s and slots mixed", t);
        for (size_t i = 1; i < want.size(); ++i)
            CHECK(want[i] > want[i - 1], "n-tile %d: stores not in warp order", t);
        const std::vector<int> got = new_epilogue(n_cta, k_len, t);
        CHECK(got == want, "n_cta %d k_len %d n-tile %d: epilogue reads != stores", n_cta, k_len, t);
        // 4. the same choice as the previous epilogue
        CHECK(got == old_epilogue(n_cta, k_len, t), "n_cta %d k_len %d n-tile %d: != 013866f",
              n_cta, k_len, t);
    }
}

int main() {
    int shapes = 0;
    for (int n_cta = 1; n_cta <= 48; ++n_cta)
        for (int k_len = 1; k_len <= 96; ++k_len) check_shape(n_cta, k_len), ++shapes;
    // Larger CTAs (dense GEMV with many n-tiles per SM, e.g. a 128k-row lm_head on 132 SMs).
    const int big[][2] = {{64, 1}, {97, 3}, {128, 16}, {250, 7}, {512, 1}, {1000, 2}, {61, 448}};
    for (const auto& b : big) check_shape(b[0], b[1]), ++shapes;
    if (g_fail) {
        std::printf("gemv runs check: %d FAILED\n", g_fail);
        return 1;
    }
    std::printf("gemv runs check: %d CTA shapes, all ok\n", shapes);
    return 0;
}
