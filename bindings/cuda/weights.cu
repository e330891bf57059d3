// The linear layer on the device: weights decoded in registers inside the canonical dot
// (weights.cuh has the contract). Rows are independent and each is computed whole by one group of
// eight threads, so the grid shape changes no bit. This file: which kernel a launch takes (the
// one-token choice measured on the device), the API (linear, linear_heads, linear_experts) and the test
// and benchmark entry points; the kernels are in lin_*.cuh, parts of this translation unit.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <cstring>

#include <string>
#include <vector>

#include "engine.cuh"
// the kernels (one translation unit: each file below is a part of this one)
#include "lin_device.cuh"
#include "lin_register.cuh"
#include "lin_staged.cuh"
#include "lin_tiled.cuh"
#include "lin_gemm.cuh"
#include "lin_pairs.cuh"
#include "lin_lanes.cuh"
#include "lin_stream.cuh"

namespace glm::cuda {

const char* wfmt_name(int f) {
    switch (f) {
        case W_BF16: return "bf16";
        case W_F32: return "f32";
        case W_FP8: return "fp8";
        case W_MXFP4: return "mxfp4";
    }
    return "?";
}

int parse_release(const std::string& release) {
    if (release == "bf16") return W_BF16;
    if (release == "f32") return W_F32;
    if (release == "fp8") return W_FP8;
    if (release == "mxfp4") return W_MXFP4;
    throw std::invalid_argument("linear: release must be 'bf16', 'f32', 'fp8' or 'mxfp4', not '" + release + "'");
}

size_t Lin::bytes() const { return static_cast<size_t>(R * row_bytes(fmt, C) + scale_bytes(fmt, R, C)); }

// (weights.cuh)
void flush_l2() {
    static void* buf = nullptr;
    constexpr size_t n = size_t{96} << 20;  // larger than the H100/H200 L2 (50 MB)
    if (!buf) check(cudaMalloc(&buf, n), "cudaMalloc (L2 flush)");
    check(cudaMemsetAsync(buf, 0, n, 0), "L2 flush");
}

int sm_count() {
    static int n = [] {
        int dev = 0;
        cudaDeviceProp p;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess) return 132;
        return p.multiProcessorCount > 0 ? p.multiProcessorCount : 132;
    }();
    return n;
}

