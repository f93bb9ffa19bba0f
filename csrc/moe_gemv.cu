// SPDX-License-Identifier: Apache-2.0
// kbit::moe's decode path (few slots, see moe_gemv_takes): the MoE layer as two
// launches of the GEMV kernel (gemv.cuh, modes kMoeGateUp / kMoeDown) instead of the grouped
// MMA kernels of moe.cu (routing, gate_up, down, combine).
//
// Why: at decode each expert gets ~1 slot, so the grouped kernel's CTAs each stream one
// expert's tiles with 8 token columns of which one is used, and the layer is 3-4 dependent
// launches; Qwen3-30B-A3B at T = 1 ran at ~0.66 TB/s of weights (30 us for 20 MB,
// benchmarks/results/bench_moe_h100__s5.md). The GEMV spreads the tiles of all slots over
// every SM, fuses the gated activation into the down kernel's staging of its input and the
// top-k weighted sum into the down kernel's K reduction: 2 launches, no routing pass, no
// atomics, deterministic.
//
//   gate_up: h[s, :] = x[s / topk] @ W13[e(s)]^T                    (rows S x 2I, K = H)
//   down:    out[t, :] = sum_j w[t, j] * act(h_gate) * h_up @ W2[e(t, j)]^T
//                                                                   (rows T x H, K' = topk I)
// Measured alternative, not kept: both GEMVs in one cooperative launch with a grid barrier was
// 1-2 us slower per layer than these two launches (bench_moe_h100_s10b.md, branch
// s10-moe-fused).
#include "gemv.cuh"

