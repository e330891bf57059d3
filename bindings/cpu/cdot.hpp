// The one reduction primitive (docs/contract.md §4.2).
//
// cdot(a, b) over n f32 elements: 64 partial sums P[g][l] (g, l in 0..7) start at +0; element
// i = 64c + 8g + l is added as P[g][l] = fma(a[i], b[i], P[g][l]), chunks c in increasing order,
// elements past n skipped. Then the accumulators fold P[g] += P[g+w] for w = 4, 2, 1 (lane-wise),
// then the lanes of P[0] fold P[0][l] += P[0][l+w] for w = 4, 2, 1. The result is P[0][0].
//
// Here accumulator g is one __m256 holding P[g][0..7]. A partial last group of eight is computed
// on zero-padded operands and then *blended* into the accumulator only on the live lanes: a
// masked-off lane must keep its value (fma(0, 0, -0) would turn a -0 partial sum into +0).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "formats.hpp"
#include "isa.hpp"

namespace glm::cpu {

float cdot(const float* a, const float* b, size_t n);
double cdot64(const double* a, const double* b, size_t n);
float csum(const float* x, size_t n);  // = cdot(x, ones)

// x of T tokens (rows X + t * ldx, n floats each) as the token blocks of at most `most` tokens read it: block b
// (tokens t0 .. t0 + nt - 1, detail::block_tokens) from Xp + 64 t0 nch (nch = ceil(n / 64) chunks), then group g
// of chunk c of its token t at ((8c + g) nt + t) 8, elements past n 0. Read in place, tokens 4n bytes apart (16 KiB
// at n = 4096) fell in the same L1 sets as each other and the accumulators: the rows at n = 4096 ran 12-15 %
// slower than at 4032 (docs/perf.md, "Session 35"). Packed into the calling thread's buffer (64 T nch floats,
// 64-byte aligned, reused by its next call), which is returned. (`most`: detail::kMultiTokens or
// detail::most_tokens' choice; cdot_multi_packed must be given the same.) One definition for every instruction set
// (isa.hpp): it only moves floats.
// With `width` 16 (the AVX-512 build's passes, detail::kGroupFloats) groups g and g + 1 (g even) of a token lie side
// by side instead: pair j of chunk c of token t at ((4c + j) nt + t) 16; with `pair_lanes` (rows whose registers hold
// the pair's chains interleaved, detail::pair_lanes) each pair's sixteen floats are interleaved the same way, element
// q of group g at 2q and of group g + 1 at 2q + 1.
const float* packed_tokens(const float* X, size_t ldx, size_t T, size_t n, size_t most, size_t width = 8,
                           bool pair_lanes = false);

inline namespace GLM_CPU_ISA {
namespace detail {

// Lane mask with the first k (0..8) lanes set.
inline __m256i lane_mask(size_t k) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)), idx);
}

__attribute__((always_inline)) inline float fold8(__m256 acc[8]) {
    // P[g] += P[g + w] for w = 4, 2, 1 (written out: constant indices keep acc in registers)
    acc[0] = _mm256_add_ps(acc[0], acc[4]);
    acc[1] = _mm256_add_ps(acc[1], acc[5]);
    acc[2] = _mm256_add_ps(acc[2], acc[6]);
    acc[3] = _mm256_add_ps(acc[3], acc[7]);
    acc[0] = _mm256_add_ps(acc[0], acc[2]);
    acc[1] = _mm256_add_ps(acc[1], acc[3]);
    acc[0] = _mm256_add_ps(acc[0], acc[1]);
    // lanes of P[0]: w = 4, then 2, then 1
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[0]), _mm256_extractf128_ps(acc[0], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));      // l < 2: P[l] += P[l+2]
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));  // l = 0: P[0] += P[1]
    return _mm_cvtss_f32(v);
}

