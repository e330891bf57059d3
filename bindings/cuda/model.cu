// The CUDA engine's executor: weights registration and upload, sequences (the device cache), and
// Engine::step, which enqueues embed -> L x [attn_hc -> attn_norm -> KDA | MLA -> attn_hc.streams,
// ffn_hc -> ffn_norm -> SwiGLU | MoE -> ffn_hc.streams] -> head for every row of a batch at once
// (docs/numerics.md), then copies the logits (and any captured stage) back.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <sstream>

#include "engine.cuh"
#include "../tensor_roles.hpp"

namespace glm::cuda {

// ---- stages ---------------------------------------------------------------------------------------

namespace {
size_t elem_bytes(SDType t) { return t == SDType::F64 ? 8 : 4; }

}  // namespace

#if !defined(GLM_CUDA_EMU)
bool pdl_enabled() {
    static const bool on = !env_is("GLM_PDL", "0");
    return on;
}
#endif

// ---- config ---------------------------------------------------------------------------------------

// What the CUDA engine's kernels hold (mHC coefficients per block, KDA state columns in registers,
// expert tables, 32-bit positions).
const EngineLimits kCudaLimits{"CUDA", 16, int64_t{1} << 30, 256, 4096};

// ---- device memory --------------------------------------------------------------------------------

DBuf::DBuf(size_t bytes) : n(bytes) {
    if (bytes) check(cudaMalloc(&p, bytes), "cudaMalloc");
}
DBuf& DBuf::operator=(DBuf&& o) noexcept {
    if (this != &o) {
        if (p) cudaFree(p);
        p = o.p;
        n = o.n;
        o.p = nullptr;
        o.n = 0;
    }
    return *this;
}
DBuf::~DBuf() {
    if (p) cudaFree(p);
}

void* Arena::alloc(size_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    if (bytes == 0) bytes = 256;
    constexpr size_t kBig = size_t{256} << 20;
    if (bytes >= kBig) {  // a large tensor gets an allocation of its own
        extra_big_.emplace_back(bytes);
        used_ += bytes;
        return extra_big_.back().p;
    }
    if (chunks_.empty() || off_ + bytes > chunks_.back().n) {
        // small tensors share chunks: 64 MiB first, doubling up to 1 GiB
        const size_t last = chunks_.empty() ? (size_t{32} << 20) : chunks_.back().n;
        const size_t chunk = std::max(bytes, std::min(2 * last, size_t{1} << 30));
        chunks_.emplace_back(chunk);
        off_ = 0;
    }
    void* p = static_cast<char*>(chunks_.back().p) + off_;
    off_ += bytes;
    used_ += bytes;
    return p;
}

SideStream::~SideStream() {
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
    if (s_) cudaStreamDestroy(s_);
}
cudaStream_t SideStream::fork() {
    if (!s_) {
        check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "side stream");
        check(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "side stream event");
        check(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), "side stream event");
    }
    check(cudaEventRecord(fork_, 0), "fork");
    check(cudaStreamWaitEvent(s_, fork_, 0), "fork");
    return s_;
}
void SideStream::join_later() {
    check(cudaEventRecord(join_, s_), "join");
    pending_ = true;
}
void SideStream::join() {
    if (!pending_) return;
    check(cudaStreamWaitEvent(0, join_, 0), "join");
    pending_ = false;
}

void linear_same_x(Step& s, const Lin& joint, std::initializer_list<const Lin*> members, const float* x,
                   int64_t ldx, float** out) {
    size_t i = 0;
    if (s.T == 1 && !joint.empty()) {
        float* row = s.scratch.d<float>(static_cast<size_t>(joint.R));
        linear(joint, x, ldx, row, joint.R, 1, true, s.nm, s.hw8);
        for (const Lin* m : members) {
            out[i++] = row;
            row += m->R;
        }
        return;
    }
    for (const Lin* m : members) {
        out[i] = s.scratch.d<float>(static_cast<size_t>(s.T) * static_cast<size_t>(m->R));
        linear(*m, x, ldx, out[i], m->R, s.T, true, s.nm, s.hw8);
        ++i;
    }
}

int* EngineCore::ep_flag() {
    if (!ep_bad.p) {
        ep_bad = DBuf(sizeof(int));
        check(cudaMemset(ep_bad.p, 0, sizeof(int)), "ep flag");
    }
    return ep_bad.as<int>();
}
void EngineCore::ep_check() {
    if (!ep_bad.p) return;
    int bad = 0;
    check(cudaMemcpy(&bad, ep_bad.p, sizeof(int), cudaMemcpyDeviceToHost), "ep flag");
    if (!bad) return;
    check(cudaMemset(ep_bad.p, 0, sizeof(int)), "ep flag");
    throw std::runtime_error("expert parallelism: the exchange returned this rank's rows altered");
}

unsigned* EngineCore::hc_tickets(int T) {
    const size_t need = static_cast<size_t>(T) * sizeof(unsigned);
    if (tickets.n < need) {
        check(cudaDeviceSynchronize(), "tickets");  // the old counters may still be in use
        tickets = DBuf(std::max(need, size_t{4096}));
        check(cudaMemset(tickets.p, 0, tickets.n), "tickets");
    }
    return tickets.as<unsigned>();
}

Scratch::~Scratch() {
    if (pinned_) cudaFreeHost(pinned_);
    for (void* p : pinned_extra_) cudaFreeHost(p);
}

void* Scratch::dev(size_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    if (bytes == 0) bytes = 256;
    need_ += bytes;
    if (off_ + bytes <= main_.n) {
        void* p = static_cast<char*>(main_.p) + off_;
        off_ += bytes;
        return p;
    }
    extra_.emplace_back(bytes);
    return extra_.back().p;
}

void* Scratch::pinned(size_t bytes) {
    const size_t b = (bytes + 255) / 256 * 256;
    pinned_need_ += b;
    void* h;
    if (pinned_off_ + b <= pinned_cap_) {
        h = static_cast<char*>(pinned_) + pinned_off_;
        pinned_off_ += b;
    } else {
        check(cudaMallocHost(&h, b), "cudaMallocHost");
        pinned_extra_.push_back(h);
    }
    return h;
}

void* Scratch::upload(const void* host, size_t bytes) {
    void* d = dev(bytes);
    if (bytes == 0) return d;
    void* h = pinned(bytes);
    std::memcpy(h, host, bytes);
    check(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, 0), "upload");
    return d;
}

void Scratch::end_deferred() {
    deferred_ = false;
    retired_.clear();
    reset();
}

void Scratch::reset() {
    if (deferred_) {
        for (DBuf& b : extra_) retired_.push_back(std::move(b));
        extra_.clear();
        off_ = 0;
        need_ = 0;
        return;
    }
    if (!extra_.empty() || need_ > main_.n) {
        extra_.clear();
        const size_t want = std::max(need_ + need_ / 4, main_.n);
        main_ = DBuf();
        main_ = DBuf(want);
    }
    if (!pinned_ || !pinned_extra_.empty()) {
        for (void* p : pinned_extra_) cudaFreeHost(p);
        pinned_extra_.clear();
        // room for what this step asked for (a steady batch then never allocates pinned memory again)
        const size_t want = std::max(pinned_ ? 2 * pinned_cap_ : size_t{1} << 20, pinned_need_ + pinned_need_ / 4);
        if (pinned_) cudaFreeHost(pinned_);
        pinned_ = nullptr;
        check(cudaMallocHost(&pinned_, want), "cudaMallocHost");
        pinned_cap_ = want;
    }
    off_ = 0;
    need_ = 0;
    pinned_off_ = 0;
    pinned_need_ = 0;
}

// ---- the step context -----------------------------------------------------------------------------

Step::Step(EngineCore& e, Scratch& sc) : E(e), c(e.cfg), nm(e.nm), hw8(e.hw8), scratch(sc) {}

bool Step::wants_any(int layer, int stage) const {
    if (!wants(layer, stage)) return false;
    for (uint8_t r : cap_row)
        if (r) return true;
    return false;
}

