// SPDX-License-Identifier: Apache-2.0
// How kbit::gemv (gemv.cuh) deals a CTA's work to its warps, and where the epilogue finds the
// sums: pure index math, compiled for the device and for the host check
// tools/gemv_runs_check.cu (tests/test_index_math.py), which runs it against a model of the
// kernel's main loop. No torch headers here.
//
// A CTA owns `units` = n_cta x k_len (n-tile, k-tile) pairs, n-major. Warp w streams the
// contiguous run [run_begin(w), run_begin(w + 1)) (all runs the same length +-1; a run is empty
// when units < kWarps). Its sums leave the registers one n-tile segment at a time: a segment
// that covers all k_len k-tiles of its n-tile goes to that n-tile's rows of acc_s; only the first
// and the last segment of a run can be partial, they go to the warp's part_s slots 0 and 1.
// kDensePair's units are (pair of n-tiles, k-tile): "n-tile" here then means the pair, whose 32
// rows' sums travel together; the index math is the same.
#pragma once

namespace kbit {

constexpr int kWarps = 16;  // one CTA per SM: the table is filled once per SM

// Int (the kernel's main loop, whose measured sm_90a code uses signed compares on it) or unsigned
// (the epilogue: the division by kWarps is then one shift, with no sign fix-up).
template <typename I>
__host__ __device__ __forceinline__ I run_begin(I w, I units) {
    return w * units / kWarps;
}

// The warp whose run holds unit u (0 <= u < units): the largest w with run_begin(w) <= u, i.e.
// w * units < kWarps * (u + 1). Empty runs never hold a unit.
__host__ __device__ __forceinline__ unsigned warp_of(unsigned u, unsigned units) {
    return (kWarps * u + kWarps - 1) / units;
}

// N-tile `tile` spans units [a, a + k_len), a = tile * k_len. Its sums are
//  * in acc_s when one warp holds the whole range (warp_of(a) == warp_of(a + k_len - 1));
//  * else in part_s: one slot per non-empty warp w in [warp_of(a), warp_of(a + k_len - 1)],
//    slot 1 when w's run began before a (the n-tile is its last segment), else slot 0 (its
//    first). Added in ascending w, the order is fixed: the result is deterministic.
__host__ __device__ __forceinline__ unsigned partial_slot(unsigned w, unsigned a, unsigned units) {
    return 2 * w + (run_begin(w, units) < a ? 1 : 0);
}

// Run w is empty (it holds no unit and wrote no slot).
__host__ __device__ __forceinline__ bool run_empty(unsigned w, unsigned units) {
    return run_begin(w, units) == run_begin(w + 1, units);
}

}  // namespace kbit
