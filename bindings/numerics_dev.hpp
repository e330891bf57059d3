// The scalar canonical numerics both engines compute, written once (docs/contract.md §4.1, 4.3; docs/numerics.md):
// bit views, BF16 rounding, the canonical expf (glibc's algorithm, N = 32, its five FMAs explicit), the
// canonical double exp64 of mHC (glibc's exp, N = 128, degree-5 polynomial, special cases as glibc's
// FMA build) and its sigmoid, and the non-canonical expf="native" stand-in of the CPU engine and the
// CUDA emulation (Cephes-style). Each is a port of the algorithm in basic IEEE operations, so the same
// source gives the same bits on the host (the CPU engine, the CUDA emulation) and on the device.
//
// GLM_HD marks them __host__ __device__ under nvcc and plain inline elsewhere; on the device every
// operation is the explicit round-to-nearest intrinsic and table reads go through the read-only
// cache, on the host the plain operation (the builds never contract: -ffp-contract=off, --fmad=false).
// The CPU engine's vectorized paths (AVX2) keep their own code over the same constants and tables.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GLM_HD __host__ __device__ __forceinline__
#else
#define GLM_HD inline
#endif

namespace glm::num {

// ---- basic operations, round to nearest even, never fused unless written as an fma ---------------

GLM_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
GLM_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
GLM_HD double sub_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dsub_rn(a, b);
#else
    return a - b;
#endif
}
GLM_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}
GLM_HD double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __ddiv_rn(a, b);
#else
    return a / b;
#endif
}
GLM_HD double fma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
    return __fma_rn(a, b, c);
#else
    return std::fma(a, b, c);
#endif
}
GLM_HD float f32_rn(double x) {  // double -> float, round to nearest even
#if defined(__CUDA_ARCH__)
    return __double2float_rn(x);
#else
    return static_cast<float>(x);
#endif
}

// ---- bit views ------------------------------------------------------------------------------------

GLM_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
#endif
}
GLM_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, 4);
    return x;
#endif
}

// The greedy choice over logits: the largest, the lowest index among equals, and a NaN over every
// number (the first NaN): np.argmax's rule. (a, ia) is chosen over (b, ib); an index < 0 is no
// candidate. A total order on (value, index) pairs, so any reduction tree gives the scan's index.
GLM_HD bool argmax_better(float a, int ia, float b, int ib) {
    if (ia < 0) return false;
    if (ib < 0) return true;
    const bool na = a != a, nb = b != b;
    if (na || nb) return na && (!nb || ia < ib);
    return a > b || (a == b && ia < ib);
}

