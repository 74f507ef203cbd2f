"""A creditor's native answer to a decode step's RemoteAttend on a shared-memory ring
(kernels/csrc/ring_lane.cpp; the ring: kvd/node/attention_ring.py).

A debtor sends one RemoteAttend per layer of a decode step for each remote part, the
same message but for its id and layer (kvd/node/step_template.py). The ring's thread
decodes, checks and serves the step's first one in full, in Python (the trust gate,
the rManager's access check, ``LentKV.step_from``). ``RingLane`` then answers the
step's other layers in one native call each, the GIL released: the header must be the
served one's byte for byte but for a plain id and a plain decimal layer below the layer
count, the frames of its sizes; the call writes the layer's K/V row where the served
message's went (``DecodeCall``), runs the paged attention kernel into the reply slot and
writes ``protocol.encode``'s header for the ok RemotePartials and the slot's head.
Anything else (another step, a forged byte, a loan returned meanwhile) goes the full
way. What a native answer may touch is fixed when the lane is made, from the message
served in full; a request's bytes pick only the layer.

``RingLane.serve`` holds the attention server's lock and asks ``held()`` (the loan is
still the debtor's) for every request, as the full path does.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from engine.dist_attention import DecodeCall
from kernels.paged_attention import PagedAttention
from kernels.ring_lane import NOT_MINE, REFUSED, SERVED, Lane, address, library, pattern

__all__ = ["NOT_MINE", "REFUSED", "SERVED", "RingLane", "available"]
_i = ctypes.c_int64


def available() -> bool:
    """Whether this host builds the native lane (else every ring request goes the full way)."""
    return library() is not None


class RingLane:
    """One decode step's native answers for one ring (module docstring).

    ``pieces``: the served request's header around its id and layer (``StepTemplate.pieces``);
    ``sizes``: its frames' bytes (q, k, v); ``reply``: (prefix, suffix) of the header of an ok
    RemotePartials around its id's JSON and the partials' shape (rows, chunks, heads, head dim);
    ``call``: the step's ``DecodeCall`` on the lent part; ``kernel``: whose partials run;
    ``heads``: (query heads, KV heads, head dim); ``layers``: the model's; ``lock`` and
    ``held``: the attention server's, taken and asked at every request; ``served``: called
    (under the lock) for each request answered."""

    def __init__(self, pieces: tuple[bytes, bytes, bytes], sizes: tuple[int, ...],
                 reply: tuple[bytes, bytes, tuple[int, int, int, int]], call: DecodeCall, kernel: PagedAttention,
                 heads: tuple[int, int, int], layers: int, lock: threading.Lock, held: Callable[[], bool],
                 served: Callable[[], None] = lambda: None) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("no native ring lane on this host")
        rows, chunks, H, hd = reply[2]
        if len(sizes) != 3 or sizes[1] != call.row_bytes or sizes[2] != call.row_bytes or rows != call.layout.rows \
                or chunks != call.layout.slots or (H, hd) != (heads[0], heads[2]) or sizes[0] != 4 * rows * H * hd:
            raise ValueError("the served message is not a one-row decode this lane answers")
        self._fn, self.lock, self.held, self.served, self.call = lib.serve, lock, held, served, call
        rpre, rpost = reply[0] + b'"', b'"' + reply[1]          # the id's JSON: a plain id in quotes
        self._keep = (pieces, rpre, rpost)                       # the bytes the struct points at
        lay = call.layout
        rsizes = (4 * rows * lay.slots * H, 4 * rows * lay.slots * H, 4 * rows * lay.slots * H * hd)
        self._lane = Lane(
            pattern(*pieces, list(sizes)), address(rpre), len(rpre), address(rpost), len(rpost), (_i * 3)(*rsizes),
            layers, call.k_rows.data_ptr(), call.v_rows.data_ptr(), call.row_bytes,
            kernel.partials_address, call.k_caches.data_ptr(), call.v_caches.data_ptr(), call.windows.data_ptr(),
            int(call.kv_half), call.num_blocks, lay.sequences, lay.starts.data_ptr(), lay.lens.data_ptr(),
            lay.ctxs.data_ptr(), lay.lo.data_ptr(), lay.hi.data_ptr(), lay.tables.data_ptr(), lay.tables.shape[1],
            rows, H, heads[1], hd, call.block_size, call.scale, lay.slots, call.threads)
        if len(call.k_rows) != layers or len(call.windows) != layers:
            raise ValueError("the step's call does not cover every layer")
        self._ref = ctypes.byref(self._lane)

    def serve(self, request: int, reply: int, seq: int, slot_bytes: int) -> int:
        """Answer the request at address ``request`` (its slot: ``seq``, ``slot_bytes``) into
        the reply slot at ``reply``: ``SERVED`` (post it), ``NOT_MINE`` (nothing written: the
        full path), ``REFUSED`` (the kernel refused the layout: drop the lane, the full path)."""
        with self.lock:
            if not self.held():
                return NOT_MINE
            rc = self._fn(self._ref, request, reply, seq & 0xFFFFFFFF, slot_bytes)
            if rc == SERVED:
                self.served()
            return rc

