// SPDX-License-Identifier: Apache-2.0
// kbit::mma's KBIT_MMA_WGMMA=2 path: the dense launches of the warp-specialized Hopper kernel
// (wgmma_gemm.cuh; the grouped MoE launches are in moe_wgmma.cu).
#include "wgmma_gemm.cuh"

namespace kbit {
namespace {

#if defined(KBIT_SM90A)

// KBIT_WG_SPLIT_WS=0 restores session 33's planning above 128 tokens (no price on split-K's
// partial sums, C2 for 192 < M <= 256 on K < 8192 whatever the width): A/B and tests.
bool split_ws_priced() { return env_int("KBIT_WG_SPLIT_WS", 1) != 0; }

template <int BITS, int RWG, int TN, bool BF16, int AB = kABufs>
void run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
         const at::Tensor& codebook, at::Tensor& y, const TiledShape& s) {
    using L = wg::StageLayout<BITS, RWG, TN>;
    const WgConfig c = configure<BITS, RWG, TN, BF16, kDense, AB>(x.get_device());
    const int M = static_cast<int>(x.size(0));
    const int n_groups = static_cast<int>(ceil_div(s.n_tiles, L::kTiles));
    const int m_tiles = static_cast<int>(ceil_div(M, TN)), k_tiles = static_cast<int>(s.k_tiles);
    // 1 CTA per SM: split K where the output tiles alone would leave SMs idle. Above 128 tokens
    // the splits' fp32 partial sums (splits x M x n x 4 bytes, written, then read back by the
    // reduce kernel) cost as much as whole k-tiles: priced as HBM traffic (3.35 TB/s) in k-tiles
    // of one CTA (~1.7 us for a 256-row x 128-token or 128 x 256 tile, ~1.2 us for 128 x 128),
    // fitted on H100 8B / 70B layers at M = 160..512 (benchmarks/results/
    // probe_env_h100_s34_nosplit.md: 8B gate_up at M = 160 took 159 us with 4 splits, 112 us
    // without; 70B qkv at M = 256 132 us with 8, 96 without; 8B o / down and 70B o / down, 32-64
    // row blocks, still need 2-4 splits). Up to 128 tokens the measured rule stays (no price).
    const bool ws_price = M > 128 && split_ws_priced();
    const double unit_bytes = 2 * RWG * TN >= 32768 ? 5.7e6 : 4.0e6;
    const double ws_per_split = ws_price ? 8.0 * M * double(s.n) / unit_bytes : 0.0;
    int want = choose_splits(double(n_groups) * m_tiles, k_tiles, c.sms, kMaxSplits, ws_per_split);
    if (const int forced = env_int("KBIT_MMA_SPLITS", 0); forced > 0) want = std::min(forced, kMaxSplits);
    const wg::SplitPlan sp = wg::split_plan(k_tiles, want);
    const int kchunk = sp.kchunk, splits = sp.splits;
    const int mode = splits == 1                                                       ? kDirect
                     : use_cluster(c.clusters, double(n_groups) * m_tiles, splits, c.sms) ? kCluster
                                                                                             : kWorkspace;
    at::Tensor ws;
    if (mode == kWorkspace) ws = at::empty({splits, M, s.n}, x.options().dtype(at::kFloat));

    WgParams p{};
    p.xmap = x_tensor_map(x, TN);
    p.qw = reinterpret_cast<const uint8_t*>(qweight.data_ptr<int32_t>());
    p.am = absmax.data_ptr<uint8_t>();
    p.cb = codebook.data_ptr<float>();
    p.y = y.data_ptr();
    p.ws = mode == kWorkspace ? ws.data_ptr<float>() : nullptr;
    p.M = M, p.n = static_cast<int>(s.n), p.K = static_cast<int>(s.k);
    p.n_tiles = static_cast<int>(s.n_tiles), p.k_tiles = k_tiles;
    p.kchunk = kchunk, p.splits = splits, p.stages = c.stages, p.mode = mode;
    p.copies_log2 = c.copies_log2, p.table_bytes = c.table_bytes;
    p.wmap = tile_tensor_map(p.qw, s.n_tiles, k_tiles, BITS * 256, L::kTiles, "qweight");
    p.amap = tile_tensor_map(p.am, s.n_tiles, k_tiles, 64, L::kTiles, "weight_absmax");

    p.pdl = pdl_requested();  // sm_90a code: griddepcontrol is there
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    launch_kernel(wgmma_gemm_kernel<BITS, RWG, TN, BF16, kDense, AB>,
                  dim3(n_groups, splits, m_tiles), wg::kThreads, c.smem, stream,
                  mode == kCluster ? splits : 1, p.pdl != 0, p, WgMoe{});
    if (mode == kWorkspace)  // sm_90a only: PDL is there
        launch_splitk_reduce<BF16>(ws.data_ptr<float>(), y.data_ptr(), int64_t{M} * s.n, splits,
                                   c.sms, true, stream);
}

// Stages of C2w's ring at BITS (wg::ring_plan, through the cached per-kernel configure).
template <int BITS>
int c2w_stages(bool bf16, int dev) {
    constexpr int RWG = wg::config_rwg(wg::kC2w), TN = wg::config_tn(wg::kC2w);
    const WgConfig c =
        bf16 ? configure<BITS, RWG, TN, true>(dev) : configure<BITS, RWG, TN, false>(dev);
    return c.stages;
}

// Does C2w's ring get >= KBIT_WG_C2W_MIN_STAGES (default 3) stages? A C2w stage holds 256 tokens
// of x (64 KB) and 128 rows of weights; at k=5 (75 KB) only two fit beside the pair table in an
// H100's 227 KB of shared memory, and with two the producer cannot refill a stage while the
// consumers still read the other: on the 8B layer at M = 192 / 256, k=5 C2w took 141.3 / 148.8 us
// on gate_up against C3's 133.9 / 136.8, and 76.4 / 82.0 on down against 65.1 / 69.1
// (benchmarks/results/k5_c3_h100_s44/). k <= 4 gets three stages. (The MoE kernel takes 128 x 224
// tiles at k=5 instead, moe_wgmma.cu; the dense kernel has no such instantiation.)
// KBIT_WG_C2W_MIN_STAGES=2 restores C2w at k=5 (A/B).
bool c2w_ring_deep(int64_t bits, bool bf16, int dev) {
    const int stages = bits == 2   ? c2w_stages<2>(bf16, dev)
                       : bits == 3 ? c2w_stages<3>(bf16, dev)
                       : bits == 4 ? c2w_stages<4>(bf16, dev)
                                   : c2w_stages<5>(bf16, dev);
    return stages >= env_int("KBIT_WG_C2W_MIN_STAGES", 3);
}

// Tile configuration (wg::pick_config, checked on the CPU): KBIT_WGMMA_CONFIG=1..5 forces
// C1 = 128 x 64, C2 = 128 x 128, C3 = 256 x 128, C1w = 256 x 64 or C2w = 128 x 256 (tests,
// tuning); unset = by M and, up to 64 tokens, by layer size (c1w_by_size, kbit_format.cuh;
// KBIT_WGMMA_C1W=1 / 0 forces C1w / C1 there), above 128 tokens by C2w's ring depth at this k.
int choose_config(int64_t M, int64_t n, int64_t K, int64_t k_tiles, int64_t bits, bool bf16,
                  int dev) {
    const int forced = env_int("KBIT_WGMMA_CONFIG", 0);
    TORCH_CHECK(forced >= 0 && forced <= wg::kNumConfigs,
                "kbit::mma: KBIT_WGMMA_CONFIG must be 1, 2, 3, 4 or 5, got ", forced);
    const int c1w = env_int("KBIT_WGMMA_C1W", -1);
    // C2w's row blocks (2 x its rows per warpgroup) alone fill the GPU
    const bool wide_fill =
        split_ws_priced() && ceil_div(n, 2 * wg::config_rwg(wg::kC2w)) >= device_sms(dev);
    const bool c2w_deep = forced != 0 || M <= 128 || c2w_ring_deep(bits, bf16, dev);
    return wg::pick_config(M, k_tiles, forced, c1w == -1 ? c1w_by_size(n, K) : c1w == 1,
                           wide_fill, c2w_deep);
}

template <int BITS, int C>
void run_config(bool bf16, const at::Tensor& x, const at::Tensor& q, const at::Tensor& a,
                const at::Tensor& cb, at::Tensor& y, const TiledShape& s) {
    constexpr int RWG = wg::config_rwg(C), TN = wg::config_tn(C);
    if constexpr (TN == 64) {  // 64-token tiles: KBIT_WG_ABUFS=4 runs 4 A-register sets
        const bool ab4 = env_int("KBIT_WG_ABUFS", kABufs) == 4;
        if (ab4) {
            if (bf16) run<BITS, RWG, TN, true, 4>(x, q, a, cb, y, s);
            else run<BITS, RWG, TN, false, 4>(x, q, a, cb, y, s);
            return;
        }
    }
    if (bf16) run<BITS, RWG, TN, true>(x, q, a, cb, y, s);
    else run<BITS, RWG, TN, false>(x, q, a, cb, y, s);
}

template <int BITS>
void run_bits(int config, bool bf16, const at::Tensor& x, const at::Tensor& q, const at::Tensor& a,
              const at::Tensor& cb, at::Tensor& y, const TiledShape& s) {
    switch (config) {
        case wg::kC1: run_config<BITS, wg::kC1>(bf16, x, q, a, cb, y, s); break;
        case wg::kC2: run_config<BITS, wg::kC2>(bf16, x, q, a, cb, y, s); break;
        case wg::kC1w: run_config<BITS, wg::kC1w>(bf16, x, q, a, cb, y, s); break;
        case wg::kC2w: run_config<BITS, wg::kC2w>(bf16, x, q, a, cb, y, s); break;
        default: run_config<BITS, wg::kC3>(bf16, x, q, a, cb, y, s); break;
    }
}


#endif  // KBIT_SM90A

}  // namespace

