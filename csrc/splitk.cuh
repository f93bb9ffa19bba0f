// SPDX-License-Identifier: Apache-2.0
// Split-K "the last CTA of an output tile reduces" (mode kSerial of mma.cu and wgmma_gemm.cu).
//
// Every split CTA stores its fp32 partials in the workspace [splits, M, n] as kWorkspace does, then
// counts itself in the tile's arrival counter; the CTA that brings the count to `splits` adds the
// splits' partials in split order (the order of splitk_reduce_kernel and of the DSMEM cluster sum,
// so all three reductions give the same bits) and writes y. That removes the separate reduce
// kernel: its launch, its gap in a CUDA graph (two per decoder layer at M = 64 on Llama-3.1-8B)
// and a second pass over the partials, which the last CTA now reads from L2 right after the other
// splits wrote them.
//
// Counters: one per output tile, in a per-device buffer zeroed once when it is made and left zero
// by every launch (the last CTA resets its tile's counter; all splits have counted by then). Each
// CUDA stream gets its own slice: launches on one stream never overlap, so none sees another's
// counts. The buffer is made outside CUDA graph capture only; a stream first seen during capture
// just takes a free slice (no allocation), and where there is none the caller keeps kWorkspace.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "kbit_format.cuh"

namespace kbit {
namespace splitk {

// Output tiles of one launch (8B lm_head at M = 64 on mma: 501; the wgmma kernel's C2w at M = 1024
// on 8B gate_up: 896) and streams per device (PyTorch's pools hold 32 + 32 per device, plus the
// default and the graph-capture streams): 4 MB per device.
constexpr int kTilesPerSlice = 1 << 13;
constexpr int kSlices = 128;

// Called by every thread of the `threads` that stored this CTA's partials, after their stores;
// `bar` synchronises exactly those threads and `flag` is a shared-memory int. True in the last
// CTA of the tile, whose threads may then read every split's partials.
template <typename Bar>
__device__ __forceinline__ bool arrive(unsigned* counter, int splits, bool leader, int* flag,
                                       Bar bar) {
    __threadfence();  // this thread's partials are visible GPU-wide before the CTA counts
    bar();
    if (leader) {
        const bool last = atomicAdd(counter, 1u) == static_cast<unsigned>(splits - 1);
        if (last) *counter = 0u;  // every split has counted: clean for the next launch
        *flag = last;
    }
    bar();
    const bool last = *flag != 0;
    if (last) __threadfence();  // acquire side of the other CTAs' fences
    return last;
}

// Sum over the splits, in split order, of the 4 partials at (row, col..col+3) of ws [splits, M, n]
// (split stride `plane` = M * n). L2 loads (__ldcg): written by other SMs during this launch.
// Columns >= n are not read (their sums are not stored).
__device__ __forceinline__ float4 sum4(const float* ws, int64_t plane, int splits, int row, int col,
                                       int n) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    const float* src = ws + static_cast<int64_t>(row) * n + col;
    for (int s = 0; s < splits; ++s, src += plane) {
        if ((n & 3) == 0) {  // 16-byte aligned: col % 4 == 0 and row * n % 4 == 0
            const float4 r = __ldcg(reinterpret_cast<const float4*>(src));
            v.x += r.x, v.y += r.y, v.z += r.z, v.w += r.w;
        } else {
            v.x += __ldcg(src);
            if (col + 1 < n) v.y += __ldcg(src + 1);
            if (col + 2 < n) v.z += __ldcg(src + 2);
            if (col + 3 < n) v.w += __ldcg(src + 3);
        }
    }
    return v;
}

// Zeroed counters for `tiles` output tiles of a launch on `stream`, or nullptr (the caller falls
// back to kWorkspace + splitk_reduce_kernel): too many tiles, KBIT_MMA_NO_SERIAL=1, no buffer on
// this device yet while capturing a CUDA graph, or more than kSlices streams.
inline unsigned* counters(int device, cudaStream_t stream, int64_t tiles) {
    if (tiles > kTilesPerSlice || env_int("KBIT_MMA_NO_SERIAL", 0) != 0) return nullptr;
    struct Device {
        unsigned* buf = nullptr;
        std::vector<cudaStream_t> streams;  // slice i belongs to streams[i]
    };
    static std::mutex mu;
    static Device devices[64];
    if (device < 0 || device >= 64) return nullptr;
    const std::lock_guard<std::mutex> lock(mu);
    Device& d = devices[device];
    if (!d.buf) {
        cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
        C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
        if (st != cudaStreamCaptureStatusNone) return nullptr;  // no allocation inside a capture
        const size_t bytes = sizeof(unsigned) * kTilesPerSlice * kSlices;
        void* p = nullptr;
        C10_CUDA_CHECK(cudaMalloc(&p, bytes));  // lives as long as the process
        // zero before anything can read it, whichever stream that is
        C10_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
        C10_CUDA_CHECK(cudaStreamSynchronize(stream));
        d.buf = static_cast<unsigned*>(p);
    }
    size_t slice = 0;
    while (slice < d.streams.size() && d.streams[slice] != stream) ++slice;
    if (slice == d.streams.size()) {
        if (slice == kSlices) return nullptr;
        d.streams.push_back(stream);
    }
    return d.buf + slice * kTilesPerSlice;
}

}  // namespace splitk
}  // namespace kbit
