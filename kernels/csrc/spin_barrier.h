// A barrier for the threads of one OpenMP team, used in place of `#pragma omp barrier`.
//
// libgomp's own barrier spins only ~100 times before sleeping on a futex when the
// process has more OpenMP threads than CPUs -- which it has whenever a second thread
// runs OpenMP (the daemon's engine thread beside the main thread's pool) -- and a futex
// wake-up costs ~30 us on a VM: the ~200 barriers of a decode step doubled the step when
// it ran outside the main thread (tests/kernels/test_plan_decode.py runs it from another
// thread). This one spins on a generation counter, yielding the CPU after ~4k spins
// (tens of microseconds) so that an oversubscribed host still makes progress.
#pragma once

#include <sched.h>

#include <atomic>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

struct SpinBarrier {
    std::atomic<int> arrived{0};
    std::atomic<int> generation{0};

    // Every one of the team's n threads calls it; returns when all have. Writes before it
    // are visible to every thread after it (the generation counter orders them).
    void wait(int n) {
        if (n == 1) return;
        const int gen = generation.load(std::memory_order_acquire);
        if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
            arrived.store(0, std::memory_order_relaxed);
            generation.fetch_add(1, std::memory_order_acq_rel);
            return;
        }
        for (int spins = 0; generation.load(std::memory_order_acquire) == gen; spins++) {
#if defined(__x86_64__)
            _mm_pause();
#endif
            if (spins > 4096) sched_yield();
        }
    }
};

}  // namespace
