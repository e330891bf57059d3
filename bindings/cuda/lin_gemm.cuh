// The register-tiled several-token kernel (k_linear_gemm).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// ---- the register-tiled kernel ------------------------------------------------------------------
//
// Y[t][r] = cdot(W[r], X[t]) for a tile of rows x tokens (or an expert work item's pairs). Each output
// is 64 FMA chains P[g][l] (chain k = 8g + l takes the columns 64c + k, c in order); chains, rows and
// tokens are independent, so this is 64 small GEMMs of depth C/64 side by side, one per chain, whose
// results are folded by the canonical trees once at the end. A thread owns ONE chain k of 8 rows x 8
// tokens (64 accumulators), SGEMM-style: per chunk two 16-byte loads of its rows' weights and two of its
// tokens' x, 64 FMAs. For that the block keeps both transposed in shared memory, chain-major: W^T
// [column][row] and X^T [column][token] (a column 64u + k of the slab is one row of each). The 512
// threads are 64 chains x 8 (row groups x token groups): BM = 32 rows x BN = 16 tokens (TG = 4: dense
// launches, expert items of 16 pairs), 64 x 8 for expert items of up to eight pairs (TG = 2: decode
// batches, whose experts hold a few pairs each; an item computes its pairs rounded up to a power of two). A tile of 128 rows x 4 pairs (a thread 16 x 4) for items
// of four was slower than items of 8 in every decode batch (H200, slice FP8: b128 3811-3937 against
// 4633-4685 tok/s), its decode per FMA twice theirs: not kept.
//
// Per slab of S chunks (gm_slab): the block's weight rows (raw bytes) and its tokens' x rows (f32)
// arrive by cp.async (gm_stages: up to two slabs in flight); a slab ahead of its use, each weight is
// decoded ONCE (every token of the tile reads that value), exactly as the other kernels decode it
// (decode_raw8), and stored transposed, and the x rows are transposed; two buffers of each, one barrier
// per slab. Paddings: raw rows by 16 bytes and x rows by 4 floats (the transposing threads' 16-byte
// loads, eight rows apart, fall on distinct banks), W^T rows by 4 floats (a warp's four chains'
// 16-byte loads spread over the banks), X^T rows by 4.
//
// Earlier (sessions 5-13) a thread held 4 chains x 4 rows x 4 tokens fed by 8 loads per 64 FMAs from
// row-major slabs; ncu found shared memory the limit (LDS.128 at two or more wavefronts each, 59 % of
// the wavefront peak at 31 % of the FMA pipe): this layout halves the loads per FMA.
//
// The fold (after the last chunk): every thread writes its 64 sums to shared memory ([chain][token][row]),
// then thread o folds output o (token o / BM, row o % BM): its 64 chains in the canonical trees (P[g] +=
// P[g + w] for w = 4, 2, 1, then the lanes of P[0] likewise).
constexpr int kGmThreads = 512;
template <int TG>
constexpr int gm_rows() {  // rows per block
    return TG == 4 ? 32 : 64;
}
template <int TG>
constexpr int gm_tokens() {  // tokens (or pairs) per block
    return 4 * TG;
}
template <int FMT, int TG, int S>
constexpr int gm_stage_bytes_s() {  // raw weight rows (+16 bytes), then x rows (+4 floats)
    return gm_rows<TG>() * (S * chunk_bytes<FMT>() + 16) + gm_tokens<TG>() * (S * 64 + 4) * 4;
}
template <int TG, int S>
constexpr int gm_t_bytes_s() {  // the two transposed buffers of W and X
    return 2 * S * 64 * ((gm_rows<TG>() + 4) + (gm_tokens<TG>() + 4)) * 4;
}
template <int FMT, int TG, int S, int ST>
constexpr bool gm_fits() {
    return ST * gm_stage_bytes_s<FMT, TG, S>() + gm_t_bytes_s<TG, S>() <= 227 * 1024;
}
// Chunks per slab (4 where three stages fit, else 2, else 1) and cp.async stages (4 where they fit, else 3).
template <int FMT, int TG>
constexpr int gm_slab() {
    return gm_fits<FMT, TG, 4, 3>() ? 4 : (gm_fits<FMT, TG, 2, 3>() ? 2 : 1);
}
template <int TG>
constexpr int gm_fold_bytes() {  // [chain][token][row]
    return 64 * gm_rows<TG>() * gm_tokens<TG>() * 4;
}
template <int FMT, int TG, int S, int ST>
constexpr bool gm_overlap_fits() {  // the fold buffer past ST stages (1 KiB left for the static arrays)
    constexpr int t = gm_t_bytes_s<TG, S>(), f = gm_fold_bytes<TG>();
    return ST * gm_stage_bytes_s<FMT, TG, S>() + (t > f ? t : f) + 1024 <= 227 * 1024;
}
// Stages: 4 where they fit, else 3; and 3 where only 3 leave room for the fold buffer past them (FP8
// items of 16: the next item's copies during the fold measured worth more than a fourth stage, bench_gemm
// at 2048 tokens gate 14449 -> 14254 us, down 16822 -> 16627; perf.md "Session 18").
template <int FMT, int TG>
constexpr int gm_stages() {
    constexpr int S = gm_slab<FMT, TG>();
    if (!gm_overlap_fits<FMT, TG, S, 4>() && gm_overlap_fits<FMT, TG, S, 3>()) return 3;
    return gm_fits<FMT, TG, S, 4>() ? 4 : 3;
}
// Whether the fold buffer fits past the stages (over the transposed buffers), so that an expert block's
// next item can be copied in while it folds.
template <int FMT, int TG>
constexpr bool gm_overlap() {
    return gm_overlap_fits<FMT, TG, gm_slab<FMT, TG>(), gm_stages<FMT, TG>()>();
}
template <int FMT, int TG>
constexpr int gm_smem_bytes() {
    constexpr int S = gm_slab<FMT, TG>();
    const int stages = gm_stages<FMT, TG>() * gm_stage_bytes_s<FMT, TG, S>(), t = gm_t_bytes_s<TG, S>();
    const int fold = gm_fold_bytes<TG>();
    if (gm_overlap<FMT, TG>()) return stages + (t > fold ? t : fold);
    return stages + t > fold ? stages + t : fold;
}

