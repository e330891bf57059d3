#include "matvec.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cdot.hpp"
#include "formats.hpp"

// (compiled twice: here for AVX2, and by matvec_avx512.cpp for AVX-512VL, each in its instruction set's inline
// namespace, isa.hpp; the one-token matvec_* and the choice of kernels only here)
namespace glm::cpu {
inline namespace GLM_CPU_ISA {
namespace {

// Split rows [0, R) over threads (each row is computed whole by one thread, so the split changes
// no bit). Small problems run on the calling thread.
template <class Fn>
void for_rows(size_t R, size_t C, unsigned threads, Fn fn) {
    if (threads == 0) {
        const size_t work = R * std::max<size_t>(C, 1);
        const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        threads = work < (size_t{1} << 20) ? 1u : hw;  // spawning threads costs tens of microseconds
    }
    threads = static_cast<unsigned>(std::min<size_t>(threads, std::max<size_t>(R, 1)));
    if (threads <= 1) {
        for (size_t r = 0; r < R; ++r) fn(r);
        return;
    }
    auto part = [&](unsigned t) {
        const size_t a = R * t / threads, b = R * (t + 1) / threads;
        for (size_t r = a; r < b; ++r) fn(r);
    };
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(part, t);
    part(0);
    for (auto& th : pool) th.join();
}

struct Bf16Row {
    const uint16_t* p;
    static constexpr size_t kChunkBytes = 128;
    static constexpr bool kPlainLoads = true;
    const void* stored(size_t c) const { return p + 64 * c; }
    static __m256 widen(__m128i h) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    __m256 load8(size_t base, size_t g) const {
        return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + base + 8 * g)));
    }
    __m256 load_partial(size_t base, size_t g, size_t k) const {
        alignas(16) uint16_t buf[8] = {};
        std::memcpy(buf, p + base + 8 * g, k * sizeof(uint16_t));
        return widen(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
    }
#ifdef GLM_CPU_ZMM
    __m512 load16z(size_t base, size_t g) const {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + base + 8 * g));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
#endif
};

// FP8: w = fl32(e4m3 * s) for the block's scale s. e4m3_scaled_8 gives v = e4m3 * 2^-8 exactly, so
// w = fl32(v * 2^8 * s). Folded: s2 = s * 2^8 was formed once (exact: a power-of-two multiply that
// did not overflow) and fl32(v * s2) is the same single rounding of the same exact product.
// Unfolded (some finite scale overflows when multiplied by 2^8): v * 2^8 (exact), then * s.
// NanCodes: the row has a NaN code somewhere, so the lanes that hold one are set to NaN.
template <bool Folded, bool NanCodes>
struct Fp8Row {
    const uint8_t* p;
    const float* srow;  // this row's block of scales (pre-multiplied by 2^120 when Folded)
    __m256 decode(__m128i b, float s) const {
        __m256 v = e4m3_scaled_8(b);
        if (!Folded) v = _mm256_mul_ps(v, _mm256_set1_ps(kE4M3Unscale));
        v = _mm256_mul_ps(v, _mm256_set1_ps(s));
        if (NanCodes) v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), e4m3_nan_mask_8(b));
        return v;
    }
    __m256 load8(size_t base, size_t g) const {
        return decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + base + 8 * g)), srow[base / 128]);
    }
    __m256 load_partial(size_t base, size_t g, size_t k) const {
        alignas(16) uint8_t buf[16] = {};
        std::memcpy(buf, p + base + 8 * g, k);
        return decode(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)), srow[base / 128]);
    }
};

