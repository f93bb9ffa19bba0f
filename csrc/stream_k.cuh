// SPDX-License-Identifier: Apache-2.0
// How kbit::mma's stream-K mode (mma.cu, SK kernels) deals (n-tile group, k-tile) units to CTAs
// and which CTA finishes which group: pure index math, compiled for the device and for the host
// check tools/stream_k_check.cu (tests/test_index_math.py), which runs it against a model of the
// kernel. No torch headers here.
//
// Unit u = group * k_tiles + k-tile; `units` of them in all. CTA c of `grid` (grid <= units) runs
// [run_begin(c), run_begin(c + 1)): every run the same length +-1, none empty. The kernel cuts a
// run into segments, one per group it touches, and processes them from the highest group down
// (first_segment, then next_segment):
//  * only the first segment can end inside its group (end < k_tiles): the CTA then leaves that
//    partial tile for the group's finisher;
//  * only the last segment can start inside its group (lo > 0); if it runs to the group's end,
//    this CTA is the group's finisher and adds the partials of CTAs cta_of(group * k_tiles) ..
//    c - 1, which all hold an earlier part of the group as their first segment.
// Finishers wait only on lower-numbered CTAs, which raise their flag before they wait on
// anything: with CTAs dispatched in index order, no deadlock.
#pragma once

#include <cstdint>

namespace kbit {
namespace sk {

struct Segment {
    int group, lo, end;  // k-tiles [lo, end) of n-tile group `group`
};

// First unit of CTA c's run.
__host__ __device__ __forceinline__ int run_begin(int64_t c, int64_t units, int64_t grid) {
    return static_cast<int>(c * units / grid);
}

// The CTA whose run holds unit u: the largest c with run_begin(c) <= u.
__host__ __device__ __forceinline__ int cta_of(int64_t u, int64_t units, int64_t grid) {
    return static_cast<int>((grid * u + grid - 1) / units);
}

// The segment of run [u0, u1) processed first: the part of the run in its highest group.
__host__ __device__ __forceinline__ Segment first_segment(int u0, int u1, int k_tiles) {
    const int g = (u1 - 1) / k_tiles, lo = u0 - g * k_tiles;
    return {g, lo > 0 ? lo : 0, u1 - g * k_tiles};
}

// The segment after s: the run's part of the next group down (to that group's end).
__host__ __device__ __forceinline__ Segment next_segment(const Segment& s, int u0, int k_tiles) {
    const int g = s.group - 1, lo = u0 - g * k_tiles;
    return {g, lo > 0 ? lo : 0, k_tiles};
}

}  // namespace sk
}  // namespace kbit