namespace {

// What the shared-memory kernels (staged, tiled, streaming) need to copy rows by 16-byte pieces: whole
// chunks, 16-byte aligned weight rows and x rows.
bool rows_copyable(const LinArgs& a, bool expert) {
    const int64_t rb = row_bytes(a.fmt, a.C);
    if (a.C % 64 != 0 || a.C == 0 || rb % 16 != 0) return false;
    // expert weights are separate allocations of the arena (256-byte aligned); a dense view is checked here
    if (!expert && reinterpret_cast<uintptr_t>(a.data) % 16 != 0) return false;
    return reinterpret_cast<uintptr_t>(a.X) % 16 == 0 && a.ldx % 4 == 0;
}

// The staged kernel takes one token row (or expert items of one pair each), whole chunks, 16-byte
// aligned rows (and x rows), and matrices of at most 16 waves of 16-row blocks (lm_head streams at
// 85-90 % of the copy bandwidth through the register kernel already). The bound is per matrix, not per
// launch: a batch-1 expert launch holds k routed items and the shared expert's (k = 8: 9 items of
// 4096-row down matrices, past 16 waves together), the case the staged kernel was measured fastest on.
bool staged_applies(const LinArgs& a, bool expert) {
    if (!rows_copyable(a, expert) || a.xhs % 4 != 0) return false;
    if (expert ? a.tile_pairs != 1 : a.T != 1) return false;
    return (a.R + 15) / 16 <= 16 * static_cast<int64_t>(sm_count());
}

// f(std::integral_constant<int, DEC>{}) for the launch's decode path: FP8 has three kernels (software,
// hardware conversion, integer placement), MXFP4 two where MXFP4_INT (software, placement), every other
// format and kernel the software one (whose values every path equals).
template <int FMT, bool MXFP4_INT, class F>
void with_dec(int dec, F&& f) {
    if constexpr (FMT == W_FP8) {
        if (dec == kDecInt) f(std::integral_constant<int, kDecInt>{});
        else if (dec == kDecHw) f(std::integral_constant<int, kDecHw>{});
        else f(std::integral_constant<int, kDecSw>{});
    } else if constexpr (FMT == W_MXFP4 && MXFP4_INT) {
        if (dec == kDecInt) f(std::integral_constant<int, kDecInt>{});
        else f(std::integral_constant<int, kDecSw>{});
    } else {
        f(std::integral_constant<int, kDecSw>{});
    }
}

template <int FMT, bool EXPERT, int LPT, bool XS, int DEC>
void launch_st_dec(const LinArgs& a, dim3 grid, int rpb, int cps, size_t smem) {
    auto k = k_linear_st<FMT, EXPERT, DEC, LPT, XS>;
    allow_smem(k, 200 * 1024);
    GLM_LAUNCH(k, grid, kStThreads, smem, a, rpb, cps);
}
template <int FMT, bool EXPERT, int LPT, bool XS>
void launch_st(const LinArgs& a, dim3 grid, int rpb, int cps, size_t smem) {
    with_dec<FMT, false>(a.dec, [&](auto dec) { launch_st_dec<FMT, EXPERT, LPT, XS, decltype(dec)::value>(a, grid, rpb, cps, smem); });
}

// The staged kernel with variant c (fields 0 / -1: the defaults); false when it does not apply.
template <int FMT, bool EXPERT>
bool launch_staged(const LinArgs& a, dim3 g, const LinChoice& c) {
    constexpr int CB = chunk_bytes<FMT>();
    if (!staged_applies(a, EXPERT)) return false;
    const int64_t nsm = sm_count();
    const bool heads = a.rh < a.R && a.xhs != 0;
    const int lpt = c.lpt > 0 ? c.lpt : 8;
    const bool xs = !heads && (c.xs >= 0 ? c.xs == 1 : true);
    const int maxr = kStThreads / (64 / lpt);
    int rpb = c.rpb ? std::min(c.rpb, maxr) : std::min(16, maxr);
    if (!c.rpb)
        while (rpb > 1 && (a.R + rpb - 1) / rpb * static_cast<int64_t>(g.y) * g.z < 2 * nsm) rpb /= 2;
    const int nchunks = static_cast<int>(a.C / 64);
    int cps = c.cps ? c.cps : std::max(1, kStStageBytes / (rpb * CB));
    cps = std::min(cps, nchunks);
    const size_t smem = static_cast<size_t>(kStStages) * (rpb * (cps * CB + CB) + (xs ? cps * 256 : 0));
    if (smem > 200 * 1024) return false;
    const dim3 grid(static_cast<unsigned>((a.R + rpb - 1) / rpb), g.y, g.z);
    if (lpt == 8) {
        if (xs) launch_st<FMT, EXPERT, 8, true>(a, grid, rpb, cps, smem);
        else launch_st<FMT, EXPERT, 8, false>(a, grid, rpb, cps, smem);
    } else if (lpt == 4) {
        if (xs) launch_st<FMT, EXPERT, 4, true>(a, grid, rpb, cps, smem);
        else launch_st<FMT, EXPERT, 4, false>(a, grid, rpb, cps, smem);
    } else {
        if (xs) launch_st<FMT, EXPERT, 2, true>(a, grid, rpb, cps, smem);
        else launch_st<FMT, EXPERT, 2, false>(a, grid, rpb, cps, smem);
    }
    return true;
}

// The tiled kernel takes token rows (or expert items) of one x row each (no head-blocked x) whose rows
// can be copied. Several tokens or pairs take it always; one token (TT = 1) where the one-token tuning
// measured it fastest, or when forced.
bool tiled_applies(const LinArgs& a, bool expert) {
    return rows_copyable(a, expert) && !(a.rh < a.R && a.xhs != 0);
}

// Expert launches: the work list's length is known on the device only, and its bound (every pair its own
// item) gave up to ~140 empty blocks per working one at prefill (the register-tiled kernel's expert
// launches of a 2048-token step took 164.7 ms, now 130.2; one block resident a SM). Blocks walk the items (item += gridDim.y),
// so about 8 waves of them suffice: `per_sm_waves` blocks per SM in all (the register-tiled kernel 8,
// one resident; the tiled kernel 32, ~4 resident). H200, slice FP8, tools/bench_throughput.py: the tiled
// kernel's b128 3743 -> 3898 tok/s, b256 4083 -> 4193, prefill 512 6931 -> 7193 (8 a SM: 3845, 4242, 7011).
unsigned item_grid_y(const dim3& grid, int per_sm_waves) {
    const int64_t per = static_cast<int64_t>(per_sm_waves) * sm_count() / (static_cast<int64_t>(grid.x) * grid.z);
    return static_cast<unsigned>(std::min<int64_t>(grid.y, std::max<int64_t>(1, per)));
}
// Blocks a z half of an expert launch whose blocks walk units (an item's row block each; the lane-pass and
// register-tiled kernels, one block an SM): all resident at once over the z halves, at most one a unit.
unsigned unit_grid_x(int64_t units, unsigned z) {
    return static_cast<unsigned>(std::min(units, std::max<int64_t>(1, sm_count() / static_cast<int64_t>(z))));
}

template <int FMT, bool EXPERT, int TT, int DEC>
void launch_mt_dec(const LinArgs& a, dim3 grid) {
    auto k = k_linear_mt<FMT, EXPERT, DEC, TT>;
    constexpr size_t smem = static_cast<size_t>(kMtStages) * mt_stage_bytes<FMT, TT>();
    allow_smem(k, smem);
    grid.x = static_cast<unsigned>((a.R + kMtRows - 1) / kMtRows);
    if (EXPERT) grid.y = item_grid_y(grid, 32);
    GLM_LAUNCH(k, grid, kMtThreads, smem, a);
}
template <int FMT, bool EXPERT, int TT>
void launch_mt(const LinArgs& a, dim3 grid) {
    with_dec<FMT, false>(a.dec, [&](auto dec) { launch_mt_dec<FMT, EXPERT, TT, decltype(dec)::value>(a, grid); });
}

// The register-tiled kernel: what the tiled kernel takes, several tokens (or expert items of several
// pairs). The engine takes it (option gemm) for dense launches of kGemmMinT tokens or more; fewer
// tokens keep the tiled kernel, whose 4- and 8-token tiles waste nothing there. Expert items of 16 pairs
// (32-row tiles) where the experts average 16 (experts_may_take16), of up to 8 (64-row tiles) elsewhere
// (gemm_chosen). Head-blocked launches too, when each head is whole 32-row blocks (a block's x rows are
// then its head's).
constexpr int kGemmMinT = 16;
// The register-tiled and lane-pass kernels' scale offsets are 32-bit: the last weight row's (weight_row).
bool scale_offsets_32bit(const LinArgs& a) {
    const int64_t max_ar = a.row0 + static_cast<int64_t>((a.R - 1) / a.rh) * a.hstride + a.woff + std::min(a.R, a.rh);
    return max_ar * (a.C / 32 + 1) < (int64_t{1} << 31);
}
bool gemm_applies(const LinArgs& a, bool expert) {
    // head-blocked x (MLA's W_UK^T and W_UV by head): heads of whole 32-row blocks, x 16-byte aligned
    const bool heads_ok = !expert && a.rh % gm_rows<4>() == 0 && a.xhs % 4 == 0;
    if (!(tiled_applies(a, expert) || (rows_copyable(a, expert) && heads_ok))) return false;
    if (!(expert ? a.tile_pairs > 1 : a.T > 1)) return false;
    return scale_offsets_32bit(a);
}
// expert launches like a (its tables, x) in items of 16 pairs (expert_tile's gemm16)
bool gemm_takes_items16(LinArgs a) {
    a.tile_pairs = 16;
    return gemm_applies(a, true);
}
// Experts: items of several pairs (8 or 16, expert_tile) wherever it applies; items of 8 through it beat
// the tiled kernel at every batch that takes them (docs/perf.md, "Session 14").
bool gemm_chosen(const LinArgs& a, bool expert) {
    return launch_options().gemm && gemm_applies(a, expert) && (expert || a.T >= kGemmMinT);
}
// TG: 4 TG tokens (pairs) and 8 (16 / TG) rows per block.
template <int FMT, bool EXPERT, int DEC, int TG>
void launch_gemm_tg(const LinArgs& a, dim3 grid) {
    auto k = k_linear_gemm<FMT, EXPERT, DEC, TG>;
    constexpr size_t smem = static_cast<size_t>(gm_smem_bytes<FMT, TG>());
    allow_smem(k, smem);
    grid.x = static_cast<unsigned>((a.R + gm_rows<TG>() - 1) / gm_rows<TG>());
    if (EXPERT) {  // (grid.y: the launch's bound on its items)
        grid.x = unit_grid_x(static_cast<int64_t>(grid.x) * grid.y, grid.z);
        grid.y = 1;
    } else {
        const int64_t ty = (static_cast<int64_t>(a.T) + gm_tokens<TG>() - 1) / gm_tokens<TG>();
        if (ty > 65535) throw std::invalid_argument("linear: at most 65535 token tiles per launch");
        grid.y = static_cast<unsigned>(ty);
        grid.z = 1;
    }
    GLM_LAUNCH(k, grid, kGmThreads, smem, a);
}
// The few-pair expert kernel (lin_pairs.cuh): FP8 and MXFP4 routed-expert items of up to 8 pairs (the
// engine's items of 8: decode batches), rows of whole chunks that can be copied, each block's 64 rows in
// one 128-row scale block (MXFP4: rows of whole 8-chunk slabs, whose scales arrive as one 16-byte copy).
// The engine takes it (option pairs) for FP8 where the launch's pairs (the shared expert's included)
// average under 5 an entry of the tables. H200, slice FP8 (docs/perf.md, "Session 26"): with its fold as a
// butterfly, its multipliers staged and slots of 3 and 6, b128's four expert launches take 7836 us here
// against the register-tiled kernel's 8530 (b128 8863-8887 -> 9309-9325 tok/s); at b256 (8 pairs an entry)
// and prefill 512 the register-tiled kernel's decode once for 8 slots stays ahead (tok/s, register-tiled /
// here: b256 10106 / 10107, prefill 512 11810 / 11535). (Session 20, before those: under 2.5.) MXFP4 at any
// average (session 31, slice MXFP4: b256 9178 -> 11267, prefill 512 10499 -> 12749).
bool pairs_applies(const LinArgs& a, bool expert) {
    const bool fmt_ok = a.fmt == W_FP8 ? a.C <= 128 * kPrScaleBlocks : a.fmt == W_MXFP4 && a.C % (64 * kPrSlab) == 0;
    return expert && fmt_ok && a.tile_pairs > 1 && a.tile_pairs <= kPrPairs && rows_copyable(a, true) &&
           a.rh >= a.R && a.row0 % kPrRows == 0;
}
bool pairs_chosen(const LinArgs& a, bool expert) {
    // (MXFP4 at any average: its register-tiled items of 8 decode at ~1.1 TB/s, session 31)
    return launch_options().pairs && pairs_applies(a, expert) &&
           (a.fmt == W_MXFP4 || static_cast<int64_t>(a.max_items) < 5 * static_cast<int64_t>(a.experts));
}
// The decode path of the several-token kernels (register-tiled, lane-pass, few-pair): FP8 by the hardware
// conversion where the integer decode was chosen and the conversion passed the engine's check (both exact
// there); beside the FMAs each decoded weight feeds, the conversion unit is not the limit it is in the
// one-token kernels, and it takes fewer instructions (2.5 a weight against 3.75). H200: bench_gemm T = 2048
// q|k|v, mla.o_proj, kda.o_proj 18.5 / 20.8 / 20.0 -> 19.2 / 22.0 / 20.9 TFLOP/s, prefill 2048 8441 -> 8586
// tok/s (register-tiled); few-pair experts at 32 tokens gate 909 -> 828 us (docs/perf.md, "Session 21").
template <int FMT>
int several_token_dec(const LinArgs& a) {
    return FMT == W_FP8 && a.dec == kDecInt && a.hw8 ? kDecHw : a.dec;
}
template <int FMT>
void launch_pairs(const LinArgs& a, dim3 grid) {
    if constexpr (FMT == W_FP8 || FMT == W_MXFP4) {
        with_dec<FMT, true>(several_token_dec<FMT>(a), [&](auto dec) {
            auto k = k_linear_pairs<FMT, decltype(dec)::value>;
            constexpr size_t smem = static_cast<size_t>(pr_smem_bytes<FMT>());
            allow_smem(k, smem);
            dim3 g = grid;
            g.x = static_cast<unsigned>((a.R + kPrRows - 1) / kPrRows);
            g.y = item_grid_y(g, 8);
            GLM_LAUNCH(k, g, kPrThreads, smem, a);
        });
    }
}

// (FP8 decoded as several_token_dec says)
template <int FMT, bool EXPERT>
void launch_gemm(const LinArgs& a, dim3 grid) {
    with_dec<FMT, true>(several_token_dec<FMT>(a), [&](auto dec) {
        constexpr int DEC = decltype(dec)::value;
        // expert items of up to 8 pairs: 64 rows x 8 pairs; of 16 and dense launches: 32 rows x 16 tokens
        if (EXPERT && a.tile_pairs <= 8) launch_gemm_tg<FMT, EXPERT, DEC, 2>(a, grid);
        else launch_gemm_tg<FMT, EXPERT, DEC, 4>(a, grid);
    });
}

// The lane-pass kernel (lin_lanes.cuh): dense launches (no head blocking) of BF16, FP8 or MXFP4 rows of
// whole chunks, 16-byte aligned, several tokens. The engine takes it (option lanes) from kLanesMinT tokens;
// below, the register-tiled kernel: at 64 tokens its 64 x 64 blocks leave a 4096-row matrix 64 blocks for
// 132 SMs (H200, slice FP8: decode b64 3366-3557 tok/s with it from 64 tokens, 4213 without in session
// 14). x is re-laid into a device scratch (lanes_scratch) by k_x_lanes, at most kLanesGroup floats at a
// time: larger launches run in groups of tokens.
constexpr int kLanesMinT = 128;
constexpr int64_t kLanesGroup = int64_t{32} << 20;  // floats of re-laid x (128 MiB) per group of tokens
constexpr int64_t kLanesItemsGroup = int64_t{128} << 20;  // expert items: floats of re-laid x (512 MiB) per group
// Head-blocked launches (MLA's W_UK^T and W_UV by head) where each head is whole 64-row blocks and its x
// whole chunks: a block's rows, 32 or 64, then lie in one head, and x is re-laid over its whole width.
// (Through the register-tiled kernel their 4 and 8 chunks a row made 8192 and 4096 blocks of 32 rows x 16
// tokens at 128 tokens, each mostly waiting for its copies: 614 us of a b128 step with q_a and kv_a.)
bool lanes_heads_ok(const LinArgs& a) { return a.rh % 64 == 0 && a.xhs % 64 == 0; }
bool lanes_applies(const LinArgs& a, bool expert) {
    if (expert ? a.tile_pairs != kLanesItem : (a.T < 2 || (a.rh < a.R && !lanes_heads_ok(a)))) return false;
    if (!(a.fmt == W_BF16 || a.fmt == W_FP8 || a.fmt == W_MXFP4)) return false;
    const int64_t rb = row_bytes(a.fmt, a.C);
    if (a.C % 64 != 0 || a.C == 0 || rb % 16 != 0) return false;
    if (rb >= (int64_t{1} << 26)) return false;  // (a whole slab's copies step RPN <= 32 rows in 32-bit offsets)
    // (experts: x re-laid per item, any rows; weights are arena allocations, 256-byte aligned)
    if (!expert && reinterpret_cast<uintptr_t>(a.data) % 16 != 0) return false;
    if (expert && int64_t{kLanesItem} * a.C > kLanesItemsGroup) return false;
    return scale_offsets_32bit(a);
}
// (expert items of kLanesItem pairs: lane items beside items of 16, or all of them when the engine option
// expert_tile asks: moe.cu)
// Only where its blocks fill half the SMs: matrices of few rows (KDA's low-rank and gate projections, the
// router, the indexer's and MLA's down-projections: 32-1536 rows) made 1-48 blocks of 32 rows x 128 tokens
// at 128 tokens, each walking the whole K alone on its SM; the register-tiled kernel's 32 x 16 blocks are
// eight times as many (H200, slice FP8: the ten BF16 launches of a b128 step 1.57 -> 0.30 ms).
// Tokens a lane-pass block: 128 for dense launches from 128 tokens (each decoded weight serves them all,
// 32 rows), else 64 (64 rows).
// Nor where its last token tile is mostly empty: a block costs its BN columns whatever it holds, and the
// lane-pass kernel was 1.10-1.17x as fast as the register-tiled one (16-token tiles) at 128 tokens
// (tools/bench_gemm.py, FP8 q|k|v, o_proj: docs/perf.md "Session 21"), so it is taken where its columns are
// at most 1.1x the register-tiled kernel's: b160 computed 256 columns (7.6k tok/s against b128's 8.3k).
int lanes_bn(const LinArgs& a, bool expert) { return !expert && a.T >= 128 ? 128 : 64; }
bool lanes_chosen(const LinArgs& a, bool expert) {
    if (!(launch_options().lanes && !expert && lanes_applies(a, expert) && a.T >= kLanesMinT)) return false;
    const int64_t bn = lanes_bn(a, expert), rows = bn == 128 ? ln_rows<128>() : ln_rows<64>();
    const int64_t tiles = (a.T + bn - 1) / bn, gemm_cols = (a.T + 15) / 16 * 16;
    return 10 * tiles * bn <= 11 * gemm_cols && (a.R + rows - 1) / rows * tiles >= sm_count() / 2;
}
// One growing device buffer per device for the re-laid x (launches are in stream order on stream 0).
float* lanes_scratch(int64_t floats) {
    struct Buf {
        float* p = nullptr;
        int64_t n = 0;
    };
    static Buf bufs[64];
    static std::mutex mu;
    int dev = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    std::lock_guard<std::mutex> lock(mu);
    Buf& b = bufs[dev & 63];
    if (b.n < floats) {
        if (b.p) check(cudaFree(b.p), "cudaFree");
        b.p = nullptr;
        b.n = 0;
        void* q = nullptr;
        check(cudaMalloc(&q, static_cast<size_t>(floats) * 4), "cudaMalloc (lane-pass x)");
        b.p = static_cast<float*>(q);
        b.n = floats;
    }
    return b.p;
}
template <int FMT, bool EXPERT, int DEC, int BN, int TN>
void launch_lanes_bn(const LinArgs& a, dim3 grid) {
    auto k = k_linear_lanes<FMT, EXPERT, DEC, BN, TN>;
    constexpr int threads = ln_threads(TN);
    constexpr size_t smem = static_cast<size_t>(ln_smem_bytes<FMT, BN, EXPERT>());
    allow_smem(k, smem);
    grid.x = static_cast<unsigned>((a.R + ln_rows<BN>() - 1) / ln_rows<BN>());
    if constexpr (EXPERT) {  // x re-laid per item (k_items_lanes), kLanesItemsGroup floats at most at a time
        const int nch = static_cast<int>(a.C / 64);
        const int64_t per_item = int64_t{kLanesItem} * a.C;
        const int group = a.lanes_group > 0 ? a.lanes_group
                                            : static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(a.max_items, kLanesItemsGroup / per_item)));
        for (int i0 = 0; i0 < a.max_items; i0 += group) {
            const int n = std::min(group, a.max_items - i0);
            float* xi = lanes_scratch(n * per_item);
            LinArgs b = a;
            b.item0 = i0;
            b.item_count = n;
            auto kx = k_items_lanes;
            GLM_LAUNCH(kx, dim3(static_cast<unsigned>(n), static_cast<unsigned>(nch)), 256, 0, b, nch, xi);
            check_launch("items_lanes");
            b.X = xi;
            GLM_LAUNCH(k, dim3(unit_grid_x(static_cast<int64_t>(grid.x) * n, grid.z), 1, grid.z), threads, smem, b);
        }
        return;
    }
    const int nch = static_cast<int>(lanes_x_chunks(a));
    const int64_t per = std::max<int64_t>(BN, kLanesGroup / (64 * nch) / BN * BN);  // tokens per group
    for (int64_t t0 = 0; t0 < a.T; t0 += per) {
        const int n = static_cast<int>(std::min<int64_t>(per, a.T - t0));
        const int64_t ldT = (n + BN - 1) / BN * BN;
        float* xp = lanes_scratch(ldT * 64 * nch);
        x_lanes(a.X + t0 * a.ldx, a.ldx, n, nch, ldT, xp);
        LinArgs b = a;
        b.X = xp;
        b.ldx = ldT;
        b.Y = a.Y + t0 * a.ldy;
        b.T = n;
        grid.y = static_cast<unsigned>(ldT / BN);
        grid.z = 1;
        GLM_LAUNCH(k, grid, threads, smem, b);
    }
}
// Tokens a thread of the lane-pass kernel (EngineOptions::lanes_tn; 0: this rule): 16 (256 threads a block,
// up to 255 registers a thread) for FP8 and MXFP4 expert items and dense launches of two token tiles or more,
// else 8 (512 threads, 128 registers). Measured (docs/perf.md, "Session 41"): with 16, the FP8 expert items of a
// 2048-token prefill 52.9 -> 51.1 ms and its dense FP8 launches 35.0 -> 34.6 (prefill 2048 +1.9 %), MXFP4
// q|k|v at 2048 tokens 32 -> 39 % of the FFMA peak; but BF16 launches 1.81 -> 2.04 ms and b128 (one tile of
// 128 tokens: half the warps an SM to hide its copies) ~1 % slower.
int lanes_tn_for(int fmt, bool expert, int64_t T, int bn) {
    if (const int forced = launch_options().lanes_tn) return forced;
    return fmt != W_BF16 && (expert || T >= 2 * bn) ? 16 : 8;
}

