// The one reduction primitive on the device (docs/contract.md §4.2, docs/numerics.md):
//
//   cdot(a, b) over n elements: 64 partial sums P[g][l] start at +0; element i = 64c + 8g + l goes to
//   P[g][l] = fma(a[i], b[i], P[g][l]), chunks c in increasing order, elements past n skipped; then
//   P[g] += P[g+w] lane-wise for w = 4, 2, 1; then P[0][l] += P[0][l+w] for w = 4, 2, 1. Result P[0][0].
//
// Three mappings of that one association onto threads, chosen by the shape of the work:
//   * group_*: eight threads per dot (thread g of the group owns accumulator g: its eight lanes in
//     registers), the 4/2/1 tree over the threads by shuffles, then over the lanes in registers.
//     The matrix-vector kernels and every "many short dots" stage use it.
//   * block64_dot: 64 threads per dot, thread (g, l) owns the single partial sum P[g][l]; the fold in
//     shared memory. For a few long dots (mHC, norms of long rows): 8x the memory parallelism.
//   * cdot_serial: one thread, all 64 partial sums in local memory. For short dots (n <= a few dozen:
//     MoE weights, conv taps, the mHC stream mixes, pool softmax).
// All three produce the same bits for the same (a, b, n): the order is a function of n and the
// element index only. With dot="sequential" (Nm::seq) each computes the plain left-to-right sum
// s = s + a[i]*b[i] instead (non-canonical, for demonstrations).
#pragma once

#include "compat.cuh"

namespace glm::cuda {

GLM_DEV int lane8() { return static_cast<int>(threadIdx.x & 7u); }

// The 4/2/1 trees over the eight threads of a group, then over the lanes of P[0]: P[0][0] on all
// eight threads. Every lane of the warp must call it (full-mask shuffles).
template <class T>
GLM_DEV T group_fold(T (&acc)[8]) {
    const int g = lane8();
#pragma unroll
    for (int w = 4; w >= 1; w >>= 1) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            const T o = __shfl_down_sync(kFull, acc[l], w, 8);
            if (g < w) acc[l] = add(acc[l], o);
        }
    }
    T a0 = add(acc[0], acc[4]);
    T a1 = add(acc[1], acc[5]);
    const T a2 = add(acc[2], acc[6]);
    const T a3 = add(acc[3], acc[7]);
    a0 = add(a0, a2);
    a1 = add(a1, a3);
    a0 = add(a0, a1);
    return __shfl_sync(kFull, a0, 0, 8);
}

template <class T>
GLM_DEV void zero8(T (&acc)[8]) {
#pragma unroll
    for (int l = 0; l < 8; ++l) acc[l] = T(0);
}

// Largest n over the warp (so that loops containing shuffles run the same count on every lane).
GLM_DEV int warp_max_int(int n) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
        const int m = __shfl_xor_sync(kFull, n, o);
        n = m > n ? m : n;
    }
    return n;
}

// cdot over the group: get(i, a, b) yields element i < n. Every lane of the warp must call it (a
// lane without work passes n = 0). seq: the sequential sum, carried from thread to thread.
template <class T, class Get>
GLM_DEV T group_dot(int n, bool seq, Get get) {
    const int g = lane8();
    if (!seq) {
        T acc[8];
        zero8(acc);
#pragma unroll 4
        for (int base = 8 * g; base < n; base += 64) {
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                const int i = base + l;
                if (i < n) {
                    T a, b;
                    get(i, a, b);
                    acc[l] = fma_(a, b, acc[l]);
                }
            }
        }
        return group_fold(acc);
    }
    const int nw = warp_max_int(n);
    T s = T(0);
    for (int base = 0; base < nw; base += 64) {
        for (int gg = 0; gg < 8; ++gg) {
            if (g == gg) {
                for (int l = 0; l < 8; ++l) {
                    const int i = base + 8 * gg + l;
                    if (i < n) {
                        T a, b;
                        get(i, a, b);
                        s = add(s, mul(a, b));
                    }
                }
            }
            s = __shfl_sync(kFull, s, gg, 8);
        }
    }
    return s;
}

