// A small persistent thread pool for the CPU engine.
//
// Work is assigned in contiguous blocks: parallel_for(n, fn) gives thread t (0 = the caller) the
// items [n*t/T, n*(t+1)/T). Every item the engine hands out (a weight row, a (token, head) pair, a
// channel) is computed whole by one thread in the canonical order, so the split -- and therefore
// the thread count -- never changes a bit of any result.
//
// Workers spin for a short while after each job (steps issue many small jobs back to back), then
// sleep on a condition variable.
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
    explicit ThreadPool(unsigned threads) : n_(threads < 1 ? 1 : threads) {
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

    // fn(begin, end) on contiguous blocks of [0, n), one block per thread.
    template <class Fn>
    void parallel_for(size_t n, Fn&& fn) {
        if (n == 0) return;
        if (n_ == 1 || n == 1) {
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
        // wait for the workers: spin first (jobs are short), then yield
        for (unsigned spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
            if (spin < 4096)
                _mm_pause();
            else
                std::this_thread::yield();
        }
        job_ = nullptr;
        if (mine) std::rethrow_exception(mine);
        if (err_) std::rethrow_exception(err_);
    }

    void worker(unsigned t) {
        uint64_t seen = 0;
        for (;;) {
            // spin a little for the next job, then sleep
            uint64_t g = gen_.load(std::memory_order_acquire);
            for (unsigned spin = 0; g == seen && spin < 20000; ++spin) {
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
            pending_.fetch_sub(1, std::memory_order_acq_rel);
        }
    }

    unsigned n_;
    std::vector<std::thread> workers_;
    std::mutex m_;
    std::condition_variable cv_;
    std::atomic<uint64_t> gen_{0};
    std::atomic<unsigned> pending_{0};
    const std::function<void(unsigned)>* job_ = nullptr;
    std::exception_ptr err_;
    bool stop_ = false;
};

}  // namespace glm::cpu
