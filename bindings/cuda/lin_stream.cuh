// The streaming one-token kernel (k_linear_stream: persistent warps, bulk-copy rings).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// ---- the streaming one-token kernel -------------------------------------------------------------
//
// One token row (or expert items of one pair) streamed by warps that live for the whole launch. The
// launch's rows are cut into units of eight consecutive rows of one matrix (of one expert item and
// table); warp w of the grid takes units w, w + (warps in the grid), ..., so the warps sweep the
// weights as one front. Each warp streams its units' rows into its own ring of sm_slots buffers by
// bulk asynchronous copies (one per row and stage of 512 bytes, completing on the buffer's memory
// barrier; lane 0 announces the bytes, lanes 0-7 copy a row each) as soon as the buffer is free, across
// unit boundaries: the weights keep arriving while a unit is folded and written, and no warp waits on
// another. (A block-wide stage of 32 rows, refilled by one warp after a block barrier, ran at 1-2.5 TB/s
// on the H200: the rows' copies leave one warp one at a time.) Each row is computed as by the register
// kernel: thread g of the row's eight owns P[g][0..7] (chunks in order, one FMA each), then group_fold.
// Only where the bytes wait changes.
//
// A thread owns that accumulator for two rows of its unit (i and i + 4), so each x value it loads feeds
// two FMAs: with one row a thread, shared memory's wavefronts were the limit (ncu, batch-1 experts:
// L1 85 % busy at 40 % of the DRAM bandwidth; every 16-byte x load of a warp took 8 wavefronts, its
// quarter warps each reading eight 16-byte pieces 32 bytes apart). x staged per block (XS) is laid out
// so that a quarter warp's piece loads are 128 contiguous bytes: column 64c + 8g + 4h + e at
// 64c + 32h + 4g + e.
constexpr int kSmThreads = 256;
constexpr int kSmWarps = kSmThreads / 32;
constexpr int kSmRows = 8;      // rows per unit: rows i and i + 4 for the thread group i of a warp
constexpr int kSmStage = 512;   // bytes of each row per stage
template <int MINB, bool XS = false>
constexpr int sm_slots() {  // buffers per warp: 6 (one block per SM), 3 (two) or 2 (three); one less with x staged
    return MINB == 1 ? (XS ? 5 : 6) : (MINB == 2 ? (XS ? 2 : 3) : 2);
}
template <int FMT>
constexpr int sm_cps() {  // chunks per stage
    return kSmStage / chunk_bytes<FMT>();
}
template <int FMT>
constexpr int sm_pitch() {  // a buffer's row stride: consecutive rows on other banks
    return kSmStage + (chunk_bytes<FMT>() < 64 ? chunk_bytes<FMT>() : 64);
}
template <int FMT, int MINB, bool XS = false>
constexpr int sm_block_bytes() {
    return kSmWarps * sm_slots<MINB, XS>() * kSmRows * sm_pitch<FMT>();
}
// (host: the rings' bytes whatever the format, an upper bound for stream_xs_applies)
constexpr int sm_ring_bound(int minb, bool xs) {
    return kSmWarps * (minb == 1 ? (xs ? 5 : 6) : (minb == 2 ? (xs ? 2 : 3) : 2)) * kSmRows * (kSmStage + 64);
}

