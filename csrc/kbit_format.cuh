// SPDX-License-Identifier: Apache-2.0
// Device twin of vllm_kbit/format.py + reference.py: E4M4 decode, layout constants and
// host-side argument checks shared by every kbit kernel. Spec: docs/format.md.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/all.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace kbit {

constexpr int kBlock = 32;                          // weights per quantization block (one warp)
constexpr int kTileN = 16;                          // rows per tile: M of an m16n8k16 A fragment
constexpr int kTileK = 128;                         // columns per tile
constexpr int kBlocksPerTile = kTileK / kBlock;     // 4
constexpr int kE4M4Bias = 11;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// E4M4 (no sign, bias 11, IEEE-style subnormals) -> float, built directly from bits:
// normal e>0: 2^(e-11) * (1 + m/16); subnormal e=0: m * 2^-14. Exact, 5 integer ops.
__device__ __forceinline__ float e4m4_to_float(uint32_t code) {
    const uint32_t e = code >> 4, m = code & 15u;
    if (e == 0) return static_cast<float>(m) * 6.103515625e-05f;  // 2^-14
    return __uint_as_float(((e - kE4M4Bias + 127u) << 23) | (m << 19));
}

// Column within a 32-block of bit `e` (0..7) of a tile byte owned by lane l (t = l % 4):
// {2t, 2t+1, 2t+8, 2t+9, 2t+16, 2t+17, 2t+24, 2t+25} -- the m16n8k16 A-fragment columns of
// two consecutive k16 steps. Bits (2i, 2i+1) are adjacent columns, i.e. one half2.
__host__ __device__ constexpr int tile_col(int t, int e) {
    return 2 * t + (e & 1) + 8 * (e >> 1);
}

// d += A * B with mma.sync m16n8k16, fp16 or bf16 operands, fp32 accumulators. A holds 16
// weight rows (the tile layout's fragment), B 8 tokens. Shared by gemv.cu and mma.cu.
template <bool BF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    if constexpr (BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Programmatic dependent launch (sm_90): a kernel launched with the PDL attribute may start
// while the previous kernel on the stream still runs. Before pdl_wait() it must not read memory
// that earlier kernels write (activations, outputs, workspaces) nor write global memory at all
// (an earlier kernel may still read the memory its output reuses); pdl_wait() returns once the
// previous grid has completed and flushed. Constant data (weights, codebook) may be read before.
// pdl_trigger() lets the next PDL kernel launch. Both are no-ops without PDL / before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Host side: may `Kernel` be launched with the PDL attribute? Only if the code that runs was
// compiled for compute_90+ (else pdl_wait() is compiled out and the kernel would read its input
// before the producer finished). Cached per kernel (one static per instantiation).
template <auto Kernel>
inline bool pdl_supported() {
    static const bool ok = [] {
        cudaFuncAttributes fa;
        C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, Kernel));
        return fa.ptxVersion >= 90 && fa.binaryVersion >= 90;
    }();
    return ok;
}

// Codebook entry as the format defines it: rounded to bf16 (8 significant bits; see
// docs/format.md). The plugin only passes bf16-exact codebooks; rounding here as well makes
// every op equal to the reference for any float32 codebook a caller passes.
__device__ __forceinline__ float cb_value(const float* cb, int i) {
    return __bfloat162float(__float2bfloat16_rn(__ldg(cb + i)));
}

inline int env_int(const char* name, int fallback) {  // test and tuning hooks (KBIT_*)
    const char* v = std::getenv(name);
    return v && *v ? std::atoi(v) : fallback;
}

// SMs of CUDA device `dev`, queried once per device (launch sizes, dispatch rules).
inline int device_sms(int dev) {
    static std::atomic<int> cache[64];
    const bool cached = dev >= 0 && dev < 64;
    int v = cached ? cache[dev].load(std::memory_order_relaxed) : 0;
    if (v == 0) {
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
        if (cached) cache[dev].store(v, std::memory_order_relaxed);
    }
    return v;
}

