// SPDX-License-Identifier: Apache-2.0
// kbit::linear_add_rms_norm and kbit::linear_silu_mul: kbit::linear with the elementwise op
// that feeds it in a decoder layer folded in (vLLM's fused_add_rms_norm before qkv_proj and
// gate_up_proj, SiluAndMul before down_proj; vllm_kbit/fusion.py rewrites the compiled graph).
// Where kbit::linear takes the GEMV (M <= 8), the GEMV kernel computes the op while it stages x
// (gemv.cuh, XPro): one kernel instead of two, and the GEMV follows the previous kbit kernel
// directly, so programmatic dependent launch overlaps them. Elsewhere the op runs as its own
// kernel below, then kbit::linear. Contract: vllm_kbit/reference.py (linear_add_rms_norm,
// linear_silu_mul).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kbit_format.cuh"
#include "ops.h"

namespace kbit {
namespace {

constexpr int kNormThreads = 256;

template <typename T>
__device__ __forceinline__ float to_f(T v) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
    else return __half2float(v);
}
template <typename T>
__device__ __forceinline__ T from_f(float v) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
    else return __float2half_rn(v);
}

// One CTA per token row: v = x + res in fp32, res_out = T(v), out = T(T(v * rsqrt(mean(v^2) +
// eps)) * w) (vLLM's fused_add_rms_norm). Rows are 8-32 KB: the second pass re-reads them from L1.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    add_rms_norm_kernel(const T* x, int64_t sx, const T* res, int64_t sres, const T* w, T* out,
                        T* res_out, int K, float eps) {
    __shared__ float warp_ss[kNormThreads / 32];
    const int64_t m = blockIdx.x;
    x += m * sx, res += m * sres, out += m * K, res_out += m * K;
    float ss = 0.f;
    for (int c = threadIdx.x; c < K; c += kNormThreads) {
        const float v = to_f(x[c]) + to_f(res[c]);
        ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) warp_ss[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kNormThreads / 32; ++i) total += warp_ss[i];
    const float rinv = rsqrtf(total / static_cast<float>(K) + eps);
    for (int c = threadIdx.x; c < K; c += kNormThreads) {
        const float v = to_f(x[c]) + to_f(res[c]);
        res_out[c] = from_f<T>(v);
        out[c] = from_f<T>(to_f(from_f<T>(v * rinv)) * to_f(w[c]));
    }
}

// out[m, c] = T(T(silu(h[m, c])) * h[m, K + c]) (vLLM's SiluAndMul), grid-stride.
template <typename T>
__global__ void silu_mul_kernel(const T* h, int64_t sh, T* out, int64_t M, int K) {
    const int64_t total = M * K;
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
         i += int64_t{gridDim.x} * blockDim.x) {
        const int64_t m = i / K, c = i - m * K;
        const T* row = h + m * sh;
        out[i] = from_f<T>(to_f(from_f<T>(act_fn(to_f(row[c]), kSilu))) * to_f(row[K + c]));
    }
}

// f(static_cast<T*>(nullptr)) with T = x's 16-bit float type (the callers checked fp16 / bf16).
template <typename F>
void dispatch_half(const at::Tensor& x, F&& f) {
    if (x.scalar_type() == at::kHalf) f(static_cast<__half*>(nullptr));
    else f(static_cast<__nv_bfloat16*>(nullptr));
}

// KBIT_FUSED_GEMV=0: never fold the op into the GEMV (A/B and test hook; read per call).
bool fused_gemv_enabled() { return env_int("KBIT_FUSED_GEMV", 1) != 0; }

