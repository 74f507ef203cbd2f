"""A ring's decode step in one native call per message at each end (csrc/ring_lane.cpp):
the creditor's answer (its C struct and function; what fills the struct and when it is
used: kvd/node/ring_lane.py) and the debtor's post of a request and take of a reply
(kvd/node/attention_ring.py), loaded with ctypes (the GIL released while they run). The
source uses only the C ABI; ``library`` returns None where it does not build."""

from __future__ import annotations

import ctypes
import functools
import logging

from kernels import native

log = logging.getLogger(__name__)

LIBRARY = "ring_lane"
SERVED, NOT_MINE, REFUSED = 0, 1, -1            # kvd_ring_lane_serve's answers

_p, _i = ctypes.c_void_p, ctypes.c_int64


class RequestPattern(ctypes.Structure):
    """csrc/ring_lane.cpp's KvdRequestPattern: a step's request around its id and layer."""

    _fields_ = [("pre", _p), ("pre_len", _i), ("mid", _p), ("mid_len", _i), ("post", _p), ("post_len", _i),
                ("frames", _i), ("sizes", _i * 4)]


class Lane(ctypes.Structure):
    """csrc/ring_lane.cpp's KvdRingLane, field for field (its comments say what each is)."""

    _fields_ = [("request", RequestPattern),
                ("rpre", _p), ("rpre_len", _i), ("rpost", _p), ("rpost_len", _i), ("rsizes", _i * 3),
                ("layers", _i), ("k_dst", _p), ("v_dst", _p), ("row_bytes", _i),
                ("partials", _p), ("kc", _p), ("vc", _p), ("window", _p),
                ("kv_half", _i), ("num_blocks", _i), ("sequences", _i),
                ("q_start", _p), ("q_len", _p), ("ctx_len", _p), ("chunk_lo", _p), ("chunk_hi", _p), ("tables", _p),
                ("max_blocks", _i), ("rows", _i), ("heads", _i), ("kv_heads", _i), ("head_dim", _i),
                ("block_size", _i), ("scale", ctypes.c_double), ("slots", _i), ("threads", _i)]


class Post(ctypes.Structure):
    """csrc/ring_lane.cpp's KvdRingPost: the pattern and its frames' addresses."""

    _fields_ = [("pattern", RequestPattern), ("data", _i * 4)]


class Take(ctypes.Structure):
    """csrc/ring_lane.cpp's KvdRingTake: where a reply of one shape goes."""

    _fields_ = [("rpre", _p), ("rpre_len", _i), ("rpost", _p), ("rpost_len", _i), ("rows", _i), ("chunks", _i),
                ("heads", _i), ("head_dim", _i), ("m", _p), ("l", _p), ("o", _p), ("ld_ml", _i), ("ld_o", _i)]


class RingLaneLib:
    """One loaded build of csrc/ring_lane.cpp: ``serve``, ``post`` and ``take`` (its
    comments give each one's contract)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        u32, f = ctypes.c_uint32, ctypes.POINTER(ctypes.c_float)
        self.serve = lib.kvd_ring_lane_serve
        self.serve.restype, self.serve.argtypes = ctypes.c_int, [ctypes.c_void_p, _p, _p, u32, _i]
        self.post = lib.kvd_ring_lane_post
        self.post.restype, self.post.argtypes = ctypes.c_int, [_p, _i, u32, _p, _p, _i, _i]
        self.take = lib.kvd_ring_lane_take
        self.take.restype, self.take.argtypes = ctypes.c_int, [_p, _i, u32, _p, _p, _i]


@functools.cache
def library() -> RingLaneLib | None:
    """The build, or None where it does not build (logged once)."""
    try:
        return RingLaneLib(native.load(LIBRARY, ()))
    except (native.BuildError, OSError) as exc:
        log.warning("no native ring lane (%s): ring messages take the Python path", exc)
        return None


def pattern(pre: bytes, mid: bytes, post: bytes, sizes: list[int]) -> RequestPattern:
    """The ``RequestPattern`` of a request: header ``pre`` + id + ``mid`` + layer + ``post``,
    frames of ``sizes`` bytes (at most 4). It points at the bytes: the caller keeps them."""
    return RequestPattern(address(pre), len(pre), address(mid), len(mid), address(post), len(post), len(sizes),
                          (_i * 4)(*sizes, *[0] * (4 - len(sizes))))


def address(b: bytes) -> int:
    """Where ``b``'s bytes are (valid while ``b`` lives)."""
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value
