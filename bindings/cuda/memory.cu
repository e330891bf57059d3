// The CUDA engine's memory: owning device buffers (DBuf), the weights' arena, the per-step scratch
// (device and pinned host staging), the side stream, the engine core's small device flags and
// counters, page-locked host memory, and the device selection. No arithmetic here.
#include <algorithm>
#include <cstring>

#include "engine.cuh"

namespace glm::cuda {

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

DBuf BufPool::take(size_t bytes) {
    if (bytes == 0) return DBuf();
    auto it = free_.find(bytes);
    if (it != free_.end()) {
        DBuf b = std::move(it->second);
        free_.erase(it);
        bytes_ -= bytes;
        return b;
    }
    if (!free_.empty()) {
        DBuf b;
        if (cudaMalloc(&b.p, bytes) == cudaSuccess) {
            b.n = bytes;
            return b;
        }
        cudaGetLastError();  // (out of memory is not sticky: the kept buffers go back, and it tries again)
        b.p = nullptr;
        clear();
    }
    return DBuf(bytes);
}
void BufPool::give(DBuf&& b) {
    if (!b.p) return;
    if (bytes_ + b.n > kCap) {
        b = DBuf();
        return;
    }
    bytes_ += b.n;
    const size_t n = b.n;
    free_.emplace(n, std::move(b));
}
void BufPool::clear() {
    free_.clear();
    bytes_ = 0;
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

void* host_pinned_alloc(size_t bytes) {
    void* p = nullptr;
    check(cudaMallocHost(&p, bytes ? bytes : 16), "cudaMallocHost (logits)");
    return p;
}
void host_pinned_free(void* p) noexcept { cudaFreeHost(p); }

// ---- devices ------------------------------------------------------------------------------------

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

}  // namespace glm::cuda
