// SPDX-License-Identifier: Apache-2.0
// kbit::moe's many-tokens-per-expert path on sm_90 (moe.cu decides, routes, gathers and
// combines): the two grouped GEMMs as launches of the warp-specialized wgmma kernel
// (wgmma_gemm.cuh, GM = kMoeGateUp / kMoeDown), one CTA per (row group, routing tile).
//
// Why: with hundreds of slots per expert the layer is compute bound, and the mma.sync grouped
// kernel of moe.cu (TM <= 64 slots per tile, the dequantization repeated for every tile) runs
// far below tensor-core peak: Qwen3-30B-A3B shape, H100, T = 4096: 1.85 ms, vs 0.92 ms for vLLM's
// bf16 fused_experts (bench_moe_h100__s5_largem.md); dequantizing all experts first and running
// fused_experts cost 1.47 ms. The wgmma kernel dequantizes each weight tile once per TN = 64..256
// slots, in registers, while the tensor cores run asynchronously (dense M = 1024 on Llama-3.1-8B
// shapes: ~590 TFLOPS, bench_linear_h100__s7_c2w.md).
#include "wgmma_gemm.cuh"

namespace kbit {
namespace {

#if defined(KBIT_SM90A)

template <int BITS, int C, bool BF16, int GM>
void run_group(const MoeWgGemm& g) {
    constexpr int RWG = wg::config_rwg(C), TN = wg::config_tn(C);
    using L = wg::StageLayout<BITS, RWG, TN>;
    const WgConfig c = configure<BITS, RWG, TN, BF16, GM>(g.x.get_device());
    const int64_t K = g.x.size(1);
    const TiledShape s(GM == kMoeGateUp ? 2 * g.n : g.n, K, BITS);
    WgParams p{};
    p.xmap = x_tensor_map(g.x, TN);
    p.qw = reinterpret_cast<const uint8_t*>(g.qweight->data_ptr<int32_t>());
    p.am = g.absmax->data_ptr<uint8_t>();
    p.cb = g.codebook->data_ptr<float>();
    p.M = static_cast<int>(g.x.size(0)), p.n = static_cast<int>(g.n), p.K = static_cast<int>(K);
    // gate_up: tiles are counted in gate tiles (I / 16); a CTA takes kTiles / 2 of them and
    // the matching up tiles.
    p.n_tiles = static_cast<int>(GM == kMoeGateUp ? s.n_tiles / 2 : s.n_tiles);
    p.k_tiles = static_cast<int>(s.k_tiles);
    p.kchunk = p.k_tiles, p.splits = 1, p.stages = c.stages, p.mode = kDirect;
    p.copies_log2 = c.copies_log2, p.table_bytes = c.table_bytes;
    WgMoe mo{};
    mo.xmap_q = x_tensor_map(g.x, TN / 4);
    mo.tiles = static_cast<const int4*>(g.tiles);
    mo.num_tiles = g.num_tiles;
    mo.sorted = g.sorted;
    mo.qw_expert = s.words * 4, mo.am_expert = s.absmax_bytes;
    mo.topk_w = g.topk_w;
    mo.out = g.out;
    mo.zero = reinterpret_cast<float4*>(g.zero), mo.zero_count = g.zero_count / 4;
    mo.topk = g.topk, mo.weight_on_input = g.weight_on_input, mo.act = g.act;
    mo.out_mode = g.atomic ? kMoeAtomic : kMoeRows;
    // The weights as two TMA boxes per stage (expert_tile_map) rather than 2 kTiles bulk copies
    // of one tile each; KBIT_WG_TILE_COPIES=1 keeps the copies (A/B and test hook).
    const int tile_copies = env_int("KBIT_WG_TILE_COPIES", 0);
    TORCH_CHECK(tile_copies == 0 || tile_copies == 1,
                "kbit::moe: KBIT_WG_TILE_COPIES must be 0 or 1, got ", tile_copies);
    mo.tile_copies = tile_copies;
    // gate_up: a CTA's stage holds kTiles / 2 gate tiles and the matching up tiles.
    constexpr int kHalves = GM == kMoeGateUp ? 2 : 1, kPerCta = L::kTiles / kHalves;
    if (!tile_copies) {
        const int64_t E = g.qweight->size(0);
        p.wmap = expert_tile_map(p.qw, E, mo.qw_expert, kHalves, p.n_tiles, p.k_tiles, BITS * 256,
                                 kPerCta, "qweight");
        p.amap = expert_tile_map(p.am, E, mo.am_expert, kHalves, p.n_tiles, p.k_tiles, 64, kPerCta,
                                 "weight_absmax");
    }
    const unsigned groups = static_cast<unsigned>(ceil_div(p.n_tiles, kPerCta));
    launch_kernel(wgmma_gemm_kernel<BITS, RWG, TN, BF16, GM>,
                  dim3(groups, 1, static_cast<unsigned>(g.max_tiles)), wg::kThreads, c.smem,
                  c10::cuda::getCurrentCUDAStream(), 1, false, p, mo);
}

template <int BITS, int C>
void run_config(const MoeWgGemm& g) {
    const bool bf16 = g.x.scalar_type() == at::kBFloat16;
    if (g.gate_up) bf16 ? run_group<BITS, C, true, kMoeGateUp>(g) : run_group<BITS, C, false, kMoeGateUp>(g);
    else bf16 ? run_group<BITS, C, true, kMoeDown>(g) : run_group<BITS, C, false, kMoeDown>(g);
}

// Tile -> configuration: 256 weight rows x 128 slots (C3) or 128 rows x 256 slots (C2w; the
// accumulators of 256 x 256 would not fit the registers). 128 x 128 (C2) was slower than C3 on
// every shape measured (bench_moe_h100_s11d_{tn128,wide}.md). k = 5: 128 x 224 (C2n) instead of
// C2w, whose 76.8 KB stages (64 KB of x, 10 KB of planes) fit shared memory twice only; at 224
// slots three stages fit, as for C2w at k <= 4.
template <int BITS>
void run_bits(const MoeWgGemm& g) {
    if (g.tn == 128) run_config<BITS, wg::kC3>(g);
    else if constexpr (BITS == 5) run_config<BITS, wg::kC2n>(g);
    else run_config<BITS, wg::kC2w>(g);
}

#endif  // KBIT_SM90A

}  // namespace

bool moe_wgmma_usable(const at::Tensor& x) {
#if defined(KBIT_SM90A)
    return is_sm90(x.get_device());
#else
    (void)x;
    return false;
#endif
}

void moe_wgmma_gemm(const MoeWgGemm& g) {
#if defined(KBIT_SM90A)
    TORCH_CHECK(g.tn == 128 || g.tn == moe_wide_tile(g.bits), "kbit::moe: wgmma tile must be 128 or ",
                moe_wide_tile(g.bits), " slots at k=", g.bits, ", got ", g.tn);
    TORCH_CHECK(g.x.is_contiguous() && g.x.size(1) % kBlock == 0 && g.n % kBlock == 0,
                "kbit::moe (wgmma): internal buffers must be contiguous with 32-multiple widths");
    switch (g.bits) {
        case 2: run_bits<2>(g); break;
        case 3: run_bits<3>(g); break;
        case 4: run_bits<4>(g); break;
        default: run_bits<5>(g); break;
    }
#else
    (void)g;
    TORCH_CHECK(false, "kbit::moe: the wgmma path needs a build with sm_90a code");
#endif
}

}  // namespace kbit
