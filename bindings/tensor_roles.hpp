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

    if (role == "embed") {
        o.top().embed = o.lin(V, D);
    } else if (role == "lm_head") {
        o.top().lm_head = o.lin(V, D);
    } else if (role == "final_norm") {
        o.top().final_norm = o.vec(D);
    } else if (role == "attn_norm") {
        o.layer().attn_norm = o.vec(D);
    } else if (role == "ffn_norm") {
        o.layer().ffn_norm = o.vec(D);
    } else if (role.rfind("attn_hc.", 0) == 0 || role.rfind("ffn_hc.", 0) == 0) {
        auto& hw = role[0] == 'a' ? o.layer().attn_hc : o.layer().ffn_hc;
        const std::string leaf = role.substr(role.find('.') + 1);
        const size_t R = static_cast<size_t>(c.hc_dim());
        if (leaf == "fn") {
            hw.fn = o.f64(R * hc * D);
        } else if (leaf == "base") {
            hw.base = o.f64(R);
        } else if (leaf == "scale") {
            const auto f = o.host(3);
            for (int i = 0; i < 3; ++i) hw.scale[i] = f[static_cast<size_t>(i)];
        } else {
            o.bad("unknown role");
        }
    } else if (role.rfind("kda.", 0) == 0) {
        auto& lw = o.layer();
        if (!lw.kda) o.bad("is a KDA tensor but the layer is not a KDA layer");
        auto& k = lw.k;
        if (role == "kda.q_proj") k.q_proj = o.lin(P, D);
        else if (role == "kda.k_proj") k.k_proj = o.lin(P, D);
        else if (role == "kda.v_proj") k.v_proj = o.lin(P, D);
        else if (role == "kda.f_a_proj") k.f_a = o.lin(d, D);
        else if (role == "kda.f_b_proj") k.f_b = o.lin(P, d);
        else if (role == "kda.b_proj") k.b_proj = o.lin(H, D);
        else if (role == "kda.g_a_proj") k.g_a = o.lin(d, D);
        else if (role == "kda.g_b_proj") k.g_b = o.lin(P, d);
        else if (role == "kda.o_proj") k.o_proj = o.lin(D, P);
        else if (role == "kda.q_conv" || role == "kda.k_conv" || role == "kda.v_conv")
            o.conv(k, role == "kda.q_conv" ? 0 : role == "kda.k_conv" ? 1 : 2, P * K);
        else if (role == "kda.dt_bias") k.dt_bias = o.vec(P);
        else if (role == "kda.A_log") k.A_log = o.vec(H);
        else if (role == "kda.o_norm") k.o_norm = o.vec(d);
        else o.bad("unknown role");
    } else if (role.rfind("mla.", 0) == 0) {
        auto& lw = o.layer();
        if (lw.kda) o.bad("is an MLA tensor but the layer is a KDA layer");
        auto& m = lw.m;
        if (role == "mla.q_a_proj") m.q_a = o.lin(rq, D);
        else if (role == "mla.q_b_proj") m.q_b = o.lin(nh * (dn + dr), rq);
        else if (role == "mla.kv_a_proj") m.kv_a = o.lin(r + dr, D);
        else if (role == "mla.kv_b_proj") m.kv_b = o.lin(nh * (dn + dv), r);
        else if (role == "mla.o_proj") m.o_proj = o.lin(D, nh * dv);
        else if (role == "mla.q_a_norm") m.q_a_norm = o.vec(rq);
        else if (role == "mla.kv_a_norm") m.kv_a_norm = o.vec(r);
        else o.bad("unknown role");
    } else if (role.rfind("indexer.", 0) == 0) {
        auto& lw = o.layer();
        if (lw.kda || !lw.m.has_indexer) o.bad("is an indexer tensor but the layer has no full indexer");
        auto& m = lw.m;
        if (role == "indexer.wq_b") m.wq_b = o.lin(ni * di, rq);
        else if (role == "indexer.wk") m.wk = o.lin(di, D);
        else if (role == "indexer.weights_proj") m.weights_proj = o.lin(ni, D);
        else if (role == "indexer.kpool_gate") m.kpool_gate = o.lin(di, D);
        else if (role == "indexer.k_norm") m.k_norm_w = o.vec(di);
        else if (role == "indexer.k_norm_bias") m.k_norm_b = o.vec(di);
        else if (role == "indexer.kpool_ape") m.ape = o.vec(kp * di);
        else o.bad("unknown role");
    } else if (role.rfind("mlp.", 0) == 0) {
        auto& lw = o.layer();
        if (lw.f.moe) o.bad("is a dense-MLP tensor but the layer is an MoE layer");
        if (role == "mlp.gate_proj") lw.f.gate = o.lin(I, D);
        else if (role == "mlp.up_proj") lw.f.up = o.lin(I, D);
        else if (role == "mlp.down_proj") lw.f.down = o.lin(D, I);
        else o.bad("unknown role");
    } else if (role.rfind("moe.", 0) == 0) {
        auto& lw = o.layer();
        if (!lw.f.moe) o.bad("is an MoE tensor but the layer is a dense layer");
        auto& f = lw.f;
        if (role.rfind("moe.expert.", 0) == 0) {
            if (expert < 0 || static_cast<size_t>(expert) >= E) o.bad("expert index out of range");
            o.check_expert(expert);
            const size_t e = static_cast<size_t>(expert);
            if (role == "moe.expert.gate_proj") f.e_gate[e] = o.lin(Im, D);
            else if (role == "moe.expert.up_proj") f.e_up[e] = o.lin(Im, D);
            else if (role == "moe.expert.down_proj") f.e_down[e] = o.lin(D, Im);
            else o.bad("unknown role");
        } else if (role == "moe.gate") f.router = o.lin(E, D);
        else if (role == "moe.gate_bias") f.bias = o.vec(E);
        else if (role == "moe.shared.gate_proj") f.s_gate = o.lin(Is, D);
        else if (role == "moe.shared.up_proj") f.s_up = o.lin(Is, D);
        else if (role == "moe.shared.down_proj") f.s_down = o.lin(D, Is);
        else o.bad("unknown role");
    } else {
        o.bad("unknown role");
    }
}

}  // namespace glm
