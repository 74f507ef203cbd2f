// A phase's work handed to a team's threads in chunks, each thread taking its own share
// first and then helping with the others' (plan_decode.cpp's matmuls by output rows, its
// attention by key chunks).
//
// A static split waits for its slowest thread at the barrier after every matmul, and on a
// shared host a thread that loses its CPU for a moment stalls the whole step. Here thread t
// owns the t-th of T equal shares of the row groups and claims chunks of it from the front
// with an atomic counter; when its share is done it claims from the other shares' counters
// in turn, so it takes over what a stalled thread has not started. A chunk is claimed once
// (the counter only grows), every row is computed by exactly one thread, and which thread
// computes a row changes none of its bits (each output's arithmetic depends on its row alone).
#pragma once

#include <stdint.h>

#include <atomic>
#include <vector>

#include "quant_gemm.h"

namespace {

// Bytes of W one claim covers: large enough that a claim (an atomic add, usually on a line
// this core owns) costs nothing beside it, small enough to leave little for the last thread.
constexpr int64_t CLAIM_BYTES = 16 << 10;

struct alignas(64) ClaimCounter {
    std::atomic<int64_t> next{0};
};

class RowClaims {
  public:
    explicit RowClaims(int max_threads) : counters_(2 * (size_t)max_threads), max_threads_(max_threads) {}

    // Calls fn(n0, n1) for chunks of [0, N) rows, n0 a multiple of 8 (a group of the x8
    // layout), until no chunk is left; every thread tid < T <= max_threads of the team
    // calls it for the same matmul with the same T and `round`. Rounds count the team's
    // claimed phases (matmuls and others, run_units) from 0, and a barrier separates
    // consecutive rounds (the counters of round r are reset during round r + 1).
    template <class Fn>
    void run(int64_t N, int64_t bytes_per_group, int T, int tid, int64_t round, Fn&& fn) {
        const int64_t chunk = bytes_per_group >= CLAIM_BYTES ? 1 : CLAIM_BYTES / bytes_per_group;
        run_units((N + 7) / 8, chunk, T, tid, round, [&](int64_t g0, int64_t g1) {
            fn(g0 * 8, g1 * 8 < N ? g1 * 8 : N);
        });
    }

    // Calls fn(u0, u1) for chunks of `chunk` units of [0, units) (the last shorter) until no
    // chunk is left, with the contract of run: thread tid first takes chunks of the tid-th of T
    // equal shares, then the others' leftovers. Each unit is handed out exactly once.
    template <class Fn>
    void run_units(int64_t units, int64_t chunk, int T, int tid, int64_t round, Fn&& fn) {
        ClaimCounter* set = &counters_[(size_t)(round & 1) * max_threads_];
        for (int k = 0; k < T; k++) {
            const int owner = (tid + k) % T;
            int64_t g0, g1;
            split(units, T, owner, &g0, &g1);
            // Another share is looked at with a load before it is claimed from: a spent share
            // then costs a read of its counter, not a locked add on a line another core holds
            // (a locked add waits for the line, and every one of them is taken in series),
            // and the loads of T - 1 spent shares overlap.
            if (k > 0 && g0 + set[owner].next.load(std::memory_order_relaxed) * chunk >= g1) continue;
            for (;;) {
                const int64_t i = set[owner].next.fetch_add(1, std::memory_order_relaxed);
                const int64_t a = g0 + i * chunk;
                if (a >= g1) break;
                const int64_t b = a + chunk < g1 ? a + chunk : g1;
                fn(a, b);
                if (b == g1) break;             // the share's last chunk: its counter now says spent
            }
        }
        // Nobody claims from the other set until after the next barrier: this round's
        // callers have all finished the previous round, and the next waits for this one.
        counters_[(size_t)((round + 1) & 1) * max_threads_ + tid].next.store(0, std::memory_order_relaxed);
    }

  private:
    std::vector<ClaimCounter> counters_;
    int max_threads_;
};

}  // namespace