// The cdot kernel for any row source. A Row provides
//   __m256 load8(size_t base, size_t g)   -- elements base+8g .. base+8g+7 (all < n), as f32
//   __m256 load_partial(size_t base, size_t g, size_t k) -- elements base+8g .. +k-1 (k in 1..7),
//                                            anything finite elsewhere (those lanes are discarded)
// where base is a multiple of 64 (so a Row can share work between the groups of one chunk, e.g.
// a scale per 32 or 128 columns), and x is an f32 vector of length n (the b operand).
// A Row may also provide `void load16(size_t base, size_t g, __m256& a, __m256& b)` (groups g and
// g + 1 of a full chunk, g even) when decoding sixteen weights at once is cheaper than twice eight.
template <class Row, class = void>
struct has_load16 : std::false_type {};
template <class Row>
struct has_load16<Row, std::void_t<decltype(std::declval<const Row&>().load16(size_t{}, size_t{},
                                                                           std::declval<__m256&>(),
                                                                           std::declval<__m256&>()))>>
    : std::true_type {};

template <class Row>
__attribute__((always_inline)) inline float cdot_kernel(const Row& row, const float* x, size_t n) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) acc[g] = _mm256_setzero_ps();
    const size_t nfull = n / 64;
    for (size_t c = 0; c < nfull; ++c) {
        const size_t base = 64 * c;
        if constexpr (has_load16<Row>::value) {
#pragma GCC unroll 4
            for (size_t g = 0; g < 8; g += 2) {
                __m256 a, b;
                row.load16(base, g, a, b);
                acc[g] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + base + 8 * g), acc[g]);
                acc[g + 1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(x + base + 8 * g + 8), acc[g + 1]);
            }
        } else {
#pragma GCC unroll 8
            for (size_t g = 0; g < 8; ++g)
                acc[g] = _mm256_fmadd_ps(row.load8(base, g), _mm256_loadu_ps(x + base + 8 * g), acc[g]);
        }
    }
    const size_t base = 64 * nfull;
    const size_t rem = n - base;
    // the tail chunk, group by group with constant indices (a variable index into acc[], or a loop
    // the compiler does not unroll, would keep the accumulators in memory)
#pragma GCC unroll 8
    for (size_t g = 0; g < 8; ++g) {
        if (8 * g + 8 <= rem) {
            acc[g] = _mm256_fmadd_ps(row.load8(base, g), _mm256_loadu_ps(x + base + 8 * g), acc[g]);
        } else if (8 * g < rem) {
            const size_t k = rem - 8 * g;
            const __m256i m = lane_mask(k);
            const __m256 xv = _mm256_maskload_ps(x + base + 8 * g, m);
            const __m256 t = _mm256_fmadd_ps(row.load_partial(base, g, k), xv, acc[g]);
            acc[g] = _mm256_blendv_ps(acc[g], t, _mm256_castsi256_ps(m));
        }
    }
    return fold8(acc);
}

// Keeps v in a register: otherwise GCC folds one load of x into every fma that uses it (RB loads
// instead of one), and loads are what bounds this loop.
inline __m256 in_reg(__m256 v) {
    asm("" : "+x"(v));
    return v;
}

#ifdef GLM_CPU_ZMM
// The AVX-512 build's passes hold groups g and g + 1 (g even) of one row and one token in one 512-bit register,
// P[g][0..7] and P[g + 1][0..7] side by side, since their elements are sixteen adjacent columns 64c + 8g ..
// 64c + 8g + 15: one multiply-add instruction a pair of groups, each lane still its own chain in the canonical
// order. A Row provides `__m512 load16z(size_t base, size_t g)` (groups g and g + 1 of a full chunk). On CPUs with
// two 512-bit FMA units (Intel Xeon since Skylake-SP) this doubles the multiply-adds an instruction can issue; on
// Zen 4 (256-bit units) it halves the instructions, not the multiply-add time.
template <class Row, class = void>
struct has_load16z : std::false_type {};
template <class Row>
struct has_load16z<Row, std::void_t<decltype(void(std::declval<const Row&>().load16z(size_t{}, size_t{})))>>
    : std::true_type {};
