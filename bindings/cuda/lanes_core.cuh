// The lane pass's core, shared by the lane-pass linear kernel (lin_lanes.cuh) and MLA's prefill scores
// (mla.cu, k_mla_attn_lanes): a thread owns chain g of one lane for 8 rows x TN columns (8 x TN
// accumulators; TN 8, or 16 in the linear kernel's 256-thread blocks), both operands k-major in shared memory
// (A^T [chunk * 8 + chain][row], B^T [..][column]), and a warp is the 8 chains of 4 such tiles. Why a lane at a time: cdot's fold adds the eight
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

// One chunk: 8 x TN FMAs, each the next step of its chain. A points at A^T's row of (chunk, chain g) + 4 rg, B
// likewise; HA, HB: half the block's rows and columns (the thread's second groups of four; a chain that holds
// a side's halves swapped, lane_swap_a and lane_swap_b, reads its own half first). TN = 8: the thread's columns
// are B0's group of four and the one HB past it. TN = 16: four groups, B0's and B1's (a quarter of the block's
// columns apart: two pointers, the expert items' swizzle being an XOR) and HB past each.
template <int HA, int HB, int TN>
GLM_DEV void lane_chunk_n(float (&acc)[8][TN], const float* A, const float* B0, const float* B1) {
    constexpr int NB = TN / 4, PER_HALF = TN / 8;  // groups of four columns; of them in each half
    const float4 a0 = *reinterpret_cast<const float4*>(A);
    const float4 a1 = *reinterpret_cast<const float4*>(A + HA);
    float4 b[NB];
#pragma unroll
    for (int q = 0; q < NB; ++q) b[q] = *reinterpret_cast<const float4*>((q % PER_HALF ? B1 : B0) + q / PER_HALF * HB);
    const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    float bv[TN];
#pragma unroll
    for (int q = 0; q < NB; ++q) {
        bv[4 * q] = b[q].x;
        bv[4 * q + 1] = b[q].y;
        bv[4 * q + 2] = b[q].z;
        bv[4 * q + 3] = b[q].w;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = ffma(av[i], bv[j], acc[i][j]);
}
template <int HA, int HB>
GLM_DEV void lane_chunk(float (&acc)[8][8], const float* A, const float* B) {
    lane_chunk_n<HA, HB, 8>(acc, A, B, B);
}

// Where the operands' halves lie. The fold's first two steps keep one half of the thread's values and send
// the other, and which half a thread keeps follows its chain (g's bit 2, then bit 1); so that no thread has
// to choose its halves by a select, chains 4-7 find A^T's two halves of a row swapped and chains 2, 3, 6, 7
// B^T's (the writer of A^T's row (chunk, chain g) puts column c at c ^ lane_swap_a(g, half), B^T's at
// c ^ lane_swap_b(g, half)): then a thread's acc rows 0-3 are always the half it keeps, and acc columns
// 0-3 likewise. A swap by half the row moves every 16-byte load by a multiple of 32 floats or by a
// permutation of the warp's rows, so the bank spreads stay as they were.
GLM_DEV int lane_swap_a(int g, int half) { return (g & 4) ? half : 0; }
GLM_DEV int lane_swap_b(int g, int half) { return (g & 2) ? half : 0; }

// The end of lane pass p (lane 0 4 2 6 1 5 3 7: p's bits reversed): the warp's chains fold by shuffles in
// the canonical tree (g ^ 4, g ^ 2, g ^ 1; a + b and b + a are the same bits) into Q[l] of 2 rows x TN / 2
// columns of the thread's tile (lane_row, lane_col: Q[TN / 2 i + j]); acc is cleared for the next pass. The
// lanes' partials fold as they arrive, ((Q0 + Q4) + (Q2 + Q6)) + ((Q1 + Q5) + (Q3 + Q7)), three parked at
// pk[(slot * TN + j) * stride]. True after the last pass, Q then the whole dots.
template <int TN>
GLM_DEV bool lane_pass_end(float (&acc)[8][TN], int g, int p, float* pk, int stride, float (&Q)[TN]) {
    constexpr int H = TN / 2;  // columns a thread keeps
    float* const f = &acc[0][0];  // [TN i + j]
    float r1[4 * TN], r2[2 * TN];
#pragma unroll
    for (int e = 0; e < 4 * TN; ++e)  // P[g] + P[g ^ 4]: rows 0-3 the thread's half (lane_swap_a), 4-7 its partner's
        r1[e] = fadd(f[e], __shfl_xor_sync(kFull, f[4 * TN + e], 16));
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < H; ++j)  // + (P[g ^ 2] + P[g ^ 6]): columns 0 .. H - 1 the thread's half (lane_swap_b)
            r2[H * i + j] = fadd(r1[TN * i + j], __shfl_xor_sync(kFull, r1[TN * i + H + j], 2));
    const bool b0 = g & 1;
#pragma unroll
    for (int e = 0; e < TN; ++e) {  // + (the odd chains' sum): rows 0, 1 (even chains) or 2, 3 (odd) of the four
        const float lo = r2[e], hi = r2[TN + e];
        Q[e] = fadd(b0 ? hi : lo, __shfl_xor_sync(kFull, b0 ? lo : hi, 1));
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
    // P0 = Q0 + Q4, P1 = Q2 + Q6 -> P0 += P1; P1 = Q1 + Q5, P2 = Q3 + Q7 -> the last pass adds them all
    auto at = [&](int slot, int j) -> float& { return pk[(slot * TN + j) * stride]; };
#pragma unroll
    for (int j = 0; j < TN; ++j) {
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
// The row and column of Q[4 i + j] after the fold (half: half the block's rows, or columns): the thread's
// half of rows by g's bit 2, rows 2 (g & 1) + i of its four, and its half of columns by g's bit 1.
GLM_DEV int lane_row(int g, int rg, int half, int i) { return lane_swap_a(g, half) + 4 * rg + 2 * (g & 1) + i; }
GLM_DEV int lane_col(int g, int tg, int half, int j) { return lane_swap_b(g, half) + 4 * tg + j; }
// TN = 16: Q's column j < 8 is group j / 4 (B0's or B1's, half / 2 apart) of the thread's half.
GLM_DEV int lane_col16(int g, int tg, int half, int j) { return lane_swap_b(g, half) + 4 * tg + (j >> 2) * (half / 2) + (j & 3); }

}  // namespace
}  // namespace glm::cuda
