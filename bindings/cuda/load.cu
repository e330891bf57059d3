// Weights registration (the CUDA counterpart of the CPU engine's add_tensor / finalize in
// bindings/cpu/model.cpp): each role goes where bindings/tensor_roles.hpp says, uploaded once in its
// release format into the arena; members of a joint group (roles that read the same x) are placed as
// consecutive rows of one matrix; finalize checks completeness and computes the derived weights on
// the device (KDA decay, W_UK^T, the expert pointer tables).
#include <algorithm>
#include <cstring>

#include "engine.cuh"
#include "../tensor_roles.hpp"

namespace glm::cuda {

// ---- derived weights ------------------------------------------------------------------------------

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


std::vector<float> to_f32(const std::string& what, const std::string& release, const void* data, size_t n) {
    std::vector<float> out(n);
    if (release == "bf16") {
        const uint16_t* p = static_cast<const uint16_t*>(data);
        for (size_t i = 0; i < n; ++i) out[i] = num::bf16_to_f32(p[i]);
    } else if (release == "f32") {
        std::memcpy(out.data(), data, n * sizeof(float));
    } else {
        throw std::invalid_argument(what + ": expected a bf16 or f32 tensor, given release '" + release + "'");
    }
    return out;
}

}  // namespace

// ---- joint groups --------------------------------------------------------------------------------

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

// ---- registration and finalize --------------------------------------------------------------------

void Engine::add_tensor(const std::string& role, int layer, int expert, const std::string& release, const void* data,
                        const void* scale, const std::vector<int64_t>& shape, const std::vector<int64_t>& data_shape,
                        const std::vector<int64_t>& scale_shape) {
    Impl& E_ = *p_;
    if (E_.finalized) throw std::logic_error("add_tensor after finalize");
    const ActiveOptions active(E_.opts);
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
    t.E = static_cast<int>(ls.size());
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
    const ActiveOptions active(E_.opts);
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

}  // namespace glm::cuda