void check_same(const at::Tensor& t, const at::Tensor& x, const char* name, const char* op) {
    TORCH_CHECK(t.is_cuda() && t.get_device() == x.get_device(), "kbit::", op, ": ", name,
                " must be a CUDA tensor on x's device");
    TORCH_CHECK(t.scalar_type() == x.scalar_type(), "kbit::", op, ": ", name, " must have x's dtype ",
                x.scalar_type(), ", got ", t.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_add_rms_norm(
    const at::Tensor& x_in, const at::Tensor& residual_in, const at::Tensor& norm_weight,
    double eps, const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook,
    int64_t bits, int64_t n) {
    constexpr const char* op = "linear_add_rms_norm";
    TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2, "kbit::", op,
                ": x must be a 2-D CUDA tensor [M, K], got ", x_in.sizes());
    const c10::cuda::CUDAGuard guard(x_in.device());
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    const at::Tensor residual = residual_in.stride(-1) == 1 ? residual_in : residual_in.contiguous();
    check_activation(x, qweight, op);
    const int64_t M = x.size(0), K = x.size(1);
    check_same(residual, x, "residual", op);
    TORCH_CHECK(residual.sizes() == x.sizes(), "kbit::", op, ": residual must have x's shape ",
                x.sizes(), ", got ", residual.sizes());
    check_same(norm_weight, x, "norm_weight", op);
    TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == K && norm_weight.is_contiguous(),
                "kbit::", op, ": norm_weight must be contiguous [", K, "], got ",
                norm_weight.sizes());
    TORCH_CHECK(eps >= 0.0, "kbit::", op, ": eps must be >= 0, got ", eps);
    check_tiled(qweight, absmax, bits, n, K, op);
    check_codebook(codebook, bits, op);
    at::Tensor res_out = at::empty({M, K}, x.options());
    if (M == 0) return {at::empty({0, n}, x.options()), res_out};
    if (fused_gemv_enabled() && linear_uses_gemv(M, n, bits) &&
        gemv_fused_takes(x, &residual, &norm_weight))
        return {gemv_fused(x, &residual, &res_out, &norm_weight, eps, qweight, absmax, codebook,
                           bits, n),
                res_out};
    at::Tensor xn = at::empty({M, K}, x.options());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    dispatch_half(x, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        add_rms_norm_kernel<T><<<M, kNormThreads, 0, stream>>>(
            static_cast<const T*>(x.data_ptr()), x.stride(0),
            static_cast<const T*>(residual.data_ptr()), residual.stride(0),
            static_cast<const T*>(norm_weight.data_ptr()), static_cast<T*>(xn.data_ptr()),
            static_cast<T*>(res_out.data_ptr()), static_cast<int>(K), static_cast<float>(eps));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {linear(xn, qweight, absmax, codebook, bits, n), res_out};
}

at::Tensor linear_silu_mul(const at::Tensor& h_in, const at::Tensor& qweight,
                           const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits,
                           int64_t n) {
    constexpr const char* op = "linear_silu_mul";
    TORCH_CHECK(h_in.is_cuda() && h_in.dim() == 2 && h_in.size(1) % 2 == 0, "kbit::", op,
                ": h must be a 2-D CUDA tensor [M, 2K] (gate, up), got ", h_in.sizes());
    const c10::cuda::CUDAGuard guard(h_in.device());
    const at::Tensor h = h_in.stride(1) == 1 ? h_in : h_in.contiguous();
    check_activation(h, qweight, op);
    const int64_t M = h.size(0), K = h.size(1) / 2;
    check_tiled(qweight, absmax, bits, n, K, op);
    check_codebook(codebook, bits, op);
    if (M == 0) return at::empty({0, n}, h.options());
    if (fused_gemv_enabled() && linear_uses_gemv(M, n, bits) &&
        gemv_fused_takes(h, nullptr, nullptr))
        return gemv_fused(h, nullptr, nullptr, nullptr, 0.0, qweight, absmax, codebook, bits, n);
    at::Tensor a = at::empty({M, K}, h.options());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(M * K, 256), 8 * 1024));
    dispatch_half(h, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        silu_mul_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(h.data_ptr()),
                                                       h.stride(0), static_cast<T*>(a.data_ptr()),
                                                       M, static_cast<int>(K));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return linear(a, qweight, absmax, codebook, bits, n);
}

}  // namespace kbit