// The 8x8 fold of 64 partial sums held by one warp, lane q holding P[q] (a) and P[q + 32] (b): the
// accumulator tree (P[k] += P[k + 8w] for k < 8w, w = 4, 2, 1) and the lane tree (P[l] += P[l + w],
// l < w), each addition the fold's own. Every lane of the warp calls it; the result is on lane 0.
template <class T>
GLM_DEV T warp_fold64(T a, T b) {
    const int q = static_cast<int>(threadIdx.x & 31u);
    a = add(a, b);  // w = 4
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) {  // w = 2, 1 (d = 16, 8), then the lanes (d = 4, 2, 1)
        const T o = __shfl_down_sync(kFull, a, d);
        if (q < d) a = add(a, o);
    }
    return a;
}

// cdot over the first 64 threads of a block (threadIdx.x < 64 take part; the block has >= 64
// threads and every thread of the block calls it). red: 64 elements of shared memory of type T.
// The result on every thread of the block.
template <class T, class Get>
GLM_DEV T block64_dot(int n, bool seq, T* red, Get get) {
    const int tid = static_cast<int>(threadIdx.x);
    __syncthreads();  // red may still be read from a previous call
    if (!seq) {
        if (tid < 64) {
            T p = T(0);
#pragma unroll 8
            for (int i = tid; i < n; i += 64) {
                T a, b;
                get(i, a, b);
                p = fma_(a, b, p);
            }
            red[tid] = p;
        }
        __syncthreads();
        if (tid < 32) {
            const T f = warp_fold64(red[tid], red[tid + 32]);
            if (tid == 0) red[0] = f;
        }
    } else if (tid == 0) {
        T s = T(0);
        for (int i = 0; i < n; ++i) {
            T a, b;
            get(i, a, b);
            s = add(s, mul(a, b));
        }
        red[0] = s;
    }
    __syncthreads();
    return red[0];
}

// cdot's fold as a walk over its leaves, for many dots per thread (the tiled kernels: a thread makes each
// of its NR x NC dots whole). The fold of the 64 partial sums (P[g] += P[g+w] lane-wise for w = 4, 2, 1,
// then the same over the lanes of P[0]) is a balanced binary tree whose leaves, left to right, are the
// partials k = bitrev6(j), j = 0..63 (g = bitrev3(j & 7), l = bitrev3(j >> 3), k = 8g + l).
// leaf(k, v) makes partial k of every dot into v (its fma chain over the chunks, from +0); each is
// folded into a stack of pairwise sums as j counts up, the earlier (left) operand first, so the stack's
// level-6 entry is each dot's cdot. Fully unrolled: k and the stack levels are constants and the stack
// (7 x NR x NC values) stays in registers.
GLM_DEV constexpr int bitrev6(int j) {
    return ((j & 1) << 5) | ((j & 2) << 3) | ((j & 4) << 1) | ((j & 8) >> 1) | ((j & 16) >> 3) | ((j & 32) >> 5);
}
// Four consecutive elements of a row, v, stored k-major into shared memory: element k + i of the row at
// d + i * stride (the tiled kernels stage their operands so that one element index of a tile's rows is
// contiguous, for leaf_chain's vector loads).
GLM_DEV void store_kmajor4(float* d, float4 v, int stride) {
    d[0] = v.x, d[stride] = v.y, d[2 * stride] = v.z, d[3 * stride] = v.w;
}
// N consecutive floats of shared memory (16-byte aligned for N a multiple of 4, 8 for N = 2) in vector
// loads.
template <int N>
GLM_DEV void load_n(const float* p, float (&v)[N]) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4 x = *reinterpret_cast<const float4*>(p + i);
            v[i] = x.x, v[i + 1] = x.y, v[i + 2] = x.z, v[i + 3] = x.w;
        }
    } else if constexpr (N == 2) {
        const float2 x = *reinterpret_cast<const float2*>(p);
        v[0] = x.x, v[1] = x.y;
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = p[i];
    }
}

