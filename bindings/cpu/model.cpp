// The model executor: weights registration, sequences (the cache), and Engine::step, which runs
// embed -> L x [attn_hc -> attn_norm -> KDA | MLA -> attn_hc.streams, ffn_hc -> ffn_norm -> SwiGLU | MoE
// -> ffn_hc.streams] -> head for every row of a batch at once (docs/numerics.md).
#include <immintrin.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <set>
#include <sstream>

#include "engine.hpp"
#include "../inject_step.hpp"
#include "../numerics_dev.hpp"
#include "../tensor_roles.hpp"
#include "formats.hpp"
#include "greedy.hpp"
#include "matvec.hpp"
#include "smalldot.hpp"

namespace glm::cpu {


// ---- numerics switches --------------------------------------------------------------------------

namespace {
const double kOnes64[64] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
}

float Numerics::dot(const float* a, const float* b, size_t n) const {
    if (!seq_dot) return n <= 8 ? cdot_small(a, b, n) : cdot(a, b, n);
    float s = 0.0f;
    for (size_t i = 0; i < n; ++i) s = s + a[i] * b[i];
    return s;
}

double Numerics::dot64(const double* a, const double* b, size_t n) const {
    if (!seq_dot) return n <= 8 ? cdot64_small(a, b, n) : cdot64(a, b, n);
    double s = 0.0;
    for (size_t i = 0; i < n; ++i) s = s + a[i] * b[i];
    return s;
}

float Numerics::sum(const float* x, size_t n) const {
    if (!seq_dot) return n <= 8 ? csum_small(x, n) : csum(x, n);
    float s = 0.0f;
    for (size_t i = 0; i < n; ++i) s = s + x[i];
    return s;
}

double Numerics::sum64(const double* x, size_t n) const {
    if (!seq_dot && n <= 8) return csum64_small(x, n);
    if (n <= 64) return dot64(x, kOnes64, n);
    std::vector<double> ones(n, 1.0);
    return dot64(x, ones.data(), n);
}

// expf="native": the classic Cephes-style single-precision exp (bindings/numerics_dev.hpp), what a
// fast vectorized libm would do; differs from the canonical expf on a good fraction of inputs, by design.
float Numerics::fast_expf(float x) { return num::expf_cephes(x); }

// ---- config -------------------------------------------------------------------------------------

// What the CPU engine's kernels hold (mHC coefficients in fixed arrays, the top-k in one pass).
const EngineLimits kCpuLimits{"CPU", 63};

// ---- the step context ---------------------------------------------------------------------------

Step::Step(const Engine& e, ThreadPool& p, const Numerics& n) : E(e), c(e.config()), pool(p), nm(n) {}

void Step::inject_f32(int layer, int stage, size_t t, float* p, size_t off, size_t n) {
    const int64_t e = inject_element(layer, stage, t);
    if (e < 0 || static_cast<size_t>(e) < off || static_cast<size_t>(e) >= off + n) return;
    float* v = p + (static_cast<size_t>(e) - off);
    *v = f32_from_bits(kStages[stage].dtype == SDType::BF16 ? inject_step_bf16(f32_bits(*v), inj.ulps)
                                                             : inject_step_f32(f32_bits(*v), inj.ulps));
    std::lock_guard<std::mutex> lk(cap_mutex);
    out->injected += 1;
}

void Step::inject_f64(int layer, int stage, size_t t, double* p, size_t off, size_t n) {
    const int64_t e = inject_element(layer, stage, t);
    if (e < 0 || static_cast<size_t>(e) < off || static_cast<size_t>(e) >= off + n) return;
    double* v = p + (static_cast<size_t>(e) - off);
    uint64_t u;
    std::memcpy(&u, v, 8);
    u = inject_step_f64(u, inj.ulps);
    std::memcpy(v, &u, 8);
    std::lock_guard<std::mutex> lk(cap_mutex);
    out->injected += 1;
}

void Step::capture(int layer, int stage, size_t t, const void* p, size_t elem_bytes, std::vector<int64_t> shape) {
    if (!wants_row(layer, stage, t)) return;
    CaptureRecord rec;
    rec.layer = layer;
    rec.stage = stage;
    rec.row = static_cast<int64_t>(t);
    const size_t nb = numel(shape) * elem_bytes;
    rec.shape = std::move(shape);
    rec.bytes.resize(nb);
    if (nb) std::memcpy(rec.bytes.data(), p, nb);
    std::lock_guard<std::mutex> lk(cap_mutex);
    out->captures.push_back(std::move(rec));
}

void Step::emit(int layer, int stage, size_t t, float* p, std::vector<int64_t> shape) {
    const size_t n = numel(shape);
    inject_f32(layer, stage, t, p, 0, n);
    capture(layer, stage, t, p, 4, std::move(shape));
}

void Step::emit64(int layer, int stage, size_t t, double* p, std::vector<int64_t> shape) {
    const size_t n = numel(shape);
    inject_f64(layer, stage, t, p, 0, n);
    capture(layer, stage, t, p, 8, std::move(shape));
}

void Step::emit_i32(int layer, int stage, size_t t, int32_t* p, std::vector<int64_t> shape) {
    const int64_t e = inject_element(layer, stage, t);
    if (e >= 0 && static_cast<size_t>(e) < numel(shape)) {
        p[e] = inject_step_i32(p[e], inj.ulps);
        std::lock_guard<std::mutex> lk(cap_mutex);
        out->injected += 1;
    }
    capture(layer, stage, t, p, 4, std::move(shape));
}

void Step::emit_rows(int layer, int stage, float* p, size_t n, size_t ld, std::vector<int64_t> shape) {
    (void)n;
    for (size_t t = 0; t < T; ++t) emit(layer, stage, t, p + t * ld, shape);
}

void Step::linear(const Lin& W, const float* X, size_t ldx, float* Y, size_t ldy, bool round, size_t rows) const {
    const size_t R = W.R, C = W.C;
    if (rows == 0 || R == 0) return;
    if (!nm.seq_dot) {
        // every token count: the weights decoded in registers, each group once for up to six tokens
        // (Lin::matmul), rows split over the pool
        pool.parallel_for(R, C * rows, [&](size_t a, size_t b) { W.matmul(a, b, X, ldx, rows, Y + a, ldy, round); });
        return;
    }
    // several tokens: decode each weight row once, then one cdot per token
    pool.parallel_for(R, C * (rows + 1), [&](size_t a, size_t b) {
        thread_local std::vector<float> buf;
        if (buf.size() < C) buf.resize(C);
        for (size_t r = a; r < b; ++r) {
            const float* wr;
            if (W.fmt == WFmt::F32) {
                wr = static_cast<const float*>(W.data) + (W.row0 + r) * C;
            } else {
                W.decode_row(r, buf.data());
                wr = buf.data();
            }
            for (size_t t = 0; t < rows; ++t) {
                const float v = nm.dot(wr, X + t * ldx, C);
                Y[t * ldy + r] = round ? bf16_round(v) : v;
            }
        }
    });
}

// ---- the engine ---------------------------------------------------------------------------------

Engine::Engine(const EngineConfig& cfg, unsigned threads, Numerics nm, size_t inline_work) : cfg_(cfg), nm_(nm) {
    validate_config(cfg_, kCpuLimits);
    lin_kernels();  // (the linear kernels' build chosen here, so that a refused GLM_CPU_KERNELS stops construction)
    pool_ = std::make_unique<ThreadPool>(threads, inline_work);
    layers.resize(static_cast<size_t>(cfg_.num_hidden_layers));
    for (size_t l = 0; l < layers.size(); ++l) {
        layers[l].kda = cfg_.is_kda[l] != 0;
        layers[l].m.has_indexer = !layers[l].kda && cfg_.has_indexer[l] != 0;
        layers[l].f.moe = cfg_.is_moe[l] != 0;
        if (layers[l].f.moe) {
            const size_t E = static_cast<size_t>(cfg_.n_routed_experts);
            layers[l].f.e_gate.resize(E);
            layers[l].f.e_up.resize(E);
            layers[l].f.e_down.resize(E);
        }
    }
}

namespace {

std::vector<float> to_f32(const std::string& what, const std::string& release, const void* data, size_t n) {
    std::vector<float> out(n);
    if (release == "bf16") {
        const uint16_t* p = static_cast<const uint16_t*>(data);
        for (size_t i = 0; i < n; ++i) out[i] = f32_from_bf16(p[i]);
    } else if (release == "f32") {
        std::memcpy(out.data(), data, n * sizeof(float));
    } else {
        throw std::invalid_argument(what + ": expected a bf16 or f32 tensor, given release '" + release + "'");
    }
    return out;
}

}  // namespace

void Engine::add_tensor(const std::string& role, int layer, int expert, const std::string& release,
                        const void* data, const void* scale, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& data_shape, const std::vector<int64_t>& scale_shape) {
    if (finalized_) throw std::logic_error("add_tensor after finalize");
    const EngineConfig& c = cfg_;
    const int64_t L = c.num_hidden_layers;
    std::string what = role + (layer >= 0 ? " (layer " + std::to_string(layer) + ")" : "") +
                       (expert >= 0 ? " (expert " + std::to_string(expert) + ")" : "");
    auto bad = [&](const std::string& why) { throw std::invalid_argument(what + ": " + why); };
    if (data == nullptr) bad("no data");
    if (layer >= L) bad("layer out of range");
    for (int64_t d : shape)
        if (d < 0) bad("negative dimension");
    const size_t n = numel(shape);

    // the stored arrays must match the logical shape in their release format (check_stored_lin)
    auto make_lin = [&](size_t rows, size_t cols) -> Lin {
        check_stored_lin(shape, rows, cols, release, data_shape, scale != nullptr, scale_shape, bad);
        Lin w;
        w.R = rows;
        w.C = cols;
        w.data = data;
        w.scale = scale;
        if (release == "bf16") {
            w.fmt = WFmt::BF16;
        } else if (release == "f32") {
            w.fmt = WFmt::F32;
        } else if (release == "fp8") {
            w.fmt = WFmt::FP8;
            w.fp8_nan_free = !has_e4m3_nan(static_cast<const uint8_t*>(data), rows * cols);
        } else {
            w.fmt = WFmt::MXFP4;
        }
        return w;
    };
    auto small = [&](size_t want) -> std::vector<float> {
        if (n != want) bad("has " + std::to_string(n) + " values, expected " + std::to_string(want));
        if (numel(data_shape) != want) bad("stored array has " + std::to_string(numel(data_shape)) + " values");
        return to_f32(what, release, data, want);
    };
    const std::string key = role + "#" + std::to_string(layer) + "#" + std::to_string(expert);
    if (have_.count(key)) bad("registered twice");

    // where the role goes and its shape: bindings/tensor_roles.hpp, shared with the CUDA engine
    using Bad = decltype(bad);
    using MakeLin = decltype(make_lin);
    using Small = decltype(small);
    struct Ops {
        Engine& e;
        int layer_index;
        const Bad& bad_;
        const MakeLin& make_lin_;
        const Small& small_;
        void bad(const std::string& why) const { bad_(why); }
        LayerWeights& layer() const {
            if (layer_index < 0) bad_("needs a layer index");
            return e.layers[static_cast<size_t>(layer_index)];
        }
        Engine& top() const { return e; }
        Lin lin(size_t rows, size_t cols) const { return make_lin_(rows, cols); }
        std::vector<float> vec(size_t n) const { return small_(n); }
        std::vector<float> host(size_t n) const { return small_(n); }
        std::vector<double> f64(size_t n) const {
            const std::vector<float> f = small_(n);
            return std::vector<double>(f.begin(), f.end());
        }
        void conv(KdaWeights& k, size_t which, size_t n) const {
            const std::vector<float> f = small_(n);
            if (k.conv.empty()) k.conv.assign(3 * n, 0.0f);
            std::copy(f.begin(), f.end(), k.conv.begin() + static_cast<std::ptrdiff_t>(which * n));
        }
        void check_expert(int x) const {
            if (!e.ep.part.owns(x))  // expert parallelism: another rank's expert
                bad_("is not in this rank's expert range (rank " + std::to_string(e.ep.part.rank) + ")");
        }
    } ops{*this, layer, bad, make_lin, small};
    glm::assign_role(role, expert, c, ops);
    have_[key] = 1;
}

void Engine::finalize() {
    const EngineConfig& c = cfg_;
    std::vector<std::string> missing;
    auto need = [&](bool ok, const std::string& role, int layer, int expert = -1) {
        if (!ok)
            missing.push_back(role + (layer >= 0 ? " (layer " + std::to_string(layer) + ")" : "") +
                              (expert >= 0 ? " (expert " + std::to_string(expert) + ")" : ""));
    };
    need(!embed.empty(), "embed", -1);
    need(!final_norm.empty(), "final_norm", -1);
    if (lm_head.empty() && c.tie_word_embeddings) lm_head = embed;
    need(!lm_head.empty(), "lm_head", -1);
    for (size_t li = 0; li < layers.size(); ++li) {
        const int l = static_cast<int>(li);
        LayerWeights& w = layers[li];
        need(!w.attn_norm.empty(), "attn_norm", l);
        need(!w.ffn_norm.empty(), "ffn_norm", l);
        need(!w.attn_hc.fn.empty(), "attn_hc.fn", l);
        need(!w.attn_hc.base.empty(), "attn_hc.base", l);
        need(!w.ffn_hc.fn.empty(), "ffn_hc.fn", l);
        need(!w.ffn_hc.base.empty(), "ffn_hc.base", l);
        if (w.kda) {
            KdaWeights& k = w.k;
            for (auto [lin, name] : {std::pair<Lin*, const char*>{&k.q_proj, "kda.q_proj"}, {&k.k_proj, "kda.k_proj"},
                                     {&k.v_proj, "kda.v_proj"}, {&k.f_a, "kda.f_a_proj"}, {&k.f_b, "kda.f_b_proj"},
                                     {&k.b_proj, "kda.b_proj"}, {&k.g_a, "kda.g_a_proj"}, {&k.g_b, "kda.g_b_proj"},
                                     {&k.o_proj, "kda.o_proj"}})
                need(!lin->empty(), name, l);
            need(!k.conv.empty(), "kda.q_conv/k_conv/v_conv", l);
            need(!k.dt_bias.empty(), "kda.dt_bias", l);
            need(!k.A_log.empty(), "kda.A_log", l);
            need(!k.o_norm.empty(), "kda.o_norm", l);
            if (!k.conv.empty()) {
                const size_t C3 = 3 * static_cast<size_t>(c.kda_dim()), K = static_cast<size_t>(c.linear_conv_kernel_dim);
                k.conv_t.assign(K * C3, 0.0f);
                for (size_t ch = 0; ch < C3; ++ch)
                    for (size_t j = 0; j < K; ++j) k.conv_t[j * C3 + ch] = k.conv[ch * K + j];
            }
            k.decay_rate.resize(k.A_log.size());
            for (size_t h = 0; h < k.A_log.size(); ++h) k.decay_rate[h] = nm_.exp(k.A_log[h]);
        } else {
            MlaWeights& m = w.m;
            for (auto [lin, name] : {std::pair<Lin*, const char*>{&m.q_a, "mla.q_a_proj"}, {&m.q_b, "mla.q_b_proj"},
                                     {&m.kv_a, "mla.kv_a_proj"}, {&m.kv_b, "mla.kv_b_proj"}, {&m.o_proj, "mla.o_proj"}})
                need(!lin->empty(), name, l);
            need(!m.q_a_norm.empty(), "mla.q_a_norm", l);
            need(!m.kv_a_norm.empty(), "mla.kv_a_norm", l);
            if (m.has_indexer) {
                for (auto [lin, name] : {std::pair<Lin*, const char*>{&m.wq_b, "indexer.wq_b"}, {&m.wk, "indexer.wk"},
                                         {&m.weights_proj, "indexer.weights_proj"},
                                         {&m.kpool_gate, "indexer.kpool_gate"}})
                    need(!lin->empty(), name, l);
                need(!m.k_norm_w.empty(), "indexer.k_norm", l);
                need(!m.k_norm_b.empty(), "indexer.k_norm_bias", l);
                need(!m.ape.empty(), "indexer.kpool_ape", l);
            }
            if (!m.kv_b.empty()) {
                // W_UK_h transposed: w_uk_t[h][k][i] = kv_b[h(d_n+d_v) + i][k], decoded exactly
                const size_t nh = static_cast<size_t>(c.num_attention_heads), dn = static_cast<size_t>(c.qk_nope_head_dim);
                const size_t dv = static_cast<size_t>(c.v_head_dim), r = static_cast<size_t>(c.kv_lora_rank);
                m.w_uk_t.assign(nh * r * dn, 0.0f);
                std::vector<float> row(r);
                for (size_t h = 0; h < nh; ++h)
                    for (size_t i = 0; i < dn; ++i) {
                        m.kv_b.decode_row(h * (dn + dv) + i, row.data());
                        for (size_t k = 0; k < r; ++k) m.w_uk_t[(h * r + k) * dn + i] = row[k];
                    }
            }
        }
        FfnWeights& f = w.f;
        if (f.moe) {
            need(!f.router.empty(), "moe.gate", l);
            need(!f.bias.empty(), "moe.gate_bias", l);
            need(!f.s_gate.empty(), "moe.shared.gate_proj", l);
            need(!f.s_up.empty(), "moe.shared.up_proj", l);
            need(!f.s_down.empty(), "moe.shared.down_proj", l);
            for (size_t e = 0; e < f.e_gate.size(); ++e) {
                if (!ep.part.owns(static_cast<int64_t>(e))) continue;  // another rank's (expert parallelism)
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
    finalized_ = true;
}

size_t Engine::weight_bytes() const {
    // bytes one decode token reads: every weight of the layers it runs (k routed experts per MoE
    // layer), in the form the engine reads them (release format; mHC fn as double, W_UK as f32)
    const size_t hc_bytes = 8 * static_cast<size_t>(cfg_.hc_dim() * cfg_.hc_mult * cfg_.hidden_size);
    size_t b = embed.C * (embed.fmt == WFmt::F32 ? 4 : 2) + lm_head.bytes();
    for (const LayerWeights& w : layers) {
        b += 2 * hc_bytes;
        if (w.kda) {
            for (const Lin* l : {&w.k.q_proj, &w.k.k_proj, &w.k.v_proj, &w.k.f_a, &w.k.f_b, &w.k.b_proj, &w.k.g_a,
                                 &w.k.g_b, &w.k.o_proj})
                b += l->bytes();
        } else {
            for (const Lin* l : {&w.m.q_a, &w.m.q_b, &w.m.kv_a, &w.m.o_proj, &w.m.wq_b, &w.m.wk,
                                 &w.m.weights_proj, &w.m.kpool_gate})
                b += l->bytes();
            const size_t nh = static_cast<size_t>(cfg_.num_attention_heads), dn = static_cast<size_t>(cfg_.qk_nope_head_dim);
            const size_t dv = static_cast<size_t>(cfg_.v_head_dim);
            b += w.m.w_uk_t.size() * 4;  // W_UK (decoded, transposed)
            for (size_t h = 0; h < nh && !w.m.kv_b.empty(); ++h) b += w.m.kv_b.rows(h * (dn + dv) + dn, dv).bytes();
        }
        if (w.f.moe) {
            b += w.f.router.bytes() + w.f.s_gate.bytes() + w.f.s_up.bytes() + w.f.s_down.bytes();
            const size_t k = static_cast<size_t>(cfg_.num_experts_per_tok);
            for (size_t e = 0; e < w.f.e_gate.size(); ++e)  // one loaded expert's size (this rank's, with EP)
                if (!w.f.e_gate[e].empty()) {
                    b += k * (w.f.e_gate[e].bytes() + w.f.e_up[e].bytes() + w.f.e_down[e].bytes());
                    break;
                }
        } else {
            b += w.f.gate.bytes() + w.f.up.bytes() + w.f.down.bytes();
        }
    }
    return b;
}

void Engine::set_expert_partition(const ExpertPartition& p) {
    if (!have_.empty() || finalized_) throw std::logic_error("set the expert partition before registering tensors");
    p.validate(cfg_.n_routed_experts);
    ep.part = p;
}

// ---- sequences ----------------------------------------------------------------------------------

Sequence Engine::make_sequence() const {
    const EngineConfig& c = cfg_;
    Sequence s;
    const size_t L = layers.size();
    s.kda.resize(L);
    s.mla.resize(L);
    const size_t P = static_cast<size_t>(c.kda_dim()), d = static_cast<size_t>(c.linear_head_dim);
    const size_t K = static_cast<size_t>(c.linear_conv_kernel_dim);
    for (size_t l = 0; l < L; ++l)
        if (layers[l].kda) {
            s.kda[l].conv_tail.assign((K - 1) * 3 * P, 0.0f);
            s.kda[l].S.assign(static_cast<size_t>(c.linear_num_heads) * d * d, 0.0f);
        }
    return s;
}

int64_t Engine::new_sequence() {
    std::lock_guard<std::mutex> lk(mu_);
    if (!finalized_) throw std::logic_error("the engine's weights are not finalized");
    const int64_t id = next_id_++;
    seqs_[id] = std::make_unique<Sequence>(make_sequence());
    return id;
}

int64_t Engine::fork_sequence(int64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(id);
    if (it == seqs_.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    const int64_t nid = next_id_++;
    seqs_[nid] = std::make_unique<Sequence>(*it->second);
    return nid;
}

void Engine::free_sequence(int64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    seqs_.erase(id);
}

int64_t Engine::sequence_length(int64_t id) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(id);
    if (it == seqs_.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    return it->second->length;
}

void Engine::reserve_sequence(int64_t id, int64_t positions) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(id);
    if (it == seqs_.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    if (positions < 0) throw std::invalid_argument("reserve: positions must be >= 0");
    const size_t n = static_cast<size_t>(positions), r = static_cast<size_t>(cfg_.kv_lora_rank);
    const size_t di = static_cast<size_t>(cfg_.index_head_dim), kp = static_cast<size_t>(cfg_.index_kpool);
    Sequence& q = *it->second;
    for (size_t l = 0; l < layers.size(); ++l) {
        if (layers[l].kda) continue;
        q.mla[l].c.reserve(n * r);
        if (layers[l].m.has_indexer) {
            q.mla[l].k.reserve(n * di);
            q.mla[l].gate.reserve(n * di);
            q.mla[l].pool_keys.reserve(n / kp * di);
        }
    }
}

int64_t Engine::sequence_bytes(int64_t id) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(id);
    if (it == seqs_.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    const Sequence& q = *it->second;
    size_t n = 0;
    for (const KdaState& k : q.kda) n += k.conv_tail.capacity() + k.S.capacity();
    for (const MlaState& m : q.mla) n += m.c.capacity() + m.k.capacity() + m.gate.capacity() + m.pool_keys.capacity();
    return static_cast<int64_t>(n * sizeof(float));
}

std::vector<StateTensor> Engine::export_sequence(int64_t id, int64_t& length) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(id);
    if (it == seqs_.end()) throw std::invalid_argument("unknown sequence " + std::to_string(id));
    const Sequence& q = *it->second;
    if (q.broken)
        throw std::invalid_argument("sequence " + std::to_string(id) + " is unusable: an earlier step failed half-way through it");
    length = q.length;
    std::vector<StateTensor> out;
    for (const glm::StateSpec& sp : glm::state_layout(cfg_, q.length)) {
        const size_t l = static_cast<size_t>(sp.layer);
        StateTensor t{sp.name, sp.shape, {}};
        const std::vector<float>* src = nullptr;
        switch (sp.part) {
            case glm::StatePart::ConvTail: src = &q.kda[l].conv_tail; break;
            case glm::StatePart::S: src = &q.kda[l].S; break;
            case glm::StatePart::C: src = &q.mla[l].c; break;
            case glm::StatePart::IndexK: src = &q.mla[l].k; break;
            case glm::StatePart::IndexGate: src = &q.mla[l].gate; break;
            case glm::StatePart::PoolKeys: src = &q.mla[l].pool_keys; break;
        }
        if (src->size() != glm::numel(sp.shape))
            throw std::logic_error("export: " + sp.name + " holds " + std::to_string(src->size()) + " values, expected " +
                                   std::to_string(glm::numel(sp.shape)));
        if (sp.part == glm::StatePart::S) {
            t.data.resize(src->size());
            glm::transpose_heads(src->data(), t.data.data(), sp.shape[0], sp.shape[1]);
        } else {
            t.data = *src;
        }
        out.push_back(std::move(t));
    }
    return out;
}

int64_t Engine::import_sequence(const std::vector<StateTensor>& arrays, int64_t length) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!finalized_) throw std::logic_error("the engine's weights are not finalized");
    const std::vector<const StateTensor*> given = glm::check_state(cfg_, arrays, length);
    auto q = std::make_unique<Sequence>(make_sequence());
    const std::vector<glm::StateSpec> layout = glm::state_layout(cfg_, length);
    for (size_t i = 0; i < layout.size(); ++i) {
        const glm::StateSpec& sp = layout[i];
        const size_t l = static_cast<size_t>(sp.layer);
        const std::vector<float>& v = given[i]->data;
        switch (sp.part) {
            case glm::StatePart::ConvTail: q->kda[l].conv_tail = v; break;
            case glm::StatePart::S: glm::transpose_heads(v.data(), q->kda[l].S.data(), sp.shape[0], sp.shape[1]); break;
            case glm::StatePart::C: q->mla[l].c = v; break;
            case glm::StatePart::IndexK: q->mla[l].k = v; break;
            case glm::StatePart::IndexGate: q->mla[l].gate = v; break;
            case glm::StatePart::PoolKeys: q->mla[l].pool_keys = v; break;
        }
    }
    q->length = length;
    const int64_t id = next_id_++;
    seqs_[id] = std::move(q);
    return id;
}

// ---- the step -----------------------------------------------------------------------------------

void Engine::check_hw() const {
    std::atomic<int> bad{0};
    pool_->run_all([&](unsigned) {
        if (_mm_getcsr() & 0x8040u) bad.fetch_add(1);
    });
    if (bad.load())
        throw std::runtime_error(
            "MXCSR has flush-to-zero or denormals-are-zero set (a library loaded in the process set it); "
            "exact results are impossible, refusing to run");
}

void Engine::step(const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens,
                  const std::vector<uint8_t>& want_head, const std::vector<uint8_t>& cap_rows,
                  const std::vector<uint8_t>& cap_mask, const Injection& inj, StepOutput& out) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!finalized_) throw std::logic_error("the engine's weights are not finalized");
    const EngineConfig& c = cfg_;
    const size_t T = seq_ids.size();
    const int L = static_cast<int>(c.num_hidden_layers);
    if (T == 0) throw std::invalid_argument("a step needs at least one row");
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