inline __m512 join_halves(__m256 a, __m256 b) {  // (AVX-512F only: no DQ insert)
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_zextpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}
inline __m512 in_reg(__m512 v) {
    asm("" : "+v"(v));
    return v;
}
// A Row may say `static constexpr bool kPairLanes = true`: its load16z gives groups g and g + 1 interleaved, lane 2q
// holding element q of group g (chain P[g][q]) and lane 2q + 1 element q of group g + 1 (P[g + 1][q]), which its
// decode reaches by a shift within each 64-bit lane where the natural order needs a permute across the register
// (the AVX-512 build's MXFP4 rows, 16384 x 4096 on Zen 4: one token 21.1-21.8 against 15.0-15.4 MAC/ns, two 54-56
// against 49-50 % of the FMA peak, four 73-75 against 69-71; docs/perf.md, "Session 43"). Every lane still takes
// its own chain's elements in the canonical order, so only where the chains sit changes: the x it multiplies is
// interleaved the same way (packed_tokens' pair_lanes) and the accumulators are put back in the natural order
// (pair_lanes_natural) before the fold. Such rows have n % 16 == 0 (MXFP4: C % 32 == 0, checked at load), so their
// registers are always whole.
inline __m512 pair_lanes_natural(__m512 v) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), v);
}
#endif
// (no Row of the AVX2 build says kPairLanes)
template <class Row, class = void>
struct pair_lanes : std::false_type {};
template <class Row>
struct pair_lanes<Row, std::void_t<decltype(Row::kPairLanes)>> : std::bool_constant<Row::kPairLanes> {};