// MXFP4: the eight E2M1 magnitudes times the group's E8M0 scale form a table (e2m1_scaled_row, made once for every
// scale code: fl32(m * s) per entry, exactly the product the definition rounds), the nibbles pick from it by
// permutation, and the sign is applied after (the scale is never negative). Multiplying the table per group, as
// before session 43, cost a multiply, a broadcast and (AVX-512) the signed half's OR and join a group.
struct Mxfp4Row {
    const uint8_t* p;   // this row's packed bytes
    const uint8_t* sc;  // this row's E8M0 scales, one per 32 columns
    static constexpr size_t kChunkBytes = 32;
    const void* stored(size_t c) const { return p + 32 * c; }
    __m256 load8(size_t base, size_t g) const {
        const size_t i = base + 8 * g;
        uint32_t v;
        std::memcpy(&v, p + i / 2, 4);  // columns i..i+7 = bytes i/2..i/2+3
        // lane l gets bits 4l..4l+3: column i+l (even l: low nibble of byte l/2; odd: high nibble)
        const __m256i nib =
            _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(v)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        return decode_e2m1_8(nib, _mm256_load_ps(e2m1_scaled_row(sc[base / 32 + g / 4])));
    }
    // C % 32 == 0 and groups of eight never straddle it, so there is never a partial group.
    __m256 load_partial(size_t base, size_t g, size_t) const { return load8(base, g); }
#ifdef GLM_CPU_ZMM
    static constexpr bool kPairLanes = true;  // (load16z's order: cdot.hpp pair_lanes)
    // sixteen nibbles (one scale: g even) through the scale's row of e2m1_scaled_row: the eight magnitudes times the
    // scale and, above them, the same with the sign bit set: the bits decode_e2m1_8 gives (its sign OR'd on after)
    __m512 load16z(size_t base, size_t g) const {
        const size_t i = base + 8 * g;
        // (the 8 bytes in every 64-bit lane, lane q shifted right by 4q: dword 2q's low nibble is column q, dword
        // 2q + 1's column 8 + q, the pair-lane order)
        uint64_t b8;
        std::memcpy(&b8, p + i / 2, 8);
        const __m512i nib =
            _mm512_srlv_epi64(_mm512_set1_epi64(static_cast<long long>(b8)), _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28));
        // (vpermps looks at the low 4 bits of each lane)
        return _mm512_permutexvar_ps(nib, _mm512_load_ps(e2m1_scaled_row(sc[base / 32 + g / 4])));
    }
#endif
};

// e4m3 * 2^-8 (exact: e4m3_scaled_8's value) -> fl32(e4m3 * s), the scale at sp folded (s * 2^8) or raw (then
// the value is multiplied by 2^8 first, exactly): one rounding of the exact product either way.
template <bool Folded>
inline __m256 fp8_times_scale(__m256 v, const float* sp) {
    if (!Folded) v = _mm256_mul_ps(v, _mm256_set1_ps(kE4M3Unscale));
    return _mm256_mul_ps(v, _mm256_broadcast_ss(sp));
}

// FP8 for the engine: srow is this row's block of scales, already folded (s * 2^8, exact: the caller
// checked that none overflows) when Folded, raw otherwise (then e4m3 * 2^-8 is multiplied by 2^8,
// exactly, and then by s). Either way one rounding of the exact product e4m3 * s. The scale is
// broadcast straight from memory.
template <bool Folded, bool NanCodes>
struct Fp8ScaleRow {
    const uint8_t* p;
    const float* srow;
    static constexpr size_t kChunkBytes = 64;
    const void* stored(size_t c) const { return p + 64 * c; }
    __m256 decode(__m128i b, const float* s) const {
        __m256 v = fp8_times_scale<Folded>(e4m3_scaled_8(b), s);
        if (NanCodes) v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), e4m3_nan_mask_8(b));
        return v;
    }
    __m256 load8(size_t base, size_t g) const {
        return decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + base + 8 * g)), srow + base / 128);
    }
    __m256 load_partial(size_t base, size_t g, size_t k) const {
        alignas(16) uint8_t buf[16] = {};
        std::memcpy(buf, p + base + 8 * g, k);
        return decode(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)), srow + base / 128);
    }
    // groups g and g + 1: the sixteen codes widened and masked in one register (as e4m3_scaled_8)
    void load16(size_t base, size_t g, __m256& a, __m256& b) const {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + base + 8 * g));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                                           _mm256_set1_epi16(static_cast<short>(0xBF80)));
        a = fp8_times_scale<Folded>(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), srow + base / 128);
        b = fp8_times_scale<Folded>(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), srow + base / 128);
        if (NanCodes) {
            const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
            a = _mm256_blendv_ps(a, nan, e4m3_nan_mask_8(c));
            b = _mm256_blendv_ps(b, nan, e4m3_nan_mask_8(_mm_srli_si128(c, 8)));
        }
    }
