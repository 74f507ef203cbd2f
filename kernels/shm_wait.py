"""Doorbells in shared memory (csrc/shm_wait.cpp): a 32-bit counter one process bumps
and another waits on, spinning briefly and then sleeping on a futex, the GIL released
meanwhile (ctypes). The wake-ups of kvd's shared-memory rings (kvd/node/attention_ring.py).

A doorbell is 8 bytes at a 4-byte aligned address of a shared mapping: the counter,
then its sleepers' count (the C++ file draws it). Addresses are plain ints
(``ctypes.addressof`` of a mapping's buffer): the caller keeps the mapping alive while
it uses them. Linux only: ``Doorbells.create`` returns None elsewhere, or where the
helper does not build.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

from kernels import native

log = logging.getLogger(__name__)

LIBRARY = "shm_wait"


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
