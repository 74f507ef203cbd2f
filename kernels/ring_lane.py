"""The native answer of a ring's decode step (csrc/ring_lane.cpp): its C struct and
function, loaded with ctypes (the GIL released while it runs). What fills the struct and
when it is used: kvd/node/ring_lane.py. Linux and x86 alike: the source uses only the C
ABI; ``serve_function`` returns None where it does not build."""

from __future__ import annotations

import ctypes
import functools
import logging

from kernels import native

log = logging.getLogger(__name__)

LIBRARY = "ring_lane"
SERVED, NOT_MINE, REFUSED = 0, 1, -1            # kvd_ring_lane_serve's answers

_p, _i = ctypes.c_void_p, ctypes.c_int64


class Lane(ctypes.Structure):
    """csrc/ring_lane.cpp's KvdRingLane, field for field (its comments say what each is)."""

    _fields_ = [("pre", _p), ("pre_len", _i), ("mid", _p), ("mid_len", _i), ("post", _p), ("post_len", _i),
                ("frames", _i), ("sizes", _i * 4),
                ("rpre", _p), ("rpre_len", _i), ("rpost", _p), ("rpost_len", _i), ("rsizes", _i * 3),
                ("layers", _i), ("k_dst", _p), ("v_dst", _p), ("row_bytes", _i),
                ("partials", _p), ("kc", _p), ("vc", _p), ("window", _p),
                ("kv_half", _i), ("num_blocks", _i), ("sequences", _i),
                ("q_start", _p), ("q_len", _p), ("ctx_len", _p), ("chunk_lo", _p), ("chunk_hi", _p), ("tables", _p),
                ("max_blocks", _i), ("rows", _i), ("heads", _i), ("kv_heads", _i), ("head_dim", _i),
                ("block_size", _i), ("scale", ctypes.c_double), ("slots", _i), ("threads", _i)]


@functools.cache
def serve_function():
    """``kvd_ring_lane_serve(lane*, request, reply, seq, slot_bytes) -> int`` of the build,
    or None where it does not build (logged once)."""
    try:
        lib = native.load(LIBRARY, ())
    except (native.BuildError, OSError) as exc:
        log.warning("no native ring lane (%s): ring requests take the full path", exc)
        return None
    fn = lib.kvd_ring_lane_serve
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, _p, _p, ctypes.c_uint32, _i]
    return fn


def address(b: bytes) -> int:
    """Where ``b``'s bytes are (valid while ``b`` lives)."""
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value
