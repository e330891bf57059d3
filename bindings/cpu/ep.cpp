// Expert parallelism: the partition of the routed experts and the exchange of expert outputs
// (ep.hpp; docs/ep.md). No arithmetic happens here: rows move as BF16 bit patterns, and the
// combination over experts stays in moe.cpp, in expert-index order, on every rank.
#include "ep.hpp"

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "engine.hpp"
#include "formats.hpp"

namespace glm::cpu {

void ep_exchange(Step& s, int layer, const int32_t* sel, size_t k, float* ys) {
    ExpertParallel& ep = s.E.ep;
    const ExpertPartition& P = ep.part;
    if (!P.distributed()) return;
    if (!ep.hook || !*ep.hook) throw std::runtime_error("expert parallelism: no exchange hook is set");
    const size_t T = s.T, D = static_cast<size_t>(s.c.hidden_size), R = static_cast<size_t>(P.ranks);
    const size_t me = static_cast<size_t>(P.rank);
    // owner of each slot, rows per rank
    std::vector<uint32_t> own(T * k);
    std::vector<size_t> count(R, 0);
    for (size_t i = 0; i < T * k; ++i) {
        own[i] = static_cast<uint32_t>(P.owner(sel[i]));
        ++count[own[i]];
    }
    size_t m = 0;
    for (size_t c : count) m = std::max(m, c);
    // this rank's rows, in slot order, as BF16 bits (the values are BF16-representable: exact)
    std::vector<uint16_t> send(m * D, 0), recv(R * m * D, 0);
    size_t n = 0;
    for (size_t i = 0; i < T * k; ++i) {
        if (own[i] != me) continue;
        const float* y = ys + i * D;
        uint16_t* o = send.data() + n * D;
        for (size_t d = 0; d < D; ++d) o[d] = static_cast<uint16_t>(f32_bits(y[d]) >> 16);
        ++n;
    }
    const auto t0 = std::chrono::steady_clock::now();
    (*ep.hook)(layer, send.data(), recv.data(), m, D);
    ep.stats.hook_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ep.stats.exchanges += 1;
    ep.stats.rows_sent += m;
    ep.stats.bytes_sent += m * D * sizeof(uint16_t);
    // the transport must hand back this rank's own rows unchanged
    if (m && std::memcmp(recv.data() + me * m * D, send.data(), m * D * sizeof(uint16_t)) != 0)
        throw std::runtime_error("expert parallelism: the exchange returned this rank's rows altered (layer " +
                                 std::to_string(layer) + ")");
    // every other rank's rows into their slots
    std::vector<size_t> next(R, 0);
    for (size_t i = 0; i < T * k; ++i) {
        const size_t o = own[i];
        const size_t row = next[o]++;
        if (o == me) continue;
        const uint16_t* b = recv.data() + (o * m + row) * D;
        float* y = ys + i * D;
        for (size_t d = 0; d < D; ++d) y[d] = f32_from_bf16(b[d]);
    }
}

}  // namespace glm::cpu