namespace kbit {

bool moe_gemv_takes(int64_t T, int64_t topk, int64_t global_experts) {
    const int64_t S = T * topk;
    if (S > kMoeMaxSlots || T > kMaxM) return false;
    // KBIT_MOE_GEMV_MAX_SLOTS (tests, benchmarks) replaces the default rule by S <= its value.
    if (const char* v = std::getenv("KBIT_MOE_GEMV_MAX_SLOTS"); v != nullptr && *v != '\0')
        return S <= std::atoi(v);
    // Default, from the H100 crossover (benchmarks/results/bench_moe_h100_s10.md): each slot is
    // its own GEMV, so two tokens routed to one expert read it twice, where the grouped kernel
    // reads it once for both. With few experts per slot that happens often and the grouped
    // kernel wins from T = 2 on (Mixtral, 8 experts top-2: 184 vs 153 us at T = 2, k = 4); with
    // many (Qwen3-30B-A3B, 128 top-8) the GEMV wins up to 16 slots at every k (T = 1, k = 4:
    // 19.8 vs 25.0 us) and loses at 32 for k = 2, 3 (k = 2: 51.8 vs 41.5 us).
    return S <= 16 && (T == 1 || global_experts >= 4 * S);
}

void moe_gemv(const at::Tensor& x, at::Tensor& y, const at::Tensor& ids, const at::Tensor& tw,
              const at::Tensor& emap, const at::Tensor& w13q, const at::Tensor& w13a,
              const at::Tensor& w2q, const at::Tensor& w2a, const at::Tensor& codebook,
              int64_t bits, int64_t I, int act, bool weight_on_input) {
    const int64_t T = x.size(0), H = x.size(1), topk = ids.size(1), S = T * topk,
                  E = w13q.size(0);
    TORCH_CHECK(S <= kMoeMaxSlots && T <= kMaxM, "kbit::moe: the GEMV path takes at most ",
                kMoeMaxSlots, " slots and ", kMaxM, " tokens, got T=", T, ", topk=", topk);
    // The kernel splits n-tiles over groups in 32-bit arithmetic (n_tiles * groups < 2^32).
    TORCH_CHECK(S * 2 * I < (int64_t{1} << 26) && T * H < (int64_t{1} << 26),
                "kbit::moe: layer too large for the GEMV path (S=", S, ", I=", I, ", H=", H, ")");
    const TiledShape s13(2 * I, H, bits), s2(H, I, bits);
    // The stream keeps 32-bit offsets in 8-byte (planes) and 4-byte (absmax) units.
    TORCH_CHECK(E * s13.words / 2 < (int64_t{1} << 32) && E * s2.words / 2 < (int64_t{1} << 32),
                "kbit::moe: expert weights too large for the GEMV path (E=", E, ")");
    const c10::cuda::CUDAGuard guard(x.device());
    const GemvDevice d = gemv_device(x, "moe");
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    // The down kernel is launched with PDL (sm_90): its CTAs may start their prologue (table,
    // the slots' experts, first weight tiles) as gate_up's CTAs exit; it reads h only after
    // pdl_wait. KBIT_MOE_NO_PDL=1 turns it off, as in moe.cu.
    const bool pdl = env_int("KBIT_MOE_NO_PDL", 0) == 0;

    MoeArgs mo{};
    if (ids.scalar_type() == at::kLong) mo.ids64 = ids.data_ptr<int64_t>();
    else mo.ids32 = ids.data_ptr<int32_t>();
    mo.emap = emap.defined() ? emap.data_ptr<int32_t>() : nullptr;
    mo.emap_n = emap.defined() ? static_cast<int>(emap.numel()) : 0;
    mo.topk_w = tw.data_ptr<float>();
    mo.S = static_cast<int>(S), mo.topk = static_cast<int>(topk), mo.E = static_cast<int>(E);
    mo.I = static_cast<int>(I);
    mo.act = act;
    mo.weight_on_input = weight_on_input;

    Params base{};
    base.cb = codebook.data_ptr<float>();
    base.M = 1;  // each virtual row is one slot's (gate_up) or one token's (down) output
    base.Mx = static_cast<int>(T);

    // gate_up: rows (slot, 2I), K = H, x = the T token rows.
    at::Tensor h = at::empty({S, 2 * I}, x.options());
    at::Tensor ws1, arrived1;
    MoeArgs mo1 = mo;
    mo1.q_expert = static_cast<uint32_t>(s13.words / 2);
    mo1.a_expert = static_cast<uint32_t>(s13.absmax_bytes / 4);
    mo1.nte = static_cast<int>(s13.n_tiles), mo1.kte = static_cast<int>(s13.k_tiles);
    Params p1 = base;
    p1.qw = reinterpret_cast<const uint32_t*>(w13q.data_ptr<int32_t>());
    p1.am = w13a.data_ptr<uint8_t>();
    p1.x = x.data_ptr();
    p1.sx = x.stride(0);
    p1.y = h.data_ptr();
    p1.K = static_cast<int>(H);
    p1.n = static_cast<int>(S * 2 * I);
    p1.n_tiles = static_cast<int>(S * s13.n_tiles);
    p1.k_tiles = static_cast<int>(s13.k_tiles);
    p1.x_vec = rows_aligned16(x);
    const Plan plan1 = make_plan(1, T, p1.n_tiles, p1.k_tiles, bits, d.sms, d.smem_max);
    TORCH_CHECK(plan1.splits > 0, "kbit::moe: not enough shared memory for the GEMV path");
    apply_plan(p1, plan1, x, ws1, arrived1);

    // down: rows (token, H), K' = topk x I (each slot's I padded to whole k-tiles), x' staged
    // from h; y = the layer output.
    at::Tensor ws2, arrived2;
    MoeArgs mo2 = mo;
    mo2.h = h.data_ptr();
    mo2.q_expert = static_cast<uint32_t>(s2.words / 2);
    mo2.a_expert = static_cast<uint32_t>(s2.absmax_bytes / 4);
    mo2.nte = static_cast<int>(s2.n_tiles), mo2.kte = static_cast<int>(s2.k_tiles);
    Params p2 = base;
    p2.qw = reinterpret_cast<const uint32_t*>(w2q.data_ptr<int32_t>());
    p2.am = w2a.data_ptr<uint8_t>();
    p2.y = y.data_ptr();
    p2.K = static_cast<int>(topk * s2.kp);
    p2.n = static_cast<int>(T * H);
    p2.n_tiles = static_cast<int>(T * s2.n_tiles);
    p2.k_tiles = static_cast<int>(topk * s2.k_tiles);
    const Plan plan2 = make_plan(1, T, p2.n_tiles, p2.k_tiles, bits, d.sms, d.smem_max);
    TORCH_CHECK(plan2.splits > 0, "kbit::moe: not enough shared memory for the GEMV path");
    apply_plan(p2, plan2, x, ws2, arrived2);

    if (bf16) {
        launch_bits<__nv_bfloat16, kMoeGateUp>(bits, p1, mo1, XPro{}, plan1, d, false, stream);
        launch_bits<__nv_bfloat16, kMoeDown>(bits, p2, mo2, XPro{}, plan2, d, pdl, stream);
    } else {
        launch_bits<__half, kMoeGateUp>(bits, p1, mo1, XPro{}, plan1, d, false, stream);
        launch_bits<__half, kMoeDown>(bits, p2, mo2, XPro{}, plan2, d, pdl, stream);
    }
}

}  // namespace kbit
