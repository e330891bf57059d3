// Expert parallelism (docs/ep.md): the routed experts are split over ranks in contiguous ranges;
// everything else (attention, mHC, dense MLP, router, shared expert, head) is replicated.
//
// At each MoE layer a rank computes y_e only for the selected experts it owns (moe.cpp), then
// ep_exchange() hands the owned rows to the exchange hook (set from Python: an all-gather through
// torch.distributed, never a reduction) and writes every other rank's rows into the [T][k][D]
// expert outputs. The combination moe.routed = bf16(cdot over j of (w_j, y_j[d])) then runs as in
// one process, on every rank, so every rank holds the same streams bit for bit.
//
// Wire format of one exchange (identical on every rank, computed from moe.selected, which every
// rank has): slots (t, j) in row-major order; rank o owns the slots whose expert lies in its range;
// m = max over ranks of the owned-slot count; each rank sends [m][D] BF16 bit patterns (uint16)
// holding its owned slots in slot order, zero-padded; the hook returns [ranks][m][D].
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../engine_types.hpp"

namespace glm::cpu {

struct Step;

// The hook: send [m][D] (this rank's rows), recv [ranks][m][D] (every rank's, recv[rank] included).
// It runs on the thread that called Engine::step (the caller's). It throws on failure.
using ExchangeFn = std::function<void(int layer, const uint16_t* send, uint16_t* recv, size_t m, size_t D)>;

using glm::EpStats;           // (bindings/engine_types.hpp: shared with the CUDA engine)
using glm::ExpertPartition;

struct ExpertParallel {
    ExpertPartition part;
    std::shared_ptr<ExchangeFn> hook;  // required when part.distributed()
    EpStats stats;
};

// Fill the rows of ys [T][k][D] (slot (t, j) = expert sel[t*k + j]) that other ranks own.
void ep_exchange(Step& s, int layer, const int32_t* sel, size_t k, float* ys);

}  // namespace glm::cpu
