// The lane pass's core, shared by the lane-pass linear kernel (lin_lanes.cuh) and MLA's prefill scores
// (mla.cu, k_mla_attn_lanes): a thread owns chain g of one lane for 8 rows x 8 columns (64
// accumulators), both operands k-major in shared memory (A^T [chunk * 8 + chain][row], B^T [..][column]),
// and a warp is the 8 chains of 4 such tiles. Why a lane at a time: cdot's fold adds the eight
// accumulators of one lane first, so lane l's chains fold into one partial Q[l] without the other lanes
// (docs/engine_cuda.md, "The lane-pass kernel").
#pragma once

namespace glm::cuda {
namespace {

// Pass p's lane: 0 4 2 6 1 5 3 7 (p's three bits reversed), so that the lanes' partials fold as they arrive.
GLM_DEV int ln_lane(int p) { return ((p & 1) << 2) | (p & 2) | ((p >> 2) & 1); }

// The thread's place: chain g, tile q of the warp's 4; rg, tg the row and column groups of its tile (rows
// 4 rg .. 4 rg + 3 and half + 4 rg .., columns likewise), for blocks of rows spread over rwg warps.
struct LaneSeat {
    int g, rg, tg;
};
GLM_DEV LaneSeat lane_seat(int tid, int rwg) {
    const int lane = tid & 31, warp = tid >> 5;
    const int g = (lane & 3) | ((lane >> 4) << 2), q = (lane >> 2) & 3;
    return {g, 2 * (warp % rwg) + (q & 1), 2 * (warp / rwg) + (q >> 1)};
}

// One chunk: 64 FMAs, each the next step of its chain. A points at A^T's row of (chunk, chain g) + 4 rg,
// B likewise; HA, HB: half the block's rows and columns (the thread's second groups of four).
template <int HA, int HB>
GLM_DEV void lane_chunk(float (&acc)[8][8], const float* A, const float* B) {
    const float4 a0 = *reinterpret_cast<const float4*>(A);
    const float4 a1 = *reinterpret_cast<const float4*>(A + HA);
    const float4 b0 = *reinterpret_cast<const float4*>(B);
    const float4 b1 = *reinterpret_cast<const float4*>(B + HB);
    const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = ffma(av[i], bv[j], acc[i][j]);
}

// The end of lane pass p (lane 0 4 2 6 1 5 3 7: p's bits reversed): the warp's chains fold by shuffles in
// the canonical tree (g ^ 4, g ^ 2, g ^ 1; a + b and b + a are the same bits) into Q[l] of row g of the
// thread's tile, 8 columns; acc is cleared for the next pass. The lanes' partials fold as they arrive,
// ((Q0 + Q4) + (Q2 + Q6)) + ((Q1 + Q5) + (Q3 + Q7)), three parked at pk[(slot * 8 + j) * stride]. True
// after the last pass, Q then the whole dot of (row g, column j).
GLM_DEV bool lane_pass_end(float (&acc)[8][8], int g, int p, float* pk, int stride, float (&Q)[8]) {
    float* const f = &acc[0][0];  // [8 i + j]
    float r1[32], r2[16];
    const bool b2 = (g >> 2) & 1, b1 = (g >> 1) & 1, b0 = g & 1;
#pragma unroll
    for (int e = 0; e < 32; ++e) {  // P[g] + P[g + 4]: chains g < 4 keep rows 0-3, the others rows 4-7
        const float lo = f[e], hi = f[32 + e];
        r1[e] = fadd(b2 ? hi : lo, __shfl_xor_sync(kFull, b2 ? lo : hi, 16));
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) {  // + (P[g + 2] + P[g + 6])
        const float lo = r1[e], hi = r1[16 + e];
        r2[e] = fadd(b1 ? hi : lo, __shfl_xor_sync(kFull, b1 ? lo : hi, 2));
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {  // + (the odd chains' sum): thread g now holds row g's Q[l]
        const float lo = r2[e], hi = r2[8 + e];
        Q[e] = fadd(b0 ? hi : lo, __shfl_xor_sync(kFull, b0 ? lo : hi, 1));
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    // P0 = Q0 + Q4, P1 = Q2 + Q6 -> P0 += P1; P1 = Q1 + Q5, P2 = Q3 + Q7 -> the last pass adds them all
    auto at = [&](int slot, int j) -> float& { return pk[(slot * 8 + j) * stride]; };
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        switch (p) {
            case 0: at(0, j) = Q[j]; break;
            case 1: at(0, j) = fadd(at(0, j), Q[j]); break;
            case 2: at(1, j) = Q[j]; break;
            case 3: at(0, j) = fadd(at(0, j), fadd(at(1, j), Q[j])); break;
            case 4: at(1, j) = Q[j]; break;
            case 5: at(1, j) = fadd(at(1, j), Q[j]); break;
            case 6: at(2, j) = Q[j]; break;
            default: Q[j] = fadd(at(0, j), fadd(at(1, j), fadd(at(2, j), Q[j]))); break;
        }
    }
    return p == 7;
}
// The row (of 8 in the thread's tile, half = half the block's rows) that thread g holds after the fold,
// and the column of its j-th value.
GLM_DEV int lane_row(int g, int rg, int half) { return g < 4 ? 4 * rg + g : half + 4 * rg + g - 4; }
GLM_DEV int lane_col(int j, int tg, int half) { return j < 4 ? 4 * tg + j : half + 4 * tg + j - 4; }

}  // namespace
}  // namespace glm::cuda