#ifdef GLM_CPU_ZMM
    __m512 load16z(size_t base, size_t g) const {  // (as load16, in one register)
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + base + 8 * g));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                                           _mm256_set1_epi16(static_cast<short>(0xBF80)));
        __m512 v = _mm512_cvtph_ps(h);
        if (!Folded) v = _mm512_mul_ps(v, _mm512_set1_ps(kE4M3Unscale));
        v = _mm512_mul_ps(v, _mm512_set1_ps(srow[base / 128]));
        if (NanCodes) {
            const __m512i mag = _mm512_and_si512(_mm512_cvtepu8_epi32(c), _mm512_set1_epi32(0x7F));
            v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), v,
                                     _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
        }
        return v;
    }
#endif
};

// FP8 rows already turned into the FP16 bits e4m3_scaled_8 makes (e4m3 * 2^-8, exact; NaN codes are not
// NaN there: NaN-free tensors only), for calls of many token blocks (rows_fp8): each block's pass then widens
// and scales eight weights in three instructions, not six. w = fl32(e4m3 * s) as Fp8ScaleRow gives it, from
// the same value and the same (folded) scale.
template <bool Folded>
struct Fp8HalfRow {
    const uint16_t* h;  // this row's FP16 bits
    const float* srow;
    static constexpr size_t kChunkBytes = 128;
    const void* stored(size_t c) const { return h + 64 * c; }
    __m256 load8(size_t base, size_t g) const {
        const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + base + 8 * g));
        return fp8_times_scale<Folded>(_mm256_cvtph_ps(bits), srow + base / 128);
    }
    __m256 load_partial(size_t base, size_t g, size_t k) const {
        alignas(16) uint16_t buf[8] = {};
        std::memcpy(buf, h + base + 8 * g, k * sizeof(uint16_t));
        return fp8_times_scale<Folded>(_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf))),
                                       srow + base / 128);
    }
#ifdef GLM_CPU_ZMM
    __m512 load16z(size_t base, size_t g) const {
        __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + base + 8 * g)));
        if (!Folded) v = _mm512_mul_ps(v, _mm512_set1_ps(kE4M3Unscale));
        return _mm512_mul_ps(v, _mm512_set1_ps(srow[base / 128]));
    }
#endif
};
// h[i] = the FP16 bits of code q[i] as e4m3_scaled_8 forms them: sign-extended, shifted left by 7, bit 14 cleared.
void fp8_half_bits(const uint8_t* q, size_t n, uint16_t* h) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
        const __m256i v = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                                           _mm256_set1_epi16(static_cast<short>(0xBF80)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), v);
    }
    for (; i < n; ++i) h[i] = static_cast<uint16_t>((static_cast<int8_t>(q[i]) * 128) & 0xBF80);
}

// MXFP4 rows turned likewise into the FP16 bits of their E2M1 values (exact, signed), beside their scales as
// f32: w = fl32(e2m1 * s), the product Mxfp4Row's table rounds (its sign applied after: fl32(-m s) = -fl32(m s)
// for every s but NaN, and a NaN scale, code 0xFF, keeps a call on Mxfp4Row: rows_mxfp4).
struct Mxfp4HalfRow {
    const uint16_t* h;  // this row's FP16 bits
    const float* s;     // this row's scales, one per 32 columns
    static constexpr size_t kChunkBytes = 128;
    const void* stored(size_t c) const { return h + 64 * c; }
    __m256 load8(size_t base, size_t g) const {
        const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + base + 8 * g)));
        return _mm256_mul_ps(v, _mm256_broadcast_ss(s + (base + 8 * g) / 32));
    }
    // C % 32 == 0: never a partial group
    __m256 load_partial(size_t base, size_t g, size_t) const { return load8(base, g); }