// The block's tokens by lanes_bn (expert items of kLanesItem pairs: 64 x 64); FP8 decoded as
// several_token_dec says; tokens a thread by lanes_tn_for.
template <int FMT, bool EXPERT>
void launch_lanes(const LinArgs& a, dim3 grid) {
    if constexpr (FMT == W_BF16 || FMT == W_FP8 || FMT == W_MXFP4) {
        with_dec<FMT, true>(several_token_dec<FMT>(a), [&](auto dec) {
            constexpr int DEC = decltype(dec)::value;
            const int bn = lanes_bn(a, EXPERT);
            const bool wide = lanes_tn_for(FMT, EXPERT, a.T, bn) == 16;
            if (bn == 128) {
                if (wide) launch_lanes_bn<FMT, false, DEC, 128, 16>(a, grid);
                else launch_lanes_bn<FMT, false, DEC, 128, 8>(a, grid);
            } else {
                if (wide) launch_lanes_bn<FMT, EXPERT, DEC, 64, 16>(a, grid);
                else launch_lanes_bn<FMT, EXPERT, DEC, 64, 8>(a, grid);
            }
        });
    }
}

// The streaming kernel: one token row (or expert items of one pair) whose rows can be copied, heads
// (if any) of whole units of eight rows (a thread's two rows share their x loads).
bool stream_applies(const LinArgs& a, bool expert) {
    return rows_copyable(a, expert) && a.xhs % 4 == 0 && (a.rh >= a.R || a.rh % kSmRows == 0) && (expert ? a.tile_pairs == 1 : a.T == 1);
}
// ... with x staged per block: every row of the launch reads row 0 of X (one token and no head-blocked
// x; experts: every routed pair p < min(p_split, max_items) has p / xdiv = 0 and at most one shared pair),
// and x fits beside the rings.
bool stream_xs_applies(const LinArgs& a, bool expert, int minb) {
    if (!stream_applies(a, expert)) return false;
    const bool one_x = expert ? (a.ldx == 0 || (std::min(a.p_split, a.max_items) <= a.xdiv && a.max_items <= a.p_split + 1))
                              : !(a.rh < a.R && a.xhs != 0);
    const size_t ring = static_cast<size_t>(sm_ring_bound(minb, true));
    return one_x && minb <= 2 && a.C <= 4096 && (static_cast<size_t>(a.C) * 4 + ring) * static_cast<size_t>(minb) <= 220 * 1024;
}

template <int FMT, bool EXPERT, int DEC, int MINB, bool XS>
void launch_sm_dec(const LinArgs& a, dim3 g) {
    auto k = k_linear_stream<FMT, EXPERT, DEC, MINB, XS>;
    const size_t smem = static_cast<size_t>(sm_block_bytes<FMT, MINB, XS>()) + (XS ? static_cast<size_t>(a.C) * 4 : 0);
    allow_smem(k, smem);
    LinArgs b = a;
    b.early = launch_options().stream_early && !EXPERT;  // (an A/B switch: off by default)
    // every unit's block resident at once: at most MINB blocks per SM (expert launches: as many units
    // as the largest work list could hold; blocks past the device's count of units exit at once)
    const int64_t units = (a.R + kSmRows - 1) / kSmRows * (EXPERT ? static_cast<int64_t>(a.max_items) * g.z : 1);
    const unsigned blocks =
        static_cast<unsigned>(std::min<int64_t>((units + kSmWarps - 1) / kSmWarps, static_cast<int64_t>(MINB) * sm_count()));
    GLM_LAUNCH(k, blocks, kSmThreads, smem, b);
}
template <int FMT, bool EXPERT, int MINB, bool XS>
void launch_sm(const LinArgs& a, dim3 g) {
    with_dec<FMT, true>(a.dec, [&](auto dec) { launch_sm_dec<FMT, EXPERT, decltype(dec)::value, MINB, XS>(a, g); });
}

// minb 5 or 6 (one token): the variant bounded to that many 128-thread blocks per SM (<= 102 or 85
// registers; ptxas: the FP8 expert kernel then spills 32 or 128 bytes)
template <int FMT, int TT, bool EXPERT, int DEC>
void launch_reg(const LinArgs& a, dim3 grid, int minb) {
    constexpr int threads = rows_per_block<TT>() * 8;
    grid.x = static_cast<unsigned>((a.R + rows_per_block<TT>() - 1) / rows_per_block<TT>());
    const int64_t nb = static_cast<int64_t>(grid.x) * grid.y, nsm = sm_count();
    constexpr bool can_deep = TT == 1 && !EXPERT;
    const bool deep = can_deep && (nb <= 2 * nsm || nb > 16 * nsm);
    auto k = deep ? k_linear<FMT, TT, EXPERT, DEC, can_deep> : k_linear<FMT, TT, EXPERT, DEC, false>;
    if constexpr (TT == 1) {
        if (minb == 5) k = k_linear<FMT, 1, EXPERT, DEC, false, 5>;
        if (minb == 6) k = k_linear<FMT, 1, EXPERT, DEC, false, 6>;
    }
    GLM_LAUNCH(k, grid, threads, 0, a);
}