namespace {
// Capture rows of a device array: one copy of the whole span, then one record per wanted row.
void capture_rows(Step& s, int layer, int stage, const void* p, const std::vector<int64_t>& off,
                  const std::vector<std::vector<int64_t>>& shapes, const std::vector<int>* rowmap) {
    const size_t eb = elem_bytes(kStages[stage].dtype);
    const size_t n = off.size();
    int64_t lo = -1, hi = 0;
    for (size_t r = 0; r < n; ++r) {
        const int t = rowmap ? (*rowmap)[r] : static_cast<int>(r);
        if (!s.cap_row[static_cast<size_t>(t)]) continue;
        const int64_t a = off[r], b = off[r] + static_cast<int64_t>(numel(shapes[r]));
        if (lo < 0 || a < lo) lo = a;
        hi = std::max(hi, b);
    }
    if (lo < 0) return;
    std::vector<uint8_t> host(static_cast<size_t>(hi - lo) * eb);
    if (!host.empty())
        check(cudaMemcpy(host.data(), static_cast<const char*>(p) + static_cast<size_t>(lo) * eb, host.size(),
                         cudaMemcpyDeviceToHost),
              "capture");
    for (size_t r = 0; r < n; ++r) {
        const int t = rowmap ? (*rowmap)[r] : static_cast<int>(r);
        if (!s.cap_row[static_cast<size_t>(t)]) continue;
        CaptureRecord rec;
        rec.layer = layer;
        rec.stage = stage;
        rec.row = t;
        rec.shape = shapes[r];
        const size_t nb = numel(shapes[r]) * eb;
        rec.bytes.resize(nb);
        if (nb) std::memcpy(rec.bytes.data(), host.data() + static_cast<size_t>(off[r] - lo) * eb, nb);
        s.out->captures.push_back(std::move(rec));
    }
}

void emit_impl(Step& s, int layer, int stage, void* p, const std::vector<int64_t>& off,
               const std::vector<std::vector<int64_t>>& shapes, const std::vector<int>* rowmap) {
    const SDType dt = kStages[stage].dtype;
    const size_t eb = elem_bytes(dt);
    for (size_t r = 0; r < off.size(); ++r) {
        const int t = rowmap ? (*rowmap)[r] : static_cast<int>(r);
        const int64_t e = s.inject_element(layer, stage, t);
        if (e < 0 || static_cast<size_t>(e) >= numel(shapes[r])) continue;
        inject_value(static_cast<char*>(p) + static_cast<size_t>(off[r] + e) * eb, static_cast<int>(dt), s.inj.ulps);
        s.out->injected += 1;
    }
    if (s.wants(layer, stage)) capture_rows(s, layer, stage, p, off, shapes, rowmap);
}
}  // namespace

void Step::emit(int layer, int stage, void* p, int64_t ld, const std::vector<int64_t>& shape) {
    std::vector<int64_t> off(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) off[static_cast<size_t>(t)] = t * ld;
    emit_impl(*this, layer, stage, p, off, std::vector<std::vector<int64_t>>(static_cast<size_t>(T), shape), nullptr);
}

void Step::emit_var(int layer, int stage, void* p, const std::vector<int64_t>& off,
                    const std::vector<std::vector<int64_t>>& shapes) {
    emit_impl(*this, layer, stage, p, off, shapes, nullptr);
}

void Step::emit_rows(int layer, int stage, void* p, int64_t ld, const std::vector<int64_t>& shape,
                     const std::vector<int>& rows) {
    std::vector<int64_t> off(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) off[r] = static_cast<int64_t>(r) * ld;
    emit_impl(*this, layer, stage, p, off, std::vector<std::vector<int64_t>>(rows.size(), shape), &rows);
}

void Step::capture(int layer, int stage, const void* p, int64_t ld, const std::vector<int64_t>& shape) {
    if (!wants(layer, stage)) return;
    std::vector<int64_t> off(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) off[static_cast<size_t>(t)] = t * ld;
    capture_rows(*this, layer, stage, p, off, std::vector<std::vector<int64_t>>(static_cast<size_t>(T), shape), nullptr);
}

SegDev* Step::seg_table(int layer) {
    if (seg_cache_.empty()) seg_cache_.assign(static_cast<size_t>(c.num_hidden_layers), nullptr);
    SegDev*& cached = seg_cache_[static_cast<size_t>(layer)];
    if (cached) return cached;
    std::vector<SegDev> v(segs.size());
    for (size_t i = 0; i < segs.size(); ++i) {
        SegDev& d = v[i];
        std::memset(&d, 0, sizeof(d));
        d.t0 = segs[i].t0;
        d.n = segs[i].n;
        d.pos0 = static_cast<int>(segs[i].pos0);
        Sequence& q = *segs[i].seq;
        if (E.layers[static_cast<size_t>(layer)].kda) {
            d.conv = q.kda[static_cast<size_t>(layer)].conv_tail.as<float>();
            d.S = q.kda[static_cast<size_t>(layer)].S.as<float>();
        } else {
            MlaState& m = q.mla[static_cast<size_t>(layer)];
            d.c = m.c.as<float>();
            d.k = m.k.as<float>();
            d.gate = m.gate.as<float>();
            d.pk = m.pk.as<float>();
        }
    }
    cached = scratch.up(v);
    return cached;
}

void Step::mark(const char* name) {
    if (!E.timing) return;
    if (E.event_next >= E.event_pool.size()) {
        cudaEvent_t ev;
        check(cudaEventCreate(&ev), "cudaEventCreate");
        E.event_pool.push_back(ev);
    }
    cudaEvent_t ev = E.event_pool[E.event_next++];
    check(cudaEventRecord(ev, 0), "cudaEventRecord");
    E.marks.emplace_back(name, ev);
}

void* host_pinned_alloc(size_t bytes) {
    void* p = nullptr;
    check(cudaMallocHost(&p, bytes ? bytes : 16), "cudaMallocHost (logits)");
    return p;
}
void host_pinned_free(void* p) noexcept { cudaFreeHost(p); }

// ---- the engine -----------------------------------------------------------------------------------

struct Engine::Impl : EngineCore {};

namespace {

__global__ void k_decay(const float* a_log, int n, float* out, Nm nm) {
    pdl_enter();
    const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) out[i] = nm.exp(a_log[i]);
}

// W_UK^T: element (h*r + k, i) is kv_b[h(dn+dv) + i][k] (C = r columns).
// f32: the decoded values. BF16: their bits, and *inexact set when a value is not a BF16 value (MXFP4
// and BF16 values always are). FP8 (r, dn + dv and dn multiples of 128): the codes, and the scales of
// the transposed 128-blocks, scale'[(h*r + k)/128][i/128] = scale[h(dn+dv)/128 + i/128][k/128], so
// that fl(e4m3 * scale') is the same product as before.
__global__ void k_build_wuk(int fmt, const void* data, const void* scale, int64_t C, int nh, int dn, int dv, int r,
                            int out_fmt, void* out, float* out_scale, int* inexact) {
    pdl_enter();
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(nh) * r * dn) return;
    const int64_t i = idx % dn, k = (idx / dn) % r, h = idx / (static_cast<int64_t>(dn) * r);
    const int64_t src_row = h * (dn + dv) + i;
    if (out_fmt == W_FP8) {
        static_cast<uint8_t*>(out)[idx] = static_cast<const uint8_t*>(data)[src_row * C + k];
        if (k % 128 == 0 && i % 128 == 0) {
            const int64_t ncb = (C + 127) / 128;
            out_scale[(h * r + k) / 128 * (dn / 128) + i / 128] = static_cast<const float*>(scale)[src_row / 128 * ncb + k / 128];
        }
        return;
    }
    const float v = decode_elem(fmt, data, scale, src_row, k, C);
    if (out_fmt == W_BF16) {
        const uint32_t b = f32_bits(v);
        if ((b & 0xFFFFu) != 0u) *inexact = 1;
        static_cast<uint16_t*>(out)[idx] = static_cast<uint16_t>(b >> 16);
    } else {
        static_cast<float*>(out)[idx] = v;
    }
}

// W_UK^T of an MLA layer into the arena (k_build_wuk): FP8 when the transposed blocks are whole
// 128-blocks, BF16 when every value is a BF16 value (checked on the device), else f32. The view's
// rows are read by linear_heads like any weight, so the smaller format streams fewer bytes per token.
void build_wuk(Arena& arena, MlaW& m, int nh, int dn, int dv, int r) {
    const int64_t total = static_cast<int64_t>(nh) * r * dn;
    const Lin& kv = m.kv_b;
    Lin& w = m.w_uk_t;
    w.R = static_cast<int64_t>(nh) * r;
    w.C = dn;
    const unsigned grid = static_cast<unsigned>((total + 255) / 256);
    auto build = [&](int fmt) {
        w.fmt = fmt;
        w.data = arena.alloc(static_cast<size_t>(total * row_bytes(fmt, 1)));
        w.scale = fmt == W_FP8 ? arena.alloc(static_cast<size_t>(scale_bytes(fmt, w.R, w.C))) : nullptr;
        w.int_decode = fmt == W_FP8 && kv.int_decode;
        DBuf flag(sizeof(int));
        check(cudaMemset(flag.p, 0, sizeof(int)), "w_uk");
        auto k = k_build_wuk;
        GLM_LAUNCH(k, grid, 256, 0, kv.fmt, kv.data, kv.scale, kv.C, nh, dn, dv, r, fmt, const_cast<void*>(w.data),
                   static_cast<float*>(const_cast<void*>(w.scale)), flag.as<int>());
        check_launch("w_uk");
        int inexact = 0;
        check(cudaMemcpy(&inexact, flag.p, sizeof(int), cudaMemcpyDeviceToHost), "w_uk");
        return inexact == 0;
    };
    if (kv.fmt == W_FP8 && kv.row0 == 0 && r % 128 == 0 && (dn + dv) % 128 == 0 && dn % 128 == 0) {
        build(W_FP8);
    } else if (kv.fmt == W_F32 || !build(W_BF16)) {
        build(W_F32);  // (a rejected BF16 copy stays in the arena: finalize runs once)
    }
}