// Sixteen consecutive weights of a row from shared memory (p: their first byte), decoded as decode_raw8
// does (m: the chunk's multiplier, as there), eight at a time: put(e0, w) takes weights e0 .. e0 + 7.
template <int FMT, int DEC, class Put>
GLM_DEV void decode16(const unsigned char* p, float m, Put&& put) {
    float w[8];
    if constexpr (FMT == W_F32) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            decode_smem<FMT, DEC, 8>(p + 32 * h, m, w);
            put(8 * h, w);
        }
    } else {
        // the two raw words in one load where they fit in 16 bytes (FP8 16, MXFP4 8; BF16 two of 16)
        constexpr size_t kTwo = 2 * sizeof(Raw8<FMT>);
        struct alignas(kTwo < 16 ? kTwo : 16) Two {
            Raw8<FMT> h[2];
        };
        const Two v = *reinterpret_cast<const Two*>(p);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            decode_raw8<FMT, DEC>(v.h[h], m, w);
            put(8 * h, w);
        }
    }
}

template <int FMT, bool EXPERT, int DEC, int TG>
__global__ void __launch_bounds__(kGmThreads, 1) k_linear_gemm(LinArgs a) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int CB = chunk_bytes<FMT>(), BM = gm_rows<TG>(), BN = gm_tokens<TG>();
    constexpr int RT = 8, TT = 8, RGN = BM / RT;  // a thread: RT rows x TT tokens
    constexpr int S = gm_slab<FMT, TG>(), ST = gm_stages<FMT, TG>();
    constexpr bool kOverlap = EXPERT && gm_overlap<FMT, TG>();
    constexpr int WRAW = S * CB + 16;                 // bytes per staged raw row
    constexpr int XROW = S * 64 + 4;                  // floats per staged x row
    constexpr int WS = BM + 4, XS = BN + 4;           // floats per row of W^T, X^T
    constexpr int SBYTES = gm_stage_bytes_s<FMT, TG, S>();
    constexpr int TASKS = BM * S * 4;                 // decode tasks per slab: 16 weights of one row
    constexpr int NT = (TASKS + kGmThreads - 1) / kGmThreads;
    constexpr int XTASKS = BN * S * 16;               // transposition tasks: 4 x floats of one token
    constexpr int NXT = (XTASKS + kGmThreads - 1) / kGmThreads;
    static_assert(BM * BN == kGmThreads, "the fold: one output per thread");
    static_assert(BM >= 32, "a warp's decode tasks are 32 rows of one column group");
    static_assert(gm_smem_bytes<FMT, TG>() <= 227 * 1024, "shared memory");
    static_assert(!EXPERT || 2 * gm_smem_bytes<FMT, TG>() > 228 * 1024, "one block an SM: launch_gemm_tg's resident grid of expert units");
    __shared__ const unsigned char* rowp[BM];
    __shared__ const float* xrow[BN];
    float* const Wt = reinterpret_cast<float*>(sm + ST * SBYTES);  // [2][S * 64][WS]
    float* const Xt = Wt + 2 * S * 64 * WS;                         // [2][S * 64][XS]
    const int64_t C = a.C;
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + S - 1) / S;
    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
    const int k = 4 * (tid >> 5) + (lane >> 3);                      // this thread's chain
    const int rg = (lane & 7) % RGN, tg = (lane & 7) / RGN;          // its rows RT rg .., tokens TT tg ..
    // Its rows: RT rg .. RT rg + 7, or with kHalves two groups of four half a tile apart (4 rg .. 4 rg + 3
    // and BM / 2 + 4 rg ..): with one token group (TG 2) a quarter warp's eight row groups then load 128
    // contiguous bytes of a W^T row, where eight 32-byte strides put two threads on each bank group
    // (ncu, items of 8 at 128 tokens: every W^T load two wavefronts a quarter warp).
    constexpr bool kHalves = TG == 2;
    const int row_off = kHalves ? 4 * rg : RT * rg;  // the first group's offset within a W^T row
    static_assert(!kHalves || 4 * RGN == BM / 2, "two groups of four rows per row group");
    auto load_rows = [&](const float* wp, float (&wv)[RT]) {
        if constexpr (kHalves) {
            const float4 lo = *reinterpret_cast<const float4*>(wp), hi = *reinterpret_cast<const float4*>(wp + BM / 2);
            wv[0] = lo.x, wv[1] = lo.y, wv[2] = lo.z, wv[3] = lo.w, wv[4] = hi.x, wv[5] = hi.y, wv[6] = hi.z, wv[7] = hi.w;
        } else {
            load_n<RT>(wp, wv);
        }
    };
    // the block's first row (expert items: its unit's, set_item)
    int row_base = EXPERT ? 0 : static_cast<int>(blockIdx.x) * BM;
    const int64_t rb = row_bytes(FMT, C);
    auto abs_row = [&](int r) {  // rows past R read the last row (computed, never stored)
        return weight_row(a, r < a.R ? r : a.R - 1);
    };
    // this thread's decode tasks (the same in every slab): task tid + n * threads is row gi % BM, column
    // group (16 weights) (gi / BM) % 4 of chunk gi / (4 BM) of the slab: a warp's 32 tasks are 32 rows of
    // one group, so that its transposed stores fill consecutive words. Their scales' offsets (32-bit:
    // gemm_applies).
    int dscale[NT];
    auto set_scales = [&] {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int gi = tid + n * kGmThreads;
            const int64_t ar = abs_row(row_base + gi % BM);
            dscale[n] = static_cast<int>(FMT == W_FP8 ? (ar / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar * (C / 32) : 0));
        }
    };
    set_scales();
    // Expert items: units (item i, row block b: unit i rbs + b), unit blockIdx.x, then every gridDim.x-th, by
    // blocks that all stay resident (launch_gemm_tg: one an SM over the z halves), as the lane-pass kernel's
    // expert units: the blocks finish within a unit of each other, not a wave of blocks walking ~20 items.
    const int rbs = EXPERT ? static_cast<int>((a.R + BM - 1) / BM) : 1;
    const int n_units = EXPERT ? *a.n_items * rbs : 1;
    const int stride = EXPERT ? static_cast<int>(gridDim.x) : 1;
    int unit = EXPERT ? static_cast<int>(blockIdx.x) : 0;
    if (unit >= n_units) return;
    // the unit in hand (block_work); set_item also stages its rows' and tokens' addresses and, for expert
    // units, sets the unit's rows and their decode tasks' scale offsets
    const void* data = nullptr;
    const void* scale = nullptr;
    int start = 0, cnt = 0;
    auto set_item = [&](int u) {
        const int it = EXPERT ? u / rbs : u;
        if constexpr (EXPERT) {  // (every decode of the previous unit is done: its fold follows begin_item)
            row_base = (u - it * rbs) * BM;
            set_scales();
        }
        const BlockWork bw = block_work<EXPERT>(a, it, static_cast<int>(blockIdx.y), BN);
        data = bw.data, scale = bw.scale, start = bw.start, cnt = bw.cnt;
        // (the previous item's copies are issued and, where the fold shares their memory, its fold read)
        __syncthreads();
        if (tid < BM) rowp[tid] = static_cast<const unsigned char*>(data) + abs_row(row_base + tid) * rb;
        if (tid < BN) {  // slots past cnt compute the last token again (not stored)
            const int j = tid < cnt ? tid : cnt - 1;
            int64_t xr;
            if constexpr (EXPERT) xr = pair_xrow(a, a.pairs[start + j]);
            else xr = static_cast<int64_t>(start) + j;
            // (head-blocked: the block's rows lie in one head, gemm_applies; its x is that head's)
            xrow[tid] = a.X + xr * a.ldx + (EXPERT ? 0 : static_cast<int64_t>(row_base / a.rh) * a.xhs);
        }
        __syncthreads();
    };
    // This thread's 16-byte pieces of a whole slab (the same in every slab but for the column offset):
    // weight piece p (< BM * PPR) is row p / PPR, bytes 16 (p % PPR); x piece p is token p / (16 S),
    // floats 4 (p % (16 S)). Destinations are 32-bit shared addresses within a stage. A last slab of
    // fewer chunks takes the general loop.
    constexpr int PPR = S * CB / 16, NWP = (BM * PPR + kGmThreads - 1) / kGmThreads;
    constexpr int NXP = (BN * S * 16 + kGmThreads - 1) / kGmThreads;
    constexpr bool kWAll = BM * PPR % kGmThreads == 0, kXAll = BN * S * 16 % kGmThreads == 0;
    const unsigned char* wsrc[NWP];
    int wdst[NWP];
    const float* xsrc[NXP];
    int xdst[NXP];
    auto set_copies = [&] {  // (after set_item)
#pragma unroll
        for (int n = 0; n < NWP; ++n) {
            const int p = tid + n * kGmThreads, i = p / PPR < BM ? p / PPR : BM - 1;
            wsrc[n] = rowp[i] + 16 * (p % PPR);
            wdst[n] = kWAll || p < BM * PPR ? i * WRAW + 16 * (p % PPR) : -1;
        }
#pragma unroll
        for (int n = 0; n < NXP; ++n) {
            const int p = tid + n * kGmThreads, j = p / (16 * S) < BN ? p / (16 * S) : BN - 1;
            xsrc[n] = xrow[j] + 4 * (p % (16 * S));
            xdst[n] = kXAll || p < BN * S * 16 ? BM * WRAW + 4 * (j * XROW + 4 * (p % (16 * S))) : -1;
        }
    };
    const uint32_t sm_s = smem_u32(sm);
    auto chunks_of = [&](int s) { return nchunks - s * S < S ? nchunks - s * S : S; };  // chunks of slab s
    // slab s's copies; FULL: it has S chunks (no test)
    auto issue = [&](int s, bool full) {
        const int c0 = s * S;
        const int nc = full ? S : chunks_of(s);
        const uint32_t buf = sm_s + static_cast<uint32_t>((s % ST) * SBYTES);
        if (full || nc == S) {
#pragma unroll
            for (int n = 0; n < NWP; ++n)
                if (kWAll || wdst[n] >= 0) cp_async16_s(buf + wdst[n], wsrc[n] + static_cast<int64_t>(c0) * CB);
#pragma unroll
            for (int n = 0; n < NXP; ++n)
                if (kXAll || xdst[n] >= 0) cp_async16_s(buf + xdst[n], xsrc[n] + 64 * static_cast<int64_t>(c0));
            return;
        }
        const int ppr = nc * CB / 16;
        for (int p = tid; p < BM * ppr; p += kGmThreads) {
            const int i = p / ppr, q = p - i * ppr;
            cp_async16_s(buf + i * WRAW + 16 * q, rowp[i] + static_cast<int64_t>(c0) * CB + 16 * q);
        }
        for (int p = tid; p < BN * nc * 16; p += kGmThreads) {
            const int j = p / (nc * 16), q = p - j * (nc * 16);
            cp_async16_s(buf + BM * WRAW + 4 * (j * XROW + 4 * q), xrow[j] + 64 * static_cast<int64_t>(c0) + 4 * q);
        }
    };
    // the multipliers of slab s's tasks (decode_raw8; loaded a slab ahead of their decode; chunks past
    // the last read the last chunk's, never used; FULL: none is)
    auto load_scales = [&](int s, float (&sc)[NT], bool full) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int gi = tid + n * kGmThreads;
            int ch = s * S + gi / (4 * BM);  // the task's chunk
            if (!full) ch = ch < nchunks ? ch : nchunks - 1;
            sc[n] = 0.0f;
            // (32-bit offsets: gemm_applies; a task's 16 columns share a scale)
            if constexpr (FMT == W_FP8) {
                sc[n] = fp8_mult<DEC>(__ldg(static_cast<const float*>(scale) + (dscale[n] + (ch >> 1))));
            } else if constexpr (FMT == W_MXFP4) {
                const uint32_t e = __ldg(static_cast<const uint8_t*>(scale) + (dscale[n] + 2 * ch + ((gi / BM) % 4) / 2));
                sc[n] = DEC == kDecInt ? e8m0_folded(e) : e8m0(e);
            }
        }
    };
    // raw slab s -> W^T and X^T buffers s & 1 (each weight decoded once, as the other kernels decode
    // it); FULL: every chunk of the slab is there (no test)
    auto decode = [&](int s, const float (&sc)[NT], bool full) {
        const int nc = full ? S : chunks_of(s);
        const unsigned char* buf = sm + (s % ST) * SBYTES;
        float* const W = Wt + (s & 1) * (S * 64 * WS);
        float* const X = Xt + (s & 1) * (S * 64 * XS);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int gi = tid + n * kGmThreads;
            const int i = gi % BM, cg = (gi / BM) % 4, u = gi / (4 * BM);
            if ((TASKS % kGmThreads == 0 || gi < TASKS) && (full || u < nc)) {
                float* d = W + (64 * u + 16 * cg) * WS + i;
                decode16<FMT, DEC>(buf + i * WRAW + u * CB + cg * (CB / 4), sc[n], [&](int e0, const float (&w)[8]) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) d[(e0 + e) * WS] = w[e];
                });
            }
        }
        const float* xs = reinterpret_cast<const float*>(buf + BM * WRAW);
