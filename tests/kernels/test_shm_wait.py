"""Doorbells in shared memory (kernels/shm_wait.py): a wait ends when the counter moves
(posted from another thread, past the spin: asleep on the futex) or at its deadline."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import pytest

from kernels.shm_wait import Doorbells

bells = Doorbells.create()
pytestmark = pytest.mark.skipif(bells is None, reason="no doorbells on this host")


@pytest.fixture
def bell():
    mm = mmap.mmap(-1, 4096)                         # shared and anonymous: a futex like a segment's
    anchor = (ctypes.c_char * 4096).from_buffer(mm)
    yield ctypes.addressof(anchor) + 64
    del anchor
    mm.close()


def test_a_wait_ends_at_its_deadline(bell):
    t = time.monotonic()
    assert bells.wait(bell, 0, 0.0, 0.2) is None
    assert 0.2 <= time.monotonic() - t < 5
    assert bells.wait(bell, 1, 0.0, 0.2) == 0        # not what it was: at once


def test_a_post_wakes_a_sleeping_waiter_from_another_thread(bell):
    got = []
    waiter = threading.Thread(target=lambda: got.append(bells.wait(bell, 0, 0.0, 10.0)))
    waiter.start()
    time.sleep(0.2)                                  # asleep on the futex by now
    bells.post(bell, 5)
    waiter.join(timeout=5)
    assert got == [5] and bells.load(bell) == 5
    bells.post(bell, 2**32 + 7)                      # a counter of 32 bits: it wraps
    assert bells.load(bell) == 7 and bells.wait(bell, 2**32 + 6, 1e-4, 1.0) == 7


def test_an_adaptive_spin_stays_within_its_bounds():
    """About twice the recent waits, never past the cap; the floor alone where waits
    mostly run past the cap (a busy or shared host), spinning again once they come back."""
    from kernels.shm_wait import AdaptiveSpin

    spin = AdaptiveSpin(cap_s=2e-3, floor_s=20e-6)
    assert spin.spin_s() == pytest.approx(60e-6)            # no waits seen: the floor's neighbourhood
    for _ in range(100):
        spin.waited(300e-6)
        assert 20e-6 <= spin.spin_s() <= 2e-3
    assert spin.spin_s() == pytest.approx(20e-6 + 2 * 300e-6, rel=1e-3)
    for _ in range(100):
        spin.waited(1.5e-3)                                 # within the cap: spins up to it
    assert spin.spin_s() == 2e-3
    spin.waited(30.0)                                       # a step's gap now and then: still spins
    assert spin.spin_s() == 2e-3
    for _ in range(20):
        spin.waited(5e-3)                                   # mostly past the cap: sleep soon
    assert spin.spin_s() == 20e-6
    for _ in range(30):
        spin.waited(200e-6)
    assert spin.spin_s() > 20e-6
    for bad in ((1e-3, 2e-3), (1e-3, -1.0)):
        with pytest.raises(ValueError):
            AdaptiveSpin(*bad)
    with pytest.raises(ValueError):
        AdaptiveSpin(1e-3, 0.0, weight=0.0)


def test_a_wait_spinning_long_still_ends_at_its_deadline(bell):
    """A spin longer than the wait's timeout ends with the timeout."""
    t = time.monotonic()
    assert bells.wait(bell, 0, 1.0, 0.05) is None
    assert time.monotonic() - t < 0.5
