// pybind11 glue: the extension module fast._core.
//
// Every entry point takes plain objects and validates them itself (type, dtype, ndim, shape,
// contiguity, alignment), raising ValueError that names the argument and says what was expected
// and what was given; the C++ kernels only ever see checked pointers and sizes. Numeric entry points
// also refuse to run (RuntimeError) when MXCSR has FTZ or DAZ set in the calling thread (docs/contract.md §4.6).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <type_traits>
#include <xmmintrin.h>

#include "cpu/cdot.hpp"
#include "cpu/expf.hpp"
#include "cpu/formats.hpp"
#include "cpu/greedy.hpp"
#include "cpu/hwstate.hpp"
#include "cpu/matvec.hpp"
#include "cpu/threadpool.hpp"
#include "cpu/weights.hpp"
#include "engine_types.hpp"
#include "pyglue.hpp"

namespace py = pybind11;
using namespace glm::cpu;

void register_engine(py::module_& m);  // bindings/engine_bindings.cpp: the CPU engine (fast.Engine)

namespace {

// ---- validation ---------------------------------------------------------------------------------

using glm::pyglue::bad;  // one ValueError helper for both binding files (pyglue.hpp)

using glm::shape_str;  // (py::ssize_t is int64_t here)
static_assert(std::is_same_v<py::ssize_t, int64_t>, "shapes are passed as int64_t vectors");

using glm::pyglue::shape_of;

std::string dtype_str(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

std::string type_name(const py::object& obj) {  // e.g. "list", "numpy.float32"
    const py::handle t = py::type::of(obj);
    const std::string mod = py::str(t.attr("__module__")).cast<std::string>();
    const std::string name = py::str(t.attr("__qualname__")).cast<std::string>();
    return mod == "builtins" ? name : mod + "." + name;
}

// Accepted dtypes of one argument: the plain NumPy type, plus (optionally) the ml_dtypes type whose
// storage has the same meaning (e.g. bfloat16 for bf16 bits).
struct DType {
    py::dtype plain;
    const char* alias;  // ml_dtypes name accepted as well, or nullptr
    const char* what;   // for messages
};

template <class T>
DType dt(const char* what, const char* alias = nullptr) {
    return DType{py::dtype::of<T>(), alias, what};
}

bool dtype_ok(const py::array& a, const DType& d) {
    if (a.dtype().equal(d.plain)) return true;
    if (d.alias && a.dtype().itemsize() == d.plain.itemsize() &&
        py::str(a.dtype().attr("name")).cast<std::string>() == d.alias)
        return true;
    return false;
}

// Check an argument: ndarray, dtype, ndim (-1 = any), C-contiguous, aligned.
py::array checked_arg(const py::object& obj, const char* name, const DType& d, int ndim) {
    if (!py::isinstance<py::array>(obj))
        bad(std::string(name) + ": expected a numpy.ndarray of " + d.what + ", given " + type_name(obj));
    py::array a = py::reinterpret_borrow<py::array>(obj);
    if (!dtype_ok(a, d)) bad(std::string(name) + ": expected dtype " + d.what + ", given " + dtype_str(a));
    if (ndim >= 0 && a.ndim() != ndim)
        bad(std::string(name) + ": expected a " + std::to_string(ndim) + "-D array, given " +
            std::to_string(a.ndim()) + "-D with shape " + shape_str(shape_of(a)));
    if (!(a.flags() & py::array::c_style))
        bad(std::string(name) + ": expected a C-contiguous array, given a non-contiguous view with shape " +
            shape_str(shape_of(a)) + " (use numpy.ascontiguousarray)");
    if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))
        bad(std::string(name) + ": expected an aligned array, given an unaligned one");
    return a;
}

// why() names the rule `want` follows; it is called (and the message formatted) only when the check
// fails, so a call that passes its checks formats nothing.
template <class Why>
void expect_shape(const py::array& a, const char* name, const std::vector<py::ssize_t>& want, const Why& why) {
    if (shape_of(a) != want)
        bad(std::string(name) + ": expected shape " + shape_str(want) + " (" + std::string(why()) + "), given " +
            shape_str(shape_of(a)));
}

uint64_t arg_uint(const py::object& obj, const char* name, uint64_t lo, uint64_t hi) {
    if (!py::isinstance<py::int_>(obj) || py::isinstance<py::bool_>(obj))
        bad(std::string(name) + ": expected an int, given " + type_name(obj));
    const py::int_ v = py::reinterpret_borrow<py::int_>(obj);
    if (v < py::int_(lo) || v > py::int_(hi))
        bad(std::string(name) + ": expected an int in [" + std::to_string(lo) + ", " + std::to_string(hi) +
            "], given " + py::str(v).cast<std::string>());
    return v.cast<uint64_t>();
}

float arg_f32(const py::object& obj, const char* name) {
    if (py::isinstance<py::bool_>(obj) ||
        !(py::isinstance<py::float_>(obj) || py::isinstance<py::int_>(obj) ||
          py::hasattr(obj, "__float__")))
        bad(std::string(name) + ": expected a float, given " + type_name(obj));
    return static_cast<float>(obj.cast<double>());  // f64 -> f32, RNE
}

unsigned arg_threads(const py::object& obj) { return static_cast<unsigned>(arg_uint(obj, "threads", 0, 1024)); }

void require_clean_mxcsr() {
    if (ftz_daz_enabled())
        throw std::runtime_error(
            "MXCSR has flush-to-zero or denormals-are-zero set in this thread (a library loaded in the "
            "process set it); exact results are impossible, refusing to run");
}

template <class T>
const T* data_of(const py::array& a) {
    return static_cast<const T*>(a.data());
}

template <class T>
py::array_t<T> empty_like_shape(const py::array& a) {
    return py::array_t<T>(shape_of(a));
}

py::object f32_scalar(float v) {  // numpy.float32 with exactly these bits
    py::array_t<float> a(1);
    a.mutable_at(0) = v;
    return a[py::int_(0)];
}

const DType kF32 = dt<float>("float32");
const DType kF64 = dt<double>("float64");

DType kBf16() { return dt<uint16_t>("uint16 (bf16 bits) or bfloat16", "bfloat16"); }
DType kE4M3Codes() { return dt<uint8_t>("uint8 (E4M3 codes) or float8_e4m3fn", "float8_e4m3fn"); }
DType kE8M0Codes() { return dt<uint8_t>("uint8 (E8M0 codes) or float8_e8m0fnu", "float8_e8m0fnu"); }
DType kU8(const char* what) { return dt<uint8_t>(what); }

// ---- the functions ------------------------------------------------------------------------------

py::object py_cdot(const py::object& ao, const py::object& bo) {
    const py::array a = checked_arg(ao, "a", kF32, 1), b = checked_arg(bo, "b", kF32, 1);
    expect_shape(b, "b", shape_of(a), [] { return "the shape of a"; });
    require_clean_mxcsr();
    float r;
    {
        py::gil_scoped_release nogil;
        r = cdot(data_of<float>(a), data_of<float>(b), static_cast<size_t>(a.shape(0)));
    }
    return f32_scalar(r);
}

double py_cdot64(const py::object& ao, const py::object& bo) {
    const py::array a = checked_arg(ao, "a", kF64, 1), b = checked_arg(bo, "b", kF64, 1);
    expect_shape(b, "b", shape_of(a), [] { return "the shape of a"; });
    require_clean_mxcsr();
    py::gil_scoped_release nogil;
    return cdot64(data_of<double>(a), data_of<double>(b), static_cast<size_t>(a.shape(0)));
}

py::object py_csum(const py::object& xo) {
    const py::array x = checked_arg(xo, "x", kF32, 1);
    require_clean_mxcsr();
    float r;
    {
        py::gil_scoped_release nogil;
        r = csum(data_of<float>(x), static_cast<size_t>(x.shape(0)));
    }
    return f32_scalar(r);
}

py::tuple py_argmax_logprob(const py::object& xo) {
    const py::array x = checked_arg(xo, "x", kF32, 1);
    if (x.shape(0) < 1) bad("argmax_logprob: x must not be empty");
    require_clean_mxcsr();
    const size_t n = static_cast<size_t>(x.shape(0));
    int32_t t;
    float lp;
    {
        py::gil_scoped_release nogil;
        t = argmax(data_of<float>(x), n);
        lp = argmax_logprob(data_of<float>(x), n, t);
    }
    return py::make_tuple(t, f32_scalar(lp));
}

py::array py_expf(const py::object& xo) {
    const py::array x = checked_arg(xo, "x", kF32, -1);
    require_clean_mxcsr();
    auto y = empty_like_shape<float>(x);
    float* out = y.mutable_data();
    {
        py::gil_scoped_release nogil;
        expf_array(data_of<float>(x), out, static_cast<size_t>(x.size()));
    }
    return std::move(y);
}

template <uint64_t (*Check)(uint64_t, uint64_t, uint64_t*, unsigned)>
py::tuple py_check_range(const py::object& loo, const py::object& hio) {
    const uint64_t lo = arg_uint(loo, "lo_bits", 0, uint64_t{1} << 32);
    const uint64_t hi = arg_uint(hio, "hi_bits", 0, uint64_t{1} << 32);
    if (hi < lo) bad("hi_bits: expected hi_bits >= lo_bits, given " + std::to_string(hi) + " < " + std::to_string(lo));
    require_clean_mxcsr();
    uint64_t first = 0, n = 0;
    {
        py::gil_scoped_release nogil;
        n = Check(lo, hi, &first, 0);
    }
    return py::make_tuple(n, n ? py::object(py::int_(first)) : py::object(py::none()));
}

py::array py_bf16_from_f32(const py::object& xo) {
    const py::array x = checked_arg(xo, "x", kF32, -1);
    auto y = empty_like_shape<uint16_t>(x);
    uint16_t* out = y.mutable_data();
    {
        py::gil_scoped_release nogil;
        bf16_bits_array(data_of<float>(x), out, static_cast<size_t>(x.size()));
    }
    return std::move(y);
}

py::array py_bf16_from_f64(const py::object& xo) {
    const py::array x = checked_arg(xo, "x", kF64, -1);
    require_clean_mxcsr();  // the f64 -> f32 step must not flush f32 subnormals
    auto y = empty_like_shape<uint16_t>(x);
    uint16_t* out = y.mutable_data();
    const double* in = data_of<double>(x);
    const size_t n = static_cast<size_t>(x.size());
    {
        py::gil_scoped_release nogil;
        for (size_t i = 0; i < n; ++i) out[i] = bf16_bits_from_f64(in[i]);
    }
    return std::move(y);
}

template <size_t N>
py::array decode_table(const py::object& co, const DType& d, const std::array<float, N>& table) {
    const py::array c = checked_arg(co, "codes", d, -1);
    auto y = empty_like_shape<float>(c);
    const uint8_t* in = data_of<uint8_t>(c);
    float* out = y.mutable_data();
    const size_t n = static_cast<size_t>(c.size());
    for (size_t i = 0; i < n; ++i)
        if (in[i] >= N) bad("codes: expected values in [0, " + std::to_string(N) + "), given " + std::to_string(in[i]));
    for (size_t i = 0; i < n; ++i) out[i] = table[in[i]];
    return std::move(y);
}

std::vector<py::ssize_t> fp8_scale_shape(py::ssize_t R, py::ssize_t C) {
    return {(R + 127) / 128, (C + 127) / 128};
}

py::array py_decode_fp8_weight(const py::object& qo, const py::object& so) {
    const py::array q = checked_arg(qo, "q", kE4M3Codes(), 2);
    const py::array s = checked_arg(so, "scale_inv", kF32, 2);
    const py::ssize_t R = q.shape(0), C = q.shape(1);
    expect_shape(s, "scale_inv", fp8_scale_shape(R, C),
                 [&] { return "[ceil(R/128), ceil(C/128)] for q of shape " + shape_str({R, C}); });
    require_clean_mxcsr();
    py::array_t<float> w({R, C});
    float* out = w.mutable_data();
    {
        py::gil_scoped_release nogil;
        decode_fp8_weight(data_of<uint8_t>(q), data_of<float>(s), R, C, out);
    }
    return std::move(w);
}

// packed [R, C/2], scale [R, C/32], C % 32 == 0; returns C.
py::ssize_t check_mxfp4(const py::array& p, const py::array& s) {
    const py::ssize_t R = p.shape(0), C = 2 * p.shape(1);
    if (C % 32 != 0)
        bad("packed: expected [R, C/2] with C a multiple of 32 (packed.shape[1] a multiple of 16), given shape " +
            shape_str(shape_of(p)));
    expect_shape(s, "scale", {R, C / 32}, [&] { return "[R, C/32] for packed of shape " + shape_str(shape_of(p)); });
    return C;
}

py::array py_decode_mxfp4_weight(const py::object& po, const py::object& so) {
    const py::array p = checked_arg(po, "packed", kU8("uint8 (two E2M1 nibbles per byte)"), 2);
    const py::array s = checked_arg(so, "scale", kE8M0Codes(), 2);
    const py::ssize_t R = p.shape(0), C = check_mxfp4(p, s);
    require_clean_mxcsr();
    py::array_t<float> w({R, C});
    float* out = w.mutable_data();
    {
        py::gil_scoped_release nogil;
        decode_mxfp4_weight(data_of<uint8_t>(p), data_of<uint8_t>(s), R, C, out);
    }
    return std::move(w);
}

py::array py_matvec_bf16(const py::object& wo, const py::object& xo, const py::object& to) {
    const py::array W = checked_arg(wo, "W", kBf16(), 2);
    const py::array x = checked_arg(xo, "x", kF32, 1);
    const py::ssize_t R = W.shape(0), C = W.shape(1);
    expect_shape(x, "x", {C}, [&] { return "[C] for W of shape " + shape_str({R, C}); });
    const unsigned threads = arg_threads(to);
    require_clean_mxcsr();
    py::array_t<float> y(R);
    float* out = y.mutable_data();
    {
        py::gil_scoped_release nogil;
        matvec_bf16(data_of<uint16_t>(W), R, C, data_of<float>(x), out, threads);
    }
    return std::move(y);
}

py::array py_matvec_fp8(const py::object& qo, const py::object& so, const py::object& xo, const py::object& to) {
    const py::array q = checked_arg(qo, "q", kE4M3Codes(), 2);
    const py::array s = checked_arg(so, "scale_inv", kF32, 2);
    const py::array x = checked_arg(xo, "x", kF32, 1);
    const py::ssize_t R = q.shape(0), C = q.shape(1);
    expect_shape(s, "scale_inv", fp8_scale_shape(R, C),
                 [&] { return "[ceil(R/128), ceil(C/128)] for q of shape " + shape_str({R, C}); });
    expect_shape(x, "x", {C}, [&] { return "[C] for q of shape " + shape_str({R, C}); });
    const unsigned threads = arg_threads(to);
    require_clean_mxcsr();
    py::array_t<float> y(R);
    float* out = y.mutable_data();
    {
        py::gil_scoped_release nogil;
        matvec_fp8(data_of<uint8_t>(q), data_of<float>(s), R, C, data_of<float>(x), out, threads);
    }
    return std::move(y);
}

py::array py_matvec_mxfp4(const py::object& po, const py::object& so, const py::object& xo, const py::object& to) {
    const py::array p = checked_arg(po, "packed", kU8("uint8 (two E2M1 nibbles per byte)"), 2);
    const py::array s = checked_arg(so, "scale", kE8M0Codes(), 2);
    const py::array x = checked_arg(xo, "x", kF32, 1);
    const py::ssize_t R = p.shape(0), C = check_mxfp4(p, s);
    expect_shape(x, "x", {C}, [&] { return "[C] for packed of shape " + shape_str(shape_of(p)); });
    const unsigned threads = arg_threads(to);
    require_clean_mxcsr();
    py::array_t<float> y(R);
    float* out = y.mutable_data();
    {
        py::gil_scoped_release nogil;
        matvec_mxfp4(data_of<uint8_t>(p), data_of<uint8_t>(s), R, C, data_of<float>(x), out, threads);
    }
    return std::move(y);
}

// ---- the engine's linear kernels (weights.hpp `Lin`) ---------------------------------------------

// A Lin over one stored weight in a release format, validated. nan_free (fp8) is checked here once.
struct LinArg {
    Lin w;
    py::array data, scale;
    size_t R = 0;
};

// kernels: None (lin_kernels()'s choice) or an instruction set's name that this CPU and build run.
const LinKernels* kernels_arg(const py::object& ko) {
    if (ko.is_none()) return nullptr;
    if (!py::isinstance<py::str>(ko)) bad("kernels: expected None or a name of cpu_kernels()");
    const std::string name = ko.cast<std::string>();
    const LinKernels* k = lin_kernels_named(name.c_str());
    if (k == nullptr) bad("kernels: '" + name + "': " + lin_kernels_refusal(name.c_str()) + " (None: cpu_kernels()'s choice)");
    return k;
}

LinArg lin_arg(const std::string& release, const py::object& dobj, const py::object& sobj, bool nan_free,
               const py::object& ko) {
    LinArg a;
    a.w.kernels = kernels_arg(ko);
    if (release == "bf16") {
        a.data = checked_arg(dobj, "data", kBf16(), 2);
        a.w.fmt = WFmt::BF16;
        a.w.C = static_cast<size_t>(a.data.shape(1));
    } else if (release == "f32") {
        a.data = checked_arg(dobj, "data", kF32, 2);
        a.w.fmt = WFmt::F32;
        a.w.C = static_cast<size_t>(a.data.shape(1));
    } else if (release == "fp8") {
        a.data = checked_arg(dobj, "data", kE4M3Codes(), 2);
        a.scale = checked_arg(sobj, "scale", kF32, 2);
        a.w.fmt = WFmt::FP8;
        a.w.C = static_cast<size_t>(a.data.shape(1));
        expect_shape(a.scale, "scale", fp8_scale_shape(a.data.shape(0), a.data.shape(1)),
                     [&] { return "[ceil(R/128), ceil(C/128)] for data of shape " + shape_str(shape_of(a.data)); });
    } else if (release == "mxfp4") {
        a.data = checked_arg(dobj, "data", kU8("uint8 (two E2M1 nibbles per byte)"), 2);
        a.scale = checked_arg(sobj, "scale", kE8M0Codes(), 2);
        a.w.fmt = WFmt::MXFP4;
        a.w.C = static_cast<size_t>(check_mxfp4(a.data, a.scale));
    } else {
        bad("release: expected 'bf16', 'f32', 'fp8' or 'mxfp4', given '" + release + "'");
    }
    a.R = static_cast<size_t>(a.data.shape(0));
    a.w.R = a.R;
    a.w.data = a.data.data();
    a.w.scale = a.scale ? a.scale.data() : nullptr;
    if (nan_free && a.w.fmt != WFmt::FP8) bad("nan_free: expected False for release '" + release + "' (fp8 only)");
    if (nan_free && has_e4m3_nan(data_of<uint8_t>(a.data), a.R * a.w.C))
        bad("nan_free: expected fp8 data without NaN codes (S.1111.111), given data holding one");
    a.w.fp8_nan_free = nan_free;
    return a;
}

// linear(release, data, scale, X[T, C], r0, r1, nan_free, round, threads) -> f32[T, r1 - r0]
py::array py_linear(const std::string& release, const py::object& dobj, const py::object& sobj, const py::object& xo,
                    const py::object& r0o, const py::object& r1o, bool nan_free, bool round, const py::object& to,
                    const py::object& ko) {
    LinArg a = lin_arg(release, dobj, sobj, nan_free, ko);
    const py::array X = checked_arg(xo, "X", kF32, 2);
    const size_t C = a.w.C, T = static_cast<size_t>(X.shape(0));
    if (static_cast<size_t>(X.shape(1)) != C)
        bad("X: expected shape [T, " + std::to_string(C) + "], given " + shape_str(shape_of(X)));
    const size_t r0 = arg_uint(r0o, "r0", 0, a.R);
    const size_t r1 = r1o.is_none() ? a.R : arg_uint(r1o, "r1", r0, a.R);
    const unsigned threads = std::max(1u, arg_threads(to));
    require_clean_mxcsr();
    const size_t n = r1 - r0;
    py::array_t<float> Y({static_cast<py::ssize_t>(T), static_cast<py::ssize_t>(n)});
    float* y = Y.mutable_data();
    const float* x = data_of<float>(X);
    {
        py::gil_scoped_release nogil;
        ThreadPool pool(threads, 0);
        pool.parallel_for(n, 1, [&](size_t a0, size_t b0) { a.w.matmul(r0 + a0, r0 + b0, x, C, T, y + a0, n, round); });
    }
    return std::move(Y);
}