// Every E4M3 code in every position of a group of eight, hardware path vs software path.
__global__ void k_e4m3_selftest(int* mismatches) {
    pdl_enter();
    const int test = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (test >= 256) return;
    const int base = (test / 8) * 8, rot = test % 8;
    uint32_t code[8];
    for (int l = 0; l < 8; ++l) code[l] = static_cast<uint32_t>((base + ((l + rot) % 8)) & 0xFF);
    const uint32_t lo = code[0] | (code[1] << 8) | (code[2] << 16) | (code[3] << 24);
    const uint32_t hi = code[4] | (code[5] << 8) | (code[6] << 16) | (code[7] << 24);
    float w[8];
    e4m3x8<true>(lo, hi, w);
    for (int l = 0; l < 8; ++l) {
        const float ref = e4m3_sw(code[l]);
        const bool both_nan = is_nan(ref) && is_nan(w[l]);
        if (!both_nan && f32_bits(ref) != f32_bits(w[l])) atomicAdd(mismatches, 1);
    }
}

std::vector<float> to_f32(const std::string& what, const std::string& release, const void* data, size_t n) {
    std::vector<float> out(n);
    if (release == "bf16") {
        const uint16_t* p = static_cast<const uint16_t*>(data);
        for (size_t i = 0; i < n; ++i) {
            const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
            std::memcpy(&out[i], &u, 4);
        }
    } else if (release == "f32") {
        std::memcpy(out.data(), data, n * sizeof(float));
    } else {
        throw std::invalid_argument(what + ": expected a bf16 or f32 tensor, given release '" + release + "'");
    }
    return out;
}

}  // namespace

Engine::Engine(const Config& cfg, bool seq_dot, bool native_exp) : p_(std::make_unique<Impl>()) {
    Impl& e = *p_;
    e.cfg = cfg;
    validate_config(e.cfg, kCudaLimits);
    e.nm.seq = seq_dot;
    e.nm.native = native_exp;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1) {
        cudaGetLastError();
        throw std::runtime_error("no CUDA device is available");
    }
    // the E4M3 decode path: the hardware conversion if it agrees with the software decode everywhere
    {
        DBuf bad(sizeof(int));
        check(cudaMemset(bad.p, 0, sizeof(int)), "memset");
        auto k = k_e4m3_selftest;
        GLM_LAUNCH(k, 1, 256, 0, bad.as<int>());
        check_launch("e4m3 self-test");
        int mism = 0;
        check(cudaMemcpy(&mism, bad.p, sizeof(int), cudaMemcpyDeviceToHost), "e4m3 self-test");
        e.hw8 = mism == 0;
#if defined(GLM_CUDA_EMU)
        e.decode_path = "software (CPU emulation)";
#else
        e.decode_path = e.hw8 ? "hardware cvt.rn.f16x2.e4m3x2" : "software (the hardware conversion disagreed)";
#endif
    }
    const size_t L = static_cast<size_t>(cfg.num_hidden_layers);
    e.layers.resize(L);
    for (size_t l = 0; l < L; ++l) {
        e.layers[l].kda = e.cfg.is_kda[l] != 0;
        e.layers[l].m.has_indexer = !e.layers[l].kda && e.cfg.has_indexer[l] != 0;
        e.layers[l].f.moe = e.cfg.is_moe[l] != 0;
        if (e.layers[l].f.moe) {
            const size_t E = static_cast<size_t>(e.cfg.n_routed_experts);
            e.layers[l].f.e_gate.resize(E);
            e.layers[l].f.e_up.resize(E);
            e.layers[l].f.e_down.resize(E);
        }
    }
    e.scratch.reset();
}

Engine::~Engine() {
    if (p_) {
        cudaDeviceSynchronize();
        for (cudaEvent_t ev : p_->event_pool) cudaEventDestroy(ev);
    }
}

namespace {
// The joint groups: roles that read the same x, in their row order within the group.
struct JointRole {
    const char* role;
    const char* group;
    int index;
};
constexpr JointRole kJointRoles[] = {
    {"kda.q_proj", "kda.qkv", 0},          {"kda.k_proj", "kda.qkv", 1},     {"kda.v_proj", "kda.qkv", 2},
    {"kda.f_a_proj", "kda.fbg", 0},        {"kda.b_proj", "kda.fbg", 1},     {"kda.g_a_proj", "kda.fbg", 2},
    {"indexer.wk", "idx.kgw", 0},          {"indexer.kpool_gate", "idx.kgw", 1},
    {"indexer.weights_proj", "idx.kgw", 2},
    {"moe.shared.gate_proj", "moe.shared_gu", 0}, {"moe.shared.up_proj", "moe.shared_gu", 1},
};
const JointRole* joint_role(const std::string& role) {
    for (const JointRole& j : kJointRoles)
        if (role == j.role) return &j;
    return nullptr;
}

// The members' rows of a group under this config.
std::vector<int64_t> joint_rows(const std::string& group, const Config& c) {
    const int64_t P = c.kda_dim(), d = c.linear_head_dim, H = c.linear_num_heads;
    const int64_t di = c.index_head_dim, ni = c.index_n_heads;
    if (group == "kda.qkv") return {P, P, P};
    if (group == "kda.fbg") return {d, H, d};
    if (group == "moe.shared_gu") {
        const int64_t Is = c.moe_intermediate_size * c.n_shared_experts;
        return {Is, Is};
    }
    return {di, di, ni};
}

// The slot a joint-group member goes into (and, in index, the member's place in it), allocated with its
// first member; nullptr when the role is not in a group or the member does not fit it (another format or
// width than the first member, or FP8 rows that would share a scale block with a neighbour): then it is
// placed on its own.
EngineCore::JointSlot* joint_slot(EngineCore& E, const std::string& role, int layer, int fmt, int64_t R, int64_t C,
                                  int& index) {
    const JointRole* j = joint_role(role);
    if (!j || layer < 0) return nullptr;
    EngineCore::JointSlot& s = E.joints[{layer, j->group}];
    if (s.fmt < 0) {
        s.rows = joint_rows(j->group, E.cfg);
        int64_t o = 0;
        for (int64_t r : s.rows) {
            s.off.push_back(o);
            o += r;
        }
        s.total = o;
        s.have.assign(s.rows.size(), 0);
        s.int_decode.assign(s.rows.size(), 0);
        s.fmt = fmt;
        s.C = C;
        bool ok = true;
        if (fmt == W_FP8)
            for (size_t i = 0; i < s.rows.size(); ++i) ok = ok && s.off[i] % 128 == 0 && s.rows[i] % 128 == 0;
        if (!ok) s.fmt = -2;  // never joint
        else {
            s.data = static_cast<char*>(E.arena.alloc(static_cast<size_t>(s.total * row_bytes(fmt, C))));
            const int64_t sb = scale_bytes(fmt, s.total, C);
            if (sb) s.scale = static_cast<char*>(E.arena.alloc(static_cast<size_t>(sb)));
        }
    }
    const size_t i = static_cast<size_t>(j->index);
    if (s.fmt != fmt || s.C != C || s.rows[i] != R || s.have[i]) return nullptr;
    index = j->index;
    return &s;
}

// The group's matrix when every member was placed in its slot, else an empty Lin.
Lin joint_lin(const EngineCore& E, int layer, const char* group) {
    auto it = E.joints.find({layer, group});
    if (it == E.joints.end() || it->second.fmt < 0) return Lin{};
    const EngineCore::JointSlot& s = it->second;
    Lin w;
    w.fmt = s.fmt;
    w.R = s.total;
    w.C = s.C;
    w.data = s.data;
    w.scale = s.scale;
    w.int_decode = true;
    for (size_t i = 0; i < s.rows.size(); ++i) {
        if (!s.have[i]) return Lin{};
        w.int_decode = w.int_decode && s.int_decode[i];
    }
    return w;
}
}  // namespace

