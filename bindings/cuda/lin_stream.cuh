// The streaming one-token kernel (k_linear_stream: persistent warps, bulk-copy rings).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// ---- the streaming one-token kernel -------------------------------------------------------------
//
// One token row (or expert items of one pair) streamed by warps that live for the whole launch. The
// launch's rows are cut into units of four consecutive rows of one matrix (of one expert item and
// table); warp w of the grid takes units w, w + (warps in the grid), ..., so the warps sweep the
// weights as one front. Each warp streams its units' rows into its own ring of sm_slots buffers by
// bulk asynchronous copies (one per row and stage of 1 KB, completing on the buffer's memory barrier;
// lane 0 announces the bytes, lanes 0-3 copy a row each) as soon as the buffer is free, across unit
// boundaries: the weights keep
// arriving while a unit is folded and written, and no warp waits on another. (A block-wide stage of 32
// rows, refilled by one warp after a block barrier, ran at 1-2.5 TB/s on the H200: the rows' copies
// leave one warp one at a time.) x is read through L1 as by the register kernel. Each row is computed
// as by the register kernel: thread g of the row's eight owns P[g][0..7] (chunks in order, one FMA
// each), then group_fold. Only where the bytes wait changes.
constexpr int kSmThreads = 256;
constexpr int kSmWarps = kSmThreads / 32;
template <int MINB, bool XS = false>
constexpr int sm_slots() {  // buffers per warp: 6 (one block per SM), 3 (two) or 2 (three); one less with x staged
    return MINB == 1 ? (XS ? 5 : 6) : (MINB == 2 ? (XS ? 2 : 3) : 2);
}
template <int FMT>
constexpr int sm_cps() {  // chunks per stage: 1 KB of each row
    return 1024 / chunk_bytes<FMT>();
}
template <int FMT>
constexpr int sm_pitch() {  // a buffer's row stride: consecutive rows on other banks
    return 1024 + (chunk_bytes<FMT>() < 64 ? chunk_bytes<FMT>() : 64);
}
template <int FMT, int MINB, bool XS = false>
constexpr int sm_block_bytes() {
    return kSmWarps * sm_slots<MINB, XS>() * 4 * sm_pitch<FMT>();
}

// Unit u of the launch (four rows): which matrix, rows, x and y. Units run over (item, table, row
// group), row groups fastest.
struct SmUnit {
    const unsigned char* data;
    const void* scale;
    const float* x;  // dense: add the row's head offset
    float* y;
    int r0;  // first output row
};
template <bool EXPERT>
GLM_DEV SmUnit sm_unit(const LinArgs& a, int u, int nrg) {
    SmUnit s;
    s.r0 = (u % nrg) * 4;
    if constexpr (EXPERT) {
        const int nz = a.dtab2 ? 2 : 1;
        const int item = u / nrg / nz, z = (u / nrg) % nz;
        const int e = a.items[3 * item], p = a.pairs[a.items[3 * item + 1]];
        s.data = static_cast<const unsigned char*>((z ? a.dtab2 : a.dtab)[e]);
        s.scale = (z ? a.stab2 : a.stab)[e];
        s.x = a.X + pair_xrow(a, p) * a.ldx;
        s.y = (z ? a.Y2 : a.Y) + static_cast<int64_t>(p) * a.ldy;
    } else {
        s.data = static_cast<const unsigned char*>(a.data);
        s.scale = a.scale;
        s.x = a.X;
        s.y = a.Y;
    }
    return s;
}
GLM_DEV int64_t weight_row(const LinArgs& a, int r) {
    return a.row0 + static_cast<int64_t>(r / a.rh) * a.hstride + a.woff + (r % a.rh);
}

