// The CUDA engine's executor (the counterpart of bindings/cpu/model.cpp): the engine object, the stage
// emission (injection and capture), sequences (the device cache), and Engine::step, which enqueues
// embed -> L x [attn_hc -> attn_norm -> KDA | MLA -> attn_hc.streams, ffn_hc -> ffn_norm -> SwiGLU | MoE
// -> ffn_hc.streams] -> head for every row of a batch at once (docs/numerics.md; oracle/model.py's
// DecoderLayer.forward), then copies the logits (and any captured stage) back. Memory: memory.cu;
// weights registration: load.cu; the numerics entry points: numerics_api.cu.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>

#include "engine.cuh"

namespace glm::cuda {

// ---- stages ---------------------------------------------------------------------------------------

namespace {
size_t elem_bytes(SDType t) { return t == SDType::F64 ? 8 : 4; }

}  // namespace

// ---- options ----------------------------------------------------------------------------------------

namespace {
thread_local const EngineOptions* t_active_options = nullptr;
}  // namespace

const EngineOptions& launch_options() {
    static const EngineOptions defaults;
    return t_active_options ? *t_active_options : defaults;
}
ActiveOptions::ActiveOptions(const EngineOptions& o) : prev_(t_active_options) { t_active_options = &o; }
ActiveOptions::~ActiveOptions() { t_active_options = prev_; }

#if !defined(GLM_CUDA_EMU)
bool pdl_enabled() { return launch_options().pdl; }
#endif

// ---- config ---------------------------------------------------------------------------------------

// What the CUDA engine's kernels hold (mHC coefficients per block, KDA state columns in registers,
// expert tables, 32-bit positions).
const EngineLimits kCudaLimits{"CUDA", 16, int64_t{1} << 30, 256, 4096};


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

// ---- the engine -----------------------------------------------------------------------------------

namespace {

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

}  // namespace

Engine::Engine(const Config& cfg, bool seq_dot, bool native_exp, const EngineOptions& options)
    : p_(std::make_unique<Impl>()) {
    Impl& e = *p_;
    e.cfg = cfg;
    validate_config(e.cfg, kCudaLimits);
    if (options.expert_tile != 0 && options.expert_tile != 1 && options.expert_tile != 4 && options.expert_tile != 8 &&
        options.expert_tile != 16 && options.expert_tile != kLanesItem)
        throw std::invalid_argument("options: expert_tile must be 0 (the engine's rule), 1, 4, 8, 16 or 64, got " +
                                    std::to_string(options.expert_tile));
    if (options.lanes_items < 0 || options.lanes_items > kLanesItem)
        throw std::invalid_argument("options: lanes_items must be 0 (no lane-pass expert items) to 64, got " +
                                    std::to_string(options.lanes_items));
    if (options.lanes_tn != 0 && options.lanes_tn != 8 && options.lanes_tn != 16)
        throw std::invalid_argument("options: lanes_tn must be 0 (the engine's rule), 8 or 16 (tokens a thread of the "
                                    "lane-pass kernel), got " +
                                    std::to_string(options.lanes_tn));
    if (options.items16 < 0 || options.items16 > 16)
        throw std::invalid_argument("options: items16 must be 0 (no items of 16 beside items of 8) to 16, got " +
                                    std::to_string(options.items16));
    e.opts = options;
    const ActiveOptions active(e.opts);
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

const EngineOptions& Engine::options() const { return p_->opts; }

Engine::~Engine() {
    if (p_) {
        cudaDeviceSynchronize();
        for (cudaEvent_t ev : p_->event_pool) cudaEventDestroy(ev);
    }
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
Engine::HeadBoundStats Engine::head_bound_stats() const { return p_->head_bound.stats; }
void Engine::reset_head_bound_stats() { p_->head_bound.stats = HeadBoundStats{}; }
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
std::unique_ptr<Sequence> make_sequence(EngineCore& E_) {
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
            s->kda[l].conv_tail = E_.state_pool.take(nt);
            s->kda[l].S = E_.state_pool.take(ns);
            check(cudaMemsetAsync(s->kda[l].conv_tail.p, 0, nt), "memset");
            check(cudaMemsetAsync(s->kda[l].S.p, 0, ns), "memset");
        }
    return s;
}

// Every buffer of a sequence's state, in one order (each layer's KDA parts, then each layer's MLA parts):
// what sequence_bytes counts, a fork copies and free_sequence gives back to the pool.
std::vector<DBuf*> state_bufs(Sequence& q) {
    std::vector<DBuf*> v;
    for (KdaState& k : q.kda) v.insert(v.end(), {&k.conv_tail, &k.S});
    for (MlaState& m : q.mla) v.insert(v.end(), {&m.c, &m.k, &m.gate, &m.pk});
    return v;
}

void copy_buf(BufPool& pool, DBuf& dst, const DBuf& src) {
    dst = pool.take(src.n);
    if (src.n) check(cudaMemcpy(dst.p, src.p, src.n, cudaMemcpyDeviceToDevice), "copy");
}

// Make room for `need` positions in every MLA layer's cache of one sequence (doubling, contents kept;
// `exact`: no more than `need`).
void reserve(EngineCore& E_, Sequence& q, int64_t need, bool exact = false) {
    const Config& c = E_.cfg;
    const size_t r = static_cast<size_t>(c.kv_lora_rank), di = static_cast<size_t>(c.index_head_dim);
    const int64_t kp = c.index_kpool;
    for (size_t l = 0; l < E_.layers.size(); ++l) {
        if (E_.layers[l].kda) continue;
        MlaState& m = q.mla[l];
        if (m.cap >= need) continue;
        const int64_t cap = exact ? need : std::max<int64_t>({need, 2 * m.cap, 64});
        const size_t len = static_cast<size_t>(q.length);
        auto grow = [&](DBuf& b, size_t row, size_t rows_new, size_t rows_old) {
            DBuf nb = E_.state_pool.take(rows_new * row * sizeof(float));
            if (b.p && rows_old) check(cudaMemcpy(nb.p, b.p, rows_old * row * sizeof(float), cudaMemcpyDeviceToDevice), "grow");
            E_.state_pool.give(std::move(b));
            b = std::move(nb);
        };
        grow(m.c, r, static_cast<size_t>(cap), len);
        if (E_.layers[l].m.has_indexer) {
            grow(m.k, di, static_cast<size_t>(cap), len);
            grow(m.gate, di, static_cast<size_t>(cap), len);
            grow(m.pk, di, static_cast<size_t>(cap / kp), len / static_cast<size_t>(kp));
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
    for (size_t l = 0; l < a.mla.size(); ++l) b->mla[l].cap = a.mla[l].cap;
    const std::vector<DBuf*> from = state_bufs(*it->second), to = state_bufs(*b);
    for (size_t i = 0; i < from.size(); ++i) copy_buf(E_.state_pool, *to[i], *from[i]);
    const int64_t nid = E_.next_id++;
    E_.seqs[nid] = std::move(b);
    return nid;
}

void Engine::free_sequence(int64_t id) {
    auto it = p_->seqs.find(id);
    if (it == p_->seqs.end()) return;
    for (DBuf* b : state_bufs(*it->second)) p_->state_pool.give(std::move(*b));
    p_->seqs.erase(it);
}

size_t Engine::pooled_bytes() const { return p_->state_pool.bytes(); }

int64_t Engine::sequence_length(int64_t id) const {
    auto it = p_->seqs.find(id);
    if (it == p_->seqs.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    return it->second->length;
}

void Engine::reserve_sequence(int64_t id, int64_t positions) {
    auto it = p_->seqs.find(id);
    if (it == p_->seqs.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    if (positions < 0) throw std::invalid_argument("reserve: positions must be >= 0");
    reserve(*p_, *it->second, positions, true);
}

int64_t Engine::sequence_bytes(int64_t id) const {
    auto it = p_->seqs.find(id);
    if (it == p_->seqs.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    size_t n = 0;
    for (const DBuf* b : state_bufs(*it->second)) n += b->n;
    return static_cast<int64_t>(n);
}

namespace {
// The device buffer of one layout entry.
DBuf& state_buf(Sequence& q, const glm::StateSpec& sp) {
    const size_t l = static_cast<size_t>(sp.layer);
    switch (sp.part) {
        case glm::StatePart::ConvTail: return q.kda[l].conv_tail;
        case glm::StatePart::S: return q.kda[l].S;
        case glm::StatePart::C: return q.mla[l].c;
        case glm::StatePart::IndexK: return q.mla[l].k;
        case glm::StatePart::IndexGate: return q.mla[l].gate;
        default: return q.mla[l].pk;
    }
}
}  // namespace

std::vector<StateTensor> Engine::export_sequence(int64_t id, int64_t& length) const {
    auto it = p_->seqs.find(id);
    if (it == p_->seqs.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    Sequence& q = *it->second;
    length = q.length;
    std::vector<StateTensor> out;
    for (const glm::StateSpec& sp : glm::state_layout(p_->cfg, q.length)) {
        StateTensor t{sp.name, sp.shape, std::vector<float>(glm::numel(sp.shape))};
        const DBuf& b = state_buf(q, sp);
        const size_t nb = t.data.size() * sizeof(float);
        if (nb > b.n) throw std::logic_error("export: " + sp.name + " is larger than its device buffer");
        if (nb == 0) {
            out.push_back(std::move(t));
            continue;
        }
        if (sp.part == glm::StatePart::S) {
            std::vector<float> st(t.data.size());
            check(cudaMemcpy(st.data(), b.p, nb, cudaMemcpyDeviceToHost), "export");
            glm::transpose_heads(st.data(), t.data.data(), sp.shape[0], sp.shape[1]);
        } else {
            check(cudaMemcpy(t.data.data(), b.p, nb, cudaMemcpyDeviceToHost), "export");
        }
        out.push_back(std::move(t));
    }
    return out;
}

int64_t Engine::import_sequence(const std::vector<StateTensor>& arrays, int64_t length) {
    Impl& E_ = *p_;
    if (!E_.finalized) throw std::logic_error("the engine's weights are not finalized");
    const std::vector<const StateTensor*> given = glm::check_state(E_.cfg, arrays, length);
    std::unique_ptr<Sequence> q = make_sequence(E_);
    reserve(E_, *q, length);  // the capacity a step growing a new sequence to `length` would give it
    const std::vector<glm::StateSpec> layout = glm::state_layout(E_.cfg, length);
    for (size_t i = 0; i < layout.size(); ++i) {
        const glm::StateSpec& sp = layout[i];
        const std::vector<float>& v = given[i]->data;
        const size_t nb = v.size() * sizeof(float);
        if (nb == 0) continue;
        DBuf& b = state_buf(*q, sp);
        if (nb > b.n) throw std::logic_error("import: " + sp.name + " is larger than its device buffer");
        if (sp.part == glm::StatePart::S) {
            std::vector<float> st(v.size());
            glm::transpose_heads(v.data(), st.data(), sp.shape[0], sp.shape[1]);
            check(cudaMemcpy(b.p, st.data(), nb, cudaMemcpyHostToDevice), "import");
        } else {
            check(cudaMemcpy(b.p, v.data(), nb, cudaMemcpyHostToDevice), "import");
        }
    }
    q->length = length;
    const int64_t id = E_.next_id++;
    E_.seqs[id] = std::move(q);
    return id;
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
    const ActiveOptions active(p_->opts);
    step_on(*p_, seq_ids, tokens, want_head, cap_rows, cap_mask, inj, out, nullptr);
    p_->ep.stats.step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<int32_t> Engine::greedy(int64_t seq_id, int32_t first, int n) {
    Impl& E_ = *p_;
    if (!E_.finalized) throw std::logic_error("the engine's weights are not finalized");
    const ActiveOptions active(E_.opts);
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
    for (uint8_t w : want_head)
        if (w > 3) throw std::invalid_argument("want_head must be 0, 1, 2 or 3");
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

    // head, for the rows that want logits (want_head 1), only their greedy token (2: the argmax on the
    // device, the logits not copied) or the token and its log-probability (3: both on the device)
    std::vector<int> hrows, trows, lp_slot;  // lp_slot: per token row, its place among the want_head 3 rows or -1
    int n_lp = 0;
    for (size_t t = 0; t < T; ++t) {
        if (want_head[t] == 1) hrows.push_back(static_cast<int>(t));
        else if (want_head[t] == 2 || want_head[t] == 3) {
            trows.push_back(static_cast<int>(t));
            lp_slot.push_back(want_head[t] == 3 ? n_lp++ : -1);
        }
    }
    out.head_rows.assign(hrows.begin(), hrows.end());
    out.token_rows.assign(trows.begin(), trows.end());
    const size_t V = static_cast<size_t>(c.vocab_size);
    if (gio) {  // the greedy loop: the next token stays on the device
        float* logits = s.scratch.d<float>(V);
        head_forward(s, X, hrows, logits);
        argmax_into(s, logits, static_cast<int>(V), gio->next, 1);
        s.mark("end");
        check(cudaGetLastError(), "step");
        for (const Segment& g : s.segs) g.seq->length += g.n;
        return;
    }
    float* dst = out.logits_out(hrows.size() * V);  // (not in a greedy loop: no host logits there)
    int* d_next = nullptr;
    float* d_lp = nullptr;
    if (hrows.empty() && !trows.empty() && n_lp == 0 && head_bound_applies(s, static_cast<int>(trows.size()))) {
        // only greedy tokens: from bounds on the logits (head_bound.cu); where they cannot decide, the full head
        // (d_next: the tokens, the flag, each row's candidate count)
        const size_t n = trows.size();
        d_next = s.scratch.d<int>(2 * n + 1);
        const float* normed = head_normed(s, X, trows);
        head_argmax_bounded(s, normed, static_cast<int>(n), d_next);
        s.mark("end");
        out.tokens.resize(2 * n + 1);
        check(cudaMemcpy(out.tokens.data(), d_next, (2 * n + 1) * sizeof(int), cudaMemcpyDeviceToHost), "tokens");
        Engine::HeadBoundStats& st = E_.head_bound.stats;
        st.rows += static_cast<int64_t>(n);
        for (size_t i = 0; i < n; ++i) {
            const int64_t k = out.tokens[n + 1 + i];
            st.candidates += k;
            st.max_candidates = std::max(st.max_candidates, k);
        }
        if (out.tokens[n] != 0) {
            ++st.full_steps;
            float* logits = s.scratch.d<float>(n * V);
            head_logits(s, normed, trows, logits);
            argmax_into(s, logits, static_cast<int>(V), d_next, static_cast<int>(n));
            check(cudaMemcpy(out.tokens.data(), d_next, n * sizeof(int), cudaMemcpyDeviceToHost), "tokens");
        }
        out.tokens.resize(n);
    } else if (!hrows.empty() || !trows.empty()) {
        std::vector<int> rows(hrows);  // the logits rows first: they are the block copied to the host
        rows.insert(rows.end(), trows.begin(), trows.end());
        float* logits = s.scratch.d<float>(rows.size() * V);
        head_forward(s, X, rows, logits);
        if (!trows.empty()) {
            d_next = s.scratch.d<int>(trows.size());
            if (n_lp == 0) {
                argmax_into(s, logits + hrows.size() * V, static_cast<int>(V), d_next, static_cast<int>(trows.size()));
            } else {
                d_lp = s.scratch.d<float>(static_cast<size_t>(n_lp));
                argmax_logprob_into(logits + hrows.size() * V, static_cast<int>(V), d_next, d_lp,
                                    s.scratch.up(lp_slot), static_cast<int>(trows.size()));
            }
        }
        s.mark("end");
        // into the caller's buffer (the numpy array handed back): directly when it is page-locked (the
        // bindings' pool), else through pinned staging (a pageable copy runs at a fraction of the speed)
        const size_t nb = hrows.size() * V * sizeof(float);
        if (nb == 0) {
        } else if (out.logits_dst_pinned) {
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
        if (d_next) {
            out.tokens.resize(trows.size());
            check(cudaMemcpy(out.tokens.data(), d_next, trows.size() * sizeof(int), cudaMemcpyDeviceToHost), "tokens");
        }
        if (d_lp) {
            out.logprobs.resize(static_cast<size_t>(n_lp));
            check(cudaMemcpy(out.logprobs.data(), d_lp, static_cast<size_t>(n_lp) * sizeof(float),
                             cudaMemcpyDeviceToHost), "logprobs");
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

}  // namespace glm::cuda