void Engine::add_tensor(const std::string& role, int layer, int expert, const std::string& release, const void* data,
                        const void* scale, const std::vector<int64_t>& shape, const std::vector<int64_t>& data_shape,
                        const std::vector<int64_t>& scale_shape) {
    Impl& E_ = *p_;
    if (E_.finalized) throw std::logic_error("add_tensor after finalize");
    const Config& c = E_.cfg;
    const int64_t L = c.num_hidden_layers;
    std::string what = role + (layer >= 0 ? " (layer " + std::to_string(layer) + ")" : "") +
                       (expert >= 0 ? " (expert " + std::to_string(expert) + ")" : "");
    auto bad = [&](const std::string& why) { throw std::invalid_argument(what + ": " + why); };
    if (data == nullptr) bad("no data");
    if (layer >= L) bad("layer out of range");
    for (int64_t d : shape)
        if (d < 0) bad("negative dimension");
    const size_t n = numel(shape);
    auto upload = [&](const void* src, size_t bytes) -> void* {
        void* d = E_.arena.alloc(bytes);
        if (bytes) check(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice), "weight upload");
        return d;
    };
    auto make_lin = [&](size_t rows, size_t cols) -> Lin {
        check_stored_lin(shape, rows, cols, release, data_shape, scale != nullptr, scale_shape, bad);
        Lin w;
        w.R = static_cast<int64_t>(rows);
        w.C = static_cast<int64_t>(cols);
        const int64_t R = w.R, C = w.C;
        w.fmt = parse_release(release);
        const int64_t rb = row_bytes(w.fmt, C), sb = scale_bytes(w.fmt, R, C);
        // a member of a joint group goes to its rows of the group's matrix, anything else on its own
        int i = 0;
        EngineCore::JointSlot* slot = joint_slot(E_, role, layer, w.fmt, R, C, i);
        w.row0 = slot ? slot->off[static_cast<size_t>(i)] : 0;
        char* dbase = slot ? slot->data : static_cast<char*>(E_.arena.alloc(static_cast<size_t>(R * rb)));
        char* sbase = !sb ? nullptr : slot ? slot->scale : static_cast<char*>(E_.arena.alloc(static_cast<size_t>(sb)));
        w.data = dbase;
        w.scale = sbase;
        char* d = dbase + w.row0 * rb;
        check(cudaMemcpy(d, data, static_cast<size_t>(R * rb), cudaMemcpyHostToDevice), "weight upload");
        if (sb)  // (a member's first row starts a scale block: joint_slot checks it)
            check(cudaMemcpy(sbase + scale_bytes(w.fmt, w.row0, C), scale, static_cast<size_t>(sb), cudaMemcpyHostToDevice),
                  "weight upload");
        if (w.fmt == W_FP8)  // selects the integer decode
            w.int_decode = e4m3_nan_free_device(d, static_cast<size_t>(R * C)) &&
                           fp8_scales_foldable(static_cast<const float*>(scale), static_cast<size_t>(sb / 4));
        if (w.fmt == W_MXFP4)  // selects the placement decode
            w.int_decode = mxfp4_scales_foldable(static_cast<const uint8_t*>(scale), static_cast<size_t>(sb));
        if (slot) {
            slot->have[static_cast<size_t>(i)] = 1;
            slot->int_decode[static_cast<size_t>(i)] = w.int_decode ? 1 : 0;
        }
        return w;
    };
    auto small_host = [&](size_t want) -> std::vector<float> {
        if (n != want) bad("has " + std::to_string(n) + " values, expected " + std::to_string(want));
        if (numel(data_shape) != want) bad("stored array has " + std::to_string(numel(data_shape)) + " values");
        return to_f32(what, release, data, want);
    };
    auto small = [&](size_t want) -> float* {
        const std::vector<float> f = small_host(want);
        return static_cast<float*>(upload(f.data(), f.size() * sizeof(float)));
    };

    const std::string key = role + "#" + std::to_string(layer) + "#" + std::to_string(expert);
    if (E_.have.count(key)) bad("registered twice");

    // where the role goes and its shape: bindings/tensor_roles.hpp, shared with the CPU engine
    using Bad = decltype(bad);
    using MakeLin = decltype(make_lin);
    using SmallHost = decltype(small_host);
    using Small = decltype(small);
    struct Ops {
        EngineCore& e;
        int layer_index;
        const Bad& bad_;
        const MakeLin& make_lin_;
        const SmallHost& small_host_;
        const Small& small_;
        void bad(const std::string& why) const { bad_(why); }
        LayerW& layer() const {
            if (layer_index < 0) bad_("needs a layer index");
            return e.layers[static_cast<size_t>(layer_index)];
        }
        EngineCore& top() const { return e; }
        Lin lin(size_t rows, size_t cols) const { return make_lin_(rows, cols); }
        float* vec(size_t n) const { return small_(n); }
        std::vector<float> host(size_t n) const { return small_host_(n); }
        double* f64(size_t n) const {
            const std::vector<float> f = small_host_(n);
            const std::vector<double> v(f.begin(), f.end());
            void* d = e.arena.alloc(v.size() * sizeof(double));
            check(cudaMemcpy(d, v.data(), v.size() * sizeof(double), cudaMemcpyHostToDevice), "weight upload");
            return static_cast<double*>(d);
        }
        void conv(KdaW& k, size_t which, size_t n) const {
            const std::vector<float> f = small_host_(n);
            if (!k.conv) {
                k.conv = static_cast<float*>(e.arena.alloc(3 * n * sizeof(float)));
                check(cudaMemset(k.conv, 0, 3 * n * sizeof(float)), "memset");
            }
            check(cudaMemcpy(k.conv + which * n, f.data(), n * sizeof(float), cudaMemcpyHostToDevice), "conv");
        }
        void check_expert(int x) const {
            const ExpertPartition& p = e.ep.part;
            if (!p.owns(x))  // expert parallelism: another rank's expert
                bad_("expert " + std::to_string(x) + " belongs to another rank (this rank, " + std::to_string(p.rank) +
                     ", owns [" + std::to_string(p.bounds[static_cast<size_t>(p.rank)]) + ", " +
                     std::to_string(p.bounds[static_cast<size_t>(p.rank) + 1]) + "))");
        }
    } ops{E_, layer, bad, make_lin, small_host, small};
    glm::assign_role(role, expert, c, ops);
    E_.have[key] = 1;
}

namespace {
// The first expert this rank holds (expert parallelism leaves the others empty), or nullptr.
const Lin* first_held(const std::vector<Lin>& ls) {
    for (const Lin& l : ls)
        if (!l.empty()) return &l;
    return nullptr;
}

// The device pointer tables of one layer's experts (entries of experts another rank holds: null; the
// work list never names them).
ExpertTable make_table(EngineCore& E_, const std::vector<Lin>& ls, const std::string& what, int layer) {
    ExpertTable t;
    const Lin* ref = first_held(ls);
    if (!ref) return t;
    t.fmt = ref->fmt;
    t.R = ref->R;
    t.C = ref->C;
    t.int_decode = true;
    for (const Lin& l : ls) t.int_decode = t.int_decode && (l.empty() || l.int_decode);
    std::vector<const void*> d(ls.size(), nullptr), s(ls.size(), nullptr);
    for (size_t e = 0; e < ls.size(); ++e) {
        if (ls[e].empty()) continue;
        if (ls[e].fmt != t.fmt || ls[e].R != t.R || ls[e].C != t.C)
            throw std::invalid_argument(what + " (layer " + std::to_string(layer) + "): expert " + std::to_string(e) +
                                        " is stored as " + wfmt_name(ls[e].fmt) + " but expert " +
                                        std::to_string(ref - ls.data()) + " as " + wfmt_name(t.fmt) +
                                        "; the CUDA engine needs one format per layer");
        // (a member of a joint group starts at its row0, which starts a scale block: joint_slot)
        d[e] = static_cast<const char*>(ls[e].data) + ls[e].row0 * row_bytes(t.fmt, t.C);
        s[e] = ls[e].scale ? static_cast<const char*>(ls[e].scale) + scale_bytes(t.fmt, ls[e].row0, t.C) : nullptr;
    }
    E_.tables.emplace_back(d.size() * sizeof(void*));
    check(cudaMemcpy(E_.tables.back().p, d.data(), d.size() * sizeof(void*), cudaMemcpyHostToDevice), "table");
    t.data = E_.tables.back().as<const void*>();
    E_.tables.emplace_back(s.size() * sizeof(void*));
    check(cudaMemcpy(E_.tables.back().p, s.data(), s.size() * sizeof(void*), cudaMemcpyHostToDevice), "table");
    t.scale = E_.tables.back().as<const void*>();
    return t;
}
}  // namespace