// kbit::mma's KBIT_MMA_WGMMA=2 path (ops.h). The caller has checked the tensors and made x's
// rows 16-byte aligned (mma.cu), as TMA needs.
void wgmma_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& absmax,
                const at::Tensor& codebook, int64_t bits, at::Tensor& y) {
#if defined(KBIT_SM90A)
    check_sm90(x.get_device());
    if (x.size(0) > 1 && x.stride(0) < x.size(1)) {  // overlapping rows (e.g. expanded): TMA
        wgmma_gemm(x.contiguous(), qweight, absmax, codebook, bits, y);  // wants a real stride
        return;
    }
    const TiledShape s(y.size(1), x.size(1), bits);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const int config = choose_config(x.size(0), s.n, s.k, s.k_tiles, bits, bf16, x.get_device());
    switch (bits) {
        case 2: run_bits<2>(config, bf16, x, qweight, absmax, codebook, y, s); break;
        case 3: run_bits<3>(config, bf16, x, qweight, absmax, codebook, y, s); break;
        case 4: run_bits<4>(config, bf16, x, qweight, absmax, codebook, y, s); break;
        default: run_bits<5>(config, bf16, x, qweight, absmax, codebook, y, s); break;
    }
#else
    (void)x, (void)qweight, (void)absmax, (void)codebook, (void)bits, (void)y;
    TORCH_CHECK(false, "kbit::mma: KBIT_MMA_WGMMA=2 (the warp-specialized wgmma kernel) needs a "
                "build with sm_90a code (TORCH_CUDA_ARCH_LIST containing 9.0a); this build has none");
#endif
}

}  // namespace kbit