"""KV replication to a peer, and the replicas a node holds for its peers
(DéjàVu §4.2.3; docs/cluster.md, "Failure semantics").

Sender (``Replicator``, one per node that decodes, ``[cluster].replicas =
1``): every ``replication_interval`` one round gathers, on the engine
thread between two steps, the KV blocks its running requests filled since
the last round (one ``MemPool.gather_blocks`` into one staging buffer, never
a copy per block) and sends them to the replica peer the coordinator
assigned (a ring over the live nodes that decode) as ONE ``ReplicaData``:
the prompt's blocks in the round after its prefill, then each block of new
tokens once it is full. A request that ended here is named in ``frees``.
The round waits for the peer's ``ReplicaAck`` (deadline: the cluster's
request timeout) before the next one, so at most one message is in flight.

What a round sends of blocks the peer does not hold yet (a new prompt's;
every request's again when the peer changes, as when a restarted partner
rejoins) is bounded by ``rate`` blocks per second (``[cluster].
replication_rate``; a bucket that fills at that rate and holds at most
``BURST_S`` of it): a request past the round's share sends its first full
blocks, the rest in the next rounds, so a rebuild never puts a whole
context's gather between two of this node's steps.

Holder: ``ReplicaStore`` (kvd/node/replica_store.py) keeps what the peers
send, each write checked against the coordinator's ticket (kvd/trust.py);
a request the sender has no ticket for at its peer is not sent.

What a replica misses is recomputed: the tokens past its last full block
(at most ``block_size - 1``) plus those generated since the last round.

A pair's copy (the peer is this node's ``partner``) is current to the
token instead: each round sends every token computed since the copy's
end as token rows (kvd/node/replication_rounds.py ``collect_rows``;
ReplicaData ``rows``): a step's round carries one row of KV per
request, not the block around it, and the holder writes the rows on at
the copy's end. The rounds follow the
steps (one as soon as ``PAIR_ROUND_S`` after the last, its gather at the
next step boundary), so a request handed off resumes from the copy with
nothing recomputed (kvd/node/replica_store.py ``take_current``). The
partner that handed a request off here keeps its own KV of it (every
token it computed, so at least every token the client had but the last)
as this node's copy (``kept``): the rounds extend that copy from its last
known token. The holder answers a round that does not fit the copy it
holds with what it holds: until the kept copy is there (nothing held), the request is
offered again in the next round, from there on the rounds start where the
copy ends; after ``KEPT_WAIT_S`` without it, the copy is sent from block 0.
A handoff from here holds its request first (``hold``, the coordinator's
admin ``hold``): the next round, started at once, takes it out of this
node's steps and sends the partner its last rows between the same two
steps, so the partner resumes from a copy that holds every token computed
here, and no token is computed on both nodes. A switch to prefill holds
every request whose copy is complete at the next step boundary, without
waiting for a round (``hold_all``): the node's next step decodes none of
them, before the coordinator has moved any; each move's own ``hold`` then
brings its copy up to date as above.

Disaggregated requests: the prefill node sends the prompt's replica to the
decode node's peer itself (``send_prompt_replica``, a ReplicaData with
``owner`` = the decode node), off the decode node's compute path and its
link. The decode node learns it from the KVCommit (``replica_to``) and,
instead of sending the prompt, claims that replica (``adopt``) in its next
rounds; the holder re-keys it to the decode node, whose rounds then extend
it. A claim is given up, and the decode node replicates the prompt itself,
when the holder has not answered it within ``ADOPT_WAIT_S`` (the replica did
not arrive, or was refused) or the holder is not the peer this node has once
it has one. An unclaimed replica is dropped with its request (the
coordinator's ``drop_replicas``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from engine import exact_copy
from engine.prefill_alone import PrefillAlone
from engine.stream import STAGING
from kvd import protocol
from kvd.node.engine_driver import EngineDriver
from kvd.node.replication_rounds import collect
from kvd.ratelog import RateLimitedLog
from transports import Connection, TransportError

log = logging.getLogger("kvd.replication")

REFUSED_RETRY_S = 1.0          # a request the holder refused is offered again after this
ADOPT_WAIT_S = 2.0             # how long a decode node claims a prompt replica its prefill node sent
KEPT_WAIT_S = 1.0              # how long a handoff's kept copy is waited for before it is sent whole
PAIR_ROUND_S = 0.005           # a pair's copy: the next round as soon as this after the last (one per step)
BURST_S = 0.1                  # the most a round may send at once, in seconds of ``rate``
TICKET_GRACE_S = 10.0          # a ticket from a request is kept this long without a heartbeat repeating it
HOLD_S = 5.0                   # a request held for a handoff from here decodes again after this (no Abort came)


class Replicator:
    """This node's replication stream to its peer (module docstring)."""

    def __init__(self, name: str, driver: EngineDriver, connect: Callable[[str, str], Awaitable[Connection]],
                 drop: Callable[[str], Awaitable[None]], interval: float, timeout: float) -> None:
        self.name = name
        self.driver = driver
        self._connect = connect                   # (peer name, address) -> the node's link to it
        self._drop = drop                         # peer name: forget a broken link
        self.interval = interval
        self.timeout = timeout
        self.peer: tuple[str, str] | None = None  # (name, address), from the coordinator
        self.tickets: dict[str, tuple[str, str, float]] = {}  # request id -> (holder, ticket, when given)
        self.partner = ""                         # paired: the peer whose copies are current to the token
        self.partner_prompting = False            # the partner's last ack: it computes a prompt (takes no handoff)
        self.sent: dict[str, int] = {}            # request id -> tokens the peer holds
        self.retry_at: dict[str, float] = {}      # request id -> when to offer it again (refused)
        self.adopting: dict[str, tuple[str, str, float]] = {}  # request id -> (writer, holder, give up at)
        self.kept_at: dict[str, tuple[str, int, float]] = {}   # request id -> (holder, tokens it keeps, until)
        self.lag_tokens = 0                       # computed tokens not replicated, last round
        self.rate = 0.0                           # blocks/s the peer lacks, at most (0: unbounded)
        self._allowance, self._filled_at = 0.0, time.monotonic()
        self.counts = {"rounds": 0, "messages": 0, "blocks": 0, "rows": 0, "bytes": 0, "refused": 0, "errors": 0,
                       "adopted": 0, "adopt_fallbacks": 0, "rate_limited": 0}
        self._warn = RateLimitedLog(log)
        self._epoch = 0                           # bumped on every peer change
        self._peer_changed = asyncio.Event()      # set by a peer change: the round in flight ends
        self._holds: dict[str, asyncio.Future] = {}   # request id -> its tokens made, once the next round held it
        self._wake = asyncio.Event()              # a hold waits: the next round now
        self.rule: PrefillAlone | None = None     # paired: the engine's pair rule (engine/prefill_alone.py)

    def set_peer(self, name: str, address: str, tickets: dict[str, str] | None = None) -> None:
        """The coordinator's assignment ("" = none) and its tickets there for
        the requests it runs here (a heartbeat reply). A new peer starts
        from nothing: every request is replicated to it whole. Tickets the
        reply does not repeat are forgotten once ``TICKET_GRACE_S`` old (a
        request routed here after the coordinator built the reply has its
        ticket from its leg message, kvd/protocol.py LegRequest)."""
        new = (name, address) if name else None
        if new != self.peer:
            log.info("replica peer: %s", name or "none")
            self.peer = new
            self.sent = {}
            self.retry_at.clear()
            self._epoch += 1
            self._peer_changed.set()
        now = time.monotonic()
        tickets = tickets or {}
        self.tickets = {rid: t for rid, t in self.tickets.items() if rid in tickets or now - t[2] < TICKET_GRACE_S}
        for rid, ticket in tickets.items():
            self.tickets[rid] = (name, ticket, now)

    def grant(self, request_id: str, holder: str, ticket: str) -> None:
        """The coordinator's ticket to replicate ``request_id`` at ``holder``
        (a leg message's ``replica_to``/``replica_ticket``). A request
        is replicated only to a peer it has a ticket for."""
        self.tickets[request_id] = (holder, ticket, time.monotonic())

    def expect_prompt(self, request_id: str, writer: str, holder: str, wait: float | None = None) -> None:
        """``writer`` (the prefill node, or the partner that handed
        ``request_id`` off to this node and keeps its KV as the copy) is
        writing a replica of ``request_id`` at ``holder`` for this node:
        claim it there instead of sending it from block 0, once ``holder`` is
        this node's peer (the coordinator may have told the writer first),
        for ``wait`` seconds (default ``ADOPT_WAIT_S``); then it is sent from here."""
        self.adopting[request_id] = (writer, holder, time.monotonic() + (ADOPT_WAIT_S if wait is None else wait))
        self.sent.pop(request_id, None)           # what this node sent of it before a handoff away is stale
        self.retry_at.pop(request_id, None)

    def kept(self, request_id: str, holder: str, tokens: int) -> None:
        """``holder``, the partner that handed ``request_id`` off to this
        node, keeps at least ``tokens`` tokens of its KV as this node's
        copy: the rounds extend it from there once the request runs here
        (module docstring; while ``holder`` is the peer)."""
        self.kept_at[request_id] = (holder, tokens, time.monotonic() + KEPT_WAIT_S)
        self.sent.pop(request_id, None)           # what this node sent of it before a handoff away is stale
        self.retry_at.pop(request_id, None)
        self.adopting.pop(request_id, None)

    async def run(self) -> None:
        if self.partner:                          # a paired node: no decode in a prompt's steps
            self.driver.engine.pair_rule = self.rule = PrefillAlone(self._takeable)
        while True:
            # a pair's copy follows every step (a round's gather waits for a step boundary); a hold
            # asked for (``hold``) starts the next round at once
            exact = self.peer is not None and self.peer[0] == self.partner
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(self.interval, PAIR_ROUND_S) if exact else self.interval)
            self._wake.clear()
            if self.peer is None:
                continue
            try:
                await self.round()
            except (TransportError, TimeoutError, RuntimeError, ValueError) as exc:
                self.counts["errors"] += 1
                self._warn.warning(("round", type(exc).__name__), "replication to %s failed: %s",
                                   self.peer[0] if self.peer else "-", exc)
                if self.peer is not None:
                    await self._drop(self.peer[0])
                self.sent = {}                    # the next round starts over (the holder keeps what it has)

    def _copy_complete(self, req: Any) -> bool:
        """Whether the partner's copy of ``req`` is complete (the handoff's
        test, kvd/coordinator/handoff.py ``held``: every full block of its
        prompt acknowledged). Read on the engine thread: one dict lookup."""
        peer, bs = self.peer, self.driver.engine.config.block_size
        return peer is not None and peer[0] == self.partner and \
            self.sent.get(req.request_id, 0) >= len(req.prompt_ids) // bs * bs

    def _takeable(self, req: Any) -> bool:
        """Whether the partner could take ``req`` now (the pair rule's test): its
        copy complete and, as of the partner's last ack, no prompt of its own
        there. Read on the engine thread."""
        return not self.partner_prompting and self._copy_complete(req)

    def _hold(self, engine: Any, request_id: str) -> int | None:
        """``exact_copy.hold`` for a handoff, on the engine thread: it
        replaces the pair rule's hold of the request (``PrefillAlone.taken``)."""
        made = exact_copy.hold(engine, request_id, HOLD_S)
        if self.rule is not None:
            self.rule.taken(request_id)
        return made

    async def hold(self, request_id: str) -> int | None:
        """Stop decoding ``request_id`` here at the next step boundary (a
        handoff to the partner: ``exact_copy.hold``, for ``HOLD_S``); with
        the partner as the peer, in the next round, started at once, whose
        rows (sent before this returns) bring the partner's copy up to every
        token it computed. Returns the tokens it made, None when it is not
        decoding here. Raises TimeoutError past the request timeout."""
        if self.peer is None or self.peer[0] != self.partner:
            return await self.driver.call(lambda engine: self._hold(engine, request_id), timeout=self.timeout)
        made = self._holds.get(request_id)
        if made is None:
            made = self._holds[request_id] = asyncio.get_running_loop().create_future()
        self._wake.set()
        return await asyncio.wait_for(asyncio.shield(made), self.timeout)

    async def hold_all(self) -> dict[str, int]:
        """Stop decoding here, at the next step boundary, every request whose
        partner copy is complete (a switch to prefill: the coordinator hands
        them off, kvd/coordinator/handoff.py), as ``hold`` does each, in one
        call on the engine thread that waits for no round; the next round,
        started at once, sends their last rows. Returns {request id: tokens
        made} of those held; {} when the peer is not the partner. Raises
        TimeoutError past the request timeout."""
        if self.peer is None or self.peer[0] != self.partner:
            return {}

        def hold_every(engine: Any) -> dict[str, int]:
            made = {r.request_id: self._hold(engine, r.request_id) for r in list(engine.scheduler.running)
                    if self._copy_complete(r)}
            return {rid: n for rid, n in made.items() if n is not None}
        held = await self.driver.call(hold_every, timeout=self.timeout)
        self._wake.set()
        return held

    async def round(self) -> None:
        """One round: hold the requests ``hold`` asked for (between the same
        two steps as the gather), gather what is new, send it, apply the ack."""
        peer, epoch, sent = self.peer, self._epoch, self.sent
        self._peer_changed.clear()
        now = time.monotonic()
        for rid in [rid for rid, (_, holder, until) in self.adopting.items() if until <= now or holder != peer[0]]:
            _, holder, _ = self.adopting.pop(rid)  # never arrived, was refused, or sits elsewhere: send it from here
            self.counts["adopt_fallbacks"] += 1
            self._warn.warning(("adopt",), "the replica of %s to claim is not at %s (written at %s); sending it from here",
                               rid, peer[0], holder)
        adopt = {rid: writer for rid, (writer, _, _) in self.adopting.items()}
        for rid in [rid for rid, (holder, _, until) in self.kept_at.items() if until <= now or holder != peer[0]]:
            del self.kept_at[rid]                 # never ran here, or the copy sits elsewhere: sent whole
        kept = {rid: n for rid, (_, n, _) in self.kept_at.items()}
        retry = {rid for rid, t in self.retry_at.items() if t > now}
        tickets = {rid: ticket for rid, (holder, ticket, _) in self.tickets.items() if holder == peer[0]}
        exact = peer[0] == self.partner
        budget = None
        if self.rate > 0:
            self._allowance = min(self._allowance + (now - self._filled_at) * self.rate, max(1.0, self.rate * BURST_S))
            self._filled_at, budget = now, int(self._allowance)

        holds = dict(self._holds) if exact else {}

        def hold_and_collect(engine: Any) -> tuple[tuple, dict[str, int | None]]:
            made = {rid: self._hold(engine, rid) for rid in holds}
            return collect(engine, sent, retry, adopt, tickets, exact, kept, budget), made
        (msg, buf, lag, spent), made = await self.driver.call(hold_and_collect, timeout=self.timeout)
        for rid, fut in holds.items():            # answered once the round is sent (below, at once)
            if self._holds.get(rid) is fut:
                del self._holds[rid]
            asyncio.get_running_loop().call_soon(_settle, fut, made[rid])
        self.lag_tokens = lag
        if budget is not None:
            self._allowance -= spent
            self.counts["rate_limited"] += spent == budget and lag > 0
        self.counts["rounds"] += 1
        if msg is None:
            return
        try:
            msg = protocol.ReplicaData(id=f"rep-{self.name}-{self.counts['rounds']}",
                                       deadline=time.time() + self.timeout, source=self.name, **msg)
            conn = await self._connect(*peer)
            ack = await self._call_unless_peer_changes(conn, msg)
        finally:
            if buf is not None:
                STAGING.release(buf)
        if ack is None or epoch != self._epoch:
            return                                # the peer changed meanwhile: this round no longer matters
        if not isinstance(ack, protocol.ReplicaAck):
            raise RuntimeError(f"peer {peer[0]} answered {_why(ack)}")
        self.counts["messages"] += 1
        if peer[0] == self.partner:
            self.partner_prompting = ack.prompting
        if msg.tensors:
            self.counts["rows" if msg.rows else "blocks"] += sum(msg.counts)
            self.counts["bytes"] += msg.tensors[0].nbytes
        # a request handed here again while this round was out: its answer is stale (kept, grant)
        again = {rid for rid, (_, _, until) in self.kept_at.items() if until - KEPT_WAIT_S > now}
        for rid in msg.frees:
            sent.pop(rid, None)
            self.retry_at.pop(rid, None)
            self.adopting.pop(rid, None)
            if rid in self.tickets and self.tickets[rid][2] <= now:
                del self.tickets[rid]
        for rid, n in ack.held.items():
            if rid in again:
                continue
            if rid in msg.request_ids and not (n == 0 and rid in self.kept_at):   # else: not kept yet
                sent[rid] = n
                self.kept_at.pop(rid, None)
            elif rid in msg.adopt and self.adopting.pop(rid, None) is not None:
                sent[rid] = n
                self.counts["adopted"] += 1
        for rid, why in ack.refused.items():
            if rid in msg.request_ids:
                self.counts["refused"] += 1
                self.retry_at[rid] = time.monotonic() + REFUSED_RETRY_S
                self._warn.warning(("refused", why[:40]), "peer %s refused the replica of %s: %s",
                                   peer[0], rid, why)

    async def _call_unless_peer_changes(self, conn: Connection, msg: protocol.ReplicaData) -> protocol.Message | None:
        """``msg``'s answer from the peer (deadline: the cluster's request
        timeout), or None as soon as the peer changes: a round waiting on a
        peer that died must not hold up replication to the next one."""
        call = asyncio.ensure_future(protocol.call(conn, msg, timeout=self.timeout))
        changed = asyncio.ensure_future(self._peer_changed.wait())
        try:
            await asyncio.wait({call, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        if not call.done():
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, TransportError, TimeoutError):
                await call
            return None
        return call.result()

    def stats(self) -> dict[str, Any]:
        return {"peer": self.peer[0] if self.peer else "", "requests": len(self.sent),
                "lag_tokens": self.lag_tokens, **self.counts, **(self.rule.counts if self.rule else {}),
                **({"partner_prompting": self.partner_prompting} if self.partner else {})}


def first_blocks(kv: Any, k: int) -> Any:
    """``kv[:, :, :k]`` of a contiguous staged [L, 2, n, ...] tensor, as a contiguous copy
    made by numpy on the calling thread alone. A torch copy would start an OpenMP team on
    this executor thread, beside the engine thread's, and libgomp would throttle both
    (``engine_driver.load_engine``)."""
    import numpy as np
    import torch

    raw = kv.view(torch.uint8).numpy()[:, :, :k]          # every dtype as bytes (bf16 has no numpy twin)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(kv.dtype)


async def send_prompt_replica(conn: Connection, *, source: str, owner: str, request_id: str, ticket: str,
                              prompt: list[int], kv: Any, block_size: int, timeout: float) -> tuple[str, str]:
    """Prefill node: send the full blocks of ``prompt`` (their KV: ``kv``,
    the staged [L, 2, n, bs, kvh, hd] of every prompt block) to ``owner``'s
    replica peer over ``conn``, as a replica ``owner`` adopts, with the
    coordinator's ``ticket`` for it there. Returns
    (outcome, why): ``sent``, ``empty`` (no full block), ``refused`` (the
    holder's answer) or ``failed`` (transport, deadline). Never raises
    TransportError; ``kv`` is read until it returns."""
    k = len(prompt) // block_size
    if k == 0:
        return "empty", ""
    frame = kv if k == kv.shape[2] else await asyncio.to_thread(first_blocks, kv, k)
    msg = protocol.ReplicaData(id=f"rep-{source}-{request_id}", deadline=time.time() + timeout, source=source,
                               owner=owner, block_size=block_size, request_ids=(request_id,), starts=(0,),
                               counts=(k,), token_ids=tuple(prompt[:k * block_size]), tensors=(frame,),
                               tickets={request_id: ticket})
    try:
        ack = await protocol.call(conn, msg, timeout=timeout)
    except (TransportError, TimeoutError) as exc:
        return "failed", str(exc) or type(exc).__name__
    if not isinstance(ack, protocol.ReplicaAck):
        return "refused", _why(ack)
    if request_id in ack.refused:
        return "refused", ack.refused[request_id]
    if ack.held.get(request_id) != k * block_size:
        return "refused", f"the holder holds {ack.held.get(request_id, 0)} of {k * block_size} tokens"
    return "sent", ""


def _why(msg: Any) -> str:
    return getattr(msg, "message", None) or getattr(msg, "reason", None) or getattr(msg, "TYPE", repr(msg))


def _settle(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():                            # its waiter may have timed out
        fut.set_result(value)
