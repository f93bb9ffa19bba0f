// SPDX-License-Identifier: Apache-2.0
// kbit::quantize: W[N, K] fp16/bf16/fp32 -> qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]
// kbit::dequantize: the inverse -> W[N, K] fp16/bf16/fp32. Checkpoint layout (docs/format.md);
// both are bit-identical to vllm_kbit/reference.py. Load-time ops: one warp per block of 32.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kbit_format.cuh"
#include "ops.h"

namespace kbit {
namespace {

constexpr int kWarpsPerCta = 8;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kE4M4Max = 31.0f;  // code 0xFF

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round-to-nearest-even casts, the same as torch's .to(dtype) in the reference.
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Nearest E4M4 code of a >= 0, a tie going to the larger code: the number of midpoints
// between neighbouring codes that are <= a (reference: bucketize(right=True)). A value has
// 5 significant bits, so every midpoint (v[c-1] + v[c]) * 0.5 is exact in fp32 and this
// binary search over them reproduces the reference. a is warp-uniform: no divergence.
__device__ __forceinline__ uint32_t e4m4_encode(float a) {
    uint32_t lo = 0, hi = 255;  // the answer lies in [lo, hi]
#pragma unroll
    for (int step = 0; step < 8; ++step) {
        const uint32_t c = (lo + hi + 1) >> 1;  // is the midpoint below code c <= a ?
        const float mid = __fmul_rn(__fadd_rn(e4m4_to_float(c - 1), e4m4_to_float(c)), 0.5f);
        if (mid <= a) lo = c; else hi = c - 1;
    }
    return lo;
}

// One warp per block of 32 consecutive weights (lane i = weight i), grid-stride over the
// N*K/32 blocks, which are also the order of absmax and of the qweight planes.
// err[0]: first block with a non-finite weight, err[1]: first block with absmax > 31,
// err[2]: number of such blocks (the host reports them after one sync).
template <typename T, int BITS>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
quantize_kernel(const T* __restrict__ weight, const float* __restrict__ codebook,
                uint32_t* __restrict__ qweight, uint8_t* __restrict__ absmax,
                unsigned long long* __restrict__ err, int64_t n_blocks) {
    constexpr int kMids = (1 << BITS) - 1;
    // Decision thresholds, computed exactly as the reference does (fp32 add, then * 0.5),
    // kept in registers: the code search below is kMids compare-and-adds with no memory.
    __shared__ float s_mid[kMids];
    if (threadIdx.x < kMids)
        s_mid[threadIdx.x] = __fmul_rn(
            __fadd_rn(cb_value(codebook, threadIdx.x), cb_value(codebook, threadIdx.x + 1)), 0.5f);
    __syncthreads();
    float mid[kMids];
#pragma unroll
    for (int j = 0; j < kMids; ++j) mid[j] = s_mid[j];

    const int lane = threadIdx.x & 31;
    const int64_t stride = int64_t{gridDim.x} * kWarpsPerCta;
    for (int64_t blk = int64_t{blockIdx.x} * kWarpsPerCta + threadIdx.x / 32; blk < n_blocks;
         blk += stride) {
        const float w = to_float(weight[blk * kBlock + lane]);  // 64-128 coalesced bytes/warp
        float a = fabsf(w);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(kFullMask, a, o));
        // fmaxf drops NaNs, so non-finite weights are flagged separately.
        const bool nonfinite = __any_sync(kFullMask, !isfinite(w));
        if (lane == 0 && (nonfinite || a > kE4M4Max)) {
            if (nonfinite) {
                atomicMin(&err[0], static_cast<unsigned long long>(blk));
            } else {
                atomicMin(&err[1], static_cast<unsigned long long>(blk));
                atomicAdd(&err[2], 1ull);
            }
        }
        const uint32_t c = e4m4_encode(a);
        const float q = e4m4_to_float(c);
        const float v = q > 0.0f ? __fdiv_rn(w, q) : 0.0f;  // IEEE division, as the reference
        uint32_t code = 0;  // number of midpoints strictly below v: ties take the lower entry
#pragma unroll
        for (int j = 0; j < kMids; ++j) code += mid[j] < v;
        // Bit plane j = bit j of the 32 codes, lane i in bit i: one ballot per plane.
        uint32_t plane = 0;
#pragma unroll
        for (int j = 0; j < BITS; ++j) {
            const uint32_t p = __ballot_sync(kFullMask, (code >> j) & 1u);
            if (lane == j) plane = p;
        }
        if (lane < BITS) qweight[blk * BITS + lane] = plane;
        if (lane == 0) absmax[blk] = static_cast<uint8_t>(c);
    }
}

// One warp per block: lane i decodes weight i. The k plane words and the absmax byte are
// the same address for every lane (one broadcast transaction each); the codebook sits in
// lane registers and is read with a shuffle indexed by the code.
template <typename T, int BITS>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
dequantize_kernel(const uint32_t* __restrict__ qweight, const uint8_t* __restrict__ absmax,
                  const float* __restrict__ codebook, T* __restrict__ out, int64_t n_blocks) {
    const int lane = threadIdx.x & 31;
    const float cb = cb_value(codebook, lane & ((1 << BITS) - 1));
    const int64_t stride = int64_t{gridDim.x} * kWarpsPerCta;
    for (int64_t blk = int64_t{blockIdx.x} * kWarpsPerCta + threadIdx.x / 32; blk < n_blocks;
         blk += stride) {
        uint32_t code = 0;
#pragma unroll
        for (int j = 0; j < BITS; ++j) code |= ((qweight[blk * BITS + j] >> lane) & 1u) << j;
        const float q = e4m4_to_float(absmax[blk]);
        out[blk * kBlock + lane] = from_float<T>(__fmul_rn(__shfl_sync(kFullMask, cb, code), q));
    }
}

// Grid for a grid-stride loop over n_blocks warps: enough CTAs to fill the GPU a few
// times over (the loop absorbs the rest), never more than there is work for.
int grid_for(int64_t n_blocks) {
    int dev = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    const int sms = device_sms(dev);
    const int64_t fill = int64_t{sms} * 16;
    return static_cast<int>(std::min(ceil_div(n_blocks, kWarpsPerCta), fill));
}

template <typename F>
void dispatch_bits(int64_t bits, F&& f) {
    switch (bits) {
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        default: f(std::integral_constant<int, 5>{}); break;  // bits checked by the caller
    }
}

// Calls f with a null pointer of the CUDA element type of t (fp16, bf16 or fp32).
template <typename F>
void dispatch_float(at::ScalarType t, F&& f) {
    switch (t) {
        case at::kHalf: f(static_cast<__half*>(nullptr)); break;
        case at::kBFloat16: f(static_cast<__nv_bfloat16*>(nullptr)); break;
        default: f(static_cast<float*>(nullptr)); break;  // dtype checked by the caller
    }
}

bool is_float_dtype(at::ScalarType t) {
    return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& weight, const at::Tensor& codebook,
                                            int64_t bits) {
    check_bits(bits, "quantize");
    check_codebook(codebook, bits, "quantize");
    TORCH_CHECK(weight.is_cuda() && weight.dim() == 2,
                "kbit::quantize: weight must be a 2-D CUDA tensor [out, in], got ", weight.sizes(),
                " on ", weight.device());
    TORCH_CHECK_TYPE(is_float_dtype(weight.scalar_type()),
                     "kbit::quantize: weight must be float16, bfloat16 or float32, got ",
                     weight.scalar_type());
    TORCH_CHECK_VALUE(weight.size(1) % kBlock == 0, "kbit::quantize: weight has in_features=",
                      weight.size(1), ", not a multiple of 32; leave it unquantized");
    TORCH_CHECK(codebook.device() == weight.device(),
                "kbit::quantize: codebook and weight are on different devices");
    const c10::cuda::CUDAGuard guard(weight.device());
    const at::Tensor w = weight.contiguous();
    const int64_t n = w.size(0), kb = w.size(1) / kBlock, n_blocks = n * kb;
    at::Tensor qweight = at::empty({n, kb * bits}, w.options().dtype(at::kInt));
    at::Tensor absmax = at::empty({n, kb}, w.options().dtype(at::kByte));
    if (n_blocks == 0) return {qweight, absmax};

    constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
    at::Tensor err = at::full({3}, kNone, w.options().dtype(at::kLong));
    err.narrow(0, 2, 1).zero_();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    dispatch_float(w.scalar_type(), [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        dispatch_bits(bits, [&](auto b) {
            quantize_kernel<T, decltype(b)::value><<<grid_for(n_blocks), kWarpsPerCta * 32, 0, stream>>>(
                reinterpret_cast<const T*>(w.data_ptr()), codebook.data_ptr<float>(),
                reinterpret_cast<uint32_t*>(qweight.data_ptr<int32_t>()), absmax.data_ptr<uint8_t>(),
                reinterpret_cast<unsigned long long*>(err.data_ptr<int64_t>()), n_blocks);
        });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    // One sync (load time only) to turn the device flags into the reference's errors.
    const at::Tensor h = err.cpu();
    const int64_t* e = h.data_ptr<int64_t>();
    if (e[0] != kNone) {
        const int64_t row = e[0] / kb, col = e[0] % kb * kBlock;
        TORCH_CHECK_VALUE(false, "kbit::quantize: weight has non-finite values (first at row ", row,
                          ", columns ", col, "..", col + kBlock - 1, "); it cannot be quantized");
    }
    if (e[1] != kNone) {
        const int64_t row = e[1] / kb, col = e[1] % kb * kBlock;
        const float amax = w[row].narrow(0, col, kBlock).abs().max().item<float>();
        TORCH_CHECK_VALUE(false, "kbit::quantize: weight has ", e[2],
                          " block(s) with absmax above 31 (the E4M4 maximum), e.g. ", amax,
                          " at row ", row, ", columns ", col, "..", col + kBlock - 1,
                          "; leave this module unquantized (modules_to_not_convert / --skip)");
    }
    return {qweight, absmax};
}

at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& absmax,
                      const at::Tensor& codebook, int64_t bits, at::ScalarType dtype) {
    check_bits(bits, "dequantize");
    check_codebook(codebook, bits, "dequantize");
    TORCH_CHECK_TYPE(is_float_dtype(dtype),
                     "kbit::dequantize: dtype must be float16, bfloat16 or float32, got ", dtype);
    TORCH_CHECK(absmax.is_cuda() && absmax.scalar_type() == at::kByte && absmax.dim() == 2,
                "kbit::dequantize: weight_absmax must be a 2-D CUDA uint8 tensor, got ",
                absmax.scalar_type(), " ", absmax.sizes());
    const int64_t n = absmax.size(0), kb = absmax.size(1), n_blocks = n * kb;
    TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.dim() == 2 &&
                    qweight.size(0) == n && qweight.size(1) == kb * bits,
                "kbit::dequantize: qweight must be CUDA int32 [", n, ", ", kb * bits,
                "] to match weight_absmax ", absmax.sizes(), " at bits=", bits, ", got ",
                qweight.scalar_type(), " ", qweight.sizes());
    TORCH_CHECK(qweight.device() == absmax.device() && codebook.device() == absmax.device(),
                "kbit::dequantize: qweight, weight_absmax and codebook are on different devices");
    const c10::cuda::CUDAGuard guard(qweight.device());
    const at::Tensor q = qweight.contiguous(), a = absmax.contiguous();
    at::Tensor out = at::empty({n, kb * kBlock}, q.options().dtype(dtype));
    if (n_blocks == 0) return out;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    dispatch_float(dtype, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        dispatch_bits(bits, [&](auto b) {
            dequantize_kernel<T, decltype(b)::value><<<grid_for(n_blocks), kWarpsPerCta * 32, 0, stream>>>(
                reinterpret_cast<const uint32_t*>(q.data_ptr<int32_t>()), a.data_ptr<uint8_t>(),
                codebook.data_ptr<float>(), reinterpret_cast<T*>(out.data_ptr()), n_blocks);
        });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}

}  // namespace kbit