void Engine::finalize() {
    Impl& E_ = *p_;
    const Config& c = E_.cfg;
    std::vector<std::string> missing;
    auto need = [&](bool ok, const std::string& role, int layer, int expert = -1) {
        if (!ok)
            missing.push_back(role + (layer >= 0 ? " (layer " + std::to_string(layer) + ")" : "") +
                              (expert >= 0 ? " (expert " + std::to_string(expert) + ")" : ""));
    };
    need(!E_.embed.empty(), "embed", -1);
    need(E_.final_norm != nullptr, "final_norm", -1);
    if (E_.lm_head.empty() && c.tie_word_embeddings) E_.lm_head = E_.embed;
    need(!E_.lm_head.empty(), "lm_head", -1);
    for (size_t li = 0; li < E_.layers.size(); ++li) {
        const int l = static_cast<int>(li);
        LayerW& w = E_.layers[li];
        need(w.attn_norm != nullptr, "attn_norm", l);
        need(w.ffn_norm != nullptr, "ffn_norm", l);
        need(w.attn_hc.fn != nullptr, "attn_hc.fn", l);
        need(w.attn_hc.base != nullptr, "attn_hc.base", l);
        need(w.ffn_hc.fn != nullptr, "ffn_hc.fn", l);
        need(w.ffn_hc.base != nullptr, "ffn_hc.base", l);
        if (w.kda) {
            KdaW& k = w.k;
            for (auto [lin, name] : {std::pair<Lin*, const char*>{&k.q_proj, "kda.q_proj"}, {&k.k_proj, "kda.k_proj"},
                                     {&k.v_proj, "kda.v_proj"}, {&k.f_a, "kda.f_a_proj"}, {&k.f_b, "kda.f_b_proj"},
                                     {&k.b_proj, "kda.b_proj"}, {&k.g_a, "kda.g_a_proj"}, {&k.g_b, "kda.g_b_proj"},
                                     {&k.o_proj, "kda.o_proj"}})
                need(!lin->empty(), name, l);
            need(k.conv != nullptr, "kda.q_conv/k_conv/v_conv", l);
            need(k.dt_bias != nullptr, "kda.dt_bias", l);
            need(k.A_log != nullptr, "kda.A_log", l);
            need(k.o_norm != nullptr, "kda.o_norm", l);
            k.qkv = joint_lin(E_, l, "kda.qkv");
            k.fbg = joint_lin(E_, l, "kda.fbg");
        } else {
            MlaW& m = w.m;
            for (auto [lin, name] : {std::pair<Lin*, const char*>{&m.q_a, "mla.q_a_proj"}, {&m.q_b, "mla.q_b_proj"},
                                     {&m.kv_a, "mla.kv_a_proj"}, {&m.kv_b, "mla.kv_b_proj"}, {&m.o_proj, "mla.o_proj"}})
                need(!lin->empty(), name, l);
            need(m.q_a_norm != nullptr, "mla.q_a_norm", l);
            need(m.kv_a_norm != nullptr, "mla.kv_a_norm", l);
            if (m.has_indexer) {
                for (auto [lin, name] : {std::pair<Lin*, const char*>{&m.wq_b, "indexer.wq_b"}, {&m.wk, "indexer.wk"},
                                         {&m.weights_proj, "indexer.weights_proj"},
                                         {&m.kpool_gate, "indexer.kpool_gate"}})
                    need(!lin->empty(), name, l);
                need(m.k_norm_w != nullptr, "indexer.k_norm", l);
                need(m.k_norm_b != nullptr, "indexer.k_norm_bias", l);
                need(m.ape != nullptr, "indexer.kpool_ape", l);
                m.kgw = joint_lin(E_, l, "idx.kgw");
            }
        }
        FfnW& f = w.f;
        if (f.moe) {
            need(!f.router.empty(), "moe.gate", l);
            need(f.bias != nullptr, "moe.gate_bias", l);
            need(!f.s_gate.empty(), "moe.shared.gate_proj", l);
            need(!f.s_up.empty(), "moe.shared.up_proj", l);
            need(!f.s_down.empty(), "moe.shared.down_proj", l);
            for (size_t e = 0; e < f.e_gate.size(); ++e) {
                if (!E_.ep.part.owns(static_cast<int64_t>(e))) continue;  // another rank's (expert parallelism)
                need(!f.e_gate[e].empty(), "moe.expert.gate_proj", l, static_cast<int>(e));
                need(!f.e_up[e].empty(), "moe.expert.up_proj", l, static_cast<int>(e));
                need(!f.e_down[e].empty(), "moe.expert.down_proj", l, static_cast<int>(e));
            }
        } else {
            need(!f.gate.empty(), "mlp.gate_proj", l);
            need(!f.up.empty(), "mlp.up_proj", l);
            need(!f.down.empty(), "mlp.down_proj", l);
        }
    }
    if (!missing.empty()) {
        std::string msg = std::to_string(missing.size()) + " tensor(s) missing:";
        for (const std::string& m : missing) msg += "\n  - " + m;
        throw std::invalid_argument(msg);
    }
    // derived weights, computed on the device
    for (size_t li = 0; li < E_.layers.size(); ++li) {
        LayerW& w = E_.layers[li];
        if (w.kda) {
            const int H = static_cast<int>(c.linear_num_heads);
            w.k.decay = static_cast<float*>(E_.arena.alloc(static_cast<size_t>(H) * sizeof(float)));
            auto k = k_decay;
            GLM_LAUNCH(k, (H + 127) / 128, 128, 0, w.k.A_log, H, w.k.decay, E_.nm);
            check_launch("decay");
        } else {
            const int nh = static_cast<int>(c.num_attention_heads), dn = static_cast<int>(c.qk_nope_head_dim);
            const int dv = static_cast<int>(c.v_head_dim), r = static_cast<int>(c.kv_lora_rank);
            build_wuk(E_.arena, w.m, nh, dn, dv, r);
        }
        if (w.f.moe) {
            FfnW& f = w.f;
            auto fits = [](const Lin& s, const std::vector<Lin>& es) {
                const Lin* r = first_held(es);
                return r && s.fmt == r->fmt && s.R == r->R && s.C == r->C;
            };
            f.shared_in_tables = fits(f.s_gate, f.e_gate) && fits(f.s_up, f.e_up) && fits(f.s_down, f.e_down);
            auto with_shared = [&](std::vector<Lin> es, const Lin& s) {
                if (f.shared_in_tables) es.push_back(s);
                return es;
            };
            const int l = static_cast<int>(li);
            f.t_gate = make_table(E_, with_shared(f.e_gate, f.s_gate), "moe.expert.gate_proj", l);
            f.t_up = make_table(E_, with_shared(f.e_up, f.s_up), "moe.expert.up_proj", l);
            f.t_down = make_table(E_, with_shared(f.e_down, f.s_down), "moe.expert.down_proj", l);
            f.s_gu = joint_lin(E_, l, "moe.shared_gu");
        }
    }
    check(cudaDeviceSynchronize(), "finalize");
    E_.finalized = true;
}

size_t Engine::weight_bytes(int64_t position) const {
    const Impl& E_ = *p_;
    const bool dense = position >= 0 && (position + 1) / E_.cfg.index_kpool <= E_.cfg.index_topk / E_.cfg.index_kpool;
    size_t b = static_cast<size_t>(E_.embed.C) * 2 + E_.lm_head.bytes();
    for (const LayerW& w : E_.layers) {
        if (w.kda) {
            for (const Lin* l : {&w.k.q_proj, &w.k.k_proj, &w.k.v_proj, &w.k.f_a, &w.k.f_b, &w.k.b_proj, &w.k.g_a,
                                 &w.k.g_b, &w.k.o_proj})
                b += l->bytes();
        } else {
            for (const Lin* l : {&w.m.q_a, &w.m.q_b, &w.m.kv_a, &w.m.kv_b, &w.m.o_proj, &w.m.wq_b, &w.m.wk,
                                 &w.m.weights_proj, &w.m.kpool_gate})
                if (!(dense && l == &w.m.wq_b)) b += l->bytes();  // (indexer_select: no query while dense)
        }
        if (w.f.moe) {
            b += w.f.router.bytes() + w.f.s_gate.bytes() + w.f.s_up.bytes() + w.f.s_down.bytes();
            const size_t k = static_cast<size_t>(E_.cfg.num_experts_per_tok);
            const Lin *g = first_held(w.f.e_gate), *u = first_held(w.f.e_up), *d = first_held(w.f.e_down);
            if (g && u && d) b += k * (g->bytes() + u->bytes() + d->bytes());
        } else {
            b += w.f.gate.bytes() + w.f.up.bytes() + w.f.down.bytes();
        }
    }
    return b;
}

size_t Engine::device_bytes() const { return p_->arena.used(); }

