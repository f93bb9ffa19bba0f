// SPDX-License-Identifier: Apache-2.0
// kbit::gemv: y[M, n] = x[M, K] @ W^T for decode batches M <= 8 (the kernel and its design:
// gemv.cuh; kbit::moe's decode path runs the same kernel over the routed experts, moe_gemv.cu).
#include "gemv.cuh"

namespace kbit {

namespace {

// kbit::gemv, and with xp.mode != kXPlain its fused forms (gemv_fused): K = the GEMV's K (x has
// 2K columns for kXSiluMul).
at::Tensor gemv_run(const at::Tensor& x, int64_t K, const XPro& xp, const at::Tensor& qweight,
                    const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits,
                    int64_t n) {
    check_activation(x, qweight, "gemv");
    const int64_t M = x.size(0);
    TORCH_CHECK(M <= kMaxM, "kbit::gemv: x has M=", M, " rows, the GEMV kernel takes at most ",
                kMaxM, " (use kbit::mma or kbit::linear for larger batches)");
    const TiledShape shape = check_tiled(qweight, absmax, bits, n, K, "gemv");
    check_codebook(codebook, bits, "gemv");
    TORCH_CHECK(absmax.device() == qweight.device() && codebook.device() == qweight.device(),
                "kbit::gemv: qweight, weight_absmax and codebook must be on the same device");
    // The kernel keeps 32-bit offsets in 8-byte units and 32-bit unit counters.
    TORCH_CHECK(shape.n_tiles * shape.k_tiles * bits * 32 < (int64_t{1} << 32), "kbit::gemv: ",
                n, " x ", K, " weight is too large");
    TORCH_CHECK(aligned(qweight, 8) && aligned(absmax, 4),
                "kbit::gemv: qweight must be 8-byte and weight_absmax 4-byte aligned");
    at::Tensor y = at::empty({M, n}, x.options());
    if (M == 0) return y;

    const c10::cuda::CUDAGuard guard(x.device());
    const GemvDevice d = gemv_device(x, "gemv");
    // KBIT_GEMV_PAIR: 0 = single n-tiles only, 1 = paired wherever n_tiles is even (tuning and
    // test hook; default: the cost model's choice, see kDensePair in gemv.cuh)
    const int pair_env = env_int("KBIT_GEMV_PAIR", -1);
    TORCH_CHECK(pair_env >= -1 && pair_env <= 1,
                "kbit::gemv: KBIT_GEMV_PAIR must be 0 or 1 (unset: the cost model), got ", pair_env);
    const PairMode pair_mode = pair_env == 0   ? PairMode::kNever
                               : pair_env == 1 ? PairMode::kAlways
                                               : PairMode::kAuto;
    const Plan plan =
        make_plan(M, M, shape.n_tiles, shape.k_tiles, bits, d.sms, d.smem_max, pair_mode);
    TORCH_CHECK(plan.splits > 0, "kbit::gemv: not enough shared memory (", d.smem_max,
                " B per block) for M=", M);
    // The kernel splits n-tiles over groups in 32-bit arithmetic.
    TORCH_CHECK(shape.n_tiles * plan.groups < (int64_t{1} << 32), "kbit::gemv: n=", n,
                " is too large");

    Params p{};
    p.qw = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
    p.am = absmax.data_ptr<uint8_t>();
    p.cb = codebook.data_ptr<float>();
    p.x = x.data_ptr();
    p.y = y.data_ptr();
    p.sx = x.stride(0);
    p.M = p.Mx = static_cast<int>(M);
    p.K = static_cast<int>(K);
    p.n = static_cast<int>(n);
    p.n_tiles = static_cast<int>(shape.n_tiles);
    p.k_tiles = static_cast<int>(shape.k_tiles);
    p.x_vec = rows_aligned16(x);
    at::Tensor ws, arrived;
    apply_plan(p, plan, x, ws, arrived);
    // sm_90: programmatic dependent launch (pdl_requested, KBIT_PDL=0 turns it off), so that the
    // table fill and the first weight loads overlap the previous kernel's tail (see pdl_wait).
    const bool pdl = pdl_requested();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const bool half = x.scalar_type() == at::kHalf;
    if (plan.pair && half)
        launch_bits<__half, kDensePair>(bits, p, MoeArgs{}, xp, plan, d, pdl, stream);
    else if (plan.pair)
        launch_bits<__nv_bfloat16, kDensePair>(bits, p, MoeArgs{}, xp, plan, d, pdl, stream);
    else if (half)
        launch_bits<__half, kDense>(bits, p, MoeArgs{}, xp, plan, d, pdl, stream);
    else
        launch_bits<__nv_bfloat16, kDense>(bits, p, MoeArgs{}, xp, plan, d, pdl, stream);
    return y;
}

}  // namespace

at::Tensor gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
                const at::Tensor& codebook, int64_t bits, int64_t n) {
    return gemv_run(x, x.size(1), XPro{}, qweight, absmax, codebook, bits, n);
}

bool gemv_fused_takes(const at::Tensor& x, const at::Tensor* residual,
                      const at::Tensor* norm_weight) {
    // Every prologue access is 8 elements (16 bytes) wide.
    if (x.size(0) > kMaxM || !rows_aligned16(x)) return false;
    if (residual != nullptr && !rows_aligned16(*residual)) return false;
    return norm_weight == nullptr || aligned(*norm_weight, 16);
}

at::Tensor gemv_fused(const at::Tensor& x, const at::Tensor* residual, at::Tensor* residual_out,
                      const at::Tensor* norm_weight, double eps, const at::Tensor& qweight,
                      const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits,
                      int64_t n) {
    TORCH_CHECK(gemv_fused_takes(x, residual, norm_weight),
                "kbit::gemv_fused: the caller must check gemv_fused_takes first");
    XPro xp;
    xp.kb1 = env_int("KBIT_GEMV_XPRO_KB1", 1) != 0;  // tuning and test hook (gemv.cuh, stage_xpro)
    int64_t K = x.size(1);
    if (residual != nullptr) {
        xp.mode = kXAddNorm;
        xp.res = residual->data_ptr();
        xp.res_out = residual_out->data_ptr();
        xp.nw = norm_weight->data_ptr();
        xp.sres = residual->stride(0);
        xp.eps = static_cast<float>(eps);
    } else {
        xp.mode = kXSiluMul;
        K /= 2;
    }
    return gemv_run(x, K, xp, qweight, absmax, codebook, bits, n);
}

}  // namespace kbit
