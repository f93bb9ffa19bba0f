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
// mma.cu: does kbit::mma take the warp-specialized kernel by default for this M, n, k on x's GPU?
bool wgmma2_by_default(const at::Tensor& x, int64_t M, int64_t n, int64_t bits);
// linear.cu: picks gemv / mma / dequantize_tiled + cuBLAS from M (KBIT_FORCE_KERNEL overrides).
at::Tensor linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
                  const at::Tensor& codebook, int64_t bits, int64_t n);
// linear.cu: does kbit::linear take the GEMV for this M (KBIT_FORCE_KERNEL included)?
bool linear_uses_gemv(int64_t m, int64_t n, int64_t bits);
// fused_linear.cu: kbit::linear of rms_norm(x + residual) * norm_weight (vLLM's
// fused_add_rms_norm), returning (y, x + residual); and kbit::linear of silu(h[:, :K]) *
// h[:, K:] (SiluAndMul). Contracts in vllm_kbit/reference.py.
std::tuple<at::Tensor, at::Tensor> linear_add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits,
    int64_t n);
at::Tensor linear_silu_mul(const at::Tensor& h, const at::Tensor& qweight,
                           const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits,
                           int64_t n);
// gemv.cu: the GEMV with the op folded into its x staging (residual set: add + rms norm, writing
// residual_out; else silu-and-mul of h = x [M, 2K]). gemv_fused_takes: M <= 8 and 16-byte
// aligned rows; the fused ops check the tensors themselves.
bool gemv_fused_takes(const at::Tensor& x, const at::Tensor* residual,
                      const at::Tensor* norm_weight);
at::Tensor gemv_fused(const at::Tensor& x, const at::Tensor* residual, at::Tensor* residual_out,
                      const at::Tensor* norm_weight, double eps, const at::Tensor& qweight,
                      const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits,
                      int64_t n);
// dense_gemv.cu: y[M, n] = x[M, K] @ weight^T for an unquantized fp16/bf16 weight [n, K]: a
// streaming GEMV at M <= 4 (dense_gemv_takes: also aligned, unit-stride rows), else at::linear.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight);
bool dense_gemv_takes(const at::Tensor& x, const at::Tensor& weight);
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
// moe_wgmma.cu: kbit::moe's many-tokens path on sm_90 (moe.cu routes, gathers and combines):
// one grouped GEMM over the slots' rows in expert order, through the warp-specialized wgmma
// kernel. moe_wgmma_usable: the build has sm_90a code and x's GPU is an sm_90.
struct MoeWgGemm {
    at::Tensor x;  // [rows, K] contiguous: gate_up = the slots' x rows, down = act rows
    const at::Tensor *qweight, *absmax, *codebook;  // [E, words], [E, absmax bytes], [2^bits]
    int64_t bits, n;       // n: I (gate_up: act columns) or H (down)
    bool gate_up;
    const void* tiles;     // int4 [max_tiles] {expert, first row, rows <= tn, 0}
    const int* num_tiles;  // [1], device
    int64_t max_tiles;
    const int* sorted;     // row -> slot
    const float* topk_w;   // [S]
    int topk, act, tn;     // tn: x rows (slots) per tile: 128 (256 weight rows per CTA) or
                           // moe_wide_tile(bits) (128 weight rows)
    bool weight_on_input, atomic;
    void* out;  // gate_up: act [rows, I] x.dtype; down: fp32 [T, H] (atomic) or [S, H]
    float* zero = nullptr;   // gate_up: cleared by its CTAs (the down GEMM's atomic accumulator)
    int64_t zero_count = 0;  // floats, a multiple of 4
};
// The wide tile's slots: 256, or 224 at k = 5 (see moe_wgmma.cu's run_bits).
constexpr int moe_wide_tile(int64_t bits) { return bits == 5 ? 224 : 256; }
bool moe_wgmma_usable(const at::Tensor& x);
void moe_wgmma_gemm(const MoeWgGemm& g);

}  // namespace kbit