// The wide register kernel: one token, dense and not head-blocked, FP8 or BF16 rows of whole chunks, x
// aligned for its vector loads.
bool wide_applies(const LinArgs& a, bool expert) {
    return !expert && a.T == 1 && (a.fmt == W_FP8 || a.fmt == W_BF16) && a.C % 64 == 0 && a.rh >= a.R &&
           reinterpret_cast<uintptr_t>(a.X) % 16 == 0;
}
template <int FMT>
void launch_wide(const LinArgs& a, int lpt) {
    if constexpr (FMT == W_FP8 || FMT == W_BF16) {
        const int rpb = kWideThreads / (64 / lpt);
        const unsigned nb = static_cast<unsigned>((a.R + rpb - 1) / rpb);
        with_dec<FMT, true>(a.dec, [&](auto dec) {
            constexpr int DEC = decltype(dec)::value;
            auto k = lpt == 4 ? k_linear_wide<FMT, DEC, 4> : k_linear_wide<FMT, DEC, 2>;
            GLM_LAUNCH(k, nb, kWideThreads, 0, a);
        });
    }
}

// minb (one token): the register-bounded variants (tuning candidates)
// (MXFP4 with several tokens: the software decode)
template <int FMT, int TT, bool EXPERT>
void launch_register(const LinArgs& a, dim3 grid, int minb = 1) {
    with_dec<FMT, TT == 1>(a.dec, [&](auto dec) { launch_reg<FMT, TT, EXPERT, decltype(dec)::value>(a, grid, minb); });
}

// ---- the kernel table ---------------------------------------------------------------------------
//
// Every one-token kernel kind: its name (the prefix of its variants' names, which the tuner reports and
// the test and benchmark entry points parse), the shapes it applies to, its launch (per format and
// expert-ness; false when it does not apply after all), and the variants the tuning times. A new
// kernel is one entry here (and its launch).
using LinLaunch = bool (*)(const LinArgs& a, dim3 grid, const LinChoice& c);
struct LinLaunches {
    LinLaunch f[4][2];  // [WFmt][expert]
};
template <template <int, bool> class K>
constexpr LinLaunches launches_of() {
    return {{{&K<W_BF16, false>::run, &K<W_BF16, true>::run},
             {&K<W_F32, false>::run, &K<W_F32, true>::run},
             {&K<W_FP8, false>::run, &K<W_FP8, true>::run},
             {&K<W_MXFP4, false>::run, &K<W_MXFP4, true>::run}}};
}

struct LinKernel {
    LinKind kind;
    const char* name;  // the variants' names start with it
    const char* what;  // in errors: "the <what> does not apply to this shape"
    bool (*applies)(const LinArgs& a, bool expert, const LinChoice& c);
    void (*variants)(const LinArgs& a, bool expert, std::vector<LinChoice>& out);  // tuning candidates
    std::string (*label)(const LinChoice& c);                                     // a variant's name
    bool (*parse)(const std::string& spec, LinChoice& c);                         // the variant spec names
    LinLaunches launch;
};

template <int FMT, bool EXPERT>
struct RegisterLaunch {
    static bool run(const LinArgs& a, dim3 grid, const LinChoice&) {
        launch_register<FMT, 1, EXPERT>(a, grid, 1);
        return true;
    }
};
template <int FMT, bool EXPERT>
struct StagedLaunch {
    static bool run(const LinArgs& a, dim3 grid, const LinChoice& c) { return launch_staged<FMT, EXPERT>(a, grid, c); }
};
template <int FMT, bool EXPERT>
struct TiledLaunch {
    static bool run(const LinArgs& a, dim3 grid, const LinChoice&) {
        if (!tiled_applies(a, EXPERT)) return false;
        launch_mt<FMT, EXPERT, 1>(a, grid);
        return true;
    }
};
template <int FMT, bool EXPERT>
struct RegOccLaunch {
    static bool run(const LinArgs& a, dim3 grid, const LinChoice& c) {
        launch_register<FMT, 1, EXPERT>(a, grid, c.bps);
        return true;
    }
};
template <int FMT, bool EXPERT>
struct WideLaunch {
    static bool run(const LinArgs& a, dim3, const LinChoice& c) {
        if (!wide_applies(a, EXPERT)) return false;
        launch_wide<FMT>(a, c.lpt);
        return true;
    }
};
template <int FMT, bool EXPERT>
struct GemmLaunch {
    static bool run(const LinArgs& a, dim3 grid, const LinChoice&) {
        if (!gemm_applies(a, EXPERT)) return false;
        launch_gemm<FMT, EXPERT>(a, grid);
        return true;
    }
};
template <int FMT, bool EXPERT>
struct PairsLaunch {
    static bool run(const LinArgs& a, dim3 grid, const LinChoice&) {
        if (!pairs_applies(a, EXPERT)) return false;
        launch_pairs<FMT>(a, grid);
        return true;
    }
};
template <int FMT, bool EXPERT>
struct LanesLaunch {
    static bool run(const LinArgs& a, dim3 grid, const LinChoice&) {
        if (!lanes_applies(a, EXPERT)) return false;
        launch_lanes<FMT, EXPERT>(a, grid);
        return true;
    }
};
template <int FMT, bool EXPERT>
struct StreamLaunch {
    static bool run(const LinArgs& a, dim3 grid, const LinChoice& c) {
        if (c.xs == 1) {
            if (!stream_xs_applies(a, EXPERT, c.bps)) return false;
            if (c.bps == 1) launch_sm<FMT, EXPERT, 1, true>(a, grid);
            else launch_sm<FMT, EXPERT, 2, true>(a, grid);
            return true;
        }
        if (!stream_applies(a, EXPERT)) return false;
        if (c.bps == 1) launch_sm<FMT, EXPERT, 1, false>(a, grid);
        else if (c.bps == 2) launch_sm<FMT, EXPERT, 2, false>(a, grid);
        else launch_sm<FMT, EXPERT, 3, false>(a, grid);
        return true;
    }
};

LinChoice variant(LinKind kind, int lpt = 0, int xs = -1, int bps = 0) {
    LinChoice c;
    c.kind = kind;
    c.lpt = lpt;
    c.xs = xs;
    c.bps = bps;
    return c;
}
// spec == prefix + one digit of `digits`: that digit (else 0).
int spec_digit(const std::string& spec, const char* prefix, const char* digits) {
    const std::string p(prefix);
    if (spec.size() != p.size() + 1 || spec.compare(0, p.size(), p) != 0) return 0;
    const char d = spec.back();
    return d != '\0' && std::strchr(digits, d) ? d - '0' : 0;
}

// In the tuning's order (the first of equally fast candidates is kept).
const LinKernel& lin_kernel(LinKind kind);
// A kernel of several tokens, named by one word: never a one-token tuning candidate, its one variant its name.
template <LinKind K, bool (*APPLIES)(const LinArgs&, bool), template <int, bool> class L>
LinKernel several_token_kernel(const char* name, const char* what) {
    return {K, name, what,
            [](const LinArgs& a, bool expert, const LinChoice&) { return APPLIES(a, expert); },
            [](const LinArgs&, bool, std::vector<LinChoice>&) {},
            [](const LinChoice&) { return std::string(lin_kernel(K).name); },
            [](const std::string& spec, LinChoice& c) {
                if (spec != lin_kernel(K).name) return false;
                c = variant(K);
                return true;
            },
            launches_of<L>()};
}

const LinKernel kLinKernels[] = {
    {LinKind::Register, "register", "register kernel",
     [](const LinArgs&, bool, const LinChoice&) { return true; },
     [](const LinArgs&, bool, std::vector<LinChoice>& out) { out.push_back(variant(LinKind::Register)); },
     [](const LinChoice&) { return std::string("register"); },
     [](const std::string& spec, LinChoice& c) {
         if (spec != "register") return false;
         c = variant(LinKind::Register);
         return true;
     },
     launches_of<RegisterLaunch>()},
    // "staged:LPT:XS[:RPB:CPS]" (LPT 8, 4 or 2; XS 0 or 1; RPB <= 32)
    {LinKind::Staged, "staged", "staged kernel",
     [](const LinArgs& a, bool expert, const LinChoice&) { return staged_applies(a, expert); },
     [](const LinArgs& a, bool expert, std::vector<LinChoice>& out) {
         if (!staged_applies(a, expert)) return;
         const bool heads = a.rh < a.R && a.xhs != 0;
         for (int lpt : {8, 4, 2}) out.push_back(variant(LinKind::Staged, lpt, heads ? 0 : 1));
     },
     [](const LinChoice& c) {
         return "staged:" + std::to_string(c.lpt) + ":" + std::to_string(c.xs) +
                (c.rpb ? ":" + std::to_string(c.rpb) + ":" + std::to_string(c.cps) : "");
     },
     [](const std::string& spec, LinChoice& c) {
         if (spec.size() <= 7 || spec.compare(0, 7, "staged:") != 0) return false;
         int v[4] = {0, -1, 0, 0};
         int n = 0;
         size_t pos = 7;
         while (n < 4 && pos <= spec.size()) {
             const size_t e = spec.find(':', pos);
             const std::string f = spec.substr(pos, e == std::string::npos ? std::string::npos : e - pos);
             if (f.empty() || f.find_first_not_of("0123456789") != std::string::npos) break;
             v[n++] = std::stoi(f);
             if (e == std::string::npos) {
                 pos = spec.size() + 1;
                 break;
             }
             pos = e + 1;
         }
         if (!(pos == spec.size() + 1 && (n == 2 || n == 4) && (v[0] == 8 || v[0] == 4 || v[0] == 2) &&
               (v[1] == 0 || v[1] == 1) && v[2] >= 0 && v[2] <= 32 && v[3] >= 0))
             return false;
         c = variant(LinKind::Staged, v[0], v[1]);
         c.rpb = v[2];
         c.cps = v[3];
         return true;
     },
     launches_of<StagedLaunch>()},
    // "tiled" ("tiled:1": expert work items of one pair, linear_device)
    {LinKind::Tiled, "tiled", "tiled kernel",
     [](const LinArgs& a, bool expert, const LinChoice&) { return tiled_applies(a, expert); },
     [](const LinArgs& a, bool expert, std::vector<LinChoice>& out) {
         if (tiled_applies(a, expert)) out.push_back(variant(LinKind::Tiled));
     },
     [](const LinChoice&) { return std::string("tiled"); },
     [](const std::string& spec, LinChoice& c) {
         if (spec != "tiled" && spec != "tiled:1") return false;
         c = variant(LinKind::Tiled);
         return true;
     },
     launches_of<TiledLaunch>()},
    // "register:occ5|6"
    {LinKind::RegOcc, "register:occ", "register-bounded register kernel",
     [](const LinArgs&, bool, const LinChoice&) { return true; },
     [](const LinArgs&, bool, std::vector<LinChoice>& out) {
         for (int minb : {5, 6}) out.push_back(variant(LinKind::RegOcc, 0, -1, minb));
     },
     [](const LinChoice& c) { return "register:occ" + std::to_string(c.bps); },
     [](const std::string& spec, LinChoice& c) {
         const int d = spec_digit(spec, "register:occ", "56");
         if (d) c = variant(LinKind::RegOcc, 0, -1, d);
         return d != 0;
     },
     launches_of<RegOccLaunch>()},
    // "register:w4|2" (one token, dense, FP8 or BF16)
    {LinKind::Wide, "register:w", "wide register kernel",
     [](const LinArgs& a, bool expert, const LinChoice&) { return wide_applies(a, expert); },
     [](const LinArgs& a, bool expert, std::vector<LinChoice>& out) {
         if (wide_applies(a, expert))
             for (int lpt : {4, 2}) out.push_back(variant(LinKind::Wide, lpt));
     },
     [](const LinChoice& c) { return "register:w" + std::to_string(c.lpt); },
     [](const std::string& spec, LinChoice& c) {
         const int d = spec_digit(spec, "register:w", "42");
         if (d) c = variant(LinKind::Wide, d);
         return d != 0;
     },
     launches_of<WideLaunch>()},
    // "stream:1|2|3[x]" (x: x staged per block)
    {LinKind::Stream, "stream", "stream kernel",
     [](const LinArgs& a, bool expert, const LinChoice& c) {
         return c.xs == 1 ? stream_xs_applies(a, expert, c.bps) : stream_applies(a, expert);
     },
     [](const LinArgs& a, bool expert, std::vector<LinChoice>& out) {
         if (!stream_applies(a, expert)) return;
         for (int bps : {1, 2, 3}) {
             out.push_back(variant(LinKind::Stream, 0, -1, bps));
             if (stream_xs_applies(a, expert, bps)) out.push_back(variant(LinKind::Stream, 0, 1, bps));
         }
     },
     [](const LinChoice& c) { return "stream:" + std::to_string(c.bps) + (c.xs == 1 ? "x" : ""); },
     [](const std::string& spec, LinChoice& c) {
         const bool x = !spec.empty() && spec.back() == 'x';
         const int d = spec_digit(x ? spec.substr(0, spec.size() - 1) : spec, "stream:", "123");
         if (d) c = variant(LinKind::Stream, 0, x ? 1 : -1, d);
         return d != 0;
     },
     launches_of<StreamLaunch>()},
    // "gemm" (several tokens or expert items of several pairs)
    several_token_kernel<LinKind::Gemm, gemm_applies, GemmLaunch>("gemm", "gemm kernel"),
    // "lanes" (dense launches of several tokens)
    several_token_kernel<LinKind::Lanes, lanes_applies, LanesLaunch>("lanes", "lanes kernel"),
    // "pairs" (FP8 routed-expert items of up to 8 pairs)
    several_token_kernel<LinKind::Pairs, pairs_applies, PairsLaunch>("pairs", "pairs kernel"),
};