#ifdef GLM_CPU_ZMM
    __m512 load16z(size_t base, size_t g) const {  // (g even: one scale)
        const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + base + 8 * g)));
        return _mm512_mul_ps(v, _mm512_set1_ps(s[(base + 8 * g) / 32]));
    }
#endif
};
// h[c] = the FP16 bits of E2M1 code c of a packed row of n columns (n % 32 == 0; column 2b in byte b's low
// nibble, 2b + 1 in its high): each code's FP16 high byte from a table, its low byte 0.
void mxfp4_half_bits(const uint8_t* packed, size_t n, uint16_t* h) {
    // +-{0, .5, 1, 1.5, 2, 3, 4, 6}: FP16 0x0000, 0x3800, 0x3C00, 0x3E00, 0x4000, 0x4200, 0x4400, 0x4600
    const __m128i table = _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, static_cast<char>(0x80),
                                        static_cast<char>(0xB8), static_cast<char>(0xBC), static_cast<char>(0xBE),
                                        static_cast<char>(0xC0), static_cast<char>(0xC2), static_cast<char>(0xC4),
                                        static_cast<char>(0xC6));
    const __m128i low = _mm_set1_epi8(0x0F), zero = _mm_setzero_si128();
    for (size_t b = 0; b < n / 2; b += 16) {  // 32 columns
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + b));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(v, low));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low));
        const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);  // columns 0-15, 16-31
        __m128i* const d = reinterpret_cast<__m128i*>(h + 2 * b);
        _mm_storeu_si128(d, _mm_unpacklo_epi8(zero, c0));
        _mm_storeu_si128(d + 1, _mm_unpackhi_epi8(zero, c0));
        _mm_storeu_si128(d + 2, _mm_unpacklo_epi8(zero, c1));
        _mm_storeu_si128(d + 3, _mm_unpackhi_epi8(zero, c1));
    }
}

// Rows [0, nr) through FP16 bits, kHalfRows at a time: turn(a, m, h, ld) fills rows a .. a + m - 1 into h (ld
// apart), row(h, ld, a, i) makes row i's source; X packed once for all.
constexpr size_t kHalfRows = 64;
template <class Turn, class MakeRow>
void rows_through_half(size_t nr, size_t C, const float* X, size_t ldx, size_t T, float* Y, size_t ldy, bool round,
                       const Turn& turn, const MakeRow& row) {
    const size_t ld = (C + 7) / 8 * 8;
    const float* const Xp = packed_tokens(X, ldx, T, C, detail::kMultiTokens, detail::kGroupFloats);
    thread_local std::vector<uint16_t> half;
    if (half.size() < kHalfRows * ld) half.resize(kHalfRows * ld);
    for (size_t a = 0; a < nr; a += kHalfRows) {
        const size_t m = std::min(kHalfRows, nr - a);
        turn(a, m, half.data(), ld);
        detail::cdot_multi_packed([&](size_t i) { return row(half.data(), ld, a, i); }, m, Xp, T, C, Y + a, ldy, round,
                                  2 * ld, /*from_memory=*/false);
    }
}
// Rows longer than rows_any's f32 pre-decode takes, against `blocks` token blocks or more (FP8 3, MXFP4 2 until
// session 43: where the turning began to pay once the turned rows' passes no longer asked for lines ahead;
// docs/perf.md, "Session 36"; since session 43 the AVX2 build's only, below).
bool takes_half(size_t T, size_t C, size_t blocks) { return detail::token_blocks(T) >= blocks && C > 1024; }
// MXFP4 rows decode through their scale's row of products since session 43 (e2m1_scaled_row: no multiply). The
// AVX-512 build's passes over the packed rows then beat both rows turned into FP16 bits (16384 x 4096, one thread,
// Zen 4: 63 -> 73 % of the FMA peak at 64-128 tokens, 50 -> 68 % at 8) and rows of <= 1024 decoded into f32 first
// (8192 x 1024: 58 -> 67 % at 18 tokens, 68 % either way at 64), so it takes neither; the AVX2 build's passes beat
// the turned rows up to ~32 tokens (54 % either way at 32, the turned 56 against 54 at 64), not the f32 rows
// (docs/perf.md, "Session 43"). (A group's decode is two operations on the vector ports, the turned rows' conversion
// and multiply three, so this should hold where 512-bit multiply-adds are full width too: not yet measured there.)
#ifdef GLM_CPU_ZMM
constexpr size_t kMxfp4HalfBlocks = SIZE_MAX;
constexpr bool kMxfp4Predecode = false;
#else
constexpr size_t kMxfp4HalfBlocks = 6;
constexpr bool kMxfp4Predecode = true;
#endif

