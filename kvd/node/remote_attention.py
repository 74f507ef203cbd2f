"""DistAttention's remote parts over the wire (Infinite-LLM §4.2, §4.6): the
debtor's ``WireLender`` and the creditor's ``AttentionServer``.

At every layer of a step the debtor's engine thread hands a sequence's
remote part its query rows and the new K/V of the positions the part holds
(engine/dist_attention.py, ``Lender.start``). ``WireLender`` sends them as a
``RemoteAttend`` (frames: q fp32, k, v) over the node's link to the creditor,
scheduled on the event loop, and returns at once: the round trip runs while
the engine thread computes the local part. The handle's ``partials`` waits
for the ``RemotePartials`` at most the layer's deadline; a refusal, a lost
link or a silent creditor raise ``RemoteKVError`` (the engine recomputes the
request's KV, engine/borrowing.py)::

    debtor engine thread        debtor loop         creditor loop       creditor worker
    start(layer, q, k, v) ───▶  RemoteAttend ─────▶ inbox / Lender ───▶ access(loan, sender)
    local micro-attention       (deadline)                              K/V into the loan's blocks
    partials(timeout)    ◀───── RemotePartials ◀─── ◀────────────────── micro-attention
    combine in chunk order

The creditor computes on ONE worker thread of its own: never on its engine
thread (a node that is at once debtor and creditor would wait on itself)
nor on its event loop. Its door to KV memory is the rManager's
``access`` (the loan's debtor only: anything else is refused, counted and
changes nothing) and ``MemPool.layer_caches`` through ``LentKV``; the
``lock`` it holds while it touches a loan's blocks is the one the lender
holds while it frees loans (kvd/node/lending.py), so a loan returned or
expired meanwhile is never written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import secrets
import threading
import time
from collections.abc import Awaitable, Callable

import torch

from engine.dist_attention import LentKV, PartialsHandle, RemoteKVError
from engine.memory.rmanager import RManager
from kernels.dist_attention import Partials, chunks_of
from kvd import protocol
from kvd.node import ring_lane
from kvd.node.attention_channel import ChannelClient
from kvd.node.attention_ring import StepRequest, partials_header
from kvd.node.ring_lane import RingLane


def partials_of(reply: protocol.Message, rows: int, lo: int, ctx: int, head_dim: int) -> Partials:
    """The partials a ``RemotePartials`` answer carries for ``rows`` query rows of a part
    from chunk ``lo`` of ``ctx`` keys; raises RemoteKVError for a refusal or a wrong shape."""
    if not isinstance(reply, protocol.RemotePartials) or not reply.ok:
        if isinstance(reply, protocol.RemotePartials):
            why = reply.reason
        elif isinstance(reply, protocol.ProtocolError):              # the answer itself did not decode
            why = f"{reply.reason}: {reply.detail}"
        else:
            why = getattr(reply, "message", None) or getattr(reply, "TYPE", type(reply).__name__)
        raise RemoteKVError(f"a remote part refused: {why}")
    m, l, o = (t.to_torch() for t in reply.tensors)
    if (m.dim() != 3 or m.shape[0] != rows or l.shape != m.shape or o.shape != (*m.shape, head_dim)
            or lo + m.shape[1] > chunks_of(ctx)):
        raise RemoteKVError(f"a remote part answered partials of the wrong shape {tuple(m.shape)}")
    return Partials(m, l, o)


def attend_message(debtor: str, loan_id: str, request_id: str, lo: int, timeout: float, layer: int,
                   q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> protocol.RemoteAttend:
    """``Lender.start``'s arguments as a RemoteAttend; its frames view ``q`` (as fp32),
    ``k`` and ``v`` (contiguous) without copying them."""
    return protocol.RemoteAttend(
        id=secrets.token_hex(6), debtor=debtor, loan_id=loan_id, request_id=request_id, lo=lo, layer=layer,
        ctx=ctx, first=int(positions[0]) if len(positions) else 0,
        tensors=(q.to(torch.float32).contiguous(), k.contiguous(), v.contiguous()), deadline=time.time() + timeout)


class WireHandle:
    """A ``PartialsHandle`` over a RemoteAttend in flight (a future of the loop's call)."""

    def __init__(self, future: concurrent.futures.Future, rows: int, lo: int, ctx: int, head_dim: int) -> None:
        self.future, self.rows, self.lo, self.ctx, self.head_dim = future, rows, lo, ctx, head_dim

    def partials(self, timeout: float) -> Partials:
        try:
            reply = self.future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            self.future.cancel()
            raise RemoteKVError(f"a remote part gave no result within {timeout} s") from None
        except Exception as exc:  # noqa: BLE001 -- a transport failure or the call's own deadline
            raise RemoteKVError(f"a remote part's creditor is unreachable: {exc}") from exc
        return partials_of(reply, self.rows, self.lo, self.ctx, self.head_dim)


class WireLender:
    """The ``Lender`` of one remote part of request ``request_id``: loan ``loan_id`` on a
    creditor, holding the sequence's chunks from ``lo`` on. ``call(msg)``: the reply of the
    creditor to ``msg`` (a coroutine run on ``loop``); ``timeout``: a message's deadline."""

    def __init__(self, call: Callable[[protocol.Message], Awaitable[protocol.Message]],
                 loop: asyncio.AbstractEventLoop, debtor: str, loan_id: str, request_id: str, lo: int,
                 timeout: float) -> None:
        self.call, self.loop, self.timeout = call, loop, timeout
        self.debtor, self.loan_id, self.request_id, self.lo = debtor, loan_id, request_id, lo

    def start(self, layer: int, q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> PartialsHandle:
        # copies: the frames are read on the loop while the engine thread goes on
        msg = attend_message(self.debtor, self.loan_id, self.request_id, self.lo, self.timeout, layer,
                             q.clone(), ctx, positions, k.clone(), v.clone())
        try:
            future = asyncio.run_coroutine_threadsafe(self.call(msg), self.loop)
        except RuntimeError as exc:             # the node's loop is closed: it is shutting down
            future = concurrent.futures.Future()
            future.set_exception(exc)
        return WireHandle(future, q.shape[0], self.lo, ctx, q.shape[-1])


class ChannelHandle:
    """A ``PartialsHandle`` over a RemoteAttend sent on a remote-attention channel; with
    ``lane``, the reply expected as its lane knows it (``StepLane.shape``)."""

    def __init__(self, client: ChannelClient, msg_id: str, rows: int, lo: int, ctx: int, head_dim: int,
                 lane: StepLane | None = None) -> None:
        self.client, self.msg_id, self.rows, self.lo, self.ctx, self.head_dim = client, msg_id, rows, lo, ctx, head_dim
        self.lane = lane

    def partials(self, timeout: float) -> Partials:
        lane = self.lane
        if lane is None:
            return partials_of(self.client.wait(self.msg_id, timeout), self.rows, self.lo, self.ctx, self.head_dim)
        if lane.shape is not None:
            got = self.client.wait_as(self.msg_id, lane.shape, timeout)
            if isinstance(got, Partials):
                return got                      # exactly the answer expected: checked whole
        else:
            got = self.client.wait(self.msg_id, timeout)
        out = partials_of(got, self.rows, self.lo, self.ctx, self.head_dim)
        lane.shape = tuple(out.o.shape)
        return out

    def partials_into(self, place: Callable[[int], Partials], timeout: float) -> None:
        """``partials``, written into ``place(chunks)`` (the gather's slots for that many
        chunks): the reply its lane expects is copied there from the ring by one native call
        (``ChannelClient.wait_into``); any other is decoded, checked and copied."""
        lane = self.lane
        if lane is None or lane.shape is None:
            got = self.partials(timeout)
            place(got.m.shape[1]).copy_(got)
            return
        reply = self.client.wait_into(self.msg_id, lane.shape, place(lane.shape[1]), timeout)
        if reply is None:
            return
        out = partials_of(reply, self.rows, self.lo, self.ctx, self.head_dim)
        lane.shape = tuple(out.o.shape)
        place(out.m.shape[1]).copy_(out)


class StepLane:
    """One step's RemoteAttend of one remote part, encoded once: every layer's message
    differs in its id and layer only (``header``), and its frames view the same q, k, v
    rows, rewritten by each layer. After the first reply, each layer's reply is expected
    as exactly the header ``protocol.encode`` writes for partials of that shape (an ok
    RemotePartials answering its id) and read off the ring without a decode; any other
    reply is decoded and checked in full. The header is the one ``attend_message`` and
    ``protocol.encode`` give (its deadline the lane's, renewed past half the timeout)."""

    def __init__(self, lender: ChannelLender, q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        self.tensors = (q, k, v)                # what the frames view: kept alive with them
        self.positions, self.ctx = positions, ctx
        self.lender = lender
        self.shape: tuple[int, int, int, int] | None = None   # the replies' partials (o's shape), once known
        self.renew()
        self.reply_bytes = reply_bytes(q, ctx, lender.lo)

    def renew(self) -> None:
        """Encode the template again, with a fresh deadline."""
        lender, (q, k, v) = self.lender, self.tensors
        msg = attend_message(lender.debtor, lender.loan_id, lender.request_id, lender.lo, lender.timeout, 0, q,
                             self.ctx, self.positions, k, v)
        self.renew_at = msg.deadline - lender.timeout / 2
        header, frames = protocol.encode(msg)
        head, found, rest = header.partition(b'"id":"' + msg.id.encode() + b'"')
        middle, found_layer, tail = rest.partition(b'"layer":0,')
        if not (found and found_layer) or b'"layer":0,' in tail:
            raise ValueError("a RemoteAttend header without its id and layer once each")
        self.request = StepRequest(head + b'"id":"', b'"' + middle + b'"layer":', b"," + tail, frames, self.tensors)

    def header(self, msg_id: str, layer: int) -> bytes:
        """Layer ``layer``'s message, its id ``msg_id`` (hex): what ``protocol.encode`` gives."""
        return self.request.header(msg_id, layer)

    def serves(self, q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether a layer's message is this lane's but for its layer: the same q, k, v and
        positions tensors (a step's buffers, sliced once: engine/dist_attention.py), the same context."""
        mine = self.tensors
        return mine[0] is q and mine[1] is k and mine[2] is v and self.positions is positions and self.ctx == ctx

    def guess(self, last: StepLane) -> None:
        """Expect this step's replies as ``last``'s (the same part's previous step) grown by
        the chunks the context gained: a wrong guess costs one reply's full decode."""
        if last.shape is not None and last.tensors[0].shape == self.tensors[0].shape:
            rows, chunks, heads, hd = last.shape
            self.shape = (rows, chunks + chunks_of(self.ctx) - chunks_of(last.ctx), heads, hd)


class ChannelLender:
    """The ``Lender`` of one remote part over the creditor's remote-attention channel
    (kvd/node/attention_channel.py; its shared-memory ring on the same host,
    attention_ring.py): sent and awaited on the calling thread (the engine
    thread, the channel client's only user), no event loop between. The frames view the
    step's tensors: the model leaves a layer's q, k, v be until its attention returns.
    The layers of a step after the first reuse its encoding (``StepLane``) where every
    layer passes the same contiguous float32 q and contiguous k and v (the plan executor's
    buffers, which ``DistStep`` slices once a step)."""

    def __init__(self, client: ChannelClient, debtor: str, loan_id: str, request_id: str, lo: int,
                 timeout: float) -> None:
        self.client, self.timeout = client, timeout
        self.debtor, self.loan_id, self.request_id, self.lo = debtor, loan_id, request_id, lo
        self._lane: StepLane | None = None
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)                     # a lane's ids: this prefix and a count

    def start(self, layer: int, q: torch.Tensor, ctx: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> PartialsHandle:
        lane = last = self._lane
        if lane is not None and not lane.serves(q, ctx, positions, k, v):
            lane = self._lane = None
        if lane is None and _lane_fits(q, k, v):
            lane = self._lane = StepLane(self, q, ctx, positions, k, v)
            if last is not None:
                lane.guess(last)
        if lane is None:
            msg = attend_message(self.debtor, self.loan_id, self.request_id, self.lo, self.timeout, layer, q, ctx,
                                 positions, k, v)
            self.client.send(msg, self.timeout, reply_bytes=reply_bytes(q, ctx, self.lo))
            return ChannelHandle(self.client, msg.id, q.shape[0], self.lo, ctx, q.shape[-1])
        if time.time() > lane.renew_at:
            lane.renew()
        msg_id = "%s%x" % (self._prefix, next(self._ids))
        self.client.send_step(msg_id, lane.request, layer, self.timeout, lane.reply_bytes)
        return ChannelHandle(self.client, msg_id, q.shape[0], self.lo, ctx, q.shape[-1], lane)


def reply_bytes(q: torch.Tensor, ctx: int, lo: int) -> int:
    """The most a reply's frames take for query rows ``q`` [n, H, hd] of a part from chunk
    ``lo`` of ``ctx`` keys: m, l and o fp32 over its chunks."""
    rows, heads, head_dim = q.shape
    return rows * max(chunks_of(ctx) - lo, 0) * heads * (head_dim + 2) * 4


def _lane_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a lane's frames can view q, k and v as they are (no copy made per layer)."""
    return q.dtype == torch.float32 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


class AttentionServer:
    """The creditor's answers to ``RemoteAttend``: on one worker thread, through
    ``rmanager.access`` and a ``LentKV`` per (loan, first chunk). ``kernel``, ``scale``,
    ``windows``, ``heads``, ``max_ctx`` (its context): the served model's (every node of a
    cluster serves the same one)."""

    def __init__(self, rmanager: RManager, kernel, scale: float, windows: list[int | None],
                 heads: tuple[int, int, int], lock: threading.Lock, threads: int = 0,
                 max_ctx: int = 1 << 17) -> None:
        self.rmanager, self.kernel, self.scale, self.windows = rmanager, kernel, scale, windows
        self.heads = heads                  # (query heads, KV heads, head dim)
        self.max_ctx = max_ctx              # the served model's context: no sequence is longer
        self.lock, self.threads = lock, threads
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvd-lent-attention")
        self._parts: dict[tuple[str, int], LentKV] = {}
        self.counts = {"served": 0, "refused": 0}

    async def answer(self, msg: protocol.RemoteAttend, debtor: str | None) -> protocol.RemotePartials:
        return await asyncio.wrap_future(self.executor.submit(self.serve, msg, debtor))

    def serve(self, msg: protocol.RemoteAttend, debtor: str | None, into=None) -> protocol.RemotePartials:
        """Worker thread: write the K/V, compute the micro-attention (into ``into(shape)``'s
        buffer where given: ``LentKV.step``); or the reason not."""
        if self.kernel is None:
            return self._refuse(msg, "this node's model has no paged attention kernel for a lent part")
        if msg.ctx > self.max_ctx:
            return self._refuse(msg, f"{msg.ctx} keys, past the model's context of {self.max_ctx}")
        with self.lock:
            loan = self.rmanager.access(msg.loan_id, debtor)
            if isinstance(loan, str):
                return self._refuse(msg, loan)
            H, kvh, hd = self.heads
            q, k, v = (t.to_torch() for t in msg.tensors)
            if q.shape[1:] != (H, hd) or k.shape[1:] != (kvh, hd):
                return self._refuse(msg, f"frames of {tuple(q.shape[1:])} query and {tuple(k.shape[1:])} K/V heads, "
                                         f"this model has ({H}, {hd}) and ({kvh}, {hd})")
            key = (msg.loan_id, msg.lo)
            lent = self._parts.get(key)
            if lent is None:
                if len(self._parts) > 2 * len(self.rmanager.loans):       # forget returned loans' views
                    self._parts = {k: p for k, p in self._parts.items() if k[0] in self.rmanager.loans}
                try:
                    lent = self._parts[key] = LentKV(self.rmanager.pool, loan.region.block_ids, msg.lo, self.kernel,
                                                     self.scale, self.windows, self.threads)
                except ValueError as exc:
                    return self._refuse(msg, str(exc))
            try:
                out = lent.step_from(msg.layer, q, msg.ctx, msg.first, k, v, into)
            except (ValueError, RuntimeError, IndexError) as exc:
                return self._refuse(msg, f"{type(exc).__name__}: {exc}"[:300])
        self.counts["served"] += 1
        # a ring's reply slot carries its frames' views already (attention_ring.SlotPartials)
        frames = getattr(out, "frames", None) or (out.m.contiguous(), out.l.contiguous(), out.o.contiguous())
        return protocol.RemotePartials(id=msg.id, ok=True, tensors=frames)

    def lane(self, msg: protocol.RemoteAttend, debtor: str | None, pieces: tuple[bytes, bytes, bytes],
             shape: tuple[int, int, int, int]) -> RingLane | None:
        """A native answer to the other layers of ``msg``'s step on a ring
        (kvd/node/ring_lane.py), once ``serve`` answered ``msg`` from ``debtor`` with partials
        of ``shape``; ``pieces``: its header around the id and the layer
        (``StepTemplate.pieces``). None where the step is not a one-row decode of the
        caches' dtype, or no lane builds here. Any thread."""
        if not ring_lane.available() or len(msg.tensors) != 3:
            return None
        q, k, v = msg.tensors
        dtype = getattr(torch, k.dtype, None)
        if v.dtype != k.dtype or dtype is None:
            return None
        with self.lock:
            loan = self.rmanager.access(msg.loan_id, debtor)
            lent = self._parts.get((msg.loan_id, msg.lo))
            if isinstance(loan, str) or lent is None:
                return None
            call = lent.decode_call(msg.ctx, q.shape[0], msg.first, k.shape[0], dtype)
        if call is None:
            return None
        prefix, suffix = partials_header(shape)
        try:
            return RingLane(pieces, tuple(t.data.nbytes for t in msg.tensors), (prefix, suffix, shape), call,
                            self.kernel, self.heads, len(self.windows), self.lock,
                            lambda: self.rmanager.still_lent(loan), self._served)
        except ValueError:
            return None

    def _served(self) -> None:
        self.counts["served"] += 1

    def _refuse(self, msg: protocol.Message, why: str) -> protocol.RemotePartials:
        self.counts["refused"] += 1
        return protocol.RemotePartials(id=msg.id, ok=False, reason=why)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