const LinKernel& lin_kernel(LinKind kind) {
    for (const LinKernel& k : kLinKernels)
        if (k.kind == kind) return k;
    throw std::logic_error("linear: no kernel of this kind");
}

// ---- the one-token kernel choice, measured -----------------------------------------------------
//
// Every variant of the table (the register kernel, also bounded to 5 or 6 blocks per SM; the staged
// kernel with 8/4/2 lanes per thread; the tiled kernel; the wide register kernel; the streaming kernel
// at 1-3 blocks per SM; each with every decode path of the format) computes the same bits, so which is
// fastest for a shape is a question for the device, not for the numerics: the first one-token launch
// of each shape (format, rows, columns, head blocking, expert items, decode path) times the candidates
// on the real operands, each after evicting L2 (decode streams every weight from HBM), and keeps the
// fastest. The candidates all write the same Y, so the call's result is unchanged. Off under the CPU
// emulation (the engine option tune=False also turns it off): there the staged kernel with 8 lanes is
// used wherever it applies, the register kernel elsewhere.
struct TuneKey {
    int fmt, R, rh, dec;
    int64_t C;
    bool expert;
    unsigned gy, gz;  // gz 2: gate and up in one launch, twice the blocks of one matrix
    bool operator<(const TuneKey& o) const {
        return std::tie(fmt, R, rh, dec, C, expert, gy, gz) <
               std::tie(o.fmt, o.R, o.rh, o.dec, o.C, o.expert, o.gy, o.gz);
    }
};
struct TuneResult {
    LinChoice choice;
    std::vector<std::pair<std::string, float>> us;
};
std::map<TuneKey, TuneResult>& tuned() {
    static std::map<TuneKey, TuneResult> m;
    return m;
}
bool tuning_on() {
#if defined(GLM_CUDA_EMU)
    return false;
#else
    return launch_options().tune;
#endif
}
std::string choice_name(const LinChoice& c) {
    const std::string base = lin_kernel(c.kind).label(c);
    if (c.dec < 0) return base;
    return base + (c.dec == kDecHw ? "/hw" : (c.dec == kDecInt ? "/int" : "/sw"));
}

// One token with kernel choice c (c.dec: another decode path); false when c does not apply to a's shape.
template <int FMT, bool EXPERT>
bool launch_one_token(const LinArgs& a, dim3 grid, const LinChoice& c) {
    if (c.dec >= 0 && c.dec != a.dec) {  // every decode path gives the same values: the tuning times them
        LinArgs b = a;
        b.dec = c.dec;
        LinChoice d = c;
        d.dec = -1;
        return launch_one_token<FMT, EXPERT>(b, grid, d);
    }
    return lin_kernel(c.kind).launch.f[FMT][EXPERT ? 1 : 0](a, grid, c);
}

// The fastest one-token kernel for a's shape: timed over the candidates on the first call (which
// leaves their common result in Y), looked up after.
template <int FMT, bool EXPERT>
LinChoice tuned_choice(const LinArgs& a, dim3 grid) {
    const TuneKey key{a.fmt, a.R, a.rh < a.R ? a.rh : 0, a.dec, a.C, EXPERT, grid.y, grid.z};
    auto it = tuned().find(key);
    if (it != tuned().end()) return it->second.choice;
    std::vector<LinChoice> cands;
    for (const LinKernel& k : kLinKernels) k.variants(a, EXPERT, cands);
    if (a.dec == kDecInt) {  // the same kernels with the hardware E4M3 conversion (MXFP4: the software decode)
        const size_t n = cands.size();
        for (size_t j = 0; j < n; ++j) {
            LinChoice c = cands[j];
            c.dec = FMT == W_FP8 ? kDecHw : kDecSw;
            cands.push_back(c);
        }
    }
    TuneResult res;
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    float best = 1e30f;
    for (const LinChoice& c : cands) {
        float t_min = 1e30f;
        for (int rep = 0; rep < 2; ++rep) {
            flush_l2();
            check(cudaEventRecord(e0, 0), "event");
            launch_one_token<FMT, EXPERT>(a, grid, c);
            check(cudaEventRecord(e1, 0), "event");
            check(cudaEventSynchronize(e1), "tuning");
            float ms = 0;
            check(cudaEventElapsedTime(&ms, e0, e1), "event");
            t_min = std::min(t_min, ms);
        }
        res.us.emplace_back(choice_name(c), 1e3f * t_min);
        if (t_min < best) {
            best = t_min;
            res.choice = c;
        }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return tuned().emplace(key, res).first->second.choice;
}

template <int FMT, int TT, bool EXPERT>
void launch_fmt(const LinArgs& a, dim3 grid) {
    if constexpr (TT == 1) {
        LinChoice c = a.choice;            // a kernel forced by a test or benchmark, else the engine's choice:
        if (c.kind == LinKind::Auto) {     // the measured one where a shared-memory kernel applies, the register kernel elsewhere
            const bool staged = !a.no_staged && staged_applies(a, EXPERT);  // (untuned: staged, LPT 8)
            if (!a.no_staged && tuning_on() && (staged || stream_applies(a, EXPERT))) c = tuned_choice<FMT, EXPERT>(a, grid);
            else c.kind = staged ? LinKind::Staged : LinKind::Register;
        }
        if (launch_one_token<FMT, EXPERT>(a, grid, c)) return;
    } else if (!a.no_staged) {  // forced: the gemm or the tiled kernel; else the register-tiled kernel where chosen
        const LinKind k = a.choice.kind;
        if (k == LinKind::Lanes || (k == LinKind::Auto && lanes_chosen(a, EXPERT))) {
            if (LanesLaunch<FMT, EXPERT>::run(a, grid, a.choice)) return;
        }
        if (k == LinKind::Pairs || (k == LinKind::Auto && pairs_chosen(a, EXPERT))) {
            if (PairsLaunch<FMT, EXPERT>::run(a, grid, a.choice)) return;
        }
        if (k == LinKind::Gemm || (k == LinKind::Auto && gemm_chosen(a, EXPERT))) {
            if (GemmLaunch<FMT, EXPERT>::run(a, grid, a.choice)) return;
        }
        if (tiled_applies(a, EXPERT)) {
            launch_mt<FMT, EXPERT, TT>(a, grid);
            return;
        }
    }
    launch_register<FMT, TT, EXPERT>(a, grid);
}

template <int TT, bool EXPERT>
void launch_tt(const LinArgs& a, dim3 grid) {
    switch (a.fmt) {
        case W_BF16: launch_fmt<W_BF16, TT, EXPERT>(a, grid); break;
        case W_F32: launch_fmt<W_F32, TT, EXPERT>(a, grid); break;
        case W_FP8: launch_fmt<W_FP8, TT, EXPERT>(a, grid); break;
        case W_MXFP4: launch_fmt<W_MXFP4, TT, EXPERT>(a, grid); break;
        default: throw std::logic_error("linear: unknown weight format");
    }
}

void run(LinArgs a, bool expert, int tile, const Nm& nm) {
    if (a.R <= 0) return;
    if (!expert && a.T <= 0) return;
    if (nm.seq) {
        const int ty = expert ? a.max_items : (a.T + tile - 1) / tile;
        if (ty > 65535) throw std::invalid_argument("dot='sequential': at most 65535 expert work items per step");
        dim3 grid((a.R + 127) / 128, ty, expert && a.dtab2 ? 2 : 1);
        if (expert) {
            auto k = k_linear_seq<true>;
            GLM_LAUNCH(k, grid, 128, 0, a, tile);
        } else {
            auto k = k_linear_seq<false>;
            GLM_LAUNCH(k, grid, 128, 0, a, tile);
        }
        check_launch("linear (sequential)");
        return;
    }
    const int TT = tile;
    const unsigned gx = 1;  // set per instantiation (rows per block)
    const unsigned gy = static_cast<unsigned>(expert ? std::min(a.max_items, 65535) : (a.T + TT - 1) / TT);
    if (gy == 0) return;
    dim3 grid(gx, gy, expert && a.dtab2 ? 2 : 1);
    // expert items only one kernel takes (expert_tile gives them only where it does): 64 pairs, the
    // lane-pass kernel; 16, the register-tiled kernel
    auto only = [&](LinKind kind) {
        if (a.fmt < W_BF16 || a.fmt > W_MXFP4 || !lin_kernel(kind).launch.f[a.fmt][1](a, grid, a.choice))
            throw std::invalid_argument("linear: expert items of " + std::to_string(TT) + " pairs need the " +
                                        lin_kernel(kind).what + ", which does not apply");
    };
    if (expert && TT == kLanesItem) {
        only(LinKind::Lanes);
    } else if (expert && TT == 16) {
        only(LinKind::Gemm);
    } else if (expert) {
        if (TT == 1) launch_tt<1, true>(a, grid);
        else if (TT == 4) launch_tt<4, true>(a, grid);
        else launch_tt<8, true>(a, grid);
    } else {
        if (TT == 1) launch_tt<1, false>(a, grid);
        else if (TT == 4) launch_tt<4, false>(a, grid);
        else launch_tt<8, false>(a, grid);
    }
    check_launch("linear");
}

int tile_for(int T) { return T <= 1 ? 1 : (T <= 4 ? 4 : 8); }
int gemm_tile_for(int T) { return T >= 16 ? 16 : tile_for(T); }  // (one expert's pairs: the gemm kernel's items)

int dec_for(int fmt, bool int_decode, bool hw8) {
    if (fmt == W_MXFP4) return int_decode ? kDecInt : kDecSw;
    if (fmt != W_FP8) return kDecSw;
    return int_decode ? kDecInt : (hw8 ? kDecHw : kDecSw);
}

__global__ void k_e4m3_nan_scan(const uint8_t* p, size_t n, int* found) {
    pdl_enter();
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        if ((p[i] & 0x7Fu) == 0x7Fu) *found = 1;
}

}  // namespace