// FP8 rows take the passes over their codes at every token count (no turned rows, no f32 pre-decode) where that was
// measured to pay: the AVX-512 build on Zen 4 (AMD family 19h, whose 512-bit operations run on 256-bit units, so a
// group's five decode operations cost about what its multiply-adds do), 16384 x 4096 at 13-128 tokens 50-63 -> 63-67
// % of the FMA peak, 8192 x 1024 at 18-24 tokens 55-58 -> 62-64 % (docs/perf.md, "Session 43"). Where 512-bit
// multiply-adds are full width (Intel, Zen 5) the decode costs twice its share and the turned rows' three operations
// a group are expected to keep paying, so the earlier rule stays there until measured. GLM_CPU_FP8_DIRECT=1 or 0 in
// the environment, read once, picks either way (tests cover both paths on any CPU).
bool fp8_direct() {
#ifdef GLM_CPU_ZMM
    static const bool direct = [] {
        const char* e = std::getenv("GLM_CPU_FP8_DIRECT");
        if (e != nullptr && (std::string(e) == "0" || std::string(e) == "1")) return std::string(e) == "1";
        __builtin_cpu_init();
        return __builtin_cpu_is("amdfam19h") != 0;
    }();
    return direct;
#else
    return false;
#endif
}

// Y[t * ldy + i] = cdot(row(i), X[t]) for i < nr, t < T (see rows_bf16). With `predecode` (formats
// whose decode costs more than an f32 load: FP8, MXFP4), rows of at most 1024 and 18 tokens or more, rows are
// first decoded, a few at a time, into a per-thread f32 buffer (the values load8 gives, stored) and
// the token blocks then read that: each weight is decoded once per call instead of once per block.
template <class MakeRow>
void rows_any(const MakeRow& row, size_t nr, const float* X, size_t ldx, size_t T, size_t C, float* Y, size_t ldy,
              bool round, size_t row_bytes, bool predecode = false) {
    if (nr == 0 || T == 0) return;
    if (T == 1) {
#ifdef GLM_CPU_ZMM
        using Row = decltype(row(size_t{0}));
        if constexpr (detail::pair_lanes<Row>::value) X = packed_tokens(X, ldx, 1, C, 1, 16, true);  // (x interleaved once)
#endif
        for (size_t i = 0; i < nr; ++i) {
#ifdef GLM_CPU_ZMM
            const float v = detail::cdot_kernel_z(row(i), X, C);
#else
            const float v = detail::cdot_kernel(row(i), X, C);
#endif
            Y[i] = round ? bf16_round(v) : v;
        }
        return;
    }
    // (measured on Zen 5: a gain for short rows and many token blocks; at C = 4096 the f32 rows, four
    // bytes a weight, cost FP8 more than its decode saves)
    if (!predecode || T < 3 * detail::kMultiTokens || C == 0 || C > 1024) {
        detail::cdot_multi(row, nr, X, ldx, T, C, Y, ldy, round, row_bytes);
        return;
    }
    const size_t ld = (C + 7) / 8 * 8;
    const size_t nb = std::max<size_t>(16, (size_t{1} << 16) / ld);  // rows per decoded block (>= 256 KiB)
    const float* const Xp = packed_tokens(X, ldx, T, C, detail::kMultiTokens, detail::kGroupFloats);  // (x packed once for every block)
    thread_local std::vector<float> buf;
    if (buf.size() < nb * ld) buf.resize(nb * ld);
    for (size_t a = 0; a < nr; a += nb) {
        const size_t m = std::min(nb, nr - a);
        for (size_t i = 0; i < m; ++i) {
            const auto src = row(a + i);
            float* out = buf.data() + i * ld;
            for (size_t base = 0; base < C; base += 64)
                for (size_t g = 0; g < 8 && base + 8 * g < C; ++g) {
                    const size_t k = C - base - 8 * g;
                    // lanes past C are stored too (the row stride is a multiple of 8); F32Row never reads them
                    _mm256_storeu_ps(out + base + 8 * g, k >= 8 ? src.load8(base, g) : src.load_partial(base, g, k));
                }
        }
        const float* w = buf.data();
        detail::cdot_multi_packed([&](size_t i) { return detail::F32Row{w + i * ld}; }, m, Xp, T, C, Y + a, ldy, round,
                                  ld * sizeof(float), /*from_memory=*/false);
    }
}

}  // namespace

