// A barrier for the threads of one OpenMP team, used in place of `#pragma omp barrier`.
//
// libgomp's own barrier spins only ~100 times before sleeping on a futex when the
// process has more OpenMP threads than CPUs -- which it has whenever a second thread
// runs OpenMP (the daemon's engine thread beside the main thread's pool) -- and a futex
// wake-up costs ~30 us on a VM: the ~200 barriers of a decode step doubled the step when
// it ran outside the main thread (tests/kernels/test_plan_decode.py runs it from another
// thread). This one spins, yielding the CPU after ~4k spins (tens of microseconds) so
// that an oversubscribed host still makes progress.
//
// Arrival is one store per thread to a cache line of its own; thread 0 gathers them
// (every flag loaded in one sweep, so the misses overlap) and releases the team with one
// store that the others spin on. A shared arrival counter instead costs one transfer of
// the same line per thread, in series, each slowed by the spinners reading it: at 16
// threads on a mesh Xeon the counter made a decode step 7-13% slower (docs/benchmarks.md).
#pragma once

#include <sched.h>

#include <atomic>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

inline void spin_pause(int spins) {
#if defined(__x86_64__)
    _mm_pause();
#endif
    if (spins > 4096) sched_yield();
}

class SpinBarrier {
  public:
    // For teams of at most max_threads threads.
    explicit SpinBarrier(int max_threads) : arrived_((size_t)(max_threads < 1 ? 1 : max_threads)) {}

    // Every one of the team's n threads calls it, thread tid with its own tid < n; returns
    // when all have. Writes before it are visible to every thread after it: each arrival
    // is a release that thread 0 acquires before its release of the team, which the others
    // acquire.
    void wait(int n, int tid) {
        if (n == 1) return;
        const unsigned e = arrived_[(size_t)tid].epoch.load(std::memory_order_relaxed) + 1;
        if (tid != 0) {
            arrived_[(size_t)tid].epoch.store(e, std::memory_order_release);
            for (int spins = 0; release_.epoch.load(std::memory_order_acquire) != e; spins++) spin_pause(spins);
            return;
        }
        arrived_[0].epoch.store(e, std::memory_order_relaxed);
        for (int spins = 0;; spins++) {
            bool all = true;
            for (int i = 1; i < n; i++) all &= arrived_[(size_t)i].epoch.load(std::memory_order_acquire) == e;
            if (all) break;
            spin_pause(spins);
        }
        release_.epoch.store(e, std::memory_order_release);
    }

  private:
    // epochs count the barriers each thread passed; a thread's next barrier is epoch + 1
    // (unsigned: wraps without undefined behaviour; compared for equality only)
    struct alignas(64) Flag {
        std::atomic<unsigned> epoch{0};
    };
    std::vector<Flag> arrived_;
    Flag release_;
};

}  // namespace