// One leaf of NR x NC tiled dots: v[r][c] = the fma chain, from +0, over the n chunks ch of a_r * b_c,
// chunk ch's NR values of a at A(ch) and NC values of b at B(ch) (consecutive in shared memory). N > 0:
// n is N, known when compiled (every chunk unrolled: no address arithmetic or branch a chunk); N = 0:
// n >= 1 at run time, four chunks an iteration. The first chunk is peeled (fma(a, b, +0), as the chain
// starts), which keeps a select per accumulator out of the loop.
template <int N, int NR, int NC, class PA, class PB>
GLM_DEV void leaf_chain(float (&v)[NR][NC], int n, PA&& A, PB&& B) {
    auto chunk = [&](int ch, bool first) {
        float a[NR], b[NC];
        load_n<NR>(A(ch), a);
        load_n<NC>(B(ch), b);
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int c = 0; c < NC; ++c) v[r][c] = fma_(a[r], b[c], first ? 0.0f : v[r][c]);
    };
    chunk(0, true);
    if constexpr (N > 0) {
#pragma unroll
        for (int ch = 1; ch < N; ++ch) chunk(ch, false);
    } else {
#pragma unroll 4
        for (int ch = 1; ch < n; ++ch) chunk(ch, false);
    }
}

template <int NR, int NC, class Leaf>
GLM_DEV void cdot_tree_walk(float (&out)[NR][NC], Leaf&& leaf) {
    float st[7][NR][NC];
#pragma unroll
    for (int j = 0; j < 64; ++j) {
        float v[NR][NC];
        leaf(bitrev6(j), v);
        int lv = 0;
#pragma unroll
        for (; lv < 6 && ((j >> lv) & 1); ++lv)
#pragma unroll
            for (int r = 0; r < NR; ++r)
#pragma unroll
                for (int c = 0; c < NC; ++c) v[r][c] = add(st[lv][r][c], v[r][c]);
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int c = 0; c < NC; ++c) st[lv][r][c] = v[r][c];
    }
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) out[r][c] = st[6][r][c];
}

// The canonical fold of one dot's 64 partial sums v[k * stride] (k = 8g + l): P[g] += P[g + w] lane-wise
// for w = 4, 2, 1, then P[0][l] += P[0][l + w] for w = 4, 2, 1. v is read, not changed.
template <class T>
GLM_DEV T fold64(const T* v, int stride) {
    T G[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) {
        T P[8];
#pragma unroll
        for (int g = 0; g < 8; ++g) P[g] = v[(8 * g + l) * stride];
#pragma unroll
        for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
            for (int g = 0; g < w; ++g) P[g] = add(P[g], P[g + w]);
        G[l] = P[0];
    }
#pragma unroll
    for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
        for (int l = 0; l < w; ++l) G[l] = add(G[l], G[l + w]);
    return G[0];
}

// cdot in one thread (any n; meant for short dots).
template <class T, class Get>
GLM_DEV T cdot_serial(int n, bool seq, Get get) {
    if (seq) {
        T s = T(0);
        for (int i = 0; i < n; ++i) {
            T a, b;
            get(i, a, b);
            s = add(s, mul(a, b));
        }
        return s;
    }
    if (n <= 8) {
        // Only P[0][0..n) can be non-zero. The accumulator tree adds +0 (P[4][l], P[2][l], P[1][l]) three
        // times to each lane of P[0]: the first addition turns a -0 into +0 and leaves every other value
        // (NaN included: it comes out of an addition already) as it is, so the other two are identities;
        // likewise the lane tree's additions of a lane l + w >= n, a +0, to a value that cannot be -0.
        // The identities are skipped: the same value from every step the definition takes.
        T q[8];
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            q[l] = T(0);
            if (l < n) {
                T a, b;
                get(l, a, b);
                q[l] = add(fma_(a, b, T(0)), T(0));
            }
        }
#pragma unroll
        for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
            for (int l = 0; l < w; ++l)
                if (l + w < n) q[l] = add(q[l], q[l + w]);
        return q[0];
    }
    T P[64];
    for (int k = 0; k < 64; ++k) P[k] = T(0);
    for (int i = 0; i < n; ++i) {
        T a, b;
        get(i, a, b);
        P[i & 63] = fma_(a, b, P[i & 63]);
    }
    return fold64(P, 1);
}

// Shorthands over plain arrays (b with a stride).
template <class T>
GLM_DEV T cdot_serial_arr(const T* a, const T* b, int n, bool seq) {
    return cdot_serial<T>(n, seq, [&](int i, T& x, T& y) {
        x = a[i];
        y = b[i];
    });
}

}  // namespace glm::cuda