void linear(const Lin& W, const float* X, int64_t ldx, float* Y, int64_t ldy, int T, bool round, const Nm& nm,
            bool hw8) {
    linear_heads(W, static_cast<int>(W.R), static_cast<int>(W.R), 0, 0, X, ldx, 0, Y, ldy, T, round, nm, hw8);
}

void linear_heads(const Lin& W, int R, int rh, int64_t hstride, int64_t woff, const float* X, int64_t ldx,
                  int64_t xhs, float* Y, int64_t ldy, int T, bool round, const Nm& nm, bool hw8) {
    LinArgs a;
    a.fmt = W.fmt;
    a.C = W.C;
    a.data = W.data;
    a.scale = W.scale;
    a.row0 = W.row0;
    a.R = R;
    a.rh = rh > 0 ? rh : 1;
    a.hstride = hstride;
    a.woff = woff;
    a.X = X;
    a.ldx = ldx;
    a.xhs = xhs;
    a.Y = Y;
    a.ldy = ldy;
    a.T = T;
    a.round = round;
    a.dec = dec_for(W.fmt, W.int_decode, hw8);
    a.hw8 = hw8;
    run(a, false, tile_for(T), nm);
}

namespace {
LinArgs expert_args(const ExpertTable& W, const int* items, const int* n_items, int max_items, const int* pairs,
                    const float* X, int64_t ldx, int xdiv, int p_split, float* Y, int64_t ldy, int tile) {
    LinArgs a;
    a.fmt = W.fmt;
    a.C = W.C;
    a.R = static_cast<int>(W.R);
    a.rh = a.R;
    a.X = X;
    a.ldx = ldx;
    a.Y = Y;
    a.ldy = ldy;
    a.round = true;
    a.dtab = W.data;
    a.stab = W.scale;
    a.items = items;
    a.n_items = n_items;
    a.max_items = max_items;
    a.pairs = pairs;
    a.xdiv = xdiv;
    a.p_split = p_split;
    a.tile_pairs = tile;
    a.experts = W.E;
    return a;
}
}  // namespace

void linear_experts(const ExpertTable& W, const int* items, const int* n_items, int max_items, const int* pairs,
                    const float* X, int64_t ldx, int xdiv, int p_split, float* Y, int64_t ldy, int tile,
                    const Nm& nm, bool hw8) {
    LinArgs a = expert_args(W, items, n_items, max_items, pairs, X, ldx, xdiv, p_split, Y, ldy, tile);
    a.dec = dec_for(W.fmt, W.int_decode, hw8);
    a.hw8 = hw8;
    run(a, true, tile, nm);
}

void linear_experts2(const ExpertTable& W, const ExpertTable& W2, const int* items, const int* n_items, int max_items,
                     const int* pairs, const float* X, int64_t ldx, int xdiv, int p_split, float* Y, float* Y2,
                     int64_t ldy, int tile, const Nm& nm, bool hw8) {
    if (W2.fmt != W.fmt || W2.R != W.R || W2.C != W.C) {  // one launch needs one kernel for both tables
        linear_experts(W, items, n_items, max_items, pairs, X, ldx, xdiv, p_split, Y, ldy, tile, nm, hw8);
        linear_experts(W2, items, n_items, max_items, pairs, X, ldx, xdiv, p_split, Y2, ldy, tile, nm, hw8);
        return;
    }
    LinArgs a = expert_args(W, items, n_items, max_items, pairs, X, ldx, xdiv, p_split, Y, ldy, tile);
    a.dtab2 = W2.data;
    a.stab2 = W2.scale;
    a.Y2 = Y2;
    // one decode path for both (the template's): every path decodes exactly, the integer one only NaN-free codes
    a.dec = dec_for(W.fmt, W.int_decode && W2.int_decode, hw8);
    a.hw8 = hw8;
    run(a, true, tile, nm);
}

int expert_tile(int T, int k, int E, bool gemm16) {
    if (T == 1 || 2 * T * k < E) return 1;
    if (gemm16 && experts_may_take16(T, k, E)) return 16;
    return 8;
}
bool experts_may_take16(int T, int k, int E) { return T > 1 && T * k >= 16 * E; }
bool experts_take_lanes(const ExpertTable& W, const float* X, int64_t ldx) {
    return lanes_applies(expert_args(W, nullptr, nullptr, 1, nullptr, X, ldx, 1, 0, nullptr, 0, kLanesItem), true);
}
void x_lanes(const float* X, int64_t ldx, int T, int nch, int64_t ldT, float* Xp) {
    if (ldT % 32 != 0 || ldT < T || nch > 65535) throw std::invalid_argument("x_lanes: ldT a multiple of 32, at least T");
    auto k = k_x_lanes;
    GLM_LAUNCH(k, dim3(static_cast<unsigned>(ldT / 32), static_cast<unsigned>(nch)), 256, 0, X, ldx, T, nch, ldT, Xp);
}

bool experts_take_pairs(const ExpertTable& W, const float* X, int64_t ldx, int max_items) {
    return pairs_chosen(expert_args(W, nullptr, nullptr, max_items, nullptr, X, ldx, 1, 0, nullptr, 0, 8), true);
}

bool experts_take_gemm(const ExpertTable& W, const float* X, int64_t ldx) {
    return launch_options().gemm && gemm_takes_items16(expert_args(W, nullptr, nullptr, 1, nullptr, X, ldx, 1, 0, nullptr, 0, 16));
}

std::vector<TunedShape> tuned_shapes() {
    std::vector<TunedShape> out;
    for (const auto& kv : tuned()) {
        TunedShape t;
        t.fmt = wfmt_name(kv.first.fmt);
        t.R = kv.first.R;
        t.C = kv.first.C;
        t.expert_items = kv.first.expert ? static_cast<int>(kv.first.gy) : 0;
        t.tables = std::max(1, static_cast<int>(kv.first.gz));
        t.heads = kv.first.rh != 0;
        t.decode = kv.first.dec == kDecInt ? "int" : (kv.first.dec == kDecHw ? "hw" : "sw");
        t.choice = choice_name(kv.second.choice);
        t.us = kv.second.us;
        out.push_back(t);
    }
    return out;
}

bool fp8_scales_foldable(const float* scale, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        const float s2 = scale[i] * 0x1p120f;  // (exact or overflowing: a power-of-two multiply)
        if (!(s2 - s2 == 0.0f)) return false;  // inf or NaN
    }
    return true;
}

bool mxfp4_scales_foldable(const uint8_t* scale, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (scale[i] > 240) return false;
    return true;
}

bool e4m3_nan_free_device(const void* data, size_t n) {
    if (n == 0) return true;
    void* dv = nullptr;
    check(cudaMalloc(&dv, sizeof(int)), "cudaMalloc");
    int* d = static_cast<int*>(dv);
    int found = 0;
    check(cudaMemcpy(d, &found, sizeof(int), cudaMemcpyHostToDevice), "nan scan");
    auto k = k_e4m3_nan_scan;
    GLM_LAUNCH(k, 1024, 256, 0, static_cast<const uint8_t*>(data), n, d);
    check_launch("nan scan");
    const cudaError_t e = cudaMemcpy(&found, d, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d);
    check(e, "nan scan");
    return found == 0;
}

// ---- test and benchmark entry points ------------------------------------------------------------

