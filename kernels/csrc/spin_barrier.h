// A barrier for the threads of one OpenMP team, used in place of `#pragma omp barrier`.
//
// A waiting thread spins (with `pause`) for up to SPIN_NS, then sleeps on a futex until the
// barrier opens; it never calls sched_yield. Why both halves:
//
// - Spinning first: libgomp's own barrier sleeps after ~100 spins when the process has more
//   OpenMP threads than CPUs (it has whenever a second thread runs OpenMP: the daemon's
//   engine thread beside the main thread's pool), and a futex wake-up costs tens of
//   microseconds on a VM, against a few microseconds between the ~200 barriers of a decode
//   step. A wait that ends within the budget costs no system call.
// - Sleeping, not yielding, after it: sched_yield hands the CPU to whatever else is
//   runnable there, even a `nice 19` process, for up to a scheduler tick on kernels whose
//   yield skips the caller, and every other thread of the team then waits at the next
//   barrier for the one that yielded. A sleeping thread is woken when the barrier opens,
//   and a woken thread of normal priority preempts a low-priority one at once. Sleeping
//   also leaves the CPU to a team thread that shares it (an oversubscribed host), which is
//   what it waits for.
//
// Arrival is one store per thread to a cache line of its own; thread 0 gathers them
// (every flag loaded in one sweep, so the misses overlap) and releases the team with one
// store that the others spin on. A shared arrival counter instead costs one transfer of
// the same line per thread, in series, each slowed by the spinners reading it
// (docs/benchmarks.md, design measurements). The sleeping side costs the fast path one
// load of a line nobody writes: an arriving thread checks whether thread 0 sleeps, thread
// 0 checks whether anyone sleeps before it releases (Dekker's pattern: each side stores,
// then loads the other's word, both sequentially consistent, so a sleeper is always seen
// or sees the barrier open before it sleeps).
//
// Every sleep has a timeout (SLEEP_NS) after which the sleeper looks again: a lost wake-up
// costs at most that, never a hang.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t SPIN_NS = 200 * 1000;     // spin this long before sleeping
constexpr long SLEEP_NS = 2 * 1000 * 1000;  // a sleep's timeout, after which the sleeper looks again

inline void cpu_relax() {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Sleeps while *word == expected (or until SLEEP_NS pass, or a spurious wake-up).
inline void futex_wait(std::atomic<unsigned>* word, unsigned expected) {
    static_assert(sizeof(std::atomic<unsigned>) == sizeof(unsigned), "futex word");
    const timespec timeout{0, SLEEP_NS};
    syscall(SYS_futex, reinterpret_cast<unsigned*>(word), FUTEX_WAIT_PRIVATE, expected, &timeout, nullptr, 0);
}

inline void futex_wake_all(std::atomic<unsigned>* word) {
    syscall(SYS_futex, reinterpret_cast<unsigned*>(word), FUTEX_WAKE_PRIVATE, 0x7fffffff, nullptr, nullptr, 0);
}

// Spins until done() for up to SPIN_NS; returns whether it became true. The clock is read
// once every 64 spins.
template <class Done>
inline bool spin_until(Done&& done) {
    int64_t deadline = 0;
    for (int spins = 0;; spins++) {
        if (done()) return true;
        cpu_relax();
        if ((spins & 63) == 63) {
            const int64_t t = now_ns();
            if (deadline == 0) deadline = t + SPIN_NS;
            else if (t >= deadline) return false;
        }
    }
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
            arrived_[(size_t)tid].epoch.store(e, std::memory_order_seq_cst);
            if (gatherer_sleeps_.word.load(std::memory_order_seq_cst) != 0) {
                gatherer_wake_.word.fetch_add(1, std::memory_order_seq_cst);
                futex_wake_all(&gatherer_wake_.word);
            }
            auto open = [&] { return release_.word.load(std::memory_order_seq_cst) == e; };
            if (spin_until(open)) return;
            sleepers_.word.fetch_add(1, std::memory_order_seq_cst);
            while (!open()) futex_wait(&release_.word, e - 1);
            sleepers_.word.fetch_sub(1, std::memory_order_relaxed);
            return;
        }
        arrived_[0].epoch.store(e, std::memory_order_relaxed);
        auto all = [&] {
            bool yes = true;
            for (int i = 1; i < n; i++) yes &= arrived_[(size_t)i].epoch.load(std::memory_order_seq_cst) == e;
            return yes;
        };
        if (!spin_until(all)) {
            for (;;) {
                const unsigned seen = gatherer_wake_.word.load(std::memory_order_seq_cst);
                gatherer_sleeps_.word.store(1, std::memory_order_seq_cst);
                if (all()) break;
                futex_wait(&gatherer_wake_.word, seen);
            }
            gatherer_sleeps_.word.store(0, std::memory_order_relaxed);
        }
        release_.word.store(e, std::memory_order_seq_cst);
        if (sleepers_.word.load(std::memory_order_seq_cst) != 0) futex_wake_all(&release_.word);
    }

  private:
    // epochs count the barriers each thread passed; a thread's next barrier is epoch + 1
    // (unsigned: wraps without undefined behaviour; compared for equality only)
    struct alignas(64) Flag {
        std::atomic<unsigned> epoch{0};
    };
    struct alignas(64) Word {
        std::atomic<unsigned> word{0};
    };
    std::vector<Flag> arrived_;
    Word release_;           // the last barrier thread 0 opened
    Word sleepers_;          // threads asleep waiting for release_
    Word gatherer_sleeps_;   // 1 while thread 0 is (about to be) asleep waiting for arrivals
    Word gatherer_wake_;     // bumped by an arrival that found thread 0 asleep
};

}  // namespace