// 33..64 tokens on sm_90 (mma.cu's wgmma2_by_default, wgmma_gemm.cu's choose_config): the
// warp-specialized kernel's 128-row C1 tile on layers of <= 16M weights (n x K), its 256-row C1w
// tile on larger ones, except where each of more than half an SM count of 256-row blocks would
// stream >= 64 k-tiles (K >= 8192): there the 64-token mma.sync kernel (stream-K). H100, M = 40 /
// 64, k = 2..5 (benchmarks/results/probe_env_h100_s32_rule.md): C1w took 0.82-0.97x mma.sync's
// time on the other 11 shapes of > 16M weights (8B and 70B layers, their TP=2 shards, an
// 8B-shaped lm_head of 501 blocks and 32 k-tiles), but 1.03-1.14x on 70B gate_up (224 blocks, 64
// k-tiles; k=5 0.95-0.99x) and 1.16-1.32x on its TP=2 shard (112 blocks, 64 k-tiles, no split-K).
// There C1w's copy pipeline alone (no dequantization, no wgmma) already takes as long as mma.sync
// (TP=2 shard, k=2: 91.5 vs 103.0 us, where 8B gate_up's takes 22.7 of 56.2), and rotating each
// CTA's k order does not help (probe_env_h100_s32_rot.md), nor does an L2 evict_first policy on
// the weight boxes, with or without evict_last on x (1.00x on every shape at M = 64 / 128 / 256:
// probe_env_h100_s33_l2hint*.md; branch s33-l2hint): not x evicted by the weight stream.
constexpr int64_t kSmallLayerWeights = int64_t{1} << 24;
inline bool c1w_by_size(int64_t n, int64_t K) { return n * K > kSmallLayerWeights; }
inline bool c1w_beats_sync(int64_t n, int64_t K, int64_t sms) {
    const int64_t blocks = ceil_div(n, 256), k_tiles = ceil_div(K, kTileK);
    return !(k_tiles >= 64 && 2 * blocks > sms);
}

// Launch the dense GEMV and GEMM kernels (gemv.cu, mma.cu, wgmma_gemm.cu) with programmatic
// dependent launch: each copies constant data (table, first weights) before pdl_wait(), so that
// copy overlaps the previous kernel's drain and launch. H100, chains of one op over the 8B layers
// (benchmarks/results/probe_env_h100_s29_pdl.md): 0.88-0.95x the time at M=1, 0.90-0.97x at M =
// 16 / 32, 0.95-1.00x at M=64; vLLM batch 64, kbit4: +1.2 to +4.3% output tok/s in three
// same-machine pairs (bench_e2e_h100_s29_pdl*.md); batch 1 unchanged (bound by vLLM's host
// time per step). KBIT_PDL=0 turns it off (read per call, as kbit::mma's other KBIT_* switches);
// each launch also needs pdl_supported().
inline bool pdl_requested() { return env_int("KBIT_PDL", 1) != 0; }

// cudaLaunchKernelEx with an optional thread-block cluster (along y) and the programmatic
// dependent launch attribute (only for kernels whose pdl_supported() is true).
template <typename Kernel, typename... Args>
void launch_kernel(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream,
                   int cluster_y, bool pdl, const Args&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    int n = 0;
    if (cluster_y > 1) {
        attr[n].id = cudaLaunchAttributeClusterDimension;
        attr[n].val.clusterDim.x = 1;
        attr[n].val.clusterDim.y = cluster_y;
        attr[n].val.clusterDim.z = 1;
        ++n;
    }
    if (pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n].val.programmaticStreamSerializationAllowed = 1;
        ++n;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// Two floats -> packed fp16x2 / bf16x2 bits (low half = first).
template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (BF16) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&h);
    } else {
        const __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&h);
    }
}

// The inverse: two packed fp16 / bf16 values (low half = first) -> float2 (bf16: the float's
// upper 16 bits, two integer ops).
template <bool BF16>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
    if constexpr (BF16) {
        return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
    } else {
        __half2 h;
        *reinterpret_cast<uint32_t*>(&h) = v;
        return __half22float2(h);
    }
}

// Gated MoE activations (vLLM's MoEActivation: act(h[:, :I]) * h[:, I:]), as moe.cu and the
// MoE GEMV stages (gemv.cuh) compute them: fp32, from h rounded to the activation dtype.
enum Act : int { kSilu = 0, kGelu = 1, kGeluTanh = 2 };

template <bool BF16>
__device__ __forceinline__ float round_to(float v) {
    if constexpr (BF16) return __bfloat162float(__float2bfloat16_rn(v));
    else return __half2float(__float2half_rn(v));
}

// v summed over the 32 lanes of a full warp (butterfly: every lane gets the sum).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float act_fn(float v, int act) {
    if (act == kSilu) return v / (1.0f + expf(-v));
    if (act == kGelu) return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);  // sqrt(2/pi)
    return 0.5f * v * (1.0f + tanhf(inner));
}

// act(h_gate) * h_up for 4 columns: h rounded to the dtype, product in fp32 rounded once
// (reference_moe.moe_tiled). `wm` = router weight applied to the fp32 sums first (or 1).
template <bool BF16>
__device__ __forceinline__ uint2 act_mul4(float4 g, float4 u, float wm, int act) {
    auto one = [&](float gv, float uv) {
        return act_fn(round_to<BF16>(gv * wm), act) * round_to<BF16>(uv * wm);
    };
    return make_uint2(pack2<BF16>(one(g.x, u.x), one(g.y, u.y)),
                      pack2<BF16>(one(g.z, u.z), one(g.w, u.w)));
}

__device__ __forceinline__ void atomic_add4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
    atomicAdd(dst, v.x), atomicAdd(dst + 1, v.y), atomicAdd(dst + 2, v.z), atomicAdd(dst + 3, v.w);
