#include "expf.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "formats.hpp"

namespace glm::cpu {

float expf(float x) { return num::expf(x); }

// The vector path: the same operations as num::expf on its constants and table, four lanes of double.
using namespace num::expf_consts;

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