// The indexer's selection order of a pool score (docs/numerics.md, "Ties at the indexer's selection
// boundary"): a u32 whose order is the scores' descending rank: -0 and +0 one key (equal scores), every
// NaN the lowest key (below -inf: the oracle's argsort of -scores puts NaN last). Equal keys go to the
// lower pool index.
GLM_HD uint32_t select_key(float v) {
    uint32_t u = f32_bits(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0u;
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
GLM_HD uint64_t f64_bits(double x) {
#if defined(__CUDA_ARCH__)
    return static_cast<uint64_t>(__double_as_longlong(x));
#else
    uint64_t u;
    std::memcpy(&u, &x, 8);
    return u;
#endif
}
GLM_HD double f64_from_bits(uint64_t u) {
#if defined(__CUDA_ARCH__)
    return __longlong_as_double(static_cast<long long>(u));
#else
    double x;
    std::memcpy(&x, &u, 8);
    return x;
#endif
}

// ---- BF16 -----------------------------------------------------------------------------------------

constexpr uint32_t kBf16CanonicalNaN = 0x7FC0u;

// f32 bits -> bf16 bits: round to nearest, ties to even; every NaN -> 0x7FC0. (Infinities and overflow
// need no special case: 0x7F7FFFFF + 0x7FFF + 1 carries into 0x7F80.)
GLM_HD uint32_t bf16_bits_of(uint32_t u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kBf16CanonicalNaN;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
GLM_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// ---- tables ---------------------------------------------------------------------------------------
// Each once, as a list; under nvcc a device copy besides the host one (a constexpr array is not
// readable from device code).

// T[i] = bits(2^(i/32) correctly rounded to double) - (i << 47).
#define GLM_EXPF_TABLE                                                                         \
    {0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull, \
     0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull, \
     0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull, \
     0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull, \
     0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull, \
     0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull, \
     0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull, \
     0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull}

// 2^(k/128) ~= H_k (1 + tail_k): H_k the correctly rounded double, tail_k = (2^(k/128) - H_k)/H_k
// rounded to double (generated with mpmath at 300 bits; equal to glibc's __exp_data.tab).
// tab[2k] = bits(tail_k), tab[2k+1] = bits(H_k) - (k << 45).
#define GLM_EXP64_TABLE                                                                        \
    {0x0000000000000000ull, 0x3ff0000000000000ull, 0x3c9b3b4f1a88bf6eull, 0x3feff63da9fb3335ull, \
     0xbc7160139cd8dc5dull, 0x3fefec9a3e778061ull, 0xbc905e7a108766d1ull, 0x3fefe315e86e7f85ull, \
     0x3c8cd2523567f613ull, 0x3fefd9b0d3158574ull, 0xbc8bce8023f98efaull, 0x3fefd06b29ddf6deull, \
     0x3c60f74e61e6c861ull, 0x3fefc74518759bc8ull, 0x3c90a3e45b33d399ull, 0x3fefbe3ecac6f383ull, \
     0x3c979aa65d837b6dull, 0x3fefb5586cf9890full, 0x3c8eb51a92fdeffcull, 0x3fefac922b7247f7ull, \
     0x3c3ebe3d702f9cd1ull, 0x3fefa3ec32d3d1a2ull, 0xbc6a033489906e0bull, 0x3fef9b66affed31bull, \
     0xbc9556522a2fbd0eull, 0x3fef9301d0125b51ull, 0xbc5080ef8c4eea55ull, 0x3fef8abdc06c31ccull, \
     0xbc91c923b9d5f416ull, 0x3fef829aaea92de0ull, 0x3c80d3e3e95c55afull, 0x3fef7a98c8a58e51ull, \
     0xbc801b15eaa59348ull, 0x3fef72b83c7d517bull, 0xbc8f1ff055de323dull, 0x3fef6af9388c8deaull, \
     0x3c8b898c3f1353bfull, 0x3fef635beb6fcb75ull, 0xbc96d99c7611eb26ull, 0x3fef5be084045cd4ull, \
     0x3c9aecf73e3a2f60ull, 0x3fef54873168b9aaull, 0xbc8fe782cb86389dull, 0x3fef4d5022fcd91dull, \
     0x3c8a6f4144a6c38dull, 0x3fef463b88628cd6ull, 0x3c807a05b0e4047dull, 0x3fef3f49917ddc96ull, \
     0x3c968efde3a8a894ull, 0x3fef387a6e756238ull, 0x3c875e18f274487dull, 0x3fef31ce4fb2a63full, \
     0x3c80472b981fe7f2ull, 0x3fef2b4565e27cddull, 0xbc96b87b3f71085eull, 0x3fef24dfe1f56381ull, \
     0x3c82f7e16d09ab31ull, 0x3fef1e9df51fdee1ull, 0xbc3d219b1a6fbffaull, 0x3fef187fd0dad990ull, \
     0x3c8b3782720c0ab4ull, 0x3fef1285a6e4030bull, 0x3c6e149289cecb8full, 0x3fef0cafa93e2f56ull, \
     0x3c834d754db0abb6ull, 0x3fef06fe0a31b715ull, 0x3c864201e2ac744cull, 0x3fef0170fc4cd831ull, \
     0x3c8fdd395dd3f84aull, 0x3feefc08b26416ffull, 0xbc86a3803b8e5b04ull, 0x3feef6c55f929ff1ull, \
     0xbc924aedcc4b5068ull, 0x3feef1a7373aa9cbull, 0xbc9907f81b512d8eull, 0x3feeecae6d05d866ull, \
     0xbc71d1e83e9436d2ull, 0x3feee7db34e59ff7ull, 0xbc991919b3ce1b15ull, 0x3feee32dc313a8e5ull, \
     0x3c859f48a72a4c6dull, 0x3feedea64c123422ull, 0xbc9312607a28698aull, 0x3feeda4504ac801cull, \
     0xbc58a78f4817895bull, 0x3feed60a21f72e2aull, 0xbc7c2c9b67499a1bull, 0x3feed1f5d950a897ull, \
     0x3c4363ed60c2ac11ull, 0x3feece086061892dull, 0x3c9666093b0664efull, 0x3feeca41ed1d0057ull, \
     0x3c6ecce1daa10379ull, 0x3feec6a2b5c13cd0ull, 0x3c93ff8e3f0f1230ull, 0x3feec32af0d7d3deull, \
     0x3c7690cebb7aafb0ull, 0x3feebfdad5362a27ull, 0x3c931dbdeb54e077ull, 0x3feebcb299fddd0dull, \
     0xbc8f94340071a38eull, 0x3feeb9b2769d2ca7ull, 0xbc87deccdc93a349ull, 0x3feeb6daa2cf6642ull, \
     0xbc78dec6bd0f385full, 0x3feeb42b569d4f82ull, 0xbc861246ec7b5cf6ull, 0x3feeb1a4ca5d920full, \
     0x3c93350518fdd78eull, 0x3feeaf4736b527daull, 0x3c7b98b72f8a9b05ull, 0x3feead12d497c7fdull, \
     0x3c9063e1e21c5409ull, 0x3feeab07dd485429ull, 0x3c34c7855019c6eaull, 0x3feea9268a5946b7ull, \
     0x3c9432e62b64c035ull, 0x3feea76f15ad2148ull, 0xbc8ce44a6199769full, 0x3feea5e1b976dc09ull, \
     0xbc8c33c53bef4da8ull, 0x3feea47eb03a5585ull, 0xbc845378892be9aeull, 0x3feea34634ccc320ull, \
     0xbc93cedd78565858ull, 0x3feea23882552225ull, 0x3c5710aa807e1964ull, 0x3feea155d44ca973ull, \
     0xbc93b3efbf5e2228ull, 0x3feea09e667f3bcdull, 0xbc6a12ad8734b982ull, 0x3feea012750bdabfull, \
     0xbc6367efb86da9eeull, 0x3fee9fb23c651a2full, 0xbc80dc3d54e08851ull, 0x3fee9f7df9519484ull, \
     0xbc781f647e5a3ecfull, 0x3fee9f75e8ec5f74ull, 0xbc86ee4ac08b7db0ull, 0x3fee9f9a48a58174ull, \
     0xbc8619321e55e68aull, 0x3fee9feb564267c9ull, 0x3c909ccb5e09d4d3ull, 0x3feea0694fde5d3full, \
     0xbc7b32dcb94da51dull, 0x3feea11473eb0187ull, 0x3c94ecfd5467c06bull, 0x3feea1ed0130c132ull, \
     0x3c65ebe1abd66c55ull, 0x3feea2f336cf4e62ull, 0xbc88a1c52fb3cf42ull, 0x3feea427543e1a12ull, \
     0xbc9369b6f13b3734ull, 0x3feea589994cce13ull, 0xbc805e843a19ff1eull, 0x3feea71a4623c7adull, \
     0xbc94d450d872576eull, 0x3feea8d99b4492edull, 0x3c90ad675b0e8a00ull, 0x3feeaac7d98a6699ull, \
     0x3c8db72fc1f0eab4ull, 0x3feeace5422aa0dbull, 0xbc65b6609cc5e7ffull, 0x3feeaf3216b5448cull, \
     0x3c7bf68359f35f44ull, 0x3feeb1ae99157736ull, 0xbc93091fa71e3d83ull, 0x3feeb45b0b91ffc6ull, \
     0xbc5da9b88b6c1e29ull, 0x3feeb737b0cdc5e5ull, 0xbc6c23f97c90b959ull, 0x3feeba44cbc8520full, \
     0xbc92434322f4f9aaull, 0x3feebd829fde4e50ull, 0xbc85ca6cd7668e4bull, 0x3feec0f170ca07baull, \
     0x3c71affc2b91ce27ull, 0x3feec49182a3f090ull, 0x3c6dd235e10a73bbull, 0x3feec86319e32323ull, \
     0xbc87c50422622263ull, 0x3feecc667b5de565ull, 0x3c8b1c86e3e231d5ull, 0x3feed09bec4a2d33ull, \
     0xbc91bbd1d3bcbb15ull, 0x3feed503b23e255dull, 0x3c90cc319cee31d2ull, 0x3feed99e1330b358ull, \
     0x3c8469846e735ab3ull, 0x3feede6b5579fdbfull, 0xbc82dfcd978e9db4ull, 0x3feee36bbfd3f37aull, \
     0x3c8c1a7792cb3387ull, 0x3feee89f995ad3adull, 0xbc907b8f4ad1d9faull, 0x3feeee07298db666ull, \
     0xbc55c3d956dcaebaull, 0x3feef3a2b84f15fbull, 0xbc90a40e3da6f640ull, 0x3feef9728de5593aull, \
     0xbc68d6f438ad9334ull, 0x3feeff76f2fb5e47ull, 0xbc91eee26b588a35ull, 0x3fef05b030a1064aull, \
     0x3c74ffd70a5fddcdull, 0x3fef0c1e904bc1d2ull, 0xbc91bdfbfa9298acull, 0x3fef12c25bd71e09ull, \
     0x3c736eae30af0cb3ull, 0x3fef199bdd85529cull, 0x3c8ee3325c9ffd94ull, 0x3fef20ab5fffd07aull, \
     0x3c84e08fd10959acull, 0x3fef27f12e57d14bull, 0x3c63cdaf384e1a67ull, 0x3fef2f6d9406e7b5ull, \
     0x3c676b2c6c921968ull, 0x3fef3720dcef9069ull, 0xbc808a1883ccb5d2ull, 0x3fef3f0b555dc3faull, \
     0xbc8fad5d3ffffa6full, 0x3fef472d4a07897cull, 0xbc900dae3875a949ull, 0x3fef4f87080d89f2ull, \
     0x3c74a385a63d07a7ull, 0x3fef5818dcfba487ull, 0xbc82919e2040220full, 0x3fef60e316c98398ull, \
     0x3c8e5a50d5c192acull, 0x3fef69e603db3285ull, 0x3c843a59ac016b4bull, 0x3fef7321f301b460ull, \
     0xbc82d52107b43e1full, 0x3fef7c97337b9b5full, 0xbc892ab93b470dc9ull, 0x3fef864614f5a129ull, \
     0x3c74b604603a88d3ull, 0x3fef902ee78b3ff6ull, 0x3c83c5ec519d7271ull, 0x3fef9a51fbc74c83ull, \
     0xbc8ff7128fd391f0ull, 0x3fefa4afa2a490daull, 0xbc8dae98e223747dull, 0x3fefaf482d8e67f1ull, \
     0x3c8ec3bc41aa2008ull, 0x3fefba1bee615a27ull, 0x3c842b94c3a9eb32ull, 0x3fefc52b376bba97ull, \
     0x3c8a64a931d185eeull, 0x3fefd0765b6e4540ull, 0xbc8e37bae43be3edull, 0x3fefdbfdad9cbe14ull, \
     0x3c77893b4d91cd9dull, 0x3fefe7c1819e90d8ull, 0x3c5305c14160cc89ull, 0x3feff3c22b8f71f1ull}

inline constexpr uint64_t kExpfTable[32] = GLM_EXPF_TABLE;
inline constexpr uint64_t kExp64Table[256] = GLM_EXP64_TABLE;
#if defined(__CUDACC__)
static __device__ const uint64_t kExpfTableDev[32] = GLM_EXPF_TABLE;
static __device__ const uint64_t kExp64TableDev[256] = GLM_EXP64_TABLE;
#endif
#undef GLM_EXPF_TABLE
#undef GLM_EXP64_TABLE

GLM_HD uint64_t expf_table(uint64_t i) {
#if defined(__CUDA_ARCH__)
    return __ldg(&kExpfTableDev[i]);
#else
    return kExpfTable[i];
#endif
}
GLM_HD uint64_t exp64_table(uint64_t i) {
#if defined(__CUDA_ARCH__)
    return __ldg(&kExp64TableDev[i]);
#else
    return kExp64Table[i];
#endif
}

// ---- expf (canonical) -----------------------------------------------------------------------------

namespace expf_consts {
constexpr double kN = 32.0;
constexpr double kInvLn2N = 0x1.71547652b82fep0 * kN;
constexpr double kShift = 0x1.8p+52;
constexpr double kC0 = 0x1.c6af84b912394p-5 / kN / kN / kN;
constexpr double kC1 = 0x1.ebfce50fac4f3p-3 / kN / kN;
constexpr double kC2 = 0x1.62e42ff0c52d6p-1 / kN;
constexpr uint32_t kAbsTop88 = 0x42B;                // top12(88.0f)
constexpr float kOverflowAbove = 0x1.62e42ep6f;      // log(0x1p128)
constexpr float kUnderflowBelow = -0x1.9fe368p6f;    // log(0x1p-150)
}  // namespace expf_consts

// The canonical expf: special cases only for |x| >= 88, inf and NaN.
GLM_HD float expf(float x) {
    using namespace expf_consts;
    const uint32_t ux = f32_bits(x);
    const uint32_t abstop = (ux >> 20) & 0x7FFu;
    if (abstop >= kAbsTop88) {
        if (ux == 0xFF800000u) return 0.0f;            // -inf
        if (abstop >= 0x7F8u) return add_rn(x, x);     // NaN or +inf
        if (x > kOverflowAbove) return f32_from_bits(0x7F800000u);
        if (x < kUnderflowBelow) return 0.0f;
    }
    const double xd = static_cast<double>(x);
    double kd = fma_rn(kInvLn2N, xd, kShift);
    const uint64_t ki = f64_bits(kd);
    kd = sub_rn(kd, kShift);
    const double r = fma_rn(kInvLn2N, xd, -kd);
    const double s = f64_from_bits(expf_table(ki % 32) + (ki << 47));
    const double z = fma_rn(kC0, r, kC1);
    const double r2 = mul_rn(r, r);
    double y = fma_rn(kC2, r, 1.0);
    y = fma_rn(z, r2, y);
    y = mul_rn(y, s);
    return f32_rn(y);
}

// ---- exp64 (canonical, double) --------------------------------------------------------------------
//   kd  = fma(InvLn2N, x, Shift);  ki = bits(kd);  kd -= Shift
//   r   = fma(kd, NegLn2loN, fma(kd, NegLn2hiN, x))
//   tail = asdouble(T[2 (ki % N)]),  sbits = T[2 (ki % N) + 1] + (ki << 45)
//   r2  = r * r
//   tmp = fma(r2 * r2, fma(r, C5, C4), fma(r2, fma(r, C3, C2), tail + r))
//   y   = fma(scale, tmp, scale)             (scale = asdouble(sbits))
// with glibc's special cases (|x| < 2^-54: 1 + x; |x| >= 512: over/underflow, inf, NaN, and the scaled
// path exp64_special: for k > 0 it fuses, 2^1009 * fma(scale, tmp, scale); for k < 0 glibc's build
// forms st = scale * tmp once and adds it unfused, y = scale + st, lo = (scale - y) + st).

// glibc's specialcase(): the scale 2^(k/N) is out of the normal range.
GLM_HD double exp64_special(double tmp, uint64_t sbits, uint64_t ki) {
    if ((ki & 0x80000000u) == 0) {  // k > 0: the exponent of scale may have overflowed by <= 460
        sbits -= uint64_t{1009} << 52;
        const double scale = f64_from_bits(sbits);
        return mul_rn(0x1p1009, fma_rn(scale, tmp, scale));
    }
    // k < 0: care in the subnormal range
    sbits += uint64_t{1022} << 52;
    const double scale = f64_from_bits(sbits);
    const double st = mul_rn(scale, tmp);  // one product, used twice (glibc's build does not fuse here)
    double y = add_rn(scale, st);
    if (y < 1.0) {  // round y to the right precision before scaling it into the subnormal range
        double lo = add_rn(sub_rn(scale, y), st);
        const double hi = add_rn(1.0, y);
        lo = add_rn(add_rn(sub_rn(1.0, hi), y), lo);
        y = sub_rn(add_rn(hi, lo), 1.0);
        if (y == 0.0) y = 0.0;  // avoid -0
    }
    return mul_rn(0x1p-1022, y);
}

GLM_HD double exp64(double x) {
    constexpr double kInvLn2N = 0x1.71547652b82fep0 * 128.0;
    constexpr double kShift = 0x1.8p52;
    constexpr double kNegLn2hiN = -0x1.62e42fefa0000p-8;
    constexpr double kNegLn2loN = -0x1.cf79abc9e3b3ap-47;
    constexpr double kC2 = 0x1.ffffffffffdbdp-2;
    constexpr double kC3 = 0x1.555555555543cp-3;
    constexpr double kC4 = 0x1.55555cf172b91p-5;
    constexpr double kC5 = 0x1.1111167a4d017p-7;
    constexpr uint32_t kTopTiny = 0x3C9;  // top12(0x1p-54)
    constexpr uint32_t kTop512 = 0x408;   // top12(512.0)
    constexpr uint32_t kTop1024 = 0x409;  // top12(1024.0)
    uint32_t abstop = static_cast<uint32_t>(f64_bits(x) >> 52) & 0x7FFu;
    if (abstop - kTopTiny >= kTop512 - kTopTiny) {
        if (static_cast<int32_t>(abstop - kTopTiny) < 0) return add_rn(1.0, x);  // tiny |x|
        if (abstop >= kTop1024) {
            if (f64_bits(x) == 0xFFF0000000000000ull) return 0.0;             // -inf
            if (abstop >= 0x7FFu) return add_rn(1.0, x);                      // NaN, +inf
            return (f64_bits(x) >> 63) ? 0.0 : f64_from_bits(0x7FF0000000000000ull);  // under/overflow
        }
        abstop = 0;  // large |x|: exp64_special
    }
    double kd = fma_rn(kInvLn2N, x, kShift);
    const uint64_t ki = f64_bits(kd);
    kd = sub_rn(kd, kShift);
    const double r = fma_rn(kd, kNegLn2loN, fma_rn(kd, kNegLn2hiN, x));
    const uint64_t idx = 2 * (ki % 128);
    const uint64_t top = ki << 45;
    const double tail = f64_from_bits(exp64_table(idx));
    const uint64_t sbits = exp64_table(idx + 1) + top;
    const double r2 = mul_rn(r, r);
    const double tmp = fma_rn(mul_rn(r2, r2), fma_rn(r, kC5, kC4), fma_rn(r2, fma_rn(r, kC3, kC2), add_rn(tail, r)));
    if (abstop == 0) return exp64_special(tmp, sbits, ki);
    const double scale = f64_from_bits(sbits);
    return fma_rn(scale, tmp, scale);
}

GLM_HD double sigmoid64(double x) { return div_rn(1.0, add_rn(1.0, exp64(-x))); }

// ---- the greedy token's log-probability (oracle/sampling.py log_softmax, docs/sampling.md) ----------

// ln(s) for a double s > 0, finite: oracle/sampling.py _log_f64, the same double operations in the same
// order. s = m * 2^e with m in [sqrt(1/2), sqrt(2)) (the split by bits: exact, as frexp), f = (m - 1) /
// (m + 1), ln m = 2 f (1 + f^2/3 + ...) by Horner with fma over 1/(2i+1), i = 12 .. 1, then e * ln2
// (hi + lo).
GLM_HD double log_f64(double s) {
    uint64_t u = f64_bits(s);
    int e;
    if (((u >> 52) & 0x7FFu) == 0) {  // subnormal: into the normal range first (exact)
        u = f64_bits(mul_rn(s, 0x1p54));
        e = static_cast<int>((u >> 52) & 0x7FFu) - 1023 - 54;
    } else {
        e = static_cast<int>((u >> 52) & 0x7FFu) - 1023;
    }
    double m = f64_from_bits((u & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull);  // [1, 2)
    if (m > 1.4142135623730951) {
        m = mul_rn(m, 0.5);
        e = e + 1;
    }
    const double f = div_rn(sub_rn(m, 1.0), add_rn(m, 1.0));
    const double f2 = mul_rn(f, f);
    double acc = div_rn(1.0, 25.0);
    for (int i = 11; i >= 1; --i) acc = fma_rn(acc, f2, div_rn(1.0, static_cast<double>(2 * i + 1)));
    acc = fma_rn(acc, f2, 1.0);
    const double lnm = mul_rn(mul_rn(2.0, f), acc);
    const double ed = static_cast<double>(e);
    return fma_rn(ed, 0.6931471803691238, fma_rn(ed, 1.9082149292705877e-10, lnm));
}

// log_softmax's value at one token from its parts: d = z_t - max(z) (f32) and s = csum(expf(z - max(z)))
// over the row: f32(f64(d) - ln(f64(s))). Every engine's "argmax_logprob" ends here.
GLM_HD float logprob_from(float d, float s) {
    return f32_rn(sub_rn(static_cast<double>(d), log_f64(static_cast<double>(s))));
}

// ---- expf="native" off the device -----------------------------------------------------------------

// The classic Cephes-style single-precision exp (range reduction by ln2 in two parts, a degree-5
// polynomial, 2^n by exponent bits) -- what a fast vectorized libm would do. About 1 ulp; differs from
// the canonical expf on a good fraction of inputs, by design. The CPU engine's expf="native" and the
// CUDA emulation's stand-in for CUDA's expf (host code only).
inline float expf_cephes(float x) {
    if (x != x) return x;
    if (x > 88.3762626647949f) return INFINITY;
    if (x < -103.972084f) return 0.0f;
    const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    float y = 1.9875691500E-4f;
    y = y * r + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * r * r + r + 1.0f;
    return std::ldexp(y, static_cast<int>(fx));
}

}  // namespace glm::num
