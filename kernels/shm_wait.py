"""Doorbells in shared memory (csrc/shm_wait.cpp): a 32-bit counter one process bumps
and another waits on, spinning briefly and then sleeping on a futex, the GIL released
meanwhile (ctypes). The wake-ups of kvd's shared-memory rings (kvd/node/attention_ring.py).

A doorbell is 8 bytes at a 4-byte aligned address of a shared mapping: the counter,
then its sleepers' count (the C++ file draws it). Addresses are plain ints
(``ctypes.addressof`` of a mapping's buffer): the caller keeps the mapping alive while
it uses them. Linux only: ``Doorbells.create`` returns None elsewhere, or where the
helper does not build.

How long a wait spins before it sleeps is the waiter's choice: ``AdaptiveSpin`` sizes
it from the waits it has seen (pure bookkeeping, no I/O).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

from kernels import native

log = logging.getLogger(__name__)

LIBRARY = "shm_wait"


class AdaptiveSpin:
    """How long a doorbell's waiter spins before it sleeps: about as long as its recent
    waits took, never past ``cap_s``.

    A spin that ends before the bell rings costs a wake-up on top of the wait (a futex
    wake, then the scheduler's latency, each way of a ring's round trip); a spin that
    outlasts the wait costs only the core it holds meanwhile. So a waiter whose bell
    mostly rings within ``cap_s`` (``hits``, an EMA of that share, at least one half)
    spins ``floor_s`` plus twice its typical wait (an EMA of the waits within the cap),
    at most ``cap_s``; one whose bell mostly rings later (the other side is slow, or
    shares this core with busy processes, where a spin takes the time the other side
    needs) spins ``floor_s`` alone. A wait's length is the caller's to report
    (``waited``): the policy times nothing and touches no memory but its own.

    ``spin_s``: 2 floats compared, for a hot path. Not thread-safe: one per waiter."""

    def __init__(self, cap_s: float, floor_s: float, weight: float = 0.125) -> None:
        if not 0 <= floor_s <= cap_s or not 0 < weight <= 1:
            raise ValueError(f"need 0 <= floor_s <= cap_s and 0 < weight <= 1, got {floor_s}, {cap_s}, {weight}")
        self.cap_s, self.floor_s, self.weight = cap_s, floor_s, weight
        self.typical_s = floor_s           # EMA of the waits that ended within the cap
        self.hits = 1.0                    # EMA of the share of waits that ended within the cap

    def spin_s(self) -> float:
        """The next wait's spin in seconds: within [floor_s, cap_s]."""
        if self.hits < 0.5:
            return self.floor_s
        return min(self.cap_s, self.floor_s + 2 * self.typical_s)

    def waited(self, seconds: float) -> None:
        """Count a wait that took ``seconds`` (from its start until the bell rang; a wait
        that timed out, its timeout or more)."""
        hit = seconds <= self.cap_s
        self.hits += self.weight * (hit - self.hits)
        if hit:
            self.typical_s += self.weight * (seconds - self.typical_s)


class Doorbells:
    """One loaded build of csrc/shm_wait.cpp."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
        self._wait = lib.kvd_ring_wait
        self._wait.restype, self._wait.argtypes = i64, [ptr, u32, i64, i64]
        self._load = lib.kvd_ring_load
        self._load.restype, self._load.argtypes = u32, [ptr]
        self._post = lib.kvd_ring_post
        self._post.restype, self._post.argtypes = None, [ptr, u32]

    @staticmethod
    @functools.cache
    def create() -> Doorbells | None:
        """The helper (built once per process), or None (logged) where it does not build or
        the OS has no futex."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            return Doorbells(native.load(LIBRARY, ()))
        except (native.BuildError, OSError) as exc:
            log.warning("no shared-memory doorbells: %s", exc)
            return None

    def wait(self, address: int, seen: int, spin_s: float, timeout_s: float) -> int | None:
        """The counter at ``address`` once it is not ``seen``; None when ``timeout_s`` pass
        first. Spins ``spin_s`` seconds, then sleeps."""
        got = self._wait(address, seen & 0xFFFFFFFF, int(spin_s * 1e9), max(0, int(timeout_s * 1e9)))
        return None if got < 0 else got

    def load(self, address: int) -> int:
        """The counter at ``address`` now."""
        return self._load(address)

    def post(self, address: int, value: int) -> None:
        """Set the counter at ``address`` to ``value`` (after every store before it) and wake
        its waiter."""
        self._post(address, value & 0xFFFFFFFF)
