#include "expf.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "formats.hpp"

namespace glm::cpu {

const uint64_t kExpfTable[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};

namespace {
constexpr double kN = 32.0;
constexpr double kInvLn2N = 0x1.71547652b82fep0 * kN;
constexpr double kShift = 0x1.8p+52;
constexpr double kC0 = 0x1.c6af84b912394p-5 / kN / kN / kN;
constexpr double kC1 = 0x1.ebfce50fac4f3p-3 / kN / kN;
constexpr double kC2 = 0x1.62e42ff0c52d6p-1 / kN;
constexpr uint32_t kAbsTop88 = 0x42B;            // top12(88.0f)
constexpr float kOverflowAbove = 0x1.62e42ep6f;  // log(0x1p128)
constexpr float kUnderflowBelow = -0x1.9fe368p6f;  // log(0x1p-150)
}  // namespace

float expf(float x) {
    const uint32_t ux = f32_bits(x);
    if (((ux >> 20) & 0x7FF) >= kAbsTop88) {  // |x| >= 88, inf or NaN
        if (ux == 0xFF800000u) return 0.0f;   // -inf
        if (((ux >> 20) & 0x7FF) >= 0x7F8) return x + x;  // NaN or +inf
        if (x > kOverflowAbove) return f32_from_bits(0x7F800000u);
        if (x < kUnderflowBelow) return 0.0f;
    }
    const double xd = static_cast<double>(x);
    double kd = std::fma(kInvLn2N, xd, kShift);
    const uint64_t ki = f64_bits(kd);
    kd -= kShift;
    const double r = std::fma(kInvLn2N, xd, -kd);
    const double s = f64_from_bits(kExpfTable[ki % 32] + (ki << 47));
    const double z = std::fma(kC0, r, kC1);
    const double r2 = r * r;
    double y = std::fma(kC2, r, 1.0);
    y = std::fma(z, r2, y);
    y = y * s;
    return static_cast<float>(y);
}

namespace {

inline __m256d expf4_normal(__m128 x4) {
    const __m256d xd = _mm256_cvtps_pd(x4);
    const __m256d inv = _mm256_set1_pd(kInvLn2N), shift = _mm256_set1_pd(kShift);
    __m256d kd = _mm256_fmadd_pd(inv, xd, shift);
    const __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, shift);
    const __m256d r = _mm256_fmsub_pd(inv, xd, kd);  // fma(InvLn2N, x, -kd)
    const __m256i idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    const __m256i t = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(kExpfTable), idx, 8);
    const __m256d s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64(ki, 47)));
    const __m256d z = _mm256_fmadd_pd(_mm256_set1_pd(kC0), r, _mm256_set1_pd(kC1));
    const __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(_mm256_set1_pd(kC2), r, _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(z, r2, y);
    return _mm256_mul_pd(y, s);
}

}  // namespace

__m256 expf8(__m256 x) {
    const __m128 ylo = _mm256_cvtpd_ps(expf4_normal(_mm256_castps256_ps128(x)));
    const __m128 yhi = _mm256_cvtpd_ps(expf4_normal(_mm256_extractf128_ps(x, 1)));
    __m256 y = _mm256_insertf128_ps(_mm256_castps128_ps256(ylo), yhi, 1);
    // special cases, only where |x| >= 88 (or inf / NaN)
    const __m256i ux = _mm256_castps_si256(x);
    const __m256i abstop = _mm256_and_si256(_mm256_srli_epi32(ux, 20), _mm256_set1_epi32(0x7FF));
    const __m256i big = _mm256_cmpgt_epi32(abstop, _mm256_set1_epi32(kAbsTop88 - 1));
    if (_mm256_testz_si256(big, big)) return y;
    const __m256 zero = _mm256_setzero_ps();
    const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000));
    const __m256 bigf = _mm256_castsi256_ps(big);
    // applied in reverse priority order so that the first matching rule wins
    const __m256 under = _mm256_and_ps(bigf, _mm256_cmp_ps(x, _mm256_set1_ps(kUnderflowBelow), _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, zero, under);
    const __m256 over = _mm256_and_ps(bigf, _mm256_cmp_ps(x, _mm256_set1_ps(kOverflowAbove), _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, inf, over);
    const __m256 naninf = _mm256_castsi256_ps(_mm256_cmpgt_epi32(abstop, _mm256_set1_epi32(0x7F7)));
    y = _mm256_blendv_ps(y, _mm256_add_ps(x, x), naninf);
    const __m256 neginf = _mm256_castsi256_ps(_mm256_cmpeq_epi32(ux, _mm256_set1_epi32(static_cast<int>(0xFF800000u))));
    y = _mm256_blendv_ps(y, zero, neginf);
    return y;
}

void expf_array(const float* x, float* y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, expf8(_mm256_loadu_ps(x + i)));
    for (; i < n; ++i) y[i] = expf(x[i]);
}