// Unit u of the launch (eight rows): which matrix, rows, x and y. Units run over (item, table, row
// group), row groups fastest.
struct SmUnit {
    const unsigned char* data;
    const void* scale;
    const float* x;  // dense: add the rows' head offset
    float* y;
    int r0;  // first output row
};
template <bool EXPERT>
GLM_DEV SmUnit sm_unit(const LinArgs& a, int u, int nrg) {
    SmUnit s;
    s.r0 = (u % nrg) * kSmRows;
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

// MINB: blocks per SM the launch keeps resident (1, 2 or 3), so the registers fit that many. XS: every
// row reads one x row (row 0 of X), staged once per block after the rings: the chunk loop reads x from
// shared memory instead of through L1. (stream_applies: rows per head a multiple of 8, so that a unit's
// rows share their x.)
template <int FMT, bool EXPERT, int DEC, int MINB, bool XS>
__global__ void __launch_bounds__(kSmThreads, MINB) k_linear_stream(LinArgs a) {
    pdl_release();  // (pdl_wait() below: a.early requests the first stages' weights before it)
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int CB = chunk_bytes<FMT>(), CPS = sm_cps<FMT>(), PITCH = sm_pitch<FMT>(), S = sm_slots<MINB, XS>();
    constexpr int SLOT = kSmRows * PITCH;
    __shared__ uint64_t bars[kSmWarps][S];
    const int64_t C = a.C;
    const int64_t rbytes = row_bytes(FMT, C);
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + CPS - 1) / CPS;
    const int nrg = (a.R + kSmRows - 1) / kSmRows;
    const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31, i = lane >> 3, g = lane & 7;
    const int gw = static_cast<int>(blockIdx.x) * kSmWarps + warp, GW = static_cast<int>(gridDim.x) * kSmWarps;
    unsigned char* wsm = sm + warp * S * SLOT;
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
    // warp runs it; lane 0 announces the bytes, lane r < 8 copies row r of the unit (512 bytes or less).
    int ik = 0, is = 0, iu = gw, islot = 0, irows = 0;
    const unsigned char* isrc = nullptr;
    auto issue_next = [&] {
        if (is == 0) {
            const SmUnit un = sm_unit<EXPERT>(a, iu, nrg);
            irows = a.R - un.r0 < kSmRows ? a.R - un.r0 : kSmRows;
            isrc = un.data + weight_row(a, un.r0 + (lane < irows ? lane : 0)) * rbytes;
        }
        const int c0 = is * CPS, nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
        uint64_t* bar = &wb[islot];
        if (lane == 0) mbar_arrive_expect(bar, static_cast<unsigned>(irows * nc * CB));
        __syncwarp();
        if (lane < irows)
            bulk_copy(wsm + islot * SLOT + lane * PITCH, isrc + static_cast<int64_t>(c0) * CB, static_cast<unsigned>(nc * CB), bar);
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
    float* xsm = reinterpret_cast<float*>(sm + kSmWarps * S * SLOT);  // (XS) after every warp's ring
    if constexpr (XS) {
        // float4 q (columns 4q .. 4q + 3: chunk q / 16, group (q / 2) % 8, half q % 2) to 16c + 8h + g
        for (int q = tid; q < static_cast<int>(C / 4); q += kSmThreads)
            reinterpret_cast<float4*>(xsm)[(q & ~15) | ((q & 1) << 3) | ((q >> 1) & 7)] =
                __ldg(reinterpret_cast<const float4*>(a.X) + q);
        __syncthreads();
    }
    if (!early) {
        count();
        while (ik < S && ik < K) issue_next();
    }

    float acc0[8], acc1[8];  // rows i and i + 4 of the unit
    zero8(acc0);
    zero8(acc1);
    SmUnit un{};
    const float* xr = nullptr;
    int64_t srow0 = 0, srow1 = 0;  // the rows' scale rows (FP8: their 128-row blocks'; MXFP4: their own)
    bool live0 = false, live1 = false;
    int s = 0, u = gw, slot = 0;
    unsigned phase = 0;
    for (int k = 0; k < K; ++k) {
        if (s == 0) {
            un = sm_unit<EXPERT>(a, u, nrg);
            const int r = un.r0 + i;
            live0 = r < a.R;
            live1 = r + 4 < a.R;
            const int64_t ar0 = weight_row(a, live0 ? r : a.R - 1), ar1 = weight_row(a, live1 ? r + 4 : a.R - 1);
            srow0 = FMT == W_FP8 ? (ar0 / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar0 * (C / 32) : 0);
            srow1 = FMT == W_FP8 ? (ar1 / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar1 * (C / 32) : 0);
            // (the unit's rows lie in one head: stream_applies)
            xr = un.x + (EXPERT ? 0 : static_cast<int64_t>((live0 ? r : a.R - 1) / a.rh) * a.xhs) + 8 * g;
        }
        const int c0 = s * CPS, nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
        const unsigned char* row0 = wsm + slot * SLOT + i * PITCH + g * (CB / 8);
        const unsigned char* row1 = row0 + 4 * PITCH;
        // FP8: the stage's scales (one per two chunks) loaded before the wait, so that their latency
        // passes under it instead of inside the chunk loop
        float sv0[FMT == W_FP8 ? CPS / 2 : 1], sv1[FMT == W_FP8 ? CPS / 2 : 1];
        if constexpr (FMT == W_FP8) {
            const float* sp0 = static_cast<const float*>(un.scale) + srow0 + c0 / 2;
            const float* sp1 = static_cast<const float*>(un.scale) + srow1 + c0 / 2;
#pragma unroll
            for (int q = 0; q < CPS / 2; ++q) {
                sv0[q] = 2 * q < nc ? fp8_mult<DEC>(__ldg(sp0 + q)) : 0.0f;
                sv1[q] = 2 * q < nc ? fp8_mult<DEC>(__ldg(sp1 + q)) : 0.0f;
            }
        }
        mbar_wait(&wb[slot], phase);
        if (live0) {
            // chunk c with its rows' multipliers (FP8: fp8_mult of the scale, as scale_fp8 applies it)
            auto chunk = [&](int c, float m0, float m1) {
                float w0[8], w1[8];
                if constexpr (FMT == W_FP8) {
                    const uint2 v0 = *reinterpret_cast<const uint2*>(row0 + c * CB);
                    const uint2 v1 = *reinterpret_cast<const uint2*>(row1 + c * CB);
                    e4m3_words<DEC>(v0.x, v0.y, w0);
                    e4m3_words<DEC>(v1.x, v1.y, w1);
#pragma unroll
                    for (int l = 0; l < 8; ++l) {
                        w0[l] = fmul(w0[l], m0);  // w = fl32(e4m3 * scale_inv)
                        w1[l] = fmul(w1[l], m1);
                    }
                } else {
                    decode_smem<FMT, DEC, 8>(row0 + c * CB, m0, w0);
                    decode_smem<FMT, DEC, 8>(row1 + c * CB, m1, w1);
                }
                float4 x0, x1;
                if constexpr (XS) {
                    const float4* xq = reinterpret_cast<const float4*>(xsm) + 16 * (c0 + c) + g;
                    x0 = xq[0];
                    x1 = xq[8];
                } else {
                    x0 = __ldg(reinterpret_cast<const float4*>(xr + 64 * (c0 + c)));
                    x1 = __ldg(reinterpret_cast<const float4*>(xr + 64 * (c0 + c) + 4));
                }
                const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int l = 0; l < 8; ++l) {
                    acc0[l] = ffma(w0[l], xv[l], acc0[l]);
                    acc1[l] = ffma(w1[l], xv[l], acc1[l]);
                }
            };
            auto mult_of = [&](int c, int64_t srow) {  // chunk c's multiplier from the scales (not FP8)
                if constexpr (FMT == W_MXFP4) {
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
                        chunk(c, sv0[c / 2], sv1[c / 2]);
                        chunk(c + 1, sv0[c / 2], sv1[c / 2]);
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < CPS; ++c) chunk(c, mult_of(c, srow0), mult_of(c, srow1));
                }
            } else {
                for (int c = 0; c < nc; ++c) {
                    if constexpr (FMT == W_FP8) chunk(c, sv0[c / 2], sv1[c / 2]);
                    else chunk(c, mult_of(c, srow0), mult_of(c, srow1));
                }
            }
        }
        __syncwarp();  // every lane is done with buffer `slot`: refill it
        if (ik < K) issue_next();
        if (s == nst - 1) {
            const float y0 = group_fold(acc0);
            const float y1 = group_fold(acc1);
            if (g == 0) {
                if (live0) un.y[un.r0 + i] = a.round ? bf16r(y0) : y0;
                if (live1) un.y[un.r0 + i + 4] = a.round ? bf16r(y1) : y1;
            }
            zero8(acc0);
            zero8(acc1);
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