void rows_bf16(const uint16_t* W, size_t C, size_t r0, size_t r1, const float* X, size_t ldx, size_t T, float* Y,
               size_t ldy, bool round) {
    if (r1 <= r0) return;
    const uint16_t* w = W + r0 * C;
    rows_any([&](size_t i) { return Bf16Row{w + i * C}; }, r1 - r0, X, ldx, T, C, Y, ldy, round, 2 * C);
}

void rows_f32(const float* W, size_t C, size_t r0, size_t r1, const float* X, size_t ldx, size_t T, float* Y,
              size_t ldy, bool round) {
    if (r1 <= r0) return;
    const float* w = W + r0 * C;
    rows_any([&](size_t i) { return detail::F32Row{w + i * C}; }, r1 - r0, X, ldx, T, C, Y, ldy, round, 4 * C);
}

void rows_fp8(const uint8_t* q, const float* scale_inv, size_t C, size_t r0, size_t r1, const float* X, size_t ldx,
              size_t T, float* Y, size_t ldy, bool round, bool nan_free) {
    if (r1 <= r0) return;
    const size_t sc = fp8_scale_cols(C), b0 = r0 / 128, nb = (r1 - 1) / 128 + 1 - b0;
    // the scales these rows use, times 2^8 (exact), unless one would overflow: then none is folded
    // (both forms give the same bits; folding saves a multiply per eight weights)
    thread_local std::vector<float> folded;
    folded.resize(nb * sc);
    bool fold = true;
    for (size_t j = 0; j < nb * sc; ++j) {
        const float s = scale_inv[b0 * sc + j];
        folded[j] = s * kE4M3Unscale;
        fold &= std::isfinite(folded[j]) || !std::isfinite(s);
    }
    const float* S = fold ? folded.data() : scale_inv + b0 * sc;
    const uint8_t* p = q + r0 * C;
    const bool direct = fp8_direct();
    if (nan_free && !direct && takes_half(T, C, 3)) {
        // kHalfRows rows at a time turned into FP16 bits (two bytes a weight, as BF16 rows), then every token block over
        // them (8192 x 4096, one thread: 64 tokens 47-50 -> 53 % of the FMA peak, 128 46-51 -> 55-56 %; docs/perf.md,
        // "Session 35"; from 13 tokens since session 36: at 7-12 the turning costs what two blocks' decodes save)
        auto turn = [&](size_t a, size_t m, uint16_t* h, size_t ld) {
            for (size_t i = 0; i < m; ++i) fp8_half_bits(p + (a + i) * C, C, h + i * ld);
        };
        auto go = [&](auto tag) {
            using Row = decltype(tag);
            rows_through_half(r1 - r0, C, X, ldx, T, Y, ldy, round, turn, [&](const uint16_t* h, size_t ld, size_t a, size_t i) {
                return Row{h + i * ld, S + ((r0 + a + i) / 128 - b0) * sc};
            });
        };
        fold ? go(Fp8HalfRow<true>{}) : go(Fp8HalfRow<false>{});
        return;
    }
    auto run = [&](auto tag) {
        using Row = decltype(tag);
        rows_any([&](size_t i) { return Row{p + i * C, S + ((r0 + i) / 128 - b0) * sc}; }, r1 - r0, X, ldx, T, C, Y,
                 ldy, round, C, !direct);
    };
    if (nan_free)
        fold ? run(Fp8ScaleRow<true, false>{}) : run(Fp8ScaleRow<false, false>{});
    else
        fold ? run(Fp8ScaleRow<true, true>{}) : run(Fp8ScaleRow<false, true>{});
}