namespace {

// kernel: "auto" (the engine's choice), "staged" (the engine's choice where the staged kernel applies,
// refused elsewhere) or a variant of kLinKernels ("register", "register:occ5|6", "register:w4|2",
// "stream:1|2|3[x]", "tiled", "tiled:1", "staged:LPT:XS[:RPB:CPS]") -> the forced choice; no_staged:
// "register" (several tokens too); "tiled" gives expert work items of tile_for(T) pairs, "gemm" of 16
// from 16 pairs (else tile_for(T)), "tiled:1" of one.
LinChoice parse_kernel(const std::string& kernel, bool& no_staged, bool& require_staged) {
    no_staged = kernel == "register";
    require_staged = kernel.rfind("staged", 0) == 0;
    LinChoice c;
    if (kernel == "auto" || kernel == "staged") return c;
    for (const LinKernel& k : kLinKernels)
        if (k.parse(kernel, c)) return c;
    throw std::invalid_argument("linear: kernel must be 'auto', 'register', 'register:occ5', 'register:occ6', "
                                "'register:w4', 'register:w2' (one token, dense, FP8 or BF16), "
                                "'stream:1|2|3' (x: x staged), 'tiled', 'gemm', 'lanes', "
                                "'tiled:1', 'staged' or "
                                "'staged:LPT:XS[:RPB:CPS]' "
                                "(LPT 8, 4 or 2; XS 0 or 1), not '" + kernel + "'");
}

// "lanes8", "lanes16" (and with ":1"): "lanes" ("lanes:1") with 8 or 16 tokens a thread (EngineOptions::lanes_tn;
// "lanes" takes the engine's rule, lanes_tn_for); o takes the options in force, lanes_tn set as the name says.
// The name without the width.
std::string lanes_width(const std::string& kernel, EngineOptions& o) {
    o = launch_options();
    for (const int tn : {8, 16}) {
        const std::string w = "lanes" + std::to_string(tn);
        if (kernel.rfind(w, 0) == 0 && (kernel.size() == w.size() || kernel[w.size()] == ':')) {
            o.lanes_tn = tn;
            return "lanes" + kernel.substr(w.size());
        }
    }
    return kernel;
}

// A forced kernel must apply to the launch's shape ("staged": the staged kernel).
void check_forced(const LinArgs& a, bool expert, bool require_staged, const char* who) {
    const LinKind kind = require_staged ? LinKind::Staged : a.choice.kind;
    if (kind == LinKind::Auto) return;
    const LinKernel& k = lin_kernel(kind);
    if (!k.applies(a, expert, a.choice))
        throw std::invalid_argument(std::string(who) + ": the " + k.what + " does not apply to this shape");
}

void parse_decode(const std::string& d) {
    if (d != "auto" && d != "sw" && d != "hw" && d != "int")
        throw std::invalid_argument("linear: decode must be 'auto', 'sw', 'hw' or 'int', not '" + d + "'");
}
// FP8 decode path: auto = the engine's choice (integer placement for NaN-free weights whose scales
// are below 2^8, else hardware); 'int' on other weights is refused. MXFP4: 'int' (placement, scales
// <= 240) or 'sw'; auto takes 'int' where it applies.
int dec_of(const std::string& d, int fmt, bool int_decode) {
    if (d == "int" && !int_decode && fmt == W_FP8)
        throw std::invalid_argument("linear: decode 'int' needs weights without NaN codes and scales below 2^8");
    if (d == "int" && !int_decode && fmt == W_MXFP4)
        throw std::invalid_argument("linear: decode 'int' needs MXFP4 scales of at most 240");
    if (d == "sw") return kDecSw;
    if (d == "hw") return fmt == W_FP8 ? kDecHw : kDecSw;
    return dec_for(fmt, int_decode, true);  // auto, int: the engine's choice
}

// Y[t][r] over all R rows of one matrix (no head blocking), x rows ldx apart, y rows R apart.
LinArgs whole_matrix_args(int fmt, int64_t R, int64_t C, const void* X, int64_t ldx, void* Y, int T, bool round,
                          bool no_staged) {
    LinArgs a;
    a.fmt = fmt;
    a.C = C;
    a.R = static_cast<int>(R);
    a.rh = a.R;
    a.X = static_cast<const float*>(X);
    a.ldx = ldx;
    a.Y = static_cast<float*>(Y);
    a.ldy = R;
    a.T = T;
    a.round = round;
    a.no_staged = no_staged;
    return a;
}

struct DevBufs {
    std::vector<void*> p;
    void* alloc(size_t n) {
        void* q = nullptr;
        check(cudaMalloc(&q, n ? n : 16), "cudaMalloc");
        p.push_back(q);
        return q;
    }
    ~DevBufs() {
        for (void* q : p) cudaFree(q);
    }
};

// Work items of `tile` consecutive pairs (the last may hold fewer), item i on expert i % n_experts:
// [3T] items (the unused ones zero), then n_items, then [T] pairs (pair t is token row t).
std::vector<int> expert_items(int T, int n_experts, int tile = 1) {
    std::vector<int> it(static_cast<size_t>(T) * 4 + 1);
    int n = 0;
    for (int t = 0; t < T; t += tile, ++n) {
        it[3 * static_cast<size_t>(n)] = n % n_experts;
        it[3 * static_cast<size_t>(n) + 1] = t;
        it[3 * static_cast<size_t>(n) + 2] = T - t < tile ? T - t : tile;
    }
    for (int t = 0; t < T; ++t) it[3 * static_cast<size_t>(T) + 1 + static_cast<size_t>(t)] = t;
    it[3 * static_cast<size_t>(T)] = n;
    return it;
}

void set_expert_args(LinArgs& a, const void* tables, const void* items, int T, int n_experts, int tile = 1) {
    const int* di = static_cast<const int*>(items);
    a.dtab = static_cast<const void* const*>(tables);
    a.stab = static_cast<const void* const*>(tables) + n_experts;
    a.items = di;
    a.n_items = di + 3 * T;
    a.pairs = di + 3 * T + 1;
    a.max_items = (T + tile - 1) / tile;
    a.tile_pairs = tile;
}

__global__ void k_fill_bytes(unsigned char* p, size_t n, uint32_t seed, int fmt) {
    pdl_enter();
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        unsigned char b = static_cast<unsigned char>(h);
        if (fmt == W_FP8 && (b & 0x7F) == 0x7F) b = 0x7E;
        if (fmt == W_BF16 && (i & 1)) b = static_cast<unsigned char>(0x3C + (b & 1));  // |w| in [2^-7, 2^-5)
        if (fmt == W_F32 && (i & 3) == 3) b = 0x3C;
        p[i] = b;
    }
}
void fill(void* p, size_t n, uint32_t seed, int fmt) {
    auto k = k_fill_bytes;
    GLM_LAUNCH(k, 1024, 256, 0, static_cast<unsigned char*>(p), n, seed, fmt);
    check_launch("fill");
}
}  // namespace

std::vector<float> linear_device(const std::string& release, const void* data, size_t data_bytes, const void* scale,
                                 size_t scale_bytes, int64_t R, int64_t C, const float* X, int T, bool round,
                                 const std::string& kernel_name, bool expert, const std::string& decode,
                                 const LinHeads* heads) {
    EngineOptions opts;
    const std::string kernel = lanes_width(kernel_name, opts);
    const ActiveOptions active(opts);
    const int fmt = parse_release(release);
    parse_decode(decode);
    bool no_staged = false, require_staged = false;
    // "gemm:8": the gemm kernel with expert items of 8 pairs whatever T (so that a test's blocks take several
    // items each, as the engine's decode batches do)
    const bool gemm8 = expert && kernel == "gemm:8";
    // "lanes:1": the lane-pass kernel's expert launch one item at a time (x re-laid and the kernel launched
    // per group of items, as launches past kLanesItemsGroup floats of x take them)
    const bool lanes1 = expert && kernel == "lanes:1";
    const LinChoice choice = parse_kernel(gemm8 ? "gemm" : (lanes1 ? "lanes" : kernel), no_staged, require_staged);
    if (R <= 0 || C <= 0 || T <= 0) throw std::invalid_argument("linear: R, C and T must be positive");
    if (expert && T > 65535) throw std::invalid_argument("linear: at most 65535 pairs");
    const int64_t ldx = heads ? heads->ldx : C, out_rows = heads ? heads->out_rows : R;
    if (heads) {
        const LinHeads& h = *heads;
        const int64_t nh = h.rh > 0 ? (h.out_rows + h.rh - 1) / h.rh : 0;
        if (expert || h.rh <= 0 || h.out_rows <= 0 || h.hstride < 0 || h.woff < 0 || h.xhs < 0 ||
            (nh - 1) * h.hstride + h.woff + std::min(h.rh, h.out_rows) > R || (nh - 1) * h.xhs + C > h.ldx)
            throw std::invalid_argument("linear: heads (out_rows, rh, hstride, woff, xhs) outside the weights or x");
    }
    DevBufs B;
    void* dd = B.alloc(data_bytes);
    void* ds = B.alloc(scale_bytes);
    void* dx = B.alloc(static_cast<size_t>(T) * ldx * 4);
    void* dy = B.alloc(static_cast<size_t>(T) * out_rows * 4);
    void* dtab = B.alloc(2 * sizeof(void*));
    void* ditems = B.alloc(static_cast<size_t>(T) * 4 * 4 + 4);
    check(cudaMemcpy(dd, data, data_bytes, cudaMemcpyHostToDevice), "linear: weights");
    if (scale_bytes) check(cudaMemcpy(ds, scale, scale_bytes, cudaMemcpyHostToDevice), "linear: scales");
    check(cudaMemcpy(dx, X, static_cast<size_t>(T) * ldx * 4, cudaMemcpyHostToDevice), "linear: X");
    LinArgs a = whole_matrix_args(fmt, out_rows, C, dx, ldx, dy, T, round, no_staged);
    if (heads) {
        a.rh = static_cast<int>(heads->rh);
        a.hstride = heads->hstride;
        a.woff = heads->woff;
        a.xhs = heads->xhs;
    }
    a.dec = dec_of(decode, fmt,
                   fmt == W_FP8 ? e4m3_nan_free_device(dd, data_bytes) &&
                                      fp8_scales_foldable(static_cast<const float*>(scale), scale_bytes / 4)
                                : fmt == W_MXFP4 && mxfp4_scales_foldable(static_cast<const uint8_t*>(scale), scale_bytes));
    a.hw8 = decode != "int";  // (as the engine, unless the integer decode is asked for)
    a.choice = choice;
    if (expert) {
        // one expert (the matrix), each token row its own work item of one pair
        const void* tab[2] = {dd, ds};
        check(cudaMemcpy(dtab, tab, sizeof(tab), cudaMemcpyHostToDevice), "linear: table");
        const int tile = gemm8 || kernel == "pairs" ? 8
                         : kernel == "gemm" ? gemm_tile_for(T)
                                            : (kernel == "tiled" ? tile_for(T) : (kernel == "lanes" || lanes1 ? kLanesItem : 1));
        const std::vector<int> it = expert_items(T, 1, tile);
        check(cudaMemcpy(ditems, it.data(), it.size() * 4, cudaMemcpyHostToDevice), "linear: items");
        set_expert_args(a, dtab, ditems, T, 1, tile);
        a.lanes_group = lanes1 ? 1 : 0;
        check_forced(a, true, require_staged, "linear");
        run(a, true, tile, Nm{});
    } else {
        a.data = dd;
        a.scale = ds;
        check_forced(a, false, require_staged, "linear");
        run(a, false, tile_for(T), Nm{});
    }
    std::vector<float> y(static_cast<size_t>(T) * out_rows);
    check(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost), "linear: Y");
    check(cudaDeviceSynchronize(), "linear");
    return y;
}

