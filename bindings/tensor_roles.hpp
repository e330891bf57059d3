// Where each checkpoint tensor role (oracle/names.py) goes and what shape it must have: one table for
// both engines' loaders (bindings/cpu/model.cpp, bindings/cuda/model.cu). The engines keep weights in
// their own containers (host views vs device memory) under the same member names, so the table is a
// template over the engine's operations:
//
//   o.bad(why)              throws, naming the tensor
//   o.layer()               the layer's weights (the role needs a layer index)
//   o.top()                 the model's embed, lm_head, final_norm
//   o.lin(rows, cols)       a linear weight of that logical shape, in the engine's Lin
//   o.vec(n)                n f32 values in the engine's container (norms, biases, ...)
//   o.f64(n)                n values as doubles in the engine's container (mHC fn, base)
//   o.host(n)               n values as a host std::vector<float>
//   o.conv(k, which, n)     the KDA conv taps of q (0), k (1) or v (2), n values, into k.conv
//   o.check_expert(e)       refuses an expert the engine does not hold (expert parallelism)
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "engine_types.hpp"

namespace glm {

// A linear weight's arrays against its logical shape [rows, cols] and release: the logical shape, the
// stored data array (and scale, which fp8 and mxfp4 need) in the release's layout. bad(why) on the first
// mismatch.
template <class Bad>
void check_stored_lin(const std::vector<int64_t>& shape, size_t rows, size_t cols, const std::string& release,
                      const std::vector<int64_t>& data_shape, bool has_scale, const std::vector<int64_t>& scale_shape,
                      const Bad& bad) {
    const int64_t R = static_cast<int64_t>(rows), C = static_cast<int64_t>(cols);
    if (shape.size() != 2 || shape[0] != R || shape[1] != C)
        bad("shape " + shape_str(shape) + ", expected " + shape_str({R, C}));
    auto expect = [&](const std::vector<int64_t>& got, const std::vector<int64_t>& want, const char* which) {
        if (got != want) bad(std::string(which) + " has shape " + shape_str(got) + ", expected " + shape_str(want));
    };
    if (release == "bf16" || release == "f32") {
        expect(data_shape, {R, C}, "data");
    } else if (release == "fp8") {
        expect(data_shape, {R, C}, "data");
        if (!has_scale) bad("fp8 weight without weight_scale_inv");
        expect(scale_shape, {(R + 127) / 128, (C + 127) / 128}, "weight_scale_inv");
    } else if (release == "mxfp4") {
        if (C % 32 != 0) bad("mxfp4 needs in_features % 32 == 0");
        expect(data_shape, {R, C / 2}, "data");
        if (!has_scale) bad("mxfp4 weight without weight_scale");
        expect(scale_shape, {R, C / 32}, "weight_scale");
    } else {
        bad("unknown release '" + release + "'");
    }
}

// The checkpoint tensor roles (oracle/names.py's table, generated into glm_schema.hpp).
enum Role : int {
#define GLM_ROLE_ENUM(id, name) id,
    GLM_ROLES(GLM_ROLE_ENUM)
#undef GLM_ROLE_ENUM
    R_COUNT
};
inline constexpr const char* kRoleNames[R_COUNT] = {
#define GLM_ROLE_NAME(id, name) name,
    GLM_ROLES(GLM_ROLE_NAME)
#undef GLM_ROLE_NAME
};

inline int role_by_name(const std::string& name) {  // -1 if unknown
    for (int i = 0; i < R_COUNT; ++i)
        if (name == kRoleNames[i]) return i;
    return -1;
}

// The switch below has no default: a role added to oracle/names.py that no case places fails the build.
#if defined(__GNUC__) && !defined(__CUDACC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
#endif
template <class Ops>
void assign_role(const std::string& role, int expert, const EngineConfig& c, Ops& o) {
    const size_t D = static_cast<size_t>(c.hidden_size), V = static_cast<size_t>(c.vocab_size);
    const size_t hc = static_cast<size_t>(c.hc_mult), P = static_cast<size_t>(c.kda_dim());
    const size_t d = static_cast<size_t>(c.linear_head_dim), H = static_cast<size_t>(c.linear_num_heads);
    const size_t K = static_cast<size_t>(c.linear_conv_kernel_dim);
    const size_t nh = static_cast<size_t>(c.num_attention_heads), dn = static_cast<size_t>(c.qk_nope_head_dim);
    const size_t dv = static_cast<size_t>(c.v_head_dim), r = static_cast<size_t>(c.kv_lora_rank);
    const size_t rq = static_cast<size_t>(c.q_lora_rank), dr = static_cast<size_t>(c.qk_rope_head_dim);
    const size_t ni = static_cast<size_t>(c.index_n_heads), di = static_cast<size_t>(c.index_head_dim);
    const size_t kp = static_cast<size_t>(c.index_kpool);
    const size_t I = static_cast<size_t>(c.intermediate_size), Im = static_cast<size_t>(c.moe_intermediate_size);
    const size_t Is = Im * static_cast<size_t>(c.n_shared_experts), E = static_cast<size_t>(c.n_routed_experts);
    const size_t R = static_cast<size_t>(c.hc_dim());
    auto starts = [&](const char* prefix) { return role.rfind(prefix, 0) == 0; };

    // the layer's weights of the role's family, after checking the layer has that family
    auto hc_of = [&]() -> auto& { return role[0] == 'a' ? o.layer().attn_hc : o.layer().ffn_hc; };
    auto kda = [&]() -> auto& {
        auto& lw = o.layer();
        if (!lw.kda) o.bad("is a KDA tensor but the layer is not a KDA layer");
        return lw.k;
    };
    auto mla = [&]() -> auto& {
        auto& lw = o.layer();
        if (lw.kda) o.bad("is an MLA tensor but the layer is a KDA layer");
        return lw.m;
    };
    auto indexer = [&]() -> auto& {
        auto& lw = o.layer();
        if (lw.kda || !lw.m.has_indexer) o.bad("is an indexer tensor but the layer has no full indexer");
        return lw.m;
    };
    auto mlp = [&]() -> auto& {
        auto& lw = o.layer();
        if (lw.f.moe) o.bad("is a dense-MLP tensor but the layer is an MoE layer");
        return lw.f;
    };
    auto moe = [&]() -> auto& {
        auto& lw = o.layer();
        if (!lw.f.moe) o.bad("is an MoE tensor but the layer is a dense layer");
        return lw.f;
    };

    // the family's layer checks before anything is read (unknown roles of a family included), in the
    // loader's order: the layer, its kind, then (routed experts) the expert index and ownership
    if (starts("attn_hc.") || starts("ffn_hc.")) {
        hc_of();
    } else if (starts("kda.")) {
        kda();
    } else if (starts("mla.")) {
        mla();
    } else if (starts("indexer.")) {
        indexer();
    } else if (starts("mlp.")) {
        mlp();
    } else if (starts("moe.")) {
        moe();
        if (starts("moe.expert.")) {
            if (expert < 0 || static_cast<size_t>(expert) >= E) o.bad("expert index out of range");
            o.check_expert(expert);
        }
    }
    const int id = role_by_name(role);
    if (id < 0) o.bad("unknown role");
    const size_t e = static_cast<size_t>(expert);
    switch (static_cast<Role>(id)) {
        case R_EMBED: o.top().embed = o.lin(V, D); break;
        case R_LM_HEAD: o.top().lm_head = o.lin(V, D); break;
        case R_FINAL_NORM: o.top().final_norm = o.vec(D); break;
        case R_ATTN_NORM: o.layer().attn_norm = o.vec(D); break;
        case R_FFN_NORM: o.layer().ffn_norm = o.vec(D); break;
        case R_ATTN_HC_FN:
        case R_FFN_HC_FN: hc_of().fn = o.f64(R * hc * D); break;
        case R_ATTN_HC_BASE:
        case R_FFN_HC_BASE: hc_of().base = o.f64(R); break;
        case R_ATTN_HC_SCALE:
        case R_FFN_HC_SCALE: {
            auto& hw = hc_of();
            const auto f = o.host(3);
            for (int i = 0; i < 3; ++i) hw.scale[i] = f[static_cast<size_t>(i)];
            break;
        }
        case R_KDA_Q_PROJ: kda().q_proj = o.lin(P, D); break;
        case R_KDA_K_PROJ: kda().k_proj = o.lin(P, D); break;
        case R_KDA_V_PROJ: kda().v_proj = o.lin(P, D); break;
        case R_KDA_F_A_PROJ: kda().f_a = o.lin(d, D); break;
        case R_KDA_F_B_PROJ: kda().f_b = o.lin(P, d); break;
        case R_KDA_B_PROJ: kda().b_proj = o.lin(H, D); break;
        case R_KDA_G_A_PROJ: kda().g_a = o.lin(d, D); break;
        case R_KDA_G_B_PROJ: kda().g_b = o.lin(P, d); break;
        case R_KDA_O_PROJ: kda().o_proj = o.lin(D, P); break;
        case R_KDA_Q_CONV: o.conv(kda(), 0, P * K); break;
        case R_KDA_K_CONV: o.conv(kda(), 1, P * K); break;
        case R_KDA_V_CONV: o.conv(kda(), 2, P * K); break;
        case R_KDA_DT_BIAS: kda().dt_bias = o.vec(P); break;
        case R_KDA_A_LOG: kda().A_log = o.vec(H); break;
        case R_KDA_O_NORM: kda().o_norm = o.vec(d); break;
        case R_MLA_Q_A_PROJ: mla().q_a = o.lin(rq, D); break;
        case R_MLA_Q_B_PROJ: mla().q_b = o.lin(nh * (dn + dr), rq); break;
        case R_MLA_KV_A_PROJ: mla().kv_a = o.lin(r + dr, D); break;
        case R_MLA_KV_B_PROJ: mla().kv_b = o.lin(nh * (dn + dv), r); break;
        case R_MLA_O_PROJ: mla().o_proj = o.lin(D, nh * dv); break;
        case R_MLA_Q_A_NORM: mla().q_a_norm = o.vec(rq); break;
        case R_MLA_KV_A_NORM: mla().kv_a_norm = o.vec(r); break;
        case R_INDEXER_WQ_B: indexer().wq_b = o.lin(ni * di, rq); break;
        case R_INDEXER_WK: indexer().wk = o.lin(di, D); break;
        case R_INDEXER_WEIGHTS_PROJ: indexer().weights_proj = o.lin(ni, D); break;
        case R_INDEXER_KPOOL_GATE: indexer().kpool_gate = o.lin(di, D); break;
        case R_INDEXER_K_NORM: indexer().k_norm_w = o.vec(di); break;
        case R_INDEXER_K_NORM_BIAS: indexer().k_norm_b = o.vec(di); break;
        case R_INDEXER_KPOOL_APE: indexer().ape = o.vec(kp * di); break;
        case R_MLP_GATE_PROJ: mlp().gate = o.lin(I, D); break;
        case R_MLP_UP_PROJ: mlp().up = o.lin(I, D); break;
        case R_MLP_DOWN_PROJ: mlp().down = o.lin(D, I); break;
        case R_MOE_GATE: moe().router = o.lin(E, D); break;
        case R_MOE_GATE_BIAS: moe().bias = o.vec(E); break;
        case R_MOE_SHARED_GATE_PROJ: moe().s_gate = o.lin(Is, D); break;
        case R_MOE_SHARED_UP_PROJ: moe().s_up = o.lin(Is, D); break;
        case R_MOE_SHARED_DOWN_PROJ: moe().s_down = o.lin(D, Is); break;
        case R_MOE_EXPERT_GATE_PROJ: moe().e_gate[e] = o.lin(Im, D); break;
        case R_MOE_EXPERT_UP_PROJ: moe().e_up[e] = o.lin(Im, D); break;
        case R_MOE_EXPERT_DOWN_PROJ: moe().e_down[e] = o.lin(D, Im); break;
        case R_COUNT: o.bad("unknown role");
    }
}
#if defined(__GNUC__) && !defined(__CUDACC__)
#pragma GCC diagnostic pop
#endif

}  // namespace glm