// The vectors a pass works in: Lanes8, one group of eight chains a register (the AVX2 build), or Lanes16, groups g and
// g + 1 (g even) side by side (the AVX-512 build): the register, its loads, a row's groups decoded into it, and the
// tail's multiply-add into the first k live lanes only (the others keep their value: fma(0, 0, -0) would turn a -0
// partial sum into +0).
struct Lanes8 {
    using V = __m256;
    static V zero() { return _mm256_setzero_ps(); }
    static V set1(float v) { return _mm256_set1_ps(v); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V load(const float* p) { return _mm256_load_ps(p); }
    static void store(float* p, V v) { _mm256_store_ps(p, v); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    template <class Row>
    __attribute__((always_inline)) static V row(const Row& r, size_t base, size_t g) { return r.load8(base, g); }
    template <class Row>
    __attribute__((always_inline)) static V row_part(const Row& r, size_t base, size_t g, size_t k) {
        return r.load_partial(base, g, k);
    }
    static V fma_live(V w, V x, V acc, size_t k) {
        return _mm256_blendv_ps(acc, _mm256_fmadd_ps(w, x, acc), _mm256_castsi256_ps(lane_mask(k)));
    }
};
#ifdef GLM_CPU_ZMM
struct Lanes16 {
    using V = __m512;
    static V zero() { return _mm512_setzero_ps(); }
    static V set1(float v) { return _mm512_set1_ps(v); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V load(const float* p) { return _mm512_load_ps(p); }
    static void store(float* p, V v) { _mm512_store_ps(p, v); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    template <class Row>
    __attribute__((always_inline)) static V row(const Row& r, size_t base, size_t g) {
        static_assert(has_load16z<Row>::value, "the AVX-512 passes need Row::load16z");
        return r.load16z(base, g);
    }
    template <class Row>
    __attribute__((always_inline)) static V row_part(const Row& r, size_t base, size_t g, size_t k) {  // (past the live columns anything finite)
        const __m256 lo = k >= 8 ? r.load8(base, g) : r.load_partial(base, g, k);
        return join_halves(lo, k > 8 ? r.load_partial(base, g + 1, k - 8) : _mm256_setzero_ps());
    }
    static V fma_live(V w, V x, V acc, size_t k) { return _mm512_mask3_fmadd_ps(w, x, acc, __mmask16((1u << k) - 1)); }
};

// cdot_kernel with two groups a 512-bit register (one token: the rows of a decode step, an expert's one token):
// acc[j] holds P[2j][0..7] and P[2j + 1][0..7] (interleaved for pair-lane rows, whose x must then be too:
// packed_tokens of the one token with pair_lanes); the same chains in the same order, then the same fold.
template <class Row>
__attribute__((always_inline)) inline float cdot_kernel_z(const Row& row, const float* x, size_t n) {
    using L = Lanes16;
    __m512 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[j] = L::zero();
    const size_t nfull = n / 64;
    for (size_t c = 0; c < nfull; ++c) {
        const size_t base = 64 * c;
#pragma GCC unroll 4
        for (size_t j = 0; j < 4; ++j) acc[j] = L::fma(L::row(row, base, 2 * j), _mm512_loadu_ps(x + base + 16 * j), acc[j]);
    }
    const size_t base = 64 * nfull, rem = n - base;
#pragma GCC unroll 4
    for (size_t j = 0; j < 4; ++j) {
        if (16 * j + 16 <= rem) {
            acc[j] = L::fma(L::row(row, base, 2 * j), _mm512_loadu_ps(x + base + 16 * j), acc[j]);
        } else if (16 * j < rem) {  // (x past n is not read: a masked load)
            if constexpr (!pair_lanes<Row>::value) {  // (pair-lane rows: whole registers only)
                const size_t k = rem - 16 * j;
                const __m512 xv = _mm512_maskz_loadu_ps(__mmask16((1u << k) - 1), x + base + 16 * j);
                acc[j] = L::fma_live(L::row_part(row, base, 2 * j, k), xv, acc[j], k);
            }
        }
    }
    alignas(64) __m256 P[8];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
        L::store(reinterpret_cast<float*>(P + 2 * j),
                 pair_lanes<Row>::value ? pair_lanes_natural(acc[j]) : acc[j]);
    return fold8(P);
}
using PassLanes = Lanes16;
#else
using PassLanes = Lanes8;
#endif
// Floats of one token's group in a packed x (packed_tokens' width): a pass's register
constexpr size_t kGroupFloats = sizeof(PassLanes::V) / sizeof(float);
constexpr size_t kGroupStep = kGroupFloats / 8;  // groups a pass takes

// Several rows against several tokens. One pass accumulates the groups of L's register (g, or g and g + 1) of rows
// 0 .. RB-1 and tokens 0 .. NT-1 over chunks [c0, c1) (and the tail chunk c1 when `tail`), x from the token block
// packed by packed_tokens with the register's width (with one group, group g of chunk c of token t at Xp + ((8c + g)
// NT + t) 8), starting from and returning to P[i * ps + t * 8 + g] (memory; the first panel, c0 = 0, starts from +0
// instead). Every accumulator P[i][t][g] receives exactly the fmas cdot_kernel would give it, in the same chunk
// order (the eight groups of a chunk are independent sums, so visiting them in separate passes, or two in one
// register, changes nothing), so after the passes of every group over all chunks, fold8(P[i][t]) is cdot(row i,
// X + t * ldx) bit for bit. Each weight group is decoded once for the NT tokens and each group of x once for the RB
// rows: RB + NT loads (or decodes) per RB * NT fmas.
template <class L, int RB, int NT, class Row>
inline void cdot_block_pass(const Row* rows, const float* Xp, size_t n, size_t c0, size_t c1, bool tail, size_t g,
                            __m256* P, size_t ps) {
    using V = typename L::V;
    constexpr size_t W = sizeof(V) / sizeof(float), G = W / 8;  // lanes, groups a register
    V acc[RB][NT];
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i)
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t)
            acc[i][t] = c0 ? L::load(reinterpret_cast<const float*>(P + i * ps + t * 8 + g)) : L::zero();
    for (size_t c = c0; c < c1; ++c) {
        const size_t base = 64 * c;
        const float* const xc = Xp + (8 / G * c + g / G) * NT * W;
        V w[RB];
#pragma GCC unroll 8
        for (int i = 0; i < RB; ++i) w[i] = NT > 1 ? in_reg(L::row(rows[i], base, g)) : L::row(rows[i], base, g);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
            const V x = RB > 1 ? in_reg(L::load(xc + W * t)) : L::load(xc + W * t);
#pragma GCC unroll 8
            for (int i = 0; i < RB; ++i) acc[i][t] = L::fma(w[i], x, acc[i][t]);
        }
    }
    if (tail) {
        const size_t base = 64 * c1, rem = n - base;
        const float* const xc = Xp + (8 / G * c1 + g / G) * NT * W;
        if (8 * g < rem) {
            const size_t k = rem - 8 * g;  // live columns of the register's groups
            V w[RB];
            const bool whole = k >= W || pair_lanes<Row>::value;  // (pair-lane rows: whole registers only)
#pragma GCC unroll 8
            for (int i = 0; i < RB; ++i) w[i] = whole ? L::row(rows[i], base, g) : L::row_part(rows[i], base, g, k);
#pragma GCC unroll 8
            for (int t = 0; t < NT; ++t) {
                const V x = L::load(xc + W * t);  // (zero past n: packed_tokens)
#pragma GCC unroll 8
                for (int i = 0; i < RB; ++i)
                    acc[i][t] = whole ? L::fma(w[i], x, acc[i][t]) : L::fma_live(w[i], x, acc[i][t], k);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i)
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) L::store(reinterpret_cast<float*>(P + i * ps + t * 8 + g), acc[i][t]);
}

// A Row may provide `const void* stored(size_t c)` and `static constexpr size_t kChunkBytes`: where chunk c
// of its stored row starts, and its bytes (cdot_multi_rows asks for the next panel's lines ahead of use).
template <class Row, class = void>
struct has_stored : std::false_type {};
template <class Row>
struct has_stored<Row, std::void_t<decltype(std::declval<const Row&>().stored(size_t{}))>> : std::true_type {};
// Part `part` of `parts` of the lines of a row's chunks [c0, c1), prefetched into L1 (`to_l2` false) or
// into L2 only.
template <bool to_l2, class Row>
inline void prefetch_part(const Row& r, size_t c0, size_t c1, size_t part, size_t parts) {
    if constexpr (has_stored<Row>::value) {
        const size_t lines = (Row::kChunkBytes * (c1 - c0) + 63) / 64;
        const char* const b = static_cast<const char*>(r.stored(c0));
        for (size_t l = lines * part / parts; l < lines * (part + 1) / parts; ++l)
            _mm_prefetch(b + 64 * l, to_l2 ? _MM_HINT_T1 : _MM_HINT_T0);
    }
}

// A Row may say `static constexpr bool kPlainLoads = true`: a weight group costs one load (and at most a widening
// shift), no decode (BF16, f32 rows).
template <class Row, class = void>
struct plain_loads : std::false_type {};
template <class Row>
struct plain_loads<Row, std::void_t<decltype(Row::kPlainLoads)>> : std::bool_constant<Row::kPlainLoads> {};

// Rows per register block for NT tokens: RB * NT accumulators, RB weight groups and one x in registers. AVX2 has 16
// vector registers; AVX-512's 32 (isa.hpp) hold three rows at 7-8 tokens (28 registers) and four at 5-6 (up to 29),
// and at 4 for rows that decode (FP8, MXFP4, and their rows turned into FP16 bits): each x load then serves three or
// four rows, not one or two. Rows 16384 x 4096, one thread, Zen 4, % of the FMA peak, AVX2 -> AVX-512 (256-bit passes):
// FP8 +1-4 points at 2-64 tokens, MXFP4 +4-8 at 4-6 and +1-4 elsewhere, BF16 +7 at 7 and +3 at 8; BF16 rows lost at
// 4-5 tokens with four rows a block (53 -> 38 at 4), so they keep two (docs/perf.md, "Session 39"). With the 512-bit
// passes three rows at 7-8 tokens against two: BF16 at 8 tokens 58-59 -> 64-65 %, the others within the spread
// (docs/perf.md, "Session 40"); four BF16 rows at 5-6 tokens against two: 6 tokens 54-57 -> 62-65 %, 5 50-54 -> 55-62;
// at 4 (bound by memory) 52-56 -> 50-54, so they keep two there (docs/perf.md, "Session 43").
template <int NT, class Row>
constexpr int block_rows() {
#ifdef GLM_CPU_ZMM
    if constexpr (NT >= 7) return 3;
    if constexpr (NT >= 5 || (NT == 4 && !plain_loads<Row>::value)) return 4;
#endif
    return NT == 1 ? 8 : NT == 2 ? 4 : NT == 3 ? 3 : NT <= 6 ? 2 : 1;
}

// Y[t * ldy + i] = cdot(row(i), x_t) over n elements for i < nr, t < NT (NT <= 8), x_t token t of the
// block Xp packed by packed_tokens, rounded to bf16 when `round`; row(i) returns the Row source of the i-th
// row. Rows go SB at a time (RB per register block) and the columns in panels of KP chunks, so that the X
// panel (NT x 64 KP floats, 16 KiB, contiguous) and the SB x NT accumulator sets (16 KiB) stay in L1 while SB
// rows go by; accumulators wait in memory between passes and panels (an f32 store and load are exact), so
// each one still receives its elements in the canonical chunk order. With `ahead` (a row chunk's first token
// block, whose weights come from memory, not from L2), each pass first asks for an eighth of the next panel's
// weight lines (Row::stored): rows in panels of 10 chunks are short runs, too short for the hardware's
// prefetch (BF16 at 6 tokens, 8192 x 4096: 33 -> 46 % of the FMA peak; docs/perf.md, "Session 35"). Blocks of
// several rows (NT <= 6) ask for them into L2 only: asked into L1, they pushed out the X panel and the
// accumulators the passes are using (BF16, 16384 x 4096, one thread: 2-6 tokens 18-43 -> 27-49 % of the FMA
// peak; docs/perf.md, "Session 38"); one-row blocks (7-8 tokens with AVX2) measured better asking into L1,
// AVX-512VL's two-row blocks there were measured (session 39) asking into L2.
template <int NT, class MakeRow>
inline void cdot_multi_rows(const MakeRow& row, size_t nr, const float* Xp, size_t n, float* Y, size_t ldy,
                            bool round, bool ahead) {
    using Row = decltype(row(size_t{0}));
    constexpr int RB = block_rows<NT, Row>();
    constexpr size_t SB = (64 / NT) / RB * RB;  // rows per sub-block, a multiple of RB
    constexpr size_t KP = 64 / NT;              // chunks per panel
    constexpr size_t PS = NT * 8;               // accumulators per row
    alignas(64) __m256 P[SB * PS];
    const size_t nfull = n / 64;
    const bool tail = n % 64 != 0;
    for (size_t r0 = 0; r0 < nr; r0 += SB) {
        const size_t sb = nr - r0 < SB ? nr - r0 : SB;
        for (size_t c0 = 0;; c0 += KP) {
            const size_t c1 = nfull - c0 < KP ? nfull : c0 + KP;
            const bool last = c1 == nfull;
            // the lines of the panel after this one (the next rows' first at the last), an eighth of them
            // before each pass of the rows they belong to
            const size_t pr = last ? r0 + SB : r0, pc0 = last ? 0 : c1;
            const size_t pc1 = (last ? nfull < KP : nfull - c1 < KP) ? nfull + tail : pc0 + KP;
            size_t i = 0;
            for (; i + RB <= sb; i += RB) {
                Row rows[RB];
                for (int k = 0; k < RB; ++k) rows[k] = row(r0 + i + k);
                for (size_t g = 0; g < 8; g += kGroupStep) {
                    if (ahead)
                        for (int k = 0; k < RB; ++k)
                            if (pr + i + k < nr) prefetch_part<(RB > 1)>(row(pr + i + k), pc0, pc1, g / kGroupStep, 8 / kGroupStep);
                    cdot_block_pass<PassLanes, RB, NT>(rows, Xp, n, c0, c1, last && tail, g, P + i * PS, PS);
                }
            }
            for (; i < sb; ++i) {
                const Row r1[1] = {row(r0 + i)};
                for (size_t g = 0; g < 8; g += kGroupStep) cdot_block_pass<PassLanes, 1, NT>(r1, Xp, n, c0, c1, last && tail, g, P + i * PS, PS);
            }
            if (last) break;
        }
        for (size_t i = 0; i < sb; ++i)
            for (int t = 0; t < NT; ++t) {
#ifdef GLM_CPU_ZMM
                if constexpr (pair_lanes<Row>::value)
                    for (size_t g = 0; g < 8; g += 2) {
                        float* const q = reinterpret_cast<float*>(P + i * PS + t * 8 + g);
                        _mm512_store_ps(q, pair_lanes_natural(_mm512_load_ps(q)));
                    }
#endif
                const float v = fold8(P + i * PS + t * 8);
                Y[t * ldy + r0 + i] = round ? bf16_round(v) : v;
            }
    }
}

// Any number of tokens: blocks of at most kMultiTokens, of near-equal sizes. (Six: 2 x 6 accumulators;
// measured on Zen 5, blocks of 7-8 tokens with one row per register block were slower, since loads
// (one per fma there) bound the loop.)
constexpr size_t kMultiTokens = 6;
// But 7 or 8 tokens against rows that stream from memory (more than kStreamBytes of them, past a core's L2) go
// as one block of one row a register block: the weights are then read once, at the memory's pace, with the
// fmas beside the reads, instead of a block of 4 from memory and a second from L2 after it (BF16, 8192 x 4096,
// 8 tokens, one thread: 41 -> 50 % of the FMA peak; weights in cache, 64 -> 57 %; docs/perf.md, "Session 36").
constexpr size_t kStreamTokens = 8;
constexpr size_t kStreamBytes = size_t{1} << 20;
inline size_t most_tokens(size_t T, size_t rows_bytes) {
    return T > kMultiTokens && T <= kStreamTokens && rows_bytes > kStreamBytes ? kStreamTokens : kMultiTokens;
}
inline size_t token_blocks(size_t T, size_t most = kMultiTokens) { return (T + most - 1) / most; }
// Tokens one packed x holds at most (packed_tokens' buffer: about 4 kPackTokens n bytes a thread): Lin::matmul
// takes longer calls in groups of it (each token's dots the same in any group).
constexpr size_t kPackTokens = 512;
// Tokens of block b of nb, whose first is t0.
inline size_t block_tokens(size_t T, size_t nb, size_t b, size_t t0) {
    return (T - t0) / (nb - b) + ((T - t0) % (nb - b) != 0);
}

// Y[t * ldy + i] = cdot(row(i), X + t * ldx) for i < nr, t < T, from X packed by packed_tokens.
// Rows are taken in chunks of about 192 KiB of stored weights (row_bytes each), and every token block
// runs over a chunk before the next chunk is read: a weight larger than the caches is read from memory
// once per call, not once per token block. `from_memory`: the rows are a weight's (the first token block
// asks for the next panel's lines ahead, cdot_multi_rows); false for rows the caller has just written into
// a buffer of its own (in L2 already, where asking cost FP8 rows turned into FP16 bits 2-4 points of the
// FMA peak at 24-64 tokens; docs/perf.md, "Session 36").
template <class MakeRow>
inline void cdot_multi_packed(const MakeRow& row, size_t nr, const float* Xp, size_t T, size_t n, float* Y, size_t ldy,
                              bool round, size_t row_bytes, bool from_memory = true, size_t most = kMultiTokens) {
    const size_t nb = token_blocks(T, most), nch = (n + 63) / 64;
    const size_t chunk = nb == 1 ? nr : std::max<size_t>(64, (size_t{192} << 10) / std::max<size_t>(row_bytes, 1));
    for (size_t a = 0; a < nr; a += chunk) {
        const size_t m = nr - a < chunk ? nr - a : chunk;
        const auto sub = [&](size_t i) { return row(a + i); };
        size_t t0 = 0;
        for (size_t b = 0; b < nb; ++b) {  // (block 0 reads the chunk from memory: ahead)
            const size_t nt = block_tokens(T, nb, b, t0);
            const bool ahead = from_memory && b == 0;
            const float* Xb = Xp + 64 * t0 * nch;
            float* Yb = Y + t0 * ldy + a;
            switch (nt) {
                case 1: cdot_multi_rows<1>(sub, m, Xb, n, Yb, ldy, round, ahead); break;
                case 2: cdot_multi_rows<2>(sub, m, Xb, n, Yb, ldy, round, ahead); break;
                case 3: cdot_multi_rows<3>(sub, m, Xb, n, Yb, ldy, round, ahead); break;
                case 4: cdot_multi_rows<4>(sub, m, Xb, n, Yb, ldy, round, ahead); break;
                case 5: cdot_multi_rows<5>(sub, m, Xb, n, Yb, ldy, round, ahead); break;
                case 6: cdot_multi_rows<6>(sub, m, Xb, n, Yb, ldy, round, ahead); break;
                case 7: cdot_multi_rows<7>(sub, m, Xb, n, Yb, ldy, round, ahead); break;
                default: cdot_multi_rows<8>(sub, m, Xb, n, Yb, ldy, round, ahead); break;
            }
            t0 += nt;
        }
    }
}
// The same from X in place (packed here, into the calling thread's buffer).
template <class MakeRow>
inline void cdot_multi(const MakeRow& row, size_t nr, const float* X, size_t ldx, size_t T, size_t n, float* Y,
                       size_t ldy, bool round, size_t row_bytes) {
    const size_t most = most_tokens(T, nr * row_bytes);
    using Row = decltype(row(size_t{0}));
    const float* const Xp = packed_tokens(X, ldx, T, n, most, kGroupFloats, pair_lanes<Row>::value);
    cdot_multi_packed(row, nr, Xp, T, n, Y, ldy, round, row_bytes, true, most);
}

struct F32Row {
    const float* p;
    static constexpr size_t kChunkBytes = 256;
    static constexpr bool kPlainLoads = true;
    const void* stored(size_t c) const { return p + 64 * c; }
    __m256 load8(size_t base, size_t g) const { return _mm256_loadu_ps(p + base + 8 * g); }
    __m256 load_partial(size_t base, size_t g, size_t k) const {
        return _mm256_maskload_ps(p + base + 8 * g, lane_mask(k));
    }
#ifdef GLM_CPU_ZMM
    __m512 load16z(size_t base, size_t g) const { return _mm512_loadu_ps(p + base + 8 * g); }
#endif
};

struct OnesRow {
    __m256 load8(size_t, size_t) const { return _mm256_set1_ps(1.0f); }
    __m256 load_partial(size_t, size_t, size_t) const { return _mm256_set1_ps(1.0f); }
};

}  // namespace detail
}  // inline namespace GLM_CPU_ISA
}  // namespace glm::cpu
