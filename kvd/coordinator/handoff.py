"""Handoffs: moving a running decode to its node's pair partner (AcceLLM §4;
docs/cluster.md, "Pairs and roles").

A paired node's partner holds the redundant copy of each of its requests
(kvd/node/replica_store.py), so a decode moves between them with no KV
transfer: ``Failover.hand_off`` resumes it on the partner after the tokens
the client has, from the copy (recomputing what the copy lacks), and stops
it on the source, at a step boundary of each. First the source holds it
(admin ``hold``: no step decodes it there any more, and the same round
brings the partner's copy up to every token it computed; a node switched
to prefill has already stopped decoding those it could at its switch, and
this hold then only brings their copies up to date), and the move waits
for the tokens it made: the partner resumes after the last of them,
and no token is computed twice. Once the partner took it and
before it stops there, the source keeps its own KV of the request as the
partner's copy of it (admin ``replica keep``) and says how many tokens it
kept (recorded in ``kept``): copy and original swap roles, the copy is
complete from the moment of the handoff (a handoff back may follow at the
new owner's next step), and it is never rebuilt from block 0 after a
move. The stream goes on with no gap and no duplicate (tokens are
deduplicated by index).

``Handoffs`` decides which requests may move (``refusal``) and moves them:
one by one (``hand_off``, the admin command ``handoff``) or every decode of
a node switched to prefill (``evacuate``, an owned task that keeps handing
off the decodes that become eligible until none is left on the node, its
role changes or ``EVACUATE_S`` passed; the rest finish where they are). A
request is never handed off whose copy is incomplete: not every full block
of its prompt at the partner, as the partner answers when asked (``held``);
nor, after a move, before its new owner made a token (its copy at the
partner is the one kept at the move, and its leg there is still starting).

Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvd.cluster_config import Role
from kvd.coordinator.roles import DECODES
from transports import TransportError

if TYPE_CHECKING:
    from kvd.coordinator.client import RemoteEngineClient
    from kvd.coordinator.membership import NodeInfo
    from kvd.coordinator.stream import Stream

log = logging.getLogger("kvd.coordinator.handoff")

EVACUATE_S = 30.0          # how long a node switched to prefill keeps handing its decodes off
EVACUATE_POLL_S = 0.05     # between two sweeps of its decodes
HOLD_WAIT_S = 0.25         # how long a move waits for the tokens its source made before it held the request

Forward = Callable[[str, str, dict], Awaitable[dict]]


class Handoffs:
    """Which decodes may move to their node's partner, and moving them
    (module docstring). ``forward``: the coordinator's admin forward to a
    node, for asking a partner what it holds."""

    def __init__(self, client: RemoteEngineClient, forward: Forward) -> None:
        self.client = client
        self.forward = forward          # (node, admin command, args) -> its result (ValueError, TransportError)
        self.recovery = client.recovery
        self.pairs = client.recovery.pairs
        self.moving: set[str] = set()   # request ids a hand_off call is moving now
        self.moved_at: dict[str, int] = {}   # request id -> tokens the client had at its last move
        self.kept: dict[str, tuple[str, int]] = {}   # request id -> (node, tokens) its last move's source kept

    def _stream(self, request_id: str) -> Stream | None:
        return self.client.failover.streams.get(request_id)

    def refusal(self, request_id: str, mine: bool = False) -> tuple[str, NodeInfo, NodeInfo] | str:
        """(request id, source, target) when ``request_id`` may be handed off
        now as far as the coordinator knows (its copy is ``held``'s to
        check), else why not (in words). ``mine``: the caller is the
        ``hand_off`` that marked it moving. Reads only."""
        stream = self._stream(request_id)
        if stream is None:
            return f"request {request_id!r} is not in flight"
        nodes = self.client.membership.nodes
        source = nodes.get(stream.node)
        if source is None:
            return f"request {request_id} runs on {stream.node}, which is not registered"
        if stream.recovering or (request_id in self.moving and not mine):
            return f"request {request_id} is being moved already"
        if not decoding(stream):
            return f"request {request_id} is not decoding yet (its prompt is being computed)"
        if len(stream.tokens) <= self.moved_at.get(request_id, -1):
            return (f"request {request_id} is not decoding yet on {source.name} (handed off there after "
                    f"{self.moved_at[request_id]} tokens, none since)")
        target = self.pairs.partner(source.name, nodes)
        if target is None:
            return f"node {source.name} has no registered partner"
        if target.role not in DECODES or target.draining or target.name not in self.client.links:
            return f"partner {target.name} does not take decodes now ({target.role}, draining={target.draining})"
        return request_id, source, target

    async def held(self, request_id: str, source: NodeInfo, target: NodeInfo) -> str | None:
        """Why ``target`` cannot take ``request_id`` (run by ``source``) now,
        asking it: its copy is incomplete (fewer tokens than every full block
        of the prompt), or its own earlier leg of the request, handed off
        from there, has not stopped yet. None: it can."""
        stream = self._stream(request_id)
        full = stream.prompt_len // source.block_size * source.block_size if stream else 0
        try:
            reply = await self.forward(target.name, "replica held", {"source": source.name, "request": request_id})
        except (ValueError, TransportError, TimeoutError) as exc:
            return f"{target.name} did not say what it holds of request {request_id}: {exc}"
        held = reply["tokens"]
        if reply.get("running"):          # its leg from before a handoff has not stopped yet: it would refuse
            return f"{target.name} is still stopping its earlier leg of request {request_id}"
        if held < full:
            return (f"the copy of request {request_id} at {target.name} is incomplete ({held} of its "
                    f"prompt's {full} tokens)")
        return None

    async def hand_off(self, request_id: str) -> dict:
        """Move ``request_id`` to its node's partner. Raises ValueError (and
        nothing changes) when it may not move (``refusal``) or the partner
        refused it (the request is then recovered elsewhere)."""
        checked = self.refusal(request_id)
        if isinstance(checked, str):
            self.pairs.refused[_reason(checked)] += 1
            raise ValueError(checked)
        _, source, target = checked
        self.moving.add(request_id)
        try:
            why = await self.held(request_id, source, target)
            again = self.refusal(request_id, mine=True)       # what changed while the partner answered
            if why is None and again != checked:
                why = again if isinstance(again, str) else f"request {request_id} moved meanwhile"
            if why is not None:
                self.pairs.refused[_reason(why)] += 1
                raise ValueError(why)
            why = await self._move(request_id, source, target)
        finally:
            self.moving.discard(request_id)
        if why is not None:
            raise ValueError(f"{target.name} did not take request {request_id}: {why}")
        return {"request": request_id, "from": source.name, "to": target.name,
                "tokens": len(self._stream(request_id).tokens) if self._stream(request_id) else 0}

    async def _move(self, request_id: str, source: NodeInfo, target: NodeInfo) -> str | None:
        stream = self._stream(request_id)
        await self._hold(request_id, source.name, stream)
        replica = self.recovery.replica_fields(target.name, request_id, self.client.membership.nodes.values())
        t0 = time.perf_counter()

        async def keep() -> None:
            await self._keep(request_id, source.name, target.name)
        why = await self.client.failover.hand_off(request_id, stream, source, target, replica, keep)
        if why is None:
            self.pairs.handoffs[source.name] += 1
            streams = self.client.failover.streams
            self.moved_at = {rid: n for rid, n in self.moved_at.items() if rid in streams}
            self.moved_at[request_id] = len(stream.tokens)
            log.info("request %s handed off %s -> %s after %d token(s) in %.1f ms", request_id, source.name,
                     target.name, len(stream.tokens), (time.perf_counter() - t0) * 1e3)
        else:
            self.pairs.refused["partner refused"] += 1
            log.warning("request %s: handoff %s -> %s refused: %s", request_id, source.name, target.name, why)
        return why

    async def _hold(self, request_id: str, source: str, stream: Stream) -> None:
        """``source`` stops decoding ``request_id`` at its next step boundary
        and brings the partner's copy up to every token it computed (admin
        ``hold``); then the tokens it made are awaited (up to
        ``HOLD_WAIT_S``), so the partner resumes after the last of them and
        no token is computed twice. A hold that fails is logged: the move
        goes on as before, the source decoding until its Abort (what it
        makes past the resume point is dropped)."""
        try:
            reply = await self.forward(source, "hold", {"request": request_id})
        except (ValueError, TransportError, TimeoutError) as exc:
            log.info("request %s: %s did not hold it for the move (%s)", request_id, source, exc)
            return
        made = reply.get("tokens")
        deadline = time.monotonic() + HOLD_WAIT_S
        while isinstance(made, int) and len(stream.tokens) < made and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    async def try_hand_off(self, request_id: str) -> int:
        """``hand_off``, as a count: 1 when ``request_id`` moved, 0 when it was
        refused (copy incomplete, ...: the caller looks at it again later)."""
        with contextlib.suppress(ValueError):
            await self.hand_off(request_id)
            return 1
        return 0

    async def _keep(self, request_id: str, source: str, target: str) -> None:
        """``source`` keeps its KV of ``request_id`` as ``target``'s copy
        (admin ``replica keep``), then says how many tokens it kept, which
        is recorded (``kept``). A failure is logged and costs only the
        copy's rebuild."""
        try:
            reply = await self.forward(source, "replica keep", {"request": request_id, "owner": target})
        except (ValueError, TransportError, TimeoutError) as exc:
            log.info("request %s: %s kept no copy for %s (%s); it is rebuilt", request_id, source, target, exc)
            return
        streams = self.client.failover.streams
        self.kept = {rid: k for rid, k in self.kept.items() if rid in streams}
        if isinstance(n := reply.get("tokens"), int) and n > 0 and request_id in streams:
            self.kept[request_id] = (source, n)

    def evacuate(self, node: str) -> None:
        """``node`` was switched to prefill: hand its decodes to its partner
        (an owned task; module docstring). Without a partner, nothing moves."""
        if self.pairs.paired(node):
            self.client.node_links.spawn(self._evacuate(node, time.monotonic() + EVACUATE_S))

    async def _evacuate(self, node: str, until: float) -> None:
        moved = 0
        while time.monotonic() < until:
            info = self.client.membership.nodes.get(node)
            left = self.client.streams_on(node)
            if info is None or info.role != Role.PREFILL or not left:
                break
            moved += sum(await asyncio.gather(*(self.try_hand_off(rid) for rid in left)))   # concurrently
            await asyncio.sleep(EVACUATE_POLL_S)
        log.info("node %s: %d decode(s) handed to its partner after its switch to prefill", node, moved)


def decoding(stream: Stream) -> bool:
    """Whether ``stream``'s node decodes it: it has its first token, and of
    a disaggregated request (a prefill leg elsewhere made token 0) one the
    node made itself, so the prompt's KV is there."""
    return len(stream.tokens) >= (2 if stream.prefill else 1)


def _reason(why: str) -> str:
    """A refusal's counter label: its kind, not its request."""
    for kind in ("not in flight", "not registered", "moved already", "not decoding", "no registered partner",
                 "does not take", "incomplete", "still stopping"):
        if kind in why:
            return kind
    return "other"
