// SPDX-License-Identifier: Apache-2.0
// Host entry points of every kbit CUDA op. Schemas live in vllm_kbit/_ops.py; layouts in
// docs/format.md. Each function is implemented in the .cu file named in its comment.
#pragma once
#include <torch/all.h>

#include <optional>
#include <tuple>

namespace kbit {

// quantize.cu: W[N, K] fp16/bf16/fp32 -> (qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]).
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& weight, const at::Tensor& codebook,
                                            int64_t bits);
// quantize.cu: checkpoint layout -> W[N, K] in dtype (fp16/bf16/fp32).
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& absmax,
                      const at::Tensor& codebook, int64_t bits, at::ScalarType dtype);
// repack.cu: checkpoint layout -> runtime tiled layout (1-D int32, 1-D uint8).
std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& qweight, const at::Tensor& absmax,
                                          int64_t bits);
// dequant_tiled.cu: tiled layout -> W[n, k] in dtype; near memory bandwidth (large-M path).
at::Tensor dequantize_tiled(const at::Tensor& qweight, const at::Tensor& absmax,
                            const at::Tensor& codebook, int64_t bits, int64_t n, int64_t k,
                            at::ScalarType dtype);
// gemv.cu: y[M, n] = x[M, K] @ W^T for small M (CUDA cores).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
                const at::Tensor& codebook, int64_t bits, int64_t n);
// mma.cu: y[M, n] = x[M, K] @ W^T with tensor cores, dequantization fused (mid M).
at::Tensor mma(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
               const at::Tensor& codebook, int64_t bits, int64_t n);
// wgmma_gemm.cu: not an op but kbit::mma's KBIT_MMA_WGMMA=2 path (the warp-specialized sm_90a
// kernel) writing y[M, n]; the caller has checked the tensors and 16-byte aligned x's rows.
void wgmma_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
                const at::Tensor& codebook, int64_t bits, at::Tensor& y);
// mma.cu: does kbit::mma take the warp-specialized kernel by default for this M, n on x's GPU?
bool wgmma2_by_default(const at::Tensor& x, int64_t M, int64_t n);
// linear.cu: picks gemv / mma / dequantize_tiled + cuBLAS from M (KBIT_FORCE_KERNEL overrides).
at::Tensor linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
                  const at::Tensor& codebook, int64_t bits, int64_t n);
// moe.cu: routed experts of one MoE layer (gate_up + gated activation + down + top-k weighted
// sum) on per-expert tiled weights [E, words]; contract in vllm_kbit/reference_moe.py.
at::Tensor moe(const at::Tensor& x, const at::Tensor& w13_qweight, const at::Tensor& w13_absmax,
               const at::Tensor& w2_qweight, const at::Tensor& w2_absmax,
               const at::Tensor& codebook, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids, const std::optional<at::Tensor>& expert_map,
               int64_t bits, int64_t inter_size, c10::string_view activation,
               bool apply_router_weight_on_input);
// moe_gemv.cu: kbit::moe's decode path (T tokens, top-k of global_experts): does it take this
// call? And the path itself, on arguments kbit::moe has checked (x with unit column stride,
// ids / tw contiguous, emap undefined or int32, y [T, H] to fill).
bool moe_gemv_takes(int64_t T, int64_t topk, int64_t global_experts);
void moe_gemv(const at::Tensor& x, at::Tensor& y, const at::Tensor& ids, const at::Tensor& tw,
              const at::Tensor& emap, const at::Tensor& w13q, const at::Tensor& w13a,
              const at::Tensor& w2q, const at::Tensor& w2a, const at::Tensor& codebook,
              int64_t bits, int64_t I, int act, bool weight_on_input);

}  // namespace kbit