void set_device(int index) {
    const int n = device_count();
    if (index < 0 || index >= n)
        throw std::invalid_argument("device " + std::to_string(index) + " outside [0, " + std::to_string(n) + ")");
    check(cudaSetDevice(index), "cudaSetDevice");
}
int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
}
std::pair<size_t, size_t> device_memory() {
    size_t f = 0, t = 0;
    check(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
    return {f, t};
}

void Engine::set_expert_partition(const ExpertPartition& p) {
    Impl& E_ = *p_;
    if (!E_.have.empty() || E_.finalized) throw std::logic_error("set the expert partition before registering tensors");
    if (p.ranks > kMaxRanks)
        throw std::invalid_argument("expert partition: ranks must be in [1, " + std::to_string(kMaxRanks) + "], got " +
                                    std::to_string(p.ranks));
    p.validate(E_.cfg.n_routed_experts);
    E_.ep.part = p;
}
void Engine::set_exchange(std::shared_ptr<DeviceExchangeFn> fn) { p_->ep.hook = std::move(fn); }
ExpertPartition Engine::expert_partition() const { return p_->ep.part; }
EpStats Engine::ep_stats() const { return p_->ep.stats; }
void Engine::reset_ep_stats() { p_->ep.stats = EpStats{}; }

std::string Engine::device_name() const {
    cudaDeviceProp p;
    int dev = 0;
    cudaGetDevice(&dev);
    if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) return "?";
    return std::string(p.name);
}

std::string Engine::decode_path() const { return p_->decode_path; }

void Engine::set_timing(bool on) { p_->timing = on; }
void Engine::reset_stage_times() {
    p_->stage_ms.clear();
    p_->stage_order.clear();
}
StageTimes Engine::stage_times() const {
    StageTimes t;
    for (const std::string& n : p_->stage_order) {
        t.names.push_back(n);
        t.ms.push_back(p_->stage_ms.at(n));
    }
    return t;
}

// ---- sequences ------------------------------------------------------------------------------------

namespace {
std::unique_ptr<Sequence> make_sequence(const EngineCore& E_) {
    const Config& c = E_.cfg;
    auto s = std::make_unique<Sequence>();
    const size_t L = E_.layers.size();
    s->kda.resize(L);
    s->mla.resize(L);
    const size_t P = static_cast<size_t>(c.kda_dim()), d = static_cast<size_t>(c.linear_head_dim);
    const size_t K = static_cast<size_t>(c.linear_conv_kernel_dim);
    for (size_t l = 0; l < L; ++l)
        if (E_.layers[l].kda) {
            const size_t nt = std::max<size_t>((K - 1) * 3 * P, 1) * sizeof(float);
            const size_t ns = static_cast<size_t>(c.linear_num_heads) * d * d * sizeof(float);
            s->kda[l].conv_tail = DBuf(nt);
            s->kda[l].S = DBuf(ns);
            check(cudaMemset(s->kda[l].conv_tail.p, 0, nt), "memset");
            check(cudaMemset(s->kda[l].S.p, 0, ns), "memset");
        }
    return s;
}

void copy_buf(DBuf& dst, const DBuf& src) {
    dst = DBuf(src.n);
    if (src.n) check(cudaMemcpy(dst.p, src.p, src.n, cudaMemcpyDeviceToDevice), "copy");
}

// Make room for `need` positions in every MLA layer's cache of one sequence (doubling, contents kept).
void reserve(const EngineCore& E_, Sequence& q, int64_t need) {
    const Config& c = E_.cfg;
    const size_t r = static_cast<size_t>(c.kv_lora_rank), di = static_cast<size_t>(c.index_head_dim);
    const int64_t kp = c.index_kpool;
    for (size_t l = 0; l < E_.layers.size(); ++l) {
        if (E_.layers[l].kda) continue;
        MlaState& m = q.mla[l];
        if (m.cap >= need) continue;
        const int64_t cap = std::max<int64_t>({need, 2 * m.cap, 64});
        const size_t len = static_cast<size_t>(q.length);
        auto grow = [&](DBuf& b, size_t row, size_t rows_new, size_t rows_old) {
            DBuf nb(std::max<size_t>(rows_new * row, 1) * sizeof(float));
            if (b.p && rows_old) check(cudaMemcpy(nb.p, b.p, rows_old * row * sizeof(float), cudaMemcpyDeviceToDevice), "grow");
            b = std::move(nb);
        };
        grow(m.c, r, static_cast<size_t>(cap), len);
        if (E_.layers[l].m.has_indexer) {
            grow(m.k, di, static_cast<size_t>(cap), len);
            grow(m.gate, di, static_cast<size_t>(cap), len);
            grow(m.pk, di, static_cast<size_t>(cap / kp + 1), len / static_cast<size_t>(kp));
        }
        m.cap = cap;
    }
}
}  // namespace

int64_t Engine::new_sequence() {
    Impl& E_ = *p_;
    if (!E_.finalized) throw std::logic_error("the engine's weights are not finalized");
    const int64_t id = E_.next_id++;
    E_.seqs[id] = make_sequence(E_);
    return id;
}

