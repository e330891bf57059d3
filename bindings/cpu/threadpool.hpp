// A small persistent thread pool for the CPU engine.
//
// Work is assigned in contiguous blocks: parallel_for(n, cost, fn) gives thread t (0 = the caller)
// the items [n*t/T, n*(t+1)/T). Every item the engine hands out (a weight row, a (token, head) pair, a
// channel) is computed whole by one thread in the canonical order, so the split -- and therefore
// the thread count -- never changes a bit of any result. Jobs too small to pay for waking the
// workers (n * cost below a threshold) run on the calling thread alone, which is the same result.
//
// Workers spin briefly after a job (a step issues many jobs back to back), then sleep on a condition
// variable; the caller likewise spins briefly, then sleeps until the last worker is done. Nothing
// spins for long, so an oversubscribed machine is not made worse.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace glm::cpu {

class ThreadPool {
   public:
    // Work below this many "cost units" (about one multiply-add each, ~50-100 us on one core) runs on
    // the calling thread: waking a sleeping worker costs microseconds on an idle machine and up to a
    // scheduler time slice on a busy one, which a small job cannot win back.
    static constexpr size_t kInlineWork = 1 << 20;

    explicit ThreadPool(unsigned threads, size_t inline_work = kInlineWork)
        : n_(threads < 1 ? 1 : threads), inline_work_(inline_work) {
        for (unsigned t = 1; t < n_; ++t) workers_.emplace_back([this, t] { worker(t); });
    }
    ~ThreadPool() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stop_ = true;
            gen_.fetch_add(1, std::memory_order_acq_rel);
        }
        cv_.notify_all();
        for (auto& w : workers_) w.join();
    }
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    unsigned size() const { return n_; }

    // fn(begin, end) on contiguous blocks of [0, n), one block per thread; `cost` is the work of one
    // item (in multiply-adds, roughly): small jobs run inline.
    template <class Fn>
    void parallel_for(size_t n, size_t cost, Fn&& fn) {
        if (n == 0) return;
        if (n_ == 1 || n == 1 || n * cost < inline_work_) {
            fn(size_t{0}, n);
            return;
        }
        const unsigned T = n_;
        std::function<void(unsigned)> job = [&](unsigned t) {
            const size_t a = n * t / T, b = n * (t + 1) / T;
            if (a < b) fn(a, b);
        };
        run(job);
    }

    // fn(t) once on every thread t in [0, size()).
    void run_all(const std::function<void(unsigned)>& fn) {
        if (n_ == 1) {
            fn(0);
            return;
        }
        run(fn);
    }

   private:
    void run(const std::function<void(unsigned)>& job) {
        job_ = &job;
        err_ = nullptr;
        pending_.store(n_ - 1, std::memory_order_release);
        {
            std::lock_guard<std::mutex> lk(m_);
            gen_.fetch_add(1, std::memory_order_acq_rel);
        }
        cv_.notify_all();
        std::exception_ptr mine;
        try {
            job(0);
        } catch (...) {
            mine = std::current_exception();
        }
        for (unsigned spin = 0; spin < 2000 && pending_.load(std::memory_order_acquire) != 0; ++spin) _mm_pause();
        if (pending_.load(std::memory_order_acquire) != 0) {
            std::unique_lock<std::mutex> lk(m_);
            done_cv_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
        }
        job_ = nullptr;
        if (mine) std::rethrow_exception(mine);
        if (err_) std::rethrow_exception(err_);
    }

    void worker(unsigned t) {
        uint64_t seen = 0;
        for (;;) {
            uint64_t g = gen_.load(std::memory_order_acquire);
            for (unsigned spin = 0; g == seen && spin < 2000; ++spin) {
                _mm_pause();
                g = gen_.load(std::memory_order_acquire);
            }
            if (g == seen) {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
                g = gen_.load(std::memory_order_acquire);
            }
            seen = g;
            if (stop_) return;
            try {
                (*job_)(t);
            } catch (...) {
                std::lock_guard<std::mutex> lk(m_);
                if (!err_) err_ = std::current_exception();
            }
            if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lk(m_);
                done_cv_.notify_one();
            }
        }
    }

    unsigned n_;
    size_t inline_work_;
    std::vector<std::thread> workers_;
    std::mutex m_;
    std::condition_variable cv_, done_cv_;
    std::atomic<uint64_t> gen_{0};
    std::atomic<unsigned> pending_{0};
    const std::function<void(unsigned)>* job_ = nullptr;
    std::exception_ptr err_;
    bool stop_ = false;
};

}  // namespace glm::cpu