void rows_mxfp4(const uint8_t* packed, const uint8_t* scale, size_t C, size_t r0, size_t r1, const float* X,
                size_t ldx, size_t T, float* Y, size_t ldy, bool round) {
    if (r1 <= r0) return;
    const uint8_t* p = packed + r0 * (C / 2);
    const uint8_t* s = scale + r0 * (C / 32);
    if (takes_half(T, C, kMxfp4HalfBlocks) && std::memchr(s, 0xFF, (r1 - r0) * (C / 32)) == nullptr) {
        const size_t ns = C / 32;
        thread_local std::vector<float> sf;  // the turned rows' scales as f32
        if (sf.size() < kHalfRows * ns) sf.resize(kHalfRows * ns);
        auto turn = [&](size_t a, size_t m, uint16_t* h, size_t ld) {
            for (size_t i = 0; i < m; ++i) {
                mxfp4_half_bits(p + (a + i) * (C / 2), C, h + i * ld);
                for (size_t j = 0; j < ns; ++j) sf[i * ns + j] = kE8M0[s[(a + i) * ns + j]];
            }
        };
        rows_through_half(r1 - r0, C, X, ldx, T, Y, ldy, round, turn, [&](const uint16_t* h, size_t ld, size_t, size_t i) {
            return Mxfp4HalfRow{h + i * ld, sf.data() + i * ns};
        });
        return;
    }
    rows_any([&](size_t i) { return Mxfp4Row{p + i * (C / 2), s + i * (C / 32)}; }, r1 - r0, X, ldx, T, C, Y, ldy,
             round, C / 2 + C / 32, kMxfp4Predecode);
}

namespace {
// (in the passes' vectors, detail::PassLanes: the widest this build's kernels use)
float fma_chains(long iters, float seed) {
    using L = detail::PassLanes;
    L::V v[kFmaChains];
    for (int k = 0; k < kFmaChains; ++k) v[k] = L::set1(seed + static_cast<float>(k));
    const L::V b = L::set1(0.999999f), c = L::set1(1e-7f);
    for (long i = 0; i < iters; ++i)
#pragma GCC unroll 12
        for (int k = 0; k < kFmaChains; ++k) v[k] = L::fma(v[k], b, c);
    L::V s = v[0];
    for (int k = 1; k < kFmaChains; ++k) s = L::add(s, v[k]);
    float out[sizeof(L::V) / sizeof(float)];
    std::memcpy(out, &s, sizeof out);
    return out[0];
}
}  // namespace

}  // inline namespace GLM_CPU_ISA

#define GLM_CPU_STR2(x) #x
#define GLM_CPU_STR(x) GLM_CPU_STR2(x)
#ifdef GLM_CPU_ZMM
#define GLM_CPU_LIN_TABLE kLinKernelsAvx512
#else
#define GLM_CPU_LIN_TABLE kLinKernelsAvx2
#endif
extern const LinKernels GLM_CPU_LIN_TABLE;
const LinKernels GLM_CPU_LIN_TABLE = {GLM_CPU_STR(GLM_CPU_ISA), &rows_bf16, &rows_f32, &rows_fp8, &rows_mxfp4,
                                       &fma_chains, detail::kGroupFloats};