#pragma unroll
        for (int n = 0; n < NXT; ++n) {
            const int xi = tid + n * kGmThreads;
            const int j = xi % BN, q = xi / BN;  // token j, floats 4q .. + 3 of the slab
            if ((XTASKS % kGmThreads == 0 || xi < XTASKS) && (full || q < 16 * nc)) {
                store_kmajor4(X + 4 * q * XS + j, *reinterpret_cast<const float4*>(xs + j * XROW + 4 * q), XS);
            }
        }
    };
    float acc[RT][TT];  // [row i][token j] of chain k
    // chunk u for the first n of the thread's tokens (the slots past an item's pairs are not computed:
    // their sums are never stored)
    auto chunk_n = [&](const float* W, const float* X, int u, auto n_) {
        constexpr int n = decltype(n_)::value, NX = (n + 3) / 4 * 4;
        const float* wp = W + (64 * u + k) * WS + row_off;
        const float* xp = X + (64 * u + k) * XS + TT * tg;
        float wv[RT], xv[NX];
        load_rows(wp, wv);
        load_n<NX>(xp, xv);
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int j = 0; j < n; ++j) acc[i][j] = ffma(wv[i], xv[j], acc[i][j]);
    };
    auto slab_w = [&](int s) { return static_cast<const float*>(Wt + (s & 1) * (S * 64 * WS)); };
    auto slab_x = [&](int s) { return static_cast<const float*>(Xt + (s & 1) * (S * 64 * XS)); };
    // One barrier per slab. Iteration s: slab s + 1 is in (cp.async) and slab s decoded and transposed
    // (the iteration before); the barrier also ends every thread's use of slab s - 1 (its stage, which
    // slab s + ST - 1 then refills, and its transposed buffers, which slab s + 1 then takes); then
    // compute slab s and decode slab s + 1.
    float sc[NT];
    // item it in hand: its rows and tokens staged, this thread's copies set, its first ST - 1 slabs issued
    auto begin_item = [&](int it) {
        set_item(it);
        set_copies();
        for (int s = 0; s < ST - 1; ++s) {
            if (s < nst) issue(s, false);
            cp_async_commit();
        }
    };
    // While slab s, the slab it decodes (s + 1) and the one it refills (s + ST - 1) are whole, the
    // iteration is one branch-free block; the last slabs take the general loop.
    const int nfull = nchunks / S;
    // the slabs, each chunk for the first n of the thread's tokens
    auto slabs = [&](auto n_) {
        int s = 0;
        for (; s + ST - 1 < nfull; ++s) {
            cp_async_wait<ST - 3>();
            __syncthreads();
            issue(s + ST - 1, true);
            cp_async_commit();
            const float* W = slab_w(s);
            const float* X = slab_x(s);
#pragma unroll
            for (int u = 0; u < S; ++u) chunk_n(W, X, u, n_);
            decode(s + 1, sc, true);
            load_scales(s + 2, sc, true);  // (s + 2 < s + ST - 1: whole)
        }
        for (; s < nst; ++s) {
            cp_async_wait<ST - 3>();
            __syncthreads();
            if (s + ST - 1 < nst) issue(s + ST - 1, false);
            cp_async_commit();
            if (s + 1 < nst) {
                decode(s + 1, sc, false);
                load_scales(s + 2, sc, false);
            }
            const int nc = chunks_of(s);
            const float* W = slab_w(s);
            const float* X = slab_x(s);
#pragma unroll 1
            for (int u = 0; u < nc; ++u) chunk_n(W, X, u, n_);
        }
    };
    // The items. With kOverlap the next item's first slabs are on their way while this one folds
    // (its fold buffer lies past the stages); else they follow the fold, which reuses the stages.
    begin_item(unit);
    for (;;) {
        load_scales(0, sc, false);
        cp_async_wait<ST - 2>();
        __syncthreads();
        decode(0, sc, false);
        load_scales(1, sc, false);
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int j = 0; j < TT; ++j) acc[i][j] = 0.0f;
        // Expert items of up to 8 pairs (TG 2: every thread holds all the block's slots) compute their
        // pairs rounded up to 1, 2, 3, 4, 6 or 8 (the few-pair kernel's counts), not all 8 slots: decode
        // batches leave most experts one to four pairs, and a 512-token prefill's items of 8 beside items
        // of 16 hold the remainders (powers of two computed 6 slots as 8: docs/perf.md, "Session 33").
        // (The slab loop is specialised, not each chunk: eight variants of every chunk cost whole items
        // 2-6 %, bench_gemm on the H200 at 256-512 tokens.)
        if constexpr (EXPERT && TG == 2) with_slots8(cnt, slabs);
        else slabs(std::integral_constant<int, TT>{});
        const int fstart = start, fcnt = cnt, frow = row_base;  // the unit folded
        const int next = unit + stride;
        if constexpr (kOverlap) {
            // (every copy of this unit has landed: each slab was waited for before its decode)
            if (next < n_units) begin_item(next);
        } else {
            cp_async_wait<0>();
        }
        // the fold: every chain's sums to red[chain][token][row], then one output a thread
        float* const red = reinterpret_cast<float*>(sm + (kOverlap ? ST * SBYTES : 0));
        __syncthreads();  // every thread is done with the last slab
#pragma unroll
        for (int j = 0; j < TT; ++j)
#pragma unroll
            for (int i = 0; i < RT; i += 4) {
                float* d = red + k * (BM * BN) + (TT * tg + j) * BM + row_off + (kHalves ? i / 4 * (BM / 2) : i);
                *reinterpret_cast<float4*>(d) = make_float4(acc[i][j], acc[i + 1][j], acc[i + 2][j], acc[i + 3][j]);
            }
        __syncthreads();
        const int o = tid, slot = o / BM, r = frow + o % BM;
        const float y = fold64(red + o, BM * BN);
        if (r < a.R && slot < fcnt) {
            float* const Y = EXPERT && blockIdx.z != 0 ? a.Y2 : a.Y;
            int64_t yrow;
            if constexpr (EXPERT) yrow = a.pairs[fstart + slot];
            else yrow = static_cast<int64_t>(fstart) + slot;
            Y[yrow * a.ldy + r] = a.round ? bf16r(y) : y;
        }
        unit = next;
        if (unit >= n_units) break;
        if constexpr (!kOverlap) {
            begin_item(unit);  // (set_item's first barrier: every thread has read the fold)
        }
    }
}

}  // namespace
}  // namespace glm::cuda