int64_t Engine::fork_sequence(int64_t id) {
    Impl& E_ = *p_;
    auto it = E_.seqs.find(id);
    if (it == E_.seqs.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    const Sequence& a = *it->second;
    auto b = std::make_unique<Sequence>();
    b->length = a.length;
    b->kda.resize(a.kda.size());
    b->mla.resize(a.mla.size());
    for (size_t l = 0; l < a.kda.size(); ++l) {
        copy_buf(b->kda[l].conv_tail, a.kda[l].conv_tail);
        copy_buf(b->kda[l].S, a.kda[l].S);
        b->mla[l].cap = a.mla[l].cap;
        copy_buf(b->mla[l].c, a.mla[l].c);
        copy_buf(b->mla[l].k, a.mla[l].k);
        copy_buf(b->mla[l].gate, a.mla[l].gate);
        copy_buf(b->mla[l].pk, a.mla[l].pk);
    }
    const int64_t nid = E_.next_id++;
    E_.seqs[nid] = std::move(b);
    return nid;
}

void Engine::free_sequence(int64_t id) { p_->seqs.erase(id); }

int64_t Engine::sequence_length(int64_t id) const {
    auto it = p_->seqs.find(id);
    if (it == p_->seqs.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    return it->second->length;
}

size_t Engine::live_sequences() const { return p_->seqs.size(); }

// ---- the step -------------------------------------------------------------------------------------

namespace {
// A step of the greedy loop: its token on the device, and where its argmax goes.
struct GreedyIo {
    const int* token;
    int* next;
};
void step_on(EngineCore& E_, const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens,
             const std::vector<uint8_t>& want_head, const std::vector<uint8_t>& cap_rows,
             const std::vector<uint8_t>& cap_mask, const Injection& inj, StepOutput& out, const GreedyIo* gio);
}  // namespace

void Engine::step(const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens,
                  const std::vector<uint8_t>& want_head, const std::vector<uint8_t>& cap_rows,
                  const std::vector<uint8_t>& cap_mask, const Injection& inj, StepOutput& out) {
    const auto t0 = std::chrono::steady_clock::now();
    step_on(*p_, seq_ids, tokens, want_head, cap_rows, cap_mask, inj, out, nullptr);
    p_->ep.stats.step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<int32_t> Engine::greedy(int64_t seq_id, int32_t first, int n) {
    Impl& E_ = *p_;
    if (!E_.finalized) throw std::logic_error("the engine's weights are not finalized");
    const Config& c = E_.cfg;
    auto it = E_.seqs.find(seq_id);
    if (it == E_.seqs.end()) throw std::invalid_argument("unknown sequence " + std::to_string(seq_id));
    if (n < 1) throw std::invalid_argument("greedy: n must be at least 1");
    if (first < 0 || first >= c.vocab_size)
        throw std::invalid_argument("token id " + std::to_string(first) + " is outside the vocabulary [0, " +
                                    std::to_string(c.vocab_size) + ")");
    Sequence* sq = it->second.get();
    if (sq->length + n > c.max_context)
        throw std::invalid_argument("sequence " + std::to_string(seq_id) + ": " + std::to_string(sq->length + n) +
                                    " positions exceed the maximum context of " + std::to_string(c.max_context));
    reserve(E_, *sq, sq->length + n);  // the cache grows (and synchronizes) before the loop, not inside it
    DBuf toks(static_cast<size_t>(n + 1) * sizeof(int));
    check(cudaMemcpy(toks.p, &first, sizeof(int), cudaMemcpyHostToDevice), "greedy");
    const int L = static_cast<int>(c.num_hidden_layers);
    const std::vector<int64_t> ids{seq_id};
    const std::vector<int32_t> tok{first};  // (validated; the steps read their token on the device)
    const std::vector<uint8_t> head{1}, cap{0}, mask(static_cast<size_t>(L + 1) * S_COUNT, 0);
    const bool timing = E_.timing;
    E_.timing = false;  // (the stage events would be read before they complete)
    E_.scratch.begin_deferred();
    try {
        for (int i = 0; i < n; ++i) {
            StepOutput out;
            const GreedyIo io{toks.as<int>() + i, toks.as<int>() + i + 1};
            step_on(E_, ids, tok, head, cap, mask, Injection{}, out, &io);
        }
    } catch (...) {
        cudaDeviceSynchronize();
        E_.scratch.end_deferred();
        E_.timing = timing;
        throw;
    }
    check(cudaDeviceSynchronize(), "greedy");
    E_.scratch.end_deferred();
    E_.timing = timing;
    E_.ep_check();
    std::vector<int32_t> res(static_cast<size_t>(n));
    check(cudaMemcpy(res.data(), toks.as<int>() + 1, static_cast<size_t>(n) * sizeof(int), cudaMemcpyDeviceToHost),
          "greedy");
    return res;
}

namespace {

void step_on(EngineCore& E_, const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens,
             const std::vector<uint8_t>& want_head, const std::vector<uint8_t>& cap_rows,
             const std::vector<uint8_t>& cap_mask, const Injection& inj, StepOutput& out, const GreedyIo* gio) {
    if (!E_.finalized) throw std::logic_error("the engine's weights are not finalized");
    const Config& c = E_.cfg;
    const size_t T = seq_ids.size();
    const int L = static_cast<int>(c.num_hidden_layers);
    if (T == 0) throw std::invalid_argument("a step needs at least one row");
    if (T > 65535) throw std::invalid_argument("a step takes at most 65535 rows in the CUDA engine");
    if (tokens.size() != T || want_head.size() != T || cap_rows.size() != T)
        throw std::invalid_argument("seq_ids, tokens, want_head and cap_rows must have one entry per row");
    if (cap_mask.size() != static_cast<size_t>(L + 1) * S_COUNT)
        throw std::invalid_argument("cap_mask must have (num_hidden_layers + 1) * n_stages entries");
    for (size_t t = 0; t < T; ++t)
        if (tokens[t] < 0 || tokens[t] >= c.vocab_size)
            throw std::invalid_argument("token id " + std::to_string(tokens[t]) + " at row " + std::to_string(t) +
                                        " is outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
    if (inj.active) {
        if (inj.layer < 0 || inj.layer > L || inj.stage < 0 || inj.stage >= S_COUNT || inj.element < 0 || inj.pos < 0)
            throw std::invalid_argument("bad injection spec");
    }

    // the scratch is released (after a synchronization; in a greedy loop, without) however the step ends
    struct Guard {
        Scratch& s;
        EngineCore& e;
        bool sync;
        ~Guard() {
            if (sync) cudaDeviceSynchronize();
            e.marks.clear();
            e.event_next = 0;
            try {
                s.reset();
            } catch (...) {
            }
        }
    } guard{E_.scratch, E_, gio == nullptr};

    Step s(E_, E_.scratch);
    s.T = static_cast<int>(T);
    s.out = &out;
    s.inj = inj;
    s.cap_row = cap_rows;
    s.cap_mask = cap_mask;
    s.pos.resize(T);
    s.seg_of.resize(T);
    std::set<int64_t> seen;
    for (size_t t = 0; t < T;) {
        auto it = E_.seqs.find(seq_ids[t]);
        if (it == E_.seqs.end()) throw std::invalid_argument("unknown sequence " + std::to_string(seq_ids[t]));
        if (!seen.insert(seq_ids[t]).second)
            throw std::invalid_argument("the rows of sequence " + std::to_string(seq_ids[t]) + " are not consecutive");
        size_t n = 1;
        while (t + n < T && seq_ids[t + n] == seq_ids[t]) ++n;
        Sequence* sq = it->second.get();
        if (sq->length + static_cast<int64_t>(n) > c.max_context)
            throw std::invalid_argument("sequence " + std::to_string(seq_ids[t]) + ": " +
                                        std::to_string(sq->length + static_cast<int64_t>(n)) +
                                        " positions exceed the maximum context of " + std::to_string(c.max_context));
        for (size_t i = 0; i < n; ++i) {
            s.pos[t + i] = sq->length + static_cast<int64_t>(i);
            s.seg_of[t + i] = static_cast<int>(s.segs.size());
        }
        s.segs.push_back(Segment{sq, static_cast<int>(t), static_cast<int>(n), sq->length});
        t += n;
    }
    for (const Segment& g : s.segs) reserve(E_, *g.seq, g.pos0 + g.n);
    s.mark("embed");

    const int hc = static_cast<int>(c.hc_mult), D = static_cast<int>(c.hidden_size);
    const int Ti = static_cast<int>(T);
    s.d_pos = s.scratch.up(std::vector<int>(s.pos.begin(), s.pos.end()));
    s.d_seg = s.scratch.up(s.seg_of);
    int* d_tok = gio ? const_cast<int*>(gio->token) : s.scratch.up(tokens);
    float* X = s.scratch.d<float>(T * hc * D);
    float* Xspare = T <= 8 ? s.scratch.d<float>(T * hc * D) : nullptr;  // (hc_expand: the fused path's output)
    float* e = s.scratch.d<float>(T * D);
    embed_rows(s, E_.embed, d_tok, e, X);

    double* pre = s.scratch.d<double>(T * hc);
    double* post = s.scratch.d<double>(T * hc);
    double* comb = s.scratch.d<double>(T * hc * hc);
    float* xin = s.scratch.d<float>(T * D);
    float* xn = s.scratch.d<float>(T * D);
    float* u = s.scratch.d<float>(T * D);
    const float eps = static_cast<float>(c.rms_norm_eps);
    for (int l = 0; l < L; ++l) {
        const LayerW& w = E_.layers[static_cast<size_t>(l)];
        // attention sublayer
        s.mark("mhc");
        if (!hc_site(s, l, false, w.attn_hc, X, pre, post, comb, xin, w.attn_norm, eps, xn))
            rms_norm_rows(s, xin, D, Ti, D, w.attn_norm, eps, xn, D);
        s.emit(l, S_ATTN_NORM, xn, D, {D});
        if (w.kda) {
            kda_forward(s, l, w.k, xn, u);
            s.have_sel = false;
        } else {
            mla_forward(s, l, w.m, xn, u);
        }
        s.mark("mhc");
        if (float* Xn = hc_expand(s, l, false, X, Xspare, u, post, comb, false); Xn != X) {
            Xspare = X;
            X = Xn;
        }
        // feed-forward sublayer
        if (!hc_site(s, l, true, w.ffn_hc, X, pre, post, comb, xin, w.ffn_norm, eps, xn))
            rms_norm_rows(s, xin, D, Ti, D, w.ffn_norm, eps, xn, D);
        s.emit(l, S_FFN_NORM, xn, D, {D});
        if (w.f.moe) {
            moe_forward(s, l, w.f, xn, u);
        } else {
            s.mark("mlp");
            swiglu(s, w.f.gate, w.f.up, w.f.down, xn, Ti, u, l);
            s.emit(l, S_MLP_OUT, u, D, {D});
        }
        s.mark("mhc");
        if (float* Xn = hc_expand(s, l, true, X, Xspare, u, post, comb, l + 1 == L); Xn != X) {
            Xspare = X;
            X = Xn;
        }
    }
    hc_flush(s);  // (none is left pending after the last layer; kept as the rule for readers of X)

    // head, for the rows that want logits
    std::vector<int> hrows;
    for (size_t t = 0; t < T; ++t)
        if (want_head[t]) hrows.push_back(static_cast<int>(t));
    out.head_rows.assign(hrows.begin(), hrows.end());
    const size_t V = static_cast<size_t>(c.vocab_size);
    if (gio) {  // the greedy loop: the next token stays on the device
        float* logits = s.scratch.d<float>(V);
        head_forward(s, X, hrows, logits);
        argmax_into(logits, static_cast<int>(V), gio->next);
        s.mark("end");
        check(cudaGetLastError(), "step");
        for (const Segment& g : s.segs) g.seq->length += g.n;
        return;
    }
    float* dst = out.logits_out(hrows.size() * V);  // (not in a greedy loop: no host logits there)
    if (!hrows.empty()) {
        float* logits = s.scratch.d<float>(hrows.size() * V);
        head_forward(s, X, hrows, logits);
        s.mark("end");
        // into the caller's buffer (the numpy array handed back): directly when it is page-locked (the
        // bindings' pool), else through pinned staging (a pageable copy runs at a fraction of the speed)
        const size_t nb = hrows.size() * V * sizeof(float);
        if (out.logits_dst_pinned) {
            check(cudaMemcpyAsync(dst, logits, nb, cudaMemcpyDeviceToHost, 0), "logits");
            check(cudaStreamSynchronize(0), "logits");
        } else if (nb <= (size_t{16} << 20)) {  // decode-sized: pinned staging; a whole prefill's rows: directly
            void* h = s.scratch.pinned(nb);
            check(cudaMemcpyAsync(h, logits, nb, cudaMemcpyDeviceToHost, 0), "logits");
            check(cudaStreamSynchronize(0), "logits");
            std::memcpy(dst, h, nb);
        } else {
            check(cudaMemcpy(dst, logits, nb, cudaMemcpyDeviceToHost), "logits");
        }
    } else {
        s.mark("end");
    }
    check(cudaDeviceSynchronize(), "step");
    check(cudaGetLastError(), "step");
    E_.ep_check();
    for (const Segment& g : s.segs) g.seq->length += g.n;

    if (E_.timing && E_.marks.size() >= 2) {
        for (size_t i = 0; i + 1 < E_.marks.size(); ++i) {
            float ms = 0;
            check(cudaEventElapsedTime(&ms, E_.marks[i].second, E_.marks[i + 1].second), "elapsed");
            const std::string& n = E_.marks[i].first;
            if (!E_.stage_ms.count(n)) E_.stage_order.push_back(n);
            E_.stage_ms[n] += ms;
        }
    }
}

}  // namespace

// ---- numerics entry points --------------------------------------------------------------------------

namespace {

__global__ void k_expf(const float* x, float* y, int64_t n, bool native) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = native ? expf_native(x[i]) : expf_c(x[i]);
}

__global__ void k_expf_bits(uint64_t lo, int64_t n, float* y) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = expf_c(f32_from_bits(static_cast<uint32_t>(lo + static_cast<uint64_t>(i))));
}

__global__ void k_exp64(const double* x, double* y, int64_t n) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = exp64(x[i]);
}

GLM_DEV uint32_t bf16_bits_of(uint32_t u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
GLM_DEV int64_t ordered(uint32_t u) {
    return (u & 0x80000000u) ? -static_cast<int64_t>(u & 0x7FFFFFFFu) - 1 : static_cast<int64_t>(u);
}

// stats: [0] differ, [1] differ_bf16, [2] differ_nonpos, [3] nonpos inputs, [4] max ulps, [5] first
__global__ void k_census(int kind, uint64_t lo, uint64_t n, unsigned long long* stats) {
    pdl_enter();
    unsigned long long d = 0, db = 0, dn = 0, np = 0, mu = 0, first = ~0ull;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint32_t bits = static_cast<uint32_t>(lo + i);
        const float x = f32_from_bits(bits);
        const float ref = expf_c(x);
        const float got = kind == 1 ? expf_native(x) : (kind == 2 ? expf_intrinsic(x) : expf_c(x));
        const uint32_t a = f32_bits(ref), b = f32_bits(got);
        const bool nonpos = x <= 0.0f;
        np += nonpos ? 1 : 0;
        if (a != b) {
            ++d;
            if (bf16_bits_of(a) != bf16_bits_of(b)) ++db;
            if (nonpos) ++dn;
            if (!is_nan(ref) && !is_nan(got)) {
                const int64_t diff = ordered(a) - ordered(b);
                const unsigned long long ad = static_cast<unsigned long long>(diff < 0 ? -diff : diff);
                mu = ad > mu ? ad : mu;
            }
            first = static_cast<unsigned long long>(bits) < first ? static_cast<unsigned long long>(bits) : first;
        }
    }
    if (d) {
        atomicAdd(&stats[0], d);
        atomicAdd(&stats[1], db);
        atomicAdd(&stats[2], dn);
        atomicMax(&stats[4], mu);
        atomicMin(&stats[5], first);
    }
    if (np) atomicAdd(&stats[3], np);
}

__global__ void k_decode_tables(int which, float* out, bool hw) {
    pdl_enter();
    const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (which == 0 && i < 32) {  // e4m3: 256 codes through the eight-wide path
        uint32_t code[8];
        for (int l = 0; l < 8; ++l) code[l] = static_cast<uint32_t>(8 * i + l);
        const uint32_t lo = code[0] | (code[1] << 8) | (code[2] << 16) | (code[3] << 24);
        const uint32_t hi = code[4] | (code[5] << 8) | (code[6] << 16) | (code[7] << 24);
        float w[8];
        if (hw)
            e4m3x8<true>(lo, hi, w);
        else
            e4m3x8<false>(lo, hi, w);
        for (int l = 0; l < 8; ++l) out[8 * i + l] = w[l];
    } else if (which == 1 && i < 16) {
        out[i] = mxfp4_w(static_cast<uint32_t>(i), 1.0f);
    } else if (which == 2 && i < 256) {
        out[i] = e8m0(static_cast<uint32_t>(i));
    }
}

}  // namespace

void expf_device(const float* x, float* y, size_t n, bool native) {
    if (n == 0) return;
    DBuf dx(n * 4), dy(n * 4);
    check(cudaMemcpy(dx.p, x, n * 4, cudaMemcpyHostToDevice), "expf_device");
    auto k = k_expf;
    GLM_LAUNCH(k, static_cast<unsigned>((n + 255) / 256), 256, 0, dx.as<float>(), dy.as<float>(),
               static_cast<int64_t>(n), native);
    check_launch("expf_device");
    check(cudaMemcpy(y, dy.p, n * 4, cudaMemcpyDeviceToHost), "expf_device");
}

void expf_device_bits(uint64_t lo, size_t n, float* y) {
    if (n == 0) return;
    DBuf dy(n * 4);
    auto k = k_expf_bits;
    GLM_LAUNCH(k, static_cast<unsigned>((n + 255) / 256), 256, 0, lo, static_cast<int64_t>(n), dy.as<float>());
    check_launch("expf_device_bits");
    check(cudaMemcpy(y, dy.p, n * 4, cudaMemcpyDeviceToHost), "expf_device_bits");
}

void exp64_device(const double* x, double* y, size_t n) {
    if (n == 0) return;
    DBuf dx(n * 8), dy(n * 8);
    check(cudaMemcpy(dx.p, x, n * 8, cudaMemcpyHostToDevice), "exp64_device");
    auto k = k_exp64;
    GLM_LAUNCH(k, static_cast<unsigned>((n + 255) / 256), 256, 0, dx.as<double>(), dy.as<double>(),
               static_cast<int64_t>(n));
    check_launch("exp64_device");
    check(cudaMemcpy(y, dy.p, n * 8, cudaMemcpyDeviceToHost), "exp64_device");
}

CensusResult expf_census(const std::string& kind, uint64_t lo, uint64_t hi) {
    int k = -1;
    if (kind == "canonical") k = 0;
    else if (kind == "expf") k = 1;
    else if (kind == "__expf") k = 2;
    else throw std::invalid_argument("census kind must be 'expf', '__expf' or 'canonical', got '" + kind + "'");
    if (hi > (uint64_t{1} << 32) || lo > hi) throw std::invalid_argument("census range must satisfy lo <= hi <= 2^32");
    CensusResult r;
    r.inputs = hi - lo;
    if (hi == lo) return r;
    unsigned long long init[6] = {0, 0, 0, 0, 0, ~0ull};
    DBuf st(sizeof(init));
    check(cudaMemcpy(st.p, init, sizeof(init), cudaMemcpyHostToDevice), "census");
    const auto t0 = std::chrono::steady_clock::now();
#if defined(GLM_CUDA_EMU)
    const unsigned nblocks = 4;
#else
    const unsigned nblocks = 132 * 16;
#endif
    auto kern = k_census;
    GLM_LAUNCH(kern, nblocks, 256, 0, k, lo, hi - lo, st.as<unsigned long long>());
    check_launch("census");
    check(cudaDeviceSynchronize(), "census");
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    unsigned long long got[6];
    check(cudaMemcpy(got, st.p, sizeof(got), cudaMemcpyDeviceToHost), "census");
    r.differ = got[0];
    r.differ_bf16 = got[1];
    r.differ_nonpos = got[2];
    r.nonpos_inputs = got[3];
    r.max_ulps = got[4];
    r.first = got[5] == ~0ull ? -1 : static_cast<int64_t>(got[5]);
    return r;
}

std::vector<float> decode_table_device(const std::string& which) {
    int w;
    size_t n;
    bool hw = true;
    if (which == "e4m3") {
        w = 0;
        n = 256;
    } else if (which == "e4m3_sw") {
        w = 0;
        n = 256;
        hw = false;
    } else if (which == "e2m1") {
        w = 1;
        n = 16;
    } else if (which == "e8m0") {
        w = 2;
        n = 256;
    } else {
        throw std::invalid_argument("decode table must be 'e4m3', 'e4m3_sw', 'e2m1' or 'e8m0'");
    }
    DBuf d(n * 4);
    auto k = k_decode_tables;
    GLM_LAUNCH(k, 1, 256, 0, w, d.as<float>(), hw);
    check_launch("decode tables");
    std::vector<float> out(n);
    check(cudaMemcpy(out.data(), d.p, n * 4, cudaMemcpyDeviceToHost), "decode tables");
    return out;
}

}  // namespace glm::cuda