    Step s(*this, *pool_, nm_);
    s.T = T;
    s.out = &out;
    s.inj = inj;
    s.cap_row = cap_rows;
    s.cap_mask = cap_mask;
    s.pos.resize(T);
    s.seg_of.resize(T);
    std::set<int64_t> seen;
    for (size_t t = 0; t < T;) {
        auto it = seqs_.find(seq_ids[t]);
        if (it == seqs_.end()) throw std::invalid_argument("unknown sequence " + std::to_string(seq_ids[t]));
        if (!seen.insert(seq_ids[t]).second)
            throw std::invalid_argument("the rows of sequence " + std::to_string(seq_ids[t]) + " are not consecutive");
        size_t n = 1;
        while (t + n < T && seq_ids[t + n] == seq_ids[t]) ++n;
        Sequence* sq = it->second.get();
        if (sq->broken)
            throw std::invalid_argument("sequence " + std::to_string(seq_ids[t]) +
                                        " is unusable: an earlier step failed half-way through it");
        if (sq->length + static_cast<int64_t>(n) > c.max_context)
            throw std::invalid_argument("sequence " + std::to_string(seq_ids[t]) + ": " +
                                        std::to_string(sq->length + static_cast<int64_t>(n)) +
                                        " positions exceed the maximum context of " + std::to_string(c.max_context));
        for (size_t i = 0; i < n; ++i) {
            s.pos[t + i] = sq->length + static_cast<int64_t>(i);
            s.seg_of[t + i] = static_cast<uint32_t>(s.segs.size());
        }
        s.segs.push_back(Segment{sq, t, n, sq->length});
        t += n;
    }
    check_hw();
    const auto t0 = std::chrono::steady_clock::now();
    try {
        run_step(s, tokens, want_head, out);
    } catch (...) {
        for (const Segment& g : s.segs) g.seq->broken = true;  // its caches may hold part of this step
        throw;
    }
    ep.stats.step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const Segment& g : s.segs) g.seq->length += static_cast<int64_t>(g.n);
}