// Benchmark hook: best seconds of `reps` calls Y = W X (X: [T, C]), rows split over `threads` threads.
double py_linear_bench(const std::string& release, const py::object& dobj, const py::object& sobj,
                       const py::object& xo, bool nan_free, const py::object& to, const py::object& repo,
                       const py::object& ko) {
    LinArg a = lin_arg(release, dobj, sobj, nan_free, ko);
    const py::array X = checked_arg(xo, "X", kF32, 2);
    const size_t C = a.w.C, T = static_cast<size_t>(X.shape(0)), R = a.R;
    if (static_cast<size_t>(X.shape(1)) != C)
        bad("X: expected shape [T, " + std::to_string(C) + "], given " + shape_str(shape_of(X)));
    const unsigned threads = std::max(1u, arg_threads(to));
    const size_t reps = std::max<uint64_t>(1, arg_uint(repo, "reps", 1, 1000000));
    require_clean_mxcsr();
    std::vector<float> y(T * R);
    const float* x = data_of<float>(X);
    double best = 1e300;
    py::gil_scoped_release nogil;
    ThreadPool pool(threads, 0);
    for (size_t i = 0; i < reps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        pool.parallel_for(R, 1, [&](size_t a0, size_t b0) { a.w.matmul(a0, b0, x, C, T, y.data() + a0, R, false); });
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
}

py::array py_div_probe(const py::object& xo, const py::object& dobj) {
    const py::array x = checked_arg(xo, "x", kF32, 1);
    const float d = arg_f32(dobj, "d");
    require_clean_mxcsr();
    py::array_t<float> y(x.shape(0));
    div_probe(data_of<float>(x), d, y.mutable_data(), static_cast<size_t>(x.shape(0)));
    return std::move(y);
}

py::array py_expf_table() {
    py::array_t<uint64_t> t(32);
    std::memcpy(t.mutable_data(), kExpfTable, sizeof(kExpfTable));
    return std::move(t);
}

// Test hook: set or clear FTZ and DAZ in the calling thread's MXCSR; returns the previous state.
bool py_set_ftz_daz(bool on) {
    const bool was = ftz_daz_enabled();
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(on ? (csr | 0x8040u) : (csr & ~0x8040u));
    return was;
}

py::dict build_info() {
    py::dict d;
    d["compiler"] = GLM_CXX_COMPILER;
    d["cxx_flags"] = GLM_CXX_FLAGS;
    d["build_type"] = GLM_BUILD_TYPE;
#ifdef __FMA__
    d["fma"] = true;
#else
    d["fma"] = false;
#endif
#ifdef __AVX2__
    d["avx2"] = true;
#else
    d["avx2"] = false;
#endif
#ifdef __FAST_MATH__
    d["fast_math"] = true;
#else
    d["fast_math"] = false;
#endif
    return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        throw py::import_error("fast._core needs a CPU with AVX2, FMA and F16C");

    m.doc() = "GLM-5.3-Flash exact engine: CPU primitives (canonical numerics, docs/contract.md §4).";
    const auto A = [](const char* n) { return py::arg(n); };

    m.def("cdot", &py_cdot, A("a"), A("b"),
          "cdot(a: f32[n], b: f32[n]) -> numpy.float32: the canonical reduction (docs/contract.md §4.2).");
    m.def("cdot64", &py_cdot64, A("a"), A("b"), "cdot64(a: f64[n], b: f64[n]) -> float: cdot in double.");
    m.def("csum", &py_csum, A("x"), "csum(x: f32[n]) -> numpy.float32: cdot(x, 1).");
    m.def("argmax_logprob", &py_argmax_logprob, A("x"),
          "argmax_logprob(x: f32[n]) -> (int, numpy.float32): the greedy token (np.argmax's rule) and "
          "oracle.sampling.log_softmax(x)[token], as a step's \"argmax_logprob\" head computes them; the "
          "log-probability is NaN when x holds a NaN or an infinity.");
    m.def("expf", &py_expf, A("x"), "expf(x: f32 array) -> f32 array: the canonical expf (docs/contract.md §4.3).");
    m.def("expf_check_range", &py_check_range<expf_check_range>, A("lo_bits"), A("hi_bits"),
          "Compare the scalar canonical expf with the host libm expf on every f32 bit pattern in "
          "[lo_bits, hi_bits) (hi_bits <= 2**32), on all cores. Returns (mismatches, first mismatching "
          "bits or None).");
    m.def("expf_avx2_check_range", &py_check_range<expf8_check_range>, A("lo_bits"), A("hi_bits"),
          "As expf_check_range, for the 8-wide AVX2 expf.");
    m.def("expf_table", &py_expf_table, "The 32-entry expf table T[i] = bits(2^(i/32)) - (i << 47), as uint64.");
    m.def("bf16_from_f32", &py_bf16_from_f32, A("x"),
          "bf16_from_f32(x: f32 array) -> uint16 array: RNE, every NaN -> 0x7FC0.");
    m.def("bf16_from_f64", &py_bf16_from_f64, A("x"),
          "bf16_from_f64(x: f64 array) -> uint16 array: f64 -> f32 (RNE) -> bf16 (RNE), NaN -> 0x7FC0.");
    m.def("decode_e4m3", [](const py::object& c) { return decode_table(c, kE4M3Codes(), kE4M3); }, A("codes"),
          "E4M3 (fn) codes (uint8 array) -> f32 array.");
    m.def("decode_e2m1", [](const py::object& c) { return decode_table(c, kU8("uint8 (E2M1 codes 0..15)"), kE2M1); },
          A("codes"), "E2M1 codes (uint8 array, values 0..15) -> f32 array.");
    m.def("decode_e8m0", [](const py::object& c) { return decode_table(c, kE8M0Codes(), kE8M0); }, A("codes"),
          "E8M0 codes (uint8 array) -> f32 array: 2^(e-127), 0xFF -> NaN.");
    m.def("decode_fp8_weight", &py_decode_fp8_weight, A("q"), A("scale_inv"),
          "decode_fp8_weight(q: u8[R, C], scale_inv: f32[ceil(R/128), ceil(C/128)]) -> f32[R, C].");
    m.def("decode_mxfp4_weight", &py_decode_mxfp4_weight, A("packed"), A("scale"),
          "decode_mxfp4_weight(packed: u8[R, C/2], scale: u8[R, C/32]) -> f32[R, C].");
    m.def("matvec_bf16", &py_matvec_bf16, A("W"), A("x"), py::arg("threads") = 0,
          "matvec_bf16(W: u16[R, C] bf16 bits, x: f32[C]) -> f32[R]; row r = cdot(W[r], x).");
    m.def("matvec_fp8", &py_matvec_fp8, A("q"), A("scale_inv"), A("x"), py::arg("threads") = 0,
          "matvec_fp8(q: u8[R, C], scale_inv: f32[ceil(R/128), ceil(C/128)], x: f32[C]) -> f32[R].");
    m.def("matvec_mxfp4", &py_matvec_mxfp4, A("packed"), A("scale"), A("x"), py::arg("threads") = 0,
          "matvec_mxfp4(packed: u8[R, C/2], scale: u8[R, C/32], x: f32[C]) -> f32[R].");
    m.def("linear", &py_linear, A("release"), A("data"), A("scale"), A("X"), py::arg("r0") = 0,
          py::arg("r1") = py::none(), py::arg("nan_free") = false, py::arg("round") = false, py::arg("threads") = 1,
          py::arg("kernels") = py::none(),
          "linear(release, data, scale, X: f32[T, C], r0=0, r1=R, nan_free=False, round=False, threads=1, kernels=None) -> "
          "f32[T, r1 - r0]: the engine's Lin kernels, Y[t, i] = cdot(W[r0 + i], X[t]) (bf16-rounded when round). "
          "release 'bf16' (data u16[R, C]), 'f32' (f32[R, C]), 'fp8' (u8[R, C], scale f32[ceil(R/128), ceil(C/128)]), "
          "'mxfp4' (u8[R, C/2], scale u8[R, C/32]); scale None for bf16/f32. nan_free (fp8): take the path without "
          "NaN-code checks (the data is scanned once here and refused if it holds one). kernels: None (cpu_kernels()'s "
          "choice) or 'avx2' / 'avx512' (refused where it does not run); every choice gives the same bits.");
    m.def("linear_bench", &py_linear_bench, A("release"), A("data"), A("scale"), A("X"), py::arg("nan_free") = false,
          py::arg("threads") = 1, py::arg("reps") = 5, py::arg("kernels") = py::none(),
          "Benchmark hook: best seconds of `reps` calls of linear(release, data, scale, X, kernels=kernels) over all "
          "rows.");
    m.def("cpu_kernels", [] {
              py::list avail;
              for (const char* n : kLinKernelNames)
                  if (lin_kernels_named(n)) avail.append(n);
              py::dict d;
              d["chosen"] = lin_kernels().isa;
              d["available"] = avail;
              return d;
          },
          "The CPU engine's multi-token kernels: {'chosen': the instruction set this process runs (AVX-512VL where "
          "the CPU, its OS and the build have it, else AVX2; the environment's GLM_CPU_KERNELS=avx2|avx512 asks), "
          "'available': those that run here}. Every choice gives the same bits.");
    m.def("ftz_daz_enabled", &ftz_daz_enabled, "True when this thread's MXCSR has FTZ or DAZ set.");
    m.def("contract_probe", &contract_probe,
          "a*b + c for a = b = 1 + 2^-12, c = -(1 + 2^-11): 0.0 unless the build contracts into an FMA (2^-24).");
    m.def("div_probe", &py_div_probe, A("x"), A("d"),
          "div_probe(x: f32[n], d) -> x / f32(d), elementwise (catches reciprocal-math builds).");
    m.def("_set_ftz_daz", &py_set_ftz_daz, A("on"),
          "Test hook: set (True) or clear (False) FTZ and DAZ in this thread's MXCSR; returns the previous state.");
    m.def("build_info", &build_info, "Compiler, flags and ISA of this build.");
    register_engine(m);
}
