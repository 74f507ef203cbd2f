// Cross-process wake-ups on a counter in shared memory: the doorbells of kvd's
// shared-memory rings (kvd/node/attention_ring.py, kernels/shm_wait.py).
//
// A doorbell is two 32-bit words in a MAP_SHARED mapping:
//
//     word[0]  the counter: bumped by its one writer (kvd_ring_post), read by its one waiter
//     word[1]  how many waiters sleep on it (so a post skips the wake syscall when none does)
//
// kvd_ring_wait spins for spin_ns (the peer usually answers within a layer's
// attention), then sleeps on a futex (a shared, not private, one: the two ends are
// different processes), until the counter moves or timeout_ns pass. ctypes calls
// release the GIL, so the caller's other threads run meanwhile.
//
// Ordering: the writer's data stores happen before its release of the counter; the
// waiter's acquire load of the counter happens before its reads of the data. The
// sleepers count and the counter are both seq_cst, so either the poster sees a sleeper
// and wakes it, or the sleeper's FUTEX_WAIT sees the new counter and returns at once.

#include <atomic>
#include <climits>
#include <cstdint>
#include <ctime>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVD_PAUSE() _mm_pause()
#else
#define KVD_PAUSE() ((void)0)
#endif

namespace {

using Word = std::atomic<uint32_t>;
static_assert(sizeof(Word) == sizeof(uint32_t) && Word::is_always_lock_free, "a doorbell word is a plain u32");

int64_t now_ns() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return int64_t(t.tv_sec) * 1000000000LL + t.tv_nsec;
}

Word* word_at(uint32_t* p) { return reinterpret_cast<Word*>(p); }

}  // namespace

extern "C" {

// The counter's value once it differs from `seen` (as a non-negative int64), or -1 when
// timeout_ns pass first. `bell` is 4-byte aligned, two words (counter, sleepers).
int64_t kvd_ring_wait(uint32_t* bell, uint32_t seen, int64_t spin_ns, int64_t timeout_ns) {
    Word* counter = word_at(bell);
    Word* sleepers = word_at(bell + 1);
    const int64_t t0 = now_ns();
    for (;;) {
        const uint32_t v = counter->load(std::memory_order_acquire);
        if (v != seen) return int64_t(v);
        const int64_t waited = now_ns() - t0;
        if (waited >= timeout_ns) return -1;
        if (waited < spin_ns) {
            for (int i = 0; i < 16; ++i) KVD_PAUSE();
            continue;
        }
        const int64_t left = timeout_ns - waited;
        timespec ts{time_t(left / 1000000000LL), long(left % 1000000000LL)};
        sleepers->fetch_add(1, std::memory_order_seq_cst);
        syscall(SYS_futex, bell, FUTEX_WAIT, seen, &ts, nullptr, 0);    // EAGAIN, EINTR, ETIMEDOUT: look again
        sleepers->fetch_sub(1, std::memory_order_seq_cst);
    }
}

// The counter now (an acquire load).
uint32_t kvd_ring_load(uint32_t* bell) { return word_at(bell)->load(std::memory_order_acquire); }

// Set the counter to `value` (a release, after the data it announces) and wake its waiter.
void kvd_ring_post(uint32_t* bell, uint32_t value) {
    word_at(bell)->store(value, std::memory_order_seq_cst);
    if (word_at(bell + 1)->load(std::memory_order_seq_cst) != 0)
        syscall(SYS_futex, bell, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // extern "C"