void Engine::run_step(Step& s, const std::vector<int32_t>& tokens, const std::vector<uint8_t>& want_head,
                      StepOutput& out) const {
    const EngineConfig& c = cfg_;
    const size_t T = s.T;
    const int L = static_cast<int>(c.num_hidden_layers);
    const size_t hc = static_cast<size_t>(c.hc_mult), D = static_cast<size_t>(c.hidden_size);
    // embed, then hc copies as the streams
    std::vector<float> X(T * hc * D), e(T * D);
    for (size_t t = 0; t < T; ++t) {
        embed.decode_row(static_cast<size_t>(tokens[t]), e.data() + t * D);
        s.emit(0, S_EMBED, t, e.data() + t * D, {static_cast<int64_t>(D)});
        for (size_t i = 0; i < hc; ++i) std::copy(e.begin() + t * D, e.begin() + (t + 1) * D, X.begin() + (t * hc + i) * D);
    }

    std::vector<double> pre(T * hc), post(T * hc), comb(T * hc * hc);
    std::vector<float> xin(T * D), xn(T * D), u(T * D);
    const float eps = static_cast<float>(c.rms_norm_eps);
    Selection sel;
    for (int l = 0; l < L; ++l) {
        const LayerWeights& w = layers[static_cast<size_t>(l)];
        // attention sublayer
        hc_site(s, l, false, w.attn_hc, X.data(), pre.data(), post.data(), comb.data(), xin.data());
        rms_norm_rows(s, xin.data(), T, D, w.attn_norm.data(), eps, xn.data());
        s.emit_rows(l, S_ATTN_NORM, xn.data(), D, D, {static_cast<int64_t>(D)});
        if (w.kda) {
            kda_forward(s, l, w.k, xn.data(), u.data());
            sel.clear();
        } else {
            mla_forward(s, l, w.m, xn.data(), u.data(), sel);
        }
        hc_expand(s, l, false, X.data(), u.data(), post.data(), comb.data());
        // feed-forward sublayer
        hc_site(s, l, true, w.ffn_hc, X.data(), pre.data(), post.data(), comb.data(), xin.data());
        rms_norm_rows(s, xin.data(), T, D, w.ffn_norm.data(), eps, xn.data());
        s.emit_rows(l, S_FFN_NORM, xn.data(), D, D, {static_cast<int64_t>(D)});
        if (w.f.moe) {
            moe_forward(s, l, w.f, xn.data(), u.data());
        } else {
            swiglu(s, w.f.gate, w.f.up, w.f.down, xn.data(), D, T, u.data(), l);
            s.emit_rows(l, S_MLP_OUT, u.data(), D, D, {static_cast<int64_t>(D)});
        }
        hc_expand(s, l, true, X.data(), u.data(), post.data(), comb.data());
    }

    // head, for the rows that want logits (want_head 1), only their greedy token (2) or the token and its
    // log-probability (3)
    std::vector<size_t> hrows, trows;
    for (size_t t = 0; t < T; ++t) {
        if (want_head[t] == 1) hrows.push_back(t);
        else if (want_head[t] == 2 || want_head[t] == 3) trows.push_back(t);
    }
    const size_t V = static_cast<size_t>(c.vocab_size);
    out.head_rows.assign(hrows.begin(), hrows.end());
    head_forward(s, X.data(), hrows, out.logits_out(hrows.size() * V));
    if (!trows.empty()) {
        std::vector<float> lg(trows.size() * V);
        head_forward(s, X.data(), trows, lg.data());
        out.token_rows.assign(trows.begin(), trows.end());
        out.tokens.resize(trows.size());
        for (size_t i = 0; i < trows.size(); ++i) {
            const float* x = lg.data() + i * V;
            out.tokens[i] = argmax(x, V);
            if (want_head[trows[i]] == 3) out.logprobs.push_back(argmax_logprob(x, V, out.tokens[i]));
        }
    }
}

}  // namespace glm::cpu