// MINB: blocks per SM the launch keeps resident (1, 2 or 3), so the registers fit that many. XS: every
// row reads one x row (row 0 of X), staged once per block after the rings: the chunk loop reads x from
// shared memory instead of through L1.
template <int FMT, bool EXPERT, int DEC, int MINB, bool XS>
__global__ void __launch_bounds__(kSmThreads, MINB) k_linear_stream(LinArgs a) {
    pdl_release();  // (pdl_wait() below: a.early requests the first stages' weights before it)
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int CB = chunk_bytes<FMT>(), CPS = sm_cps<FMT>(), PITCH = sm_pitch<FMT>(), S = sm_slots<MINB, XS>();
    __shared__ uint64_t bars[kSmWarps][S];
    const int64_t C = a.C;
    const int64_t rbytes = row_bytes(FMT, C);
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + CPS - 1) / CPS;
    const int nrg = (a.R + 3) / 4;
    const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31, i = lane >> 3, g = lane & 7;
    const int gw = static_cast<int>(blockIdx.x) * kSmWarps + warp, GW = static_cast<int>(gridDim.x) * kSmWarps;
    unsigned char* wsm = sm + warp * S * 4 * PITCH;
    uint64_t* wb = bars[warp];
    if (lane == 0)
        for (int s = 0; s < S; ++s) mbar_init(&wb[s], 1);
    mbar_init_fence();
    __syncthreads();
    // Early (dense launches, a.early): the units and the weights depend on no kernel, so the first stages
    // are requested before the wait for the previous kernel, under its tail. Everything else after it.
    const bool early = !EXPERT && a.early;
    int nunits = 0, K = 0;  // this warp's stages, in order
    auto count = [&] {
        nunits = EXPERT ? *a.n_items * (a.dtab2 ? 2 : 1) * nrg : nrg;
        K = gw < nunits ? (nunits - gw + GW - 1) / GW * nst : 0;
    };

    // The issue cursor: the next stage to request (its index, column stage, unit and buffer). The whole
    // warp runs it; lane 0 announces the bytes, lane r copies row r of the unit (1 KB or less).
    int ik = 0, is = 0, iu = gw, islot = 0, irows = 0;
    const unsigned char* isrc = nullptr;
    auto issue_next = [&] {
        if (is == 0) {
            const SmUnit un = sm_unit<EXPERT>(a, iu, nrg);
            irows = a.R - un.r0 < 4 ? a.R - un.r0 : 4;
            isrc = un.data + weight_row(a, un.r0 + (lane < irows ? lane : 0)) * rbytes;
        }
        const int c0 = is * CPS, nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
        uint64_t* bar = &wb[islot];
        if (lane == 0) mbar_arrive_expect(bar, static_cast<unsigned>(irows * nc * CB));
        __syncwarp();
        if (lane < irows)
            bulk_copy(wsm + (islot * 4 + lane) * PITCH, isrc + static_cast<int64_t>(c0) * CB, static_cast<unsigned>(nc * CB), bar);
        ++ik;
        if (++is == nst) {
            is = 0;
            iu += GW;
        }
        if (++islot == S) islot = 0;
    };
    if (early) {
        count();
        while (ik < S && ik < K) issue_next();
    }
    pdl_wait();
    float* xsm = reinterpret_cast<float*>(sm + kSmWarps * S * 4 * PITCH);  // (XS) after every warp's ring
    if constexpr (XS) {
        for (int q = tid; q < static_cast<int>(C / 4); q += kSmThreads)
            reinterpret_cast<float4*>(xsm)[q] = __ldg(reinterpret_cast<const float4*>(a.X) + q);
        __syncthreads();
    }
    if (!early) {
        count();
        while (ik < S && ik < K) issue_next();
    }

    float acc[8];
    zero8(acc);
    SmUnit un{};
    const float* xr = nullptr;
    int64_t srow = 0;  // this row's scale row (FP8: its 128-row block's; MXFP4: its own)
    bool live = false;
    int s = 0, u = gw, slot = 0;
    unsigned phase = 0;
    for (int k = 0; k < K; ++k) {
        if (s == 0) {
            un = sm_unit<EXPERT>(a, u, nrg);
            const int r = un.r0 + i;
            live = r < a.R;
            const int rr = live ? r : a.R - 1;
            const int64_t ar = weight_row(a, rr);
            srow = FMT == W_FP8 ? (ar / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar * (C / 32) : 0);
            xr = un.x + (EXPERT ? 0 : static_cast<int64_t>(rr / a.rh) * a.xhs) + 8 * g;
        }
        const int c0 = s * CPS, nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
        const unsigned char* row = wsm + (slot * 4 + i) * PITCH + g * (CB / 8);
        const float* xs = (XS ? xsm + 8 * g : xr) + 64 * static_cast<int64_t>(c0);
        // FP8: the stage's scales (one per two chunks) loaded before the wait, so that their latency
        // passes under it instead of inside the chunk loop
        float sv[FMT == W_FP8 ? CPS / 2 : 1];
        if constexpr (FMT == W_FP8) {
            const float* sp = static_cast<const float*>(un.scale) + srow + c0 / 2;
#pragma unroll
            for (int q = 0; q < CPS / 2; ++q) sv[q] = 2 * q < nc ? __ldg(sp + q) : 0.0f;
        }
        mbar_wait(&wb[slot], phase);
        if (live) {
            // chunk c with its scale (FP8: already times 2^120 for the integer decode, as scale_fp8 does)
            auto chunk = [&](int c, float sc) {
                float w[8];
                if constexpr (FMT == W_FP8) {
                    const uint2 v = *reinterpret_cast<const uint2*>(row + c * CB);
                    e4m3_words<DEC>(v.x, v.y, w);
#pragma unroll
                    for (int l = 0; l < 8; ++l) w[l] = fmul(w[l], sc);  // w = fl32(e4m3 * scale_inv)
                } else {
                    decode_smem<FMT, DEC, 8>(row + c * CB, sc, w);
                }
                const float4 x0 = XS ? *reinterpret_cast<const float4*>(xs + 64 * c) : __ldg(reinterpret_cast<const float4*>(xs + 64 * c));
                const float4 x1 = XS ? *reinterpret_cast<const float4*>(xs + 64 * c + 4)
                                     : __ldg(reinterpret_cast<const float4*>(xs + 64 * c + 4));
                acc[0] = ffma(w[0], x0.x, acc[0]);
                acc[1] = ffma(w[1], x0.y, acc[1]);
                acc[2] = ffma(w[2], x0.z, acc[2]);
                acc[3] = ffma(w[3], x0.w, acc[3]);
                acc[4] = ffma(w[4], x1.x, acc[4]);
                acc[5] = ffma(w[5], x1.y, acc[5]);
                acc[6] = ffma(w[6], x1.z, acc[6]);
                acc[7] = ffma(w[7], x1.w, acc[7]);
            };
            auto scale_of = [&](int c) {  // chunk c's scale (FP8: one per two chunks, 128 columns)
                if constexpr (FMT == W_FP8) {
                    const float sv = __ldg(static_cast<const float*>(un.scale) + srow + (c0 + c) / 2);
                    return DEC == kDecInt ? fmul(sv, 0x1p120f) : sv;
                } else if constexpr (FMT == W_MXFP4) {
                    const uint32_t e = __ldg(static_cast<const uint8_t*>(un.scale) + srow + 2 * (c0 + c) + g / 4);
                    return DEC == kDecInt ? e8m0_folded(e) : e8m0(e);
                } else {
                    return 0.0f;
                }
            };
            if (nc == CPS) {
                if constexpr (FMT == W_FP8) {
#pragma unroll
                    for (int c = 0; c < CPS; c += 2) {
                        const float sc = DEC == kDecInt ? fmul(sv[c / 2], 0x1p120f) : sv[c / 2];
                        chunk(c, sc);
                        chunk(c + 1, sc);
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < CPS; ++c) chunk(c, scale_of(c));
                }
            } else {
                for (int c = 0; c < nc; ++c) chunk(c, scale_of(c));
            }
        }
        __syncwarp();  // every lane is done with buffer `slot`: refill it
        if (ik < K) issue_next();
        if (s == nst - 1) {
            const float y = group_fold(acc);
            if (live && g == 0) un.y[un.r0 + i] = a.round ? bf16r(y) : y;
            zero8(acc);
        }
        if (++s == nst) {
            s = 0;
            u += GW;
        }
        if (++slot == S) {
            slot = 0;
            phase ^= 1u;
        }
    }
}

}  // namespace
}  // namespace glm::cuda