namespace {

using LibmExpf = float (*)(float);
// Through a volatile pointer: the compiler can neither inline nor constant-fold the host's expf.
LibmExpf volatile g_libm_expf = &::expf;

template <class Block>
uint64_t check_range(uint64_t lo, uint64_t hi, uint64_t* first, unsigned threads, Block block) {
    if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
    const uint64_t total = hi > lo ? hi - lo : 0;
    threads = static_cast<unsigned>(std::min<uint64_t>(threads, std::max<uint64_t>(1, total / 4096)));
    std::vector<uint64_t> counts(threads, 0), firsts(threads, uint64_t{1} << 32);
    auto work = [&](unsigned t) {
        const uint64_t a = lo + total * t / threads, b = lo + total * (t + 1) / threads;
        block(a, b, counts[t], firsts[t]);
    };
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work, t);
    work(0);
    for (auto& th : pool) th.join();
    uint64_t n = 0, f = uint64_t{1} << 32;
    for (unsigned t = 0; t < threads; ++t) {
        n += counts[t];
        f = std::min(f, firsts[t]);
    }
    *first = f;
    return n;
}

inline void note(uint32_t u, float mine, LibmExpf ref, uint64_t& count, uint64_t& first) {
    if (f32_bits(mine) != f32_bits(ref(f32_from_bits(u)))) {
        if (count == 0) first = u;
        ++count;
    }
}

}  // namespace

uint64_t expf_check_range(uint64_t lo, uint64_t hi, uint64_t* first, unsigned threads) {
    return check_range(lo, hi, first, threads, [](uint64_t a, uint64_t b, uint64_t& count, uint64_t& f) {
        const LibmExpf ref = g_libm_expf;
        for (uint64_t u = a; u < b; ++u) {
            const uint32_t v = static_cast<uint32_t>(u);
            note(v, expf(f32_from_bits(v)), ref, count, f);
        }
    });
}

uint64_t expf8_check_range(uint64_t lo, uint64_t hi, uint64_t* first, unsigned threads) {
    return check_range(lo, hi, first, threads, [](uint64_t a, uint64_t b, uint64_t& count, uint64_t& f) {
        const LibmExpf ref = g_libm_expf;
        alignas(32) float y[8];
        const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        uint64_t u = a;
        for (; u + 8 <= b; u += 8) {
            const __m256i bits = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(u))), step);
            _mm256_store_ps(y, expf8(_mm256_castsi256_ps(bits)));
            for (int l = 0; l < 8; ++l) note(static_cast<uint32_t>(u + l), y[l], ref, count, f);
        }
        if (u < b) {  // a last partial group: pad with the first input, check only the live lanes
            alignas(32) uint32_t in[8];
            for (int l = 0; l < 8; ++l) in[l] = static_cast<uint32_t>(u + l < b ? u + l : u);
            _mm256_store_ps(y, expf8(_mm256_load_ps(reinterpret_cast<const float*>(in))));
            for (uint64_t l = 0; u + l < b; ++l) note(static_cast<uint32_t>(u + l), y[l], ref, count, f);
        }
    });
}

}  // namespace glm::cpu