#ifndef GLM_CPU_ZMM
#if GLM_CPU_BUILD_AVX512
extern const LinKernels kLinKernelsAvx512;
#endif

namespace {
bool avx512_runs() {
#if GLM_CPU_BUILD_AVX512
    // (libgcc's answer includes the OS's: AVX-512 only where XCR0 says the OS saves its registers)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
}
}  // namespace

std::string lin_kernels_refusal(const char* isa) {
    std::string names;
    for (const char* n : kLinKernelNames) names += std::string(names.empty() ? "" : " or ") + n;
    for (const char* n : kLinKernelNames)
        if (std::string(n) == isa) return "does not run here (this CPU, its OS or this build lacks it)";
    return "expected " + names;
}

const LinKernels* lin_kernels_named(const char* isa) {
    const std::string s = isa ? isa : "";
    if (s == "avx2") return &kLinKernelsAvx2;
#if GLM_CPU_BUILD_AVX512
    if (s == "avx512" && avx512_runs()) return &kLinKernelsAvx512;
#endif
    return nullptr;
}

const LinKernels& lin_kernels() {
    static const LinKernels* const chosen = [] {
        const char* e = std::getenv("GLM_CPU_KERNELS");
        if (e == nullptr || *e == '\0') {
            const LinKernels* wide = lin_kernels_named("avx512");
            return wide ? wide : &kLinKernelsAvx2;
        }
        const LinKernels* k = lin_kernels_named(e);
        if (k == nullptr)
            throw std::invalid_argument("GLM_CPU_KERNELS=" + std::string(e) + ": " + lin_kernels_refusal(e) +
                                        " (unset: the fastest this CPU runs)");
        return k;
    }();
    return *chosen;
}

void matvec_bf16(const uint16_t* W, size_t R, size_t C, const float* x, float* y, unsigned threads) {
    for_rows(R, C, threads, [&](size_t r) { y[r] = detail::cdot_kernel(Bf16Row{W + r * C}, x, C); });
}

void matvec_fp8(const uint8_t* q, const float* scale_inv, size_t R, size_t C, const float* x, float* y,
                unsigned threads) {
    const size_t sc = fp8_scale_cols(C), ns = fp8_scale_rows(R) * sc;
    std::vector<float> folded(ns);
    bool can_fold = true;
    for (size_t j = 0; j < ns; ++j) {
        folded[j] = scale_inv[j] * kE4M3Unscale;
        can_fold &= std::isfinite(folded[j]) || !std::isfinite(scale_inv[j]);
    }
    const float* s = can_fold ? folded.data() : scale_inv;
    for_rows(R, C, threads, [&](size_t r) {
        const uint8_t* row = q + r * C;
        const float* srow = s + (r / 128) * sc;
        const bool nan = has_e4m3_nan(row, C);
        float v;
        if (can_fold)
            v = nan ? detail::cdot_kernel(Fp8Row<true, true>{row, srow}, x, C)
                    : detail::cdot_kernel(Fp8Row<true, false>{row, srow}, x, C);
        else
            v = nan ? detail::cdot_kernel(Fp8Row<false, true>{row, srow}, x, C)
                    : detail::cdot_kernel(Fp8Row<false, false>{row, srow}, x, C);
        y[r] = v;
    });
}

void matvec_mxfp4(const uint8_t* packed, const uint8_t* scale, size_t R, size_t C, const float* x, float* y,
                  unsigned threads) {
    for_rows(R, C, threads, [&](size_t r) {
        y[r] = detail::cdot_kernel(Mxfp4Row{packed + r * (C / 2), scale + r * (C / 32)}, x, C);
    });
}
#endif  // GLM_CPU_ZMM

}  // namespace glm::cpu
