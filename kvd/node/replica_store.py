"""The replicas a node holds for its peers (DéjàVu §4.2.3; the sending side
and the protocol: kvd/node/replication.py).

A replica is the request's full blocks, held in the host tier as private
blocks (a REPLICA ``Region``: in no index, so no prefix lookup of any
request ever matches them, and no eviction takes them), keyed by (sender,
request id): a node can touch only its own replicas, whatever it sends. A replica of request R run by node S is
written only with the coordinator's ticket for (this holder, S, R)
(kvd/trust.py): the coordinator hands it to S with R (and to R's prefill
node, which writes the prompt's replica for S), and repeats the tickets of
S's requests for S's current peer in S's heartbeat replies; an entry
without a valid ticket is refused in the ack (``no_ticket``). The blocks
held for all senders together stay within ``replica_kv_blocks``; a replica
past that (or past the host tier) is refused in the ack, counted and
logged, never dropped silently. The holder reports what it holds in each
heartbeat (DéjàVu's ``(x, j, t)``); the coordinator tells it in the reply
which replicas to drop (their requests ended). On recovery the
coordinator asks the holder to resume a request (``replica_from``): the
replica is taken out of the store, and the owner's commit indexes the
blocks where it agrees with the tokens the coordinator knows, as that
request's own KV (``commit``); that lock is released once the resumed
request's prefix match has taken them.

Pairs (docs/cluster.md, "Pairs and roles"): a paired node's replica peer is
its partner, and the replicas it holds are the pair's redundant copies. They
are the inbox's REPLICA purpose, not a purpose of their own: a copy has a
replica's whole lifecycle (appended each round, dropped when its request
ends, taken and committed when the request resumes here), and a planned
handoff resumes from it exactly as a recovery does. What a pair adds is a
gate (``partner``; kvd/trust.py ``pair_refusal``): a paired node takes
copies of its partner's requests only; any other writer is refused in the
ack and counted (``not_partner``), whatever ticket it shows. And a handoff
swaps the roles of copy and original instead of rebuilding the copy: the
node a request leaves ``keep``s its own KV of it (every token it computed,
copied into a REPLICA region here before the request moves) as the
partner's copy of it from that moment, keyed (partner, request) as if the
partner had written it (the coordinator records the tokens kept): the
partner's rounds extend the copy from where it ends
(kvd/node/replication.py ``kept``), and a handoff back may follow at its
next step; nothing is sent again from block 0. A pair's copy is current
to the token (each round writes the tokens its owner computed since the
last one as token rows where the copy ends, ``_apply_rows``; its last
block partial), and a request resumed from a copy that holds every token
it computed decodes from it at once (``reservation``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import Any

from engine.exact_copy import copyable
from engine.memory.mempool import PrefixLock
from engine.memory.region import Purpose, Region, RegionState
from engine.memory.token_rows import write_rows
from engine.prefill_alone import prompt_pending
from engine.stream import STAGING
from kvd import protocol, trust
from kvd.node.engine_driver import EngineDriver


@dataclass
class Replica:
    source: str                          # who may extend it (its key's sender)
    tokens: list[int] = field(default_factory=list)
    region: Region | None = None         # its KV: private blocks, in no index (a REPLICA region)
    owner: str = ""                      # a prefill node's write: the decode node that may adopt it
    lock: PrefixLock | None = None       # once a recovery committed it: the indexed prefix, until admitted
    used: float = 0.0                    # monotonic time it last grew (least recently useful first)
    kept: bool = False                   # kept here at a handoff, not extended by its owner yet

    @property
    def blocks(self) -> int:
        return self.region.blocks if self.region is not None else 0

    def usable(self, known: list[int]) -> int:
        """How many leading tokens of ``known`` (a request's prompt and the
        tokens its client has) this replica's KV is: where they agree,
        short of the last known token (its KV is the resumed step's)."""
        n = min(len(self.tokens), len(known) - 1)
        return next((i for i, (a, b) in enumerate(zip(self.tokens[:n], known)) if a != b), max(n, 0))


class ReplicaStore:
    """The replicas this node holds for its peers (module docstring).

    ``key``: this node's replica key, from the coordinator's Welcome
    (kvd/trust.py); until it comes, every replica is refused."""

    def __init__(self, driver: EngineDriver, budget_blocks: int, timeout: float) -> None:
        self.driver = driver
        self.budget = budget_blocks
        self.timeout = timeout
        self.key: str | None = None
        self.partner = ""                    # paired: the one node whose copies this node holds
        self.replicas: dict[tuple[str, str], Replica] = {}
        self.awaited: set[tuple[str, str]] = set()   # copies a resume waits for: never dropped meanwhile
        self._grew = asyncio.Event()                 # set (and replaced) after each round applied
        self.counts = {"received_blocks": 0, "received_rows": 0, "refused": 0, "no_ticket": 0, "dropped": 0,
                       "resumed": 0, "adopted": 0, "not_partner": 0, "kept": 0, "kept_blocks": 0,
                       "resumed_exact": 0, "reclaimed": 0, "reclaimed_blocks": 0}

    @property
    def blocks(self) -> int:
        return sum(r.blocks for r in list(self.replicas.values()))

    def tier_blocks(self) -> dict[str, int]:
        """Blocks held as copies, by tier (what memory the copies cost)."""
        out = {"device": 0, "host": 0}
        for rep in list(self.replicas.values()):
            if rep.region is not None:
                out[rep.region.tier] = out.get(rep.region.tier, 0) + rep.region.blocks
        return out

    def report(self) -> dict[str, dict[str, int]]:
        """sender -> {request id -> tokens held}: the heartbeat's ``replicas``."""
        out: dict[str, dict[str, int]] = {}
        for (source, rid), rep in list(self.replicas.items()):
            out.setdefault(source, {})[rid] = len(rep.tokens)
        return out

    def ticket_refusal(self, msg: protocol.ReplicaData, request_id: str) -> str | None:
        """Why ``msg`` may not write the replica of ``request_id`` here (no
        valid coordinator ticket for it at this node), or None."""
        owner = msg.owner or msg.source
        if self.key is None:
            return "this node has no replica key yet (not registered with the coordinator)"
        if not trust.valid_ticket(self.key, owner, request_id, msg.tickets.get(request_id, "")):
            return f"no valid coordinator ticket for a replica of {request_id} run by {owner} at this node"
        return None

    async def on_data(self, msg: protocol.ReplicaData) -> protocol.ReplicaAck:
        """Apply one round from ``msg.source`` (already authenticated as it)."""
        try:
            return await self.driver.call(
                lambda engine: replace(self._apply(engine, msg), prompting=prompt_pending(engine)),
                timeout=self.timeout)
        finally:
            grew, self._grew = self._grew, asyncio.Event()
            grew.set()

    async def take_current(self, source: str, request_id: str, tokens: int, wait: float) -> Replica | None:
        """``take`` the copy of ``request_id`` from ``source``, a live
        partner that handed it off here, once it holds ``tokens`` tokens (the
        KV of every token the client has but the last: its writer computed
        them, and its next round brings them) or ``wait`` seconds passed;
        the copy is not dropped meanwhile (the writer's ``frees``, the
        coordinator's ``drop``)."""
        key = (source, request_id)
        deadline = time.monotonic() + wait
        self.awaited.add(key)
        try:
            while (rep := self.replicas.get(key)) is not None and len(rep.tokens) < tokens:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._grew.wait(), left)
        finally:
            self.awaited.discard(key)
        return self.take(source, request_id)

    def _apply(self, engine: Any, msg: protocol.ReplicaData) -> protocol.ReplicaAck:
        pool = engine.pool
        bs = pool.block_size
        for rid in msg.frees:                # (not a copy kept here since: a round from before the handoff)
            if not getattr(self.replicas.get((msg.source, rid)), "kept", False):
                self._drop_now(pool, (msg.source, rid))
        held, refused = self._adopt(msg), {}
        if not msg.request_ids:
            return protocol.ReplicaAck(id=msg.id, held=held, refused=refused)
        if why := trust.pair_refusal(self.partner, msg):
            self.counts["not_partner"] += len(msg.request_ids)
            self.counts["refused"] += len(msg.request_ids)
            return protocol.ReplicaAck(id=msg.id, held=held, refused={rid: why for rid in msg.request_ids})
        for rid in msg.request_ids:
            if why := self.ticket_refusal(msg, rid):
                refused[rid] = why
        if refused:
            # a message with an entry it may not write changes nothing (its frame is one for all)
            self.counts["no_ticket"] += len(refused)
            self.counts["refused"] += len(msg.request_ids)
            why = "another entry of this message has no valid ticket"
            return protocol.ReplicaAck(id=msg.id, held=held,
                                       refused={rid: refused.get(rid, why) for rid in msg.request_ids})
        if why := _layout_refusal(pool.kv_layout(), msg):
            self.counts["refused"] += len(msg.request_ids)
            return protocol.ReplicaAck(id=msg.id, refused={rid: why for rid in msg.request_ids})
        if msg.rows:
            return self._apply_rows(pool, msg, held, refused)
        kv = msg.tensors[0].to_torch()
        total = self.blocks
        off = tok = 0
        for rid, start, count in zip(msg.request_ids, msg.starts, msg.counts):
            payload = kv[:, :, off:off + count]
            ntok = count * bs
            new_tokens = msg.token_ids[tok:tok + ntok]
            off, tok = off + count, tok + ntok
            key = (msg.source, rid)
            rep = self.replicas.get(key)
            have = len(rep.tokens) if rep is not None else 0
            if start != have - have % bs:    # a gap or a resend: the sender restarts from what is held
                held[rid] = have
                continue
            again = 1 if have % bs else 0    # the partial last block held, written again fuller
            if total + count - again > self.budget:
                refused[rid] = f"over the replica budget of {self.budget} blocks (replica_kv_blocks)"
                continue
            region = rep.region if rep is not None else None
            if region is None:
                region = pool.reserve_region((), tier=self._tier(pool, count), purpose=Purpose.REPLICA)
            if again:
                region.fill_blocks(region.blocks - 1, payload[:, :, :1], (0, payload.shape[0]))
            grown = self._append(pool, region, payload[:, :, again:])
            if grown is None:
                if region.state is not RegionState.RESERVED:    # moved off the device and lost on the way
                    self.replicas.pop(key, None)
                    self.counts["dropped"] += 1
                refused[rid] = "the host tier is full"
                continue
            region = grown
            rep = rep or Replica(msg.source, owner=msg.owner)
            rep.region, rep.used, rep.kept = region, time.monotonic(), False
            del rep.tokens[start:]
            rep.tokens.extend(new_tokens)
            total += count - again
            self.replicas[key] = rep
            held[rid] = len(rep.tokens)
            self.counts["received_blocks"] += count - again
        self.counts["refused"] += len(refused)
        return protocol.ReplicaAck(id=msg.id, held=held, refused=refused)

    def _apply_rows(self, pool: Any, msg: protocol.ReplicaData, held: dict[str, int],
                    refused: dict[str, str]) -> protocol.ReplicaAck:
        """``_apply`` for a round of token rows (a pair's copy): each entry's
        rows written on where the copy ends (``starts[i]`` must be that
        end; else the ack says what is held and the sender resends from
        there), within the budget; a device copy with no room to grow moves
        to the host tier whole."""
        bs = pool.block_size
        rows = msg.tensors[0].to_torch()
        total, off = self.blocks, 0
        for rid, start, count in zip(msg.request_ids, msg.starts, msg.counts):
            payload, new_tokens = rows[:, :, off:off + count], msg.token_ids[off:off + count]
            off += count
            key = (msg.source, rid)
            rep = self.replicas.get(key)
            region = rep.region if rep is not None else None
            have = len(rep.tokens) if region is not None else 0
            if start != have:
                held[rid] = have
                continue
            grow = max(0, -(-(start + count) // bs) - (region.blocks if region is not None else 0))
            if total + grow > self.budget:
                refused[rid] = f"over the replica budget of {self.budget} blocks (replica_kv_blocks)"
                continue
            if region is None:
                region = pool.reserve_region((), tier=self._tier(pool, grow), purpose=Purpose.REPLICA)
            grown = self._write_rows(pool, region, start, payload)
            if grown is None:
                if region.state is RegionState.RESERVED and rep is None:
                    region.cancel()                 # a new copy: nothing written
                elif region.state is not RegionState.RESERVED and rep is not None:   # moved off the device, lost
                    self.replicas.pop(key, None)
                    self.counts["dropped"] += 1
                refused[rid] = "the host tier is full"
                continue
            rep = rep if rep is not None and rep.region is not None else Replica(msg.source, owner=msg.owner)
            rep.region, rep.used, rep.kept = grown, time.monotonic(), False
            rep.tokens.extend(new_tokens)
            total += grow
            self.replicas[key] = rep
            held[rid] = len(rep.tokens)
            self.counts["received_rows"] += count
        self.counts["refused"] += len(refused)
        return protocol.ReplicaAck(id=msg.id, held=held, refused=refused)

    def _tier(self, pool: Any, blocks: int) -> str:
        """Where a new copy of ``blocks`` blocks goes: a pair's copy in the
        device tier while it has that many blocks free (the partner then
        decodes from it with no swap; this node's own work takes them back,
        ``reclaim``), else, and a ring replica always, the host tier."""
        if self.partner and pool.free_blocks("device") >= blocks:
            if pool.reclaimer is None:
                pool.reclaimer = self
            return "device"
        return "host"

    def _append(self, pool: Any, region: Region, payload: Any) -> Region | None:
        """``region`` grown by ``payload``: a device copy with no room left
        moves to the host tier whole first. None, and the copy is gone, when
        the host tier is short too."""
        return self._grow(pool, region, lambda r: r.append(payload))

    def _write_rows(self, pool: Any, region: Region, start: int, payload: Any) -> Region | None:
        """``region`` holding ``payload``'s rows from token ``start`` on
        (token_rows.py ``write_rows``), moved as ``_append`` moves it."""
        return self._grow(pool, region, lambda r: write_rows(r, start, payload))

    def _grow(self, pool: Any, region: Region, grow: Any) -> Region | None:
        """``region`` after ``grow(region)`` (True: it grew; False: its tier
        is short, nothing changed), a device copy moved to the host tier
        whole and grown there when the device is short. None when the host
        tier is short too: a host copy is then unchanged, a device copy gone."""
        if grow(region):
            return region
        if region.tier == "host":
            return None
        moved = pool.reserve_region((), tier="host", purpose=Purpose.REPLICA)
        layout = pool.kv_layout()
        buf, view = STAGING.acquire((layout.num_layers, 2, region.blocks, *layout.block_shape[2:]), layout.dtype)
        try:
            if region.blocks:
                pool.gather_blocks(region.block_ids, view, (0, layout.num_layers), tier="device")
            ok = moved.append(view) and grow(moved)
        finally:
            STAGING.release(buf)
        region.cancel()
        if not ok:
            moved.cancel()
            return None
        return moved

    def reclaimable(self, tier: str) -> int:
        """MemPool's Reclaimer: blocks of ``tier`` this node's own work may
        take from the copies (those no resume waits for)."""
        return sum(rep.region.blocks for key, rep in list(self.replicas.items())
                   if rep.region is not None and rep.region.tier == tier and key not in self.awaited)

    def reclaim(self, tier: str, n: int) -> int:
        """MemPool's Reclaimer: drop copies in ``tier``, least recently
        grown first, until ``n`` blocks are freed; their requests have no
        copy here until their owner's rounds rebuild it (the holder answers
        them that it holds nothing; the coordinator hands none of them off
        meanwhile: ``replica held``). Engine thread. Returns blocks freed."""
        freed = 0
        victims = sorted(((rep.used, key) for key, rep in list(self.replicas.items())
                          if rep.region is not None and rep.region.tier == tier and key not in self.awaited))
        for _, key in victims:
            if freed >= n:
                break
            rep = self.replicas.pop(key, None)
            if rep is None or rep.region is None:
                continue
            blocks, region, rep.region = rep.region.blocks, rep.region, None
            region.cancel()
            freed += blocks
            self.counts["reclaimed"] += 1
            self.counts["reclaimed_blocks"] += blocks
        return freed

    def _adopt(self, msg: protocol.ReplicaData) -> dict[str, int]:
        """Take over the replicas ``msg.adopt`` names (request -> the node that wrote
        them) for ``msg.source``, when that source is their owner. Returns what is
        held now for each named request, by request id. Mutates the store."""
        held = {}
        for rid, writer in msg.adopt.items():
            key = (msg.source, rid)
            rep = self.replicas.get((writer, rid))
            if key not in self.replicas and rep is not None and rep.owner == msg.source:
                del self.replicas[(writer, rid)]
                rep.source, rep.owner = msg.source, ""
                self.replicas[key] = rep
                self.counts["adopted"] += 1
            if key in self.replicas:
                held[rid] = len(self.replicas[key].tokens)
        return held

    async def keep(self, request_id: str, owner: str) -> int:
        """This node hands ``request_id``, still running here, to ``owner``
        (its partner): keep this node's KV of it as ``owner``'s copy of it,
        keyed (``owner``, request id) as if ``owner`` had written it, so
        the copy is complete at once instead of rebuilt from block 0 (a
        stale copy under that key is dropped). Copies the request's
        computed blocks (the last one partial) into host blocks of a
        REPLICA region on the engine thread, within ``replica_kv_blocks``
        (past it, or past the host tier, nothing is kept). Returns the
        tokens kept (0: nothing: the request is not running here, or no
        room)."""
        return await self.driver.call(lambda engine: self._keep(engine, request_id, owner), timeout=self.timeout)

    def _keep(self, engine: Any, request_id: str, owner: str) -> int:
        found = next((r for r in copyable(engine) if r[0] == request_id), None)
        if (found is None or not found[3] or (owner, request_id) in self.awaited
                or self.blocks + len(found[3]) > self.budget):
            return 0
        _, _, tokens, ids = found
        pool, layout = engine.pool, engine.pool.kv_layout()
        buf, view = STAGING.acquire((layout.num_layers, 2, len(ids), *layout.block_shape[2:]), layout.dtype)
        try:
            pool.gather_blocks(ids, view, (0, layout.num_layers))
            region = pool.reserve_region((), tier=self._tier(pool, len(ids)), purpose=Purpose.REPLICA)
            if not region.append(view):
                region.cancel()
                return 0
        finally:
            STAGING.release(buf)
        self._drop_now(pool, (owner, request_id))
        self.replicas[(owner, request_id)] = Replica(owner, list(tokens), region, used=time.monotonic(), kept=True)
        self.counts["kept"] += 1
        self.counts["kept_blocks"] += len(ids)
        return len(tokens)

    def _drop_now(self, pool: Any, key: tuple[str, str]) -> bool:
        if key in self.awaited:          # a resume takes it in a moment
            return False
        rep = self.replicas.pop(key, None)
        if rep is None:
            return False
        if rep.region is not None:
            rep.region.cancel()
        self.counts["dropped"] += 1
        return True

    async def drop(self, request_ids: tuple[str, ...] | list[str], source: str | None = None) -> int:
        """Drop the replicas of ``request_ids`` (from ``source``, or any). Returns how many."""
        def run(engine: Any) -> int:
            keys = [k for k in self.replicas if k[1] in request_ids and (source is None or k[0] == source)]
            return sum(self._drop_now(engine.pool, k) for k in keys)
        if not any(k[1] in request_ids for k in self.replicas):
            return 0
        return await self.driver.call(run, timeout=self.timeout)

    def take(self, source: str, request_id: str) -> Replica | None:
        """Take a replica out of the store for recovery: ``commit`` what the
        resumed request may use of it, then ``release`` it once that request
        was admitted (or did not run)."""
        rep = self.replicas.pop((source, request_id), None)
        if rep is not None:
            self.counts["resumed"] += 1
        return rep

    async def commit(self, rep: Replica, known: list[int]) -> None:
        """The owner's commit of a taken replica, for the request whose
        prompt and client-held tokens are ``known`` (the coordinator's): the
        whole blocks of its ``usable`` part become the cached KV of those
        tokens, locked until ``release``, so the resumed request's prefix
        lookup finds them; the rest of the replica is freed. Nothing of a
        replica that disagrees with ``known`` is ever indexed under them."""
        region = rep.region
        if region is None:
            return
        rep.region = None
        prefix = list(known[:rep.usable(known)])
        try:
            rep.lock = await self.driver.call(lambda engine: region.commit(prefix), timeout=self.timeout)
        except BaseException:
            rep.region = region if region.state is RegionState.RESERVED else None   # ``release`` frees it
            raise

    def reservation(self, rep: Replica, known: list[int]) -> Callable[[Any], Region | None] | None:
        """What turns a taken copy that holds the KV of every token of
        ``known`` (the request's prompt and client-held tokens) but the last
        into the PROMPT region of those tokens the resumed request decodes
        from with nothing recomputed (engine/exact_copy.py
        ``resume_from_copy``): the cached prefix here as its lookup, then the
        copy's own blocks past it when the copy is in the device tier
        (nothing copied: they become the request's), else copied into fresh
        device blocks; the copy's other blocks are freed. It is a function
        of the engine, run on its thread between two steps
        (``resume_from_copy`` runs it where it admits the request), that
        returns the region, or None, and nothing changes, when the device
        tier is short. None when the copy is shorter or disagrees
        (``commit`` it instead)."""
        region, tokens = rep.region, tuple(known[:-1])
        if region is None or not tokens or rep.usable(known) < len(tokens):
            return None

        def run(engine: Any) -> Region | None:
            pool = engine.pool
            out = pool.reserve_region(tokens, purpose=Purpose.PROMPT)
            if out is None:
                return None
            if out.block_ids and region.tier == "device":     # the copy's blocks are the request's from now on
                cut = slice(out.have_blocks, len(out.all_ids))
                region.block_ids[cut], out.block_ids = out.block_ids, region.block_ids[cut]
            elif out.block_ids:
                src = region.block_ids[out.have_blocks:len(out.all_ids)]
                layout = pool.kv_layout()
                buf, view = STAGING.acquire((layout.num_layers, 2, len(src), *layout.block_shape[2:]), layout.dtype)
                try:
                    pool.gather_blocks(src, view, (0, layout.num_layers), tier=region.tier)
                    out.fill(view, (0, layout.num_layers))
                except BaseException:
                    out.cancel()
                    raise
                finally:
                    STAGING.release(buf)
            region.cancel()
            rep.region = None
            self.counts["resumed_exact"] += 1
            return out
        return run

    async def release(self, rep: Replica) -> None:
        """Give a taken replica back: its lock (committed) or its blocks (not)."""
        lock, region = rep.lock, rep.region
        rep.lock = rep.region = None

        def run(engine: Any) -> None:
            if lock is not None:
                engine.pool.unlock(lock)
            if region is not None:
                region.cancel()
        if lock is not None or region is not None:
            await self.driver.call(run, timeout=self.timeout)

    def stats(self) -> dict[str, Any]:
        tiers = self.tier_blocks()
        return {"replicas": len(self.replicas), "blocks": self.blocks, "budget_blocks": self.budget,
                "device_blocks": tiers["device"], "host_blocks": tiers["host"], **self.counts}


def _layout_refusal(layout: Any, msg: protocol.ReplicaData) -> str | None:
    """Why ``msg``'s frame does not fit this node's KV layout, or None when it does."""
    frame, bs = msg.tensors[0], layout.block_shape[2]
    want = (layout.num_layers, 2, sum(msg.counts), *layout.block_shape[3 if msg.rows else 2:])   # rows: no bs axis
    if msg.block_size == bs and tuple(frame.shape) == want and frame.dtype == protocol.dtype_name(layout.dtype):
        return None
    return (f"layout mismatch: this node holds [{', '.join(map(str, want))}] {protocol.dtype_name(layout.dtype)} "
            f"in blocks of {bs}, got [{', '.join(map(str, frame.shape))}] {frame.dtype} in blocks of "
            f"{msg.block_size}")
