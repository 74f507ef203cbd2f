"""The decode step's team machinery (kernels/csrc/row_claims.h, spin_barrier.h) with one
thread held up, as a busy neighbour holds up a thread that shares its CPU.

``kvd_plan_team_check`` runs claimed phases separated by barriers, the shape of a decode
step, with one thread asleep before the first phase. The others take over its share
(work claiming), every unit is computed exactly once, and the threads that wait for it at
a barrier sleep rather than spin or yield their CPU away for the whole stall.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from kernels import native, plan_decode
from kernels.quant_linear import host_variant, library_flags

UNITS, ROUNDS = 64, 3
STALL_S = 0.3            # far longer than a round's work (UNITS x UNIT_S), so the outcome is not a race
UNIT_S = 50e-6


def team_check(threads: int, stall_tid: int, stall_s: float) -> tuple[int, np.ndarray, np.ndarray]:
    fn = native.load(plan_decode.LIBRARY, library_flags(plan_decode.LIBRARY, host_variant())).kvd_plan_team_check
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p]
    owner = np.full(UNITS * ROUNDS, -1, np.int32)
    claims = np.zeros(UNITS * ROUNDS, np.int32)
    size = fn(UNITS, threads, ROUNDS, stall_tid, int(stall_s * 1e9), int(UNIT_S * 1e9),
              owner.ctypes.data, claims.ctypes.data)
    return size, owner.reshape(ROUNDS, UNITS), claims.reshape(ROUNDS, UNITS)


@pytest.mark.parametrize("stall_tid", [0, 1])
def test_a_held_up_thread_leaves_its_share_to_the_team(stall_tid):
    size, owner, claims = team_check(2, stall_tid, STALL_S)
    if size < 2:
        pytest.skip("OpenMP gave a team of one thread")
    assert (claims == 1).all(), "every unit computed exactly once in every round"
    assert set(np.unique(owner)) <= {0, 1}
    # a static split would give the held-up thread half of round 0; claiming leaves it
    # what it could take after waking, which is nothing the others had not started
    assert (owner[0] == stall_tid).sum() <= UNITS // 4
    assert (owner[1:] >= 0).all()


@pytest.mark.parametrize("stall_tid", [0, 1])
def test_threads_waiting_at_a_barrier_sleep(stall_tid):
    """The thread that waits STALL_S at the first barrier (as the gatherer, thread 0, or as
    an arrival) spins for a bounded time and then sleeps: the process's CPU time stays far
    below the wall time. A barrier that spun or yielded in a loop would burn the whole wait."""
    team_check(2, stall_tid, 0.0)                      # the team exists before timing
    wall, cpu = time.perf_counter(), time.process_time()
    size, _, claims = team_check(2, stall_tid, STALL_S)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if size < 2:
        pytest.skip("OpenMP gave a team of one thread")
    assert (claims == 1).all()
    assert wall >= STALL_S
    assert cpu < wall / 2, (cpu, wall)


def test_many_rounds_and_threads_hand_out_every_unit_once():
    """Teams larger than the CPUs (oversubscribed, as when several daemons share a host):
    the sleeping barrier and the claims still compute each unit exactly once."""
    size, owner, claims = team_check(5, 3, 0.01)
    assert (claims == 1).all()
    assert owner.min() >= 0 and owner.max() < size