#endif
}

__device__ __forceinline__ float4 f4add(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
__device__ __forceinline__ float4 f4mul(float4 a, float s) {
    return make_float4(a.x * s, a.y * s, a.z * s, a.w * s);
}

// MoE routing: the local expert of slot s, or -1 (another rank's expert, or an id outside the
// tables). R (moe.cu's Routing, gemv.cuh's MoeArgs) has ids32 / ids64 (one set: topk_ids [S]),
// emap (expert_map [emap_n] or null) and E (local experts).
template <class R>
__device__ __forceinline__ int local_expert(const R& r, int s) {
    int64_t g = r.ids64 ? r.ids64[s] : static_cast<int64_t>(r.ids32[s]);
    if (r.emap) {
        if (g < 0 || g >= r.emap_n) return -1;
        g = r.emap[g];
    }
    return g >= 0 && g < r.E ? static_cast<int>(g) : -1;
}

// Sizes of the runtime layout of W[n, k].
struct TiledShape {
    int64_t n, k, np, kp, n_tiles, k_tiles, words, absmax_bytes;
    TiledShape(int64_t n_, int64_t k_, int64_t bits)
        : n(n_), k(k_), np(ceil_div(n_, kTileN) * kTileN), kp(ceil_div(k_, kTileK) * kTileK),
          n_tiles(np / kTileN), k_tiles(kp / kTileK), words(np * kp * bits / 32),
          absmax_bytes(np * kp / 32) {}
};

// Host: does p (t's data) start at a multiple of `bytes`? 16 B: vector loads, cp.async and TMA
// move 16-byte chunks; the GEMV's register loads of planes / absmax need 8 / 4 B.
inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
inline bool aligned(const at::Tensor& t, int bytes) { return aligned(t.data_ptr(), bytes); }
// Host: does every row of the 2-D tensor t start 16-byte aligned? One row has no stride to check.
inline bool rows_aligned16(const at::Tensor& t) {
    return aligned(t, 16) && (t.size(0) == 1 || t.stride(0) * t.element_size() % 16 == 0);
}

inline void check_bits(int64_t bits, const char* op) {
    TORCH_CHECK(bits >= 2 && bits <= 5, "kbit::", op, ": bits must be 2, 3, 4 or 5, got ", bits);
}

inline void check_codebook(const at::Tensor& codebook, int64_t bits, const char* op) {
    TORCH_CHECK(codebook.is_cuda(), "kbit::", op, ": codebook must be a CUDA tensor");
    TORCH_CHECK(codebook.scalar_type() == at::kFloat && codebook.dim() == 1 &&
                    codebook.numel() == (int64_t{1} << bits) && codebook.is_contiguous(),
                "kbit::", op, ": codebook must be contiguous float32 [", int64_t{1} << bits,
                "] for bits=", bits, ", got ", codebook.scalar_type(), " ", codebook.sizes());
}

// Checks the runtime-layout tensors of W[n, k] (k taken from x) and returns their sizes.
inline TiledShape check_tiled(const at::Tensor& qweight, const at::Tensor& absmax, int64_t bits,
                              int64_t n, int64_t k, const char* op) {
    check_bits(bits, op);
    TORCH_CHECK(n > 0 && k > 0 && k % kBlock == 0, "kbit::", op, ": bad weight size n=", n,
                ", k=", k, " (k must be a positive multiple of 32)");
    TiledShape s(n, k, bits);
    TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.is_contiguous() &&
                    qweight.numel() == s.words,
                "kbit::", op, ": qweight must be contiguous CUDA int32 with ", s.words,
                " elements (tiled layout, n=", n, ", k=", k, ", bits=", bits, "), got ",
                qweight.scalar_type(), " with ", qweight.numel());
    TORCH_CHECK(absmax.is_cuda() && absmax.scalar_type() == at::kByte && absmax.is_contiguous() &&
                    absmax.numel() == s.absmax_bytes,
                "kbit::", op, ": weight_absmax must be contiguous CUDA uint8 with ", s.absmax_bytes,
                " elements (tiled layout, n=", n, ", k=", k, "), got ", absmax.scalar_type(),
                " with ", absmax.numel());
    return s;
}

// x must be a 2-D fp16/bf16 CUDA tensor with unit stride along K (row stride may be larger).
inline void check_activation(const at::Tensor& x, const at::Tensor& qweight, const char* op) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, "kbit::", op, ": x must be a 2-D CUDA tensor, got ",
                x.sizes());
    TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "kbit::", op,
                ": x must be float16 or bfloat16, got ", x.scalar_type());
    TORCH_CHECK(x.stride(1) == 1, "kbit::", op, ": x must have unit stride along K");
    TORCH_CHECK(x.get_device() == qweight.get_device(), "kbit::", op,
                ": x and qweight are on different devices");
}

}  // namespace kbit