double linear_bench_device(const std::string& release, int64_t R, int64_t C, int experts, const std::string& kernel,
                           int reps, const std::string& decode) {
    const int fmt = parse_release(release);
    parse_decode(decode);
    bool no_staged = false, require_staged = false;
    const LinChoice choice = parse_kernel(kernel, no_staged, require_staged);
    if (R <= 0 || C <= 0 || C % 64 != 0 || experts < 0 || experts > 64 || reps < 1)
        throw std::invalid_argument("linear_bench: R > 0, C a positive multiple of 64, 0 <= experts <= 64, reps >= 1");
    const int nmat = std::max(1, experts);
    const size_t wbytes = static_cast<size_t>(R) * static_cast<size_t>(row_bytes(fmt, C));
    const size_t sbytes = fmt == W_FP8 ? static_cast<size_t>((R + 127) / 128) * ((C + 127) / 128) * 4
                                       : (fmt == W_MXFP4 ? static_cast<size_t>(R) * (C / 32) : 0);
    DevBufs B;
    std::vector<const void*> tab(2 * static_cast<size_t>(nmat));
    for (int e = 0; e < nmat; ++e) {
        void* w = B.alloc(wbytes);
        fill(w, wbytes, 17u + static_cast<uint32_t>(e), fmt);
        void* sc = B.alloc(sbytes);
        if (sbytes) fill(sc, sbytes, 1000u + static_cast<uint32_t>(e), W_F32);  // FP8: ~2^-7 scales; E8M0 codes
        tab[static_cast<size_t>(e)] = w;
        tab[static_cast<size_t>(nmat + e)] = sc;
    }
    void* dx = B.alloc(static_cast<size_t>(C) * 4);
    fill(dx, static_cast<size_t>(C) * 4, 5u, W_F32);
    const int T = std::max(1, experts);
    void* dy = B.alloc(static_cast<size_t>(T) * R * 4);
    LinArgs a = whole_matrix_args(fmt, R, C, dx, 0, dy, 1, true, no_staged);  // ldx 0: every pair reads one x
    a.dec = dec_of(decode, fmt, true);  // the fill makes no NaN codes
    a.hw8 = decode != "int";  // (as the engine, unless the integer decode is asked for)
    a.choice = choice;
    void* dtab = nullptr;
    if (experts > 0) {
        dtab = B.alloc(tab.size() * sizeof(void*));
        check(cudaMemcpy(dtab, tab.data(), tab.size() * sizeof(void*), cudaMemcpyHostToDevice), "bench: table");
        const std::vector<int> it = expert_items(T, nmat);
        void* ditems = B.alloc(it.size() * 4);
        check(cudaMemcpy(ditems, it.data(), it.size() * 4, cudaMemcpyHostToDevice), "bench: items");
        set_expert_args(a, dtab, ditems, T, nmat);
        if (require_staged && !staged_applies(a, true))
            throw std::invalid_argument("linear_bench: the staged kernel does not apply to this shape");
    } else {
        a.data = tab[0];
        a.scale = tab[1];
        if (require_staged && !staged_applies(a, false))
            throw std::invalid_argument("linear_bench: the staged kernel does not apply to this shape");
    }
    auto once = [&] {
        if (experts > 0) run(a, true, 1, Nm{});
        else run(a, false, 1, Nm{});
    };
    return median_us(reps, true, once);
}


// ---- several-token benchmarks (tools/bench_gemm.py) ----------------------------------------------

namespace {
// Independent FMA chains (kFfmaChains per thread, a dependent chain each): the FP32 FMA peak of the
// device, measured in the same process as the linear kernels it is the yardstick for.
constexpr int kFfmaChains = 16;
__global__ void __launch_bounds__(512) k_ffma_peak(float b, float c, int iters, float* out) {
    pdl_enter();
    float v[kFfmaChains];
#pragma unroll
    for (int k = 0; k < kFfmaChains; ++k) v[k] = static_cast<float>(threadIdx.x + k);
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int k = 0; k < kFfmaChains; ++k) v[k] = ffma(v[k], b, c);
    }
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kFfmaChains; ++k) s = fadd(s, v[k]);
    if (s == 1.2345f) out[0] = s;  // (never: keeps the chains alive)
}

}  // namespace

double ffma_peak_device(int reps) {
    if (reps < 1) throw std::invalid_argument("bench_ffma: reps >= 1");
    DevBufs B;
    float* out = static_cast<float*>(B.alloc(4));
    const int blocks = 4 * sm_count(), threads = 512, iters = 1 << 14;
    auto k = k_ffma_peak;
    const double us = median_us(reps, false, [&] { GLM_LAUNCH(k, blocks, threads, 0, 1.0000001f, 1e-7f, iters, out); });
    check_launch("bench_ffma");
    return 2.0 * blocks * threads * kFfmaChains * static_cast<double>(iters) / (us * 1e-6);  // FLOP/s
}

double linear_bench_tokens_device(const std::string& release, int64_t R, int64_t C, int T, int experts, int topk,
                                  const std::string& kernel_name, int reps, const std::string& decode) {
    EngineOptions opts;
    const std::string kernel = lanes_width(kernel_name, opts);
    const ActiveOptions active(opts);
    const int fmt = parse_release(release);
    parse_decode(decode);
    bool no_staged = false, require_staged = false;
    const LinChoice choice = parse_kernel(kernel, no_staged, require_staged);
    if (R <= 0 || C <= 0 || C % 64 != 0 || T < 1 || experts < 0 || reps < 1 || (experts > 0 && (topk < 1 || topk > experts)))
        throw std::invalid_argument("linear_bench_tokens: R > 0, C a positive multiple of 64, T >= 1, reps >= 1, "
                                    "experts >= 0, 1 <= topk <= experts");
    const int nmat = std::max(1, experts);
    const int npairs = experts > 0 ? T * topk : T;
    const size_t wbytes = static_cast<size_t>(R) * static_cast<size_t>(row_bytes(fmt, C));
    const size_t sbytes = static_cast<size_t>(scale_bytes(fmt, R, C));
    DevBufs B;
    std::vector<const void*> tab(2 * static_cast<size_t>(nmat));
    for (int e = 0; e < nmat; ++e) {
        void* w = B.alloc(wbytes);
        fill(w, wbytes, 17u + static_cast<uint32_t>(e), fmt);
        void* sc = B.alloc(sbytes);
        if (sbytes) fill(sc, sbytes, 1000u + static_cast<uint32_t>(e), W_F32);
        tab[static_cast<size_t>(e)] = w;
        tab[static_cast<size_t>(nmat + e)] = sc;
    }
    void* dx = B.alloc(static_cast<size_t>(T) * C * 4);
    fill(dx, static_cast<size_t>(T) * C * 4, 5u, W_F32);
    void* dy = B.alloc(static_cast<size_t>(npairs) * R * 4);
    LinArgs a = whole_matrix_args(fmt, R, C, dx, C, dy, T, true, no_staged);
    a.dec = dec_of(decode, fmt, true);  // the fill makes no NaN codes
    a.hw8 = decode != "int";  // (as the engine, unless the integer decode is asked for)
    a.choice = choice;
    int tile = tile_for(T);
    if (experts > 0) {
        // top-k routing: token t's j-th expert (h(t) + j * (E / k)) % E (k distinct experts), the pairs
        // grouped by expert in pair order, items of the engine's tile (moe.cu), or of one ('tiled:1', 'stream:N')
        const bool g16 = kernel == "gemm" || (kernel == "auto" && launch_options().gemm);
        const bool one = kernel == "tiled:1" || choice.kind == LinKind::Stream;
        tile = one ? 1 : expert_tile(T, topk, experts, g16 && gemm_takes_items16(a));
        if (kernel == "lanes") tile = kLanesItem;  // (x taken as rows in lane order: the fill's order is any)
        std::vector<std::vector<int>> by(static_cast<size_t>(experts));
        for (int t = 0; t < T; ++t) {
            const uint32_t h = (static_cast<uint32_t>(t) * 2654435761u) >> 7;
            for (int j = 0; j < topk; ++j)
                by[(h + static_cast<uint32_t>(j) * static_cast<uint32_t>(experts / topk)) % static_cast<uint32_t>(experts)]
                    .push_back(t * topk + j);
        }
        std::vector<int> items, pairs;
        for (int e = 0; e < experts; ++e) {
            const std::vector<int>& p = by[static_cast<size_t>(e)];
            for (size_t i = 0; i < p.size(); i += static_cast<size_t>(tile)) {
                items.push_back(e);
                items.push_back(static_cast<int>(pairs.size() + i));
                items.push_back(static_cast<int>(std::min(p.size() - i, static_cast<size_t>(tile))));
            }
            pairs.insert(pairs.end(), p.begin(), p.end());
        }
        const int n = static_cast<int>(items.size() / 3);
        std::vector<int> buf(items);
        buf.push_back(n);
        buf.insert(buf.end(), pairs.begin(), pairs.end());
        int* di = static_cast<int*>(B.alloc(buf.size() * 4));
        check(cudaMemcpy(di, buf.data(), buf.size() * 4, cudaMemcpyHostToDevice), "bench: items");
        void* dtab = B.alloc(tab.size() * sizeof(void*));
        check(cudaMemcpy(dtab, tab.data(), tab.size() * sizeof(void*), cudaMemcpyHostToDevice), "bench: table");
        a.dtab = static_cast<const void* const*>(dtab);
        a.stab = static_cast<const void* const*>(dtab) + nmat;
        a.items = di;
        a.n_items = di + 3 * n;
        a.pairs = di + 3 * n + 1;
        a.max_items = n;
        a.tile_pairs = tile;
        a.xdiv = topk;
        check_forced(a, true, require_staged, "linear_bench_tokens");
    } else {
        a.data = tab[0];
        a.scale = tab[1];
        check_forced(a, false, require_staged, "linear_bench_tokens");
    }
    const bool ex = experts > 0;
    const double us = median_us(reps, true, [&] { run(a, ex, tile, Nm{}); });
    check(cudaDeviceSynchronize(), "linear_bench_tokens");
    return us;
}

}  // namespace glm::cuda
