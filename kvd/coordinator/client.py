"""RemoteEngineClient: the EngineClient the coordinator's front door talks to.

Each request is routed to one node (``Router``), sent there as a
``GenerateRequest`` over that node's ``NodeLink``, and its ``TokenChunk``s
come back as ``RequestOutput`` deltas — the HTTP layer cannot tell it from an
in-process engine. Contracts:

- Tokens are deduplicated by index (``TokenChunk.start_index``): a chunk that
  repeats tokens already delivered is trimmed, so a later replay/recovery can
  resend safely.
- A stream's chunks that queued while its consumer was busy (the event loop
  behind the nodes) are delivered as one ``RequestOutput``
  (``RequestOutput.merge``), as the node's ``OutputCollector`` merges the
  engine's: the loop's work per request stays one output per pass.
- A node declared dead (``fail_node``) hands each of its streams to
  recovery (kvd/coordinator/failover.py executing kvd/coordinator/recovery.py,
  ``[cluster].recovery``): the
  request resumes on the holder of its replica, or is re-run with its
  tokens so far on another node, and the client's stream goes on with no
  gap and no duplicate (tokens are deduplicated by index). A request that
  cannot be recovered (policy ``fail``, ``max_recoveries`` reached, no node
  left, each candidate refused) ends with ``EngineDead`` naming the node:
  the front door turns it into a 503 or an SSE error event. Nothing waits
  on a dead node.
- A node that leaves on purpose (``node_left``) loses only the requests it
  says it gave up; the others end normally, their last chunks arriving after
  its Goodbye.
- A node that gave requests up because their output could not be delivered
  (its heartbeat's ``lost``: this coordinator stalled past the node's send
  timeout) has each recovered, away from it, or ended with EngineDead at once
  (``lost_by_node``). A node that streams a request it does not serve any
  more (failed over, aborted) is sent an ``Abort`` at its first such chunk.
- Per-node load (``NodeInfo.in_flight``, what routers balance) is changed
  only through ``LoadBook`` (kvd/coordinator/load.py): a request is counted
  where its legs run and released everywhere when it ends.
- Closing a stream early sends ``Abort`` to the node (an owned task).
- Every request ends, and at once when a node will not serve it: a
  ``GenerateRequest`` is a transport request that the node answers with
  ``Accepted`` or an ``Error`` (draining, duplicate, a message it could not
  decode), and one it does not answer within the link's request timeout ends
  with ``EngineDead``. A request whose encoded header exceeds the protocol
  limit is refused here, before it is sent.
- A node that refuses a request because it just started draining is retried
  once on another node, before any token was delivered.
- Disaggregated prefill, the prefill-queue bound and KV return: the
  request's legs are sent by ``LegSender`` (kvd/coordinator/legs.py);
  chunks from either leg feed one stream, delivered in token order and
  once each (``Stream``, kvd/coordinator/stream.py).

The rooms: links and owned send tasks (links.py), one request's stream
(stream.py), leg submission (legs.py), recovery execution (failover.py),
load (load.py). This class holds the streams in flight and wires them
together.

Imports no torch.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from engine.fingerprint import combine
from engine.model.tokenizer import Tokenizer
from engine.request import InvalidParam, RequestOutput, SamplingParams
from engine.stats import COUNTERS, QUEUES
from kvd import protocol
from kvd.coordinator.failover import Failover
from kvd.coordinator.legs import LegSender
from kvd.coordinator.links import REFUSED, NodeLink, NodeLinks
from kvd.coordinator.load import LoadBook
from kvd.coordinator.membership import Membership, NodeInfo
from kvd.coordinator.recovery import RecoveryPolicy
from kvd.coordinator.router import LeastLoadRouter, Router
from kvd.coordinator.stream import Stream, error_output, forget
from transports import Connection

log = logging.getLogger("kvd.coordinator.client")

MAX_ORPHANS = 4096         # (node, request) pairs remembered as aborted orphans (_abort_orphan)


class RemoteEngineClient:
    def __init__(self, model_name: str, tokenizer: Tokenizer, membership: Membership, router: Router,
                 *, prefill_router: Router | None = None, default_max_model_len: int = 2048,
                 stats_source: Callable[[], dict] | None = None,
                 limits: protocol.ProtocolLimits = protocol.DEFAULT_LIMITS,
                 recovery: RecoveryPolicy | None = None, kv_return: bool = False,
                 kv_return_timeout: float = 10.0, prefill_queue_factor: float = 0.0) -> None:
        self.model_name = model_name
        self.limits = limits                   # what a node's decode accepts
        self.tokenizer = tokenizer
        self.membership = membership
        self.default_max_model_len = default_max_model_len
        self.node_links = NodeLinks(self.dispatch)
        self.links: dict[str, NodeLink] = self.node_links.by_node
        self.bad_messages = self.node_links.bad_messages
        self._streams: dict[str, Stream] = {}
        self.load = LoadBook()                 # the one writer of every NodeInfo.in_flight
        self._orphans: dict[tuple[str, str], None] = {}   # (node, request id) aborted as orphans, oldest first
        self.orphans_aborted = 0               # chunks of requests not in flight on their node: Abort sent
        self._stats_source = stats_source
        self._ended_with_error = 0             # refused by their node, or ended by its Error
        self.recovery = recovery or RecoveryPolicy("fail")    # the coordinator passes [cluster].recovery
        self.legs = LegSender(membership, self.node_links, self.load, self._streams, self.recovery,
                              router, prefill_router or LeastLoadRouter(0), kv_return=kv_return,
                              kv_return_timeout=kv_return_timeout, prefill_queue_factor=prefill_queue_factor)
        self.failover = Failover(membership, self.node_links, self.load, self._streams, self.recovery,
                                 lambda nodes, prompt, rid: self.legs.router.pick(nodes, prompt, rid))

    # the routers and counters an operator reads or swaps (admin_commands.py, collector.py)
    @property
    def router(self) -> Router:
        return self.legs.router

    def set_routers(self, router: Router, prefill_router: Router) -> None:
        """Route from the next request on with ``router`` (whole requests and
        decode legs) and ``prefill_router`` (prefill legs)."""
        self.legs.router, self.legs.prefill_router = router, prefill_router

    @property
    def failed_requests(self) -> int:
        return self._ended_with_error + self.failover.failed_requests

    @property
    def recoveries(self) -> collections.Counter[tuple[str, str]]:
        """(how, outcome) -> requests (``RecoveryPolicy.outcomes``)."""
        return self.recovery.outcomes

    @property
    def kv_returns(self) -> collections.Counter[str]:
        return self.legs.kv_returns

    @property
    def prefill_queue_bypassed(self) -> int:
        return self.legs.prefill_queue_bypassed

    def prefill_queue(self, node: NodeInfo) -> int:
        return self.legs.prefill_queue(node)

    # ------------------------------------------------------------ EngineClient
    @property
    def max_model_len(self) -> int:
        lens = [n.max_model_len for n in self.membership.nodes.values() if n.max_model_len]
        return min(lens) if lens else self.default_max_model_len

    @property
    def fingerprint(self) -> str:
        """The build fingerprint of the nodes serving now (engine/fingerprint.py's
        ``combine``: the nodes' own when they agree); "" while none is registered."""
        prints = [n.fingerprint for n in self.membership.nodes.values() if n.fingerprint]
        return combine(prints) if prints else ""

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens < 1:
            raise InvalidParam("prompt", "prompt must contain at least one token")
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise InvalidParam("prompt", f"prompt has {num_prompt_tokens} tokens; this model's "
                               f"context is {limit} tokens")
        if num_prompt_tokens + params.max_tokens > limit:
            raise InvalidParam("max_tokens", f"max_tokens={params.max_tokens} plus the prompt's "
                               f"{num_prompt_tokens} tokens exceeds the context of {limit} tokens")

    def unavailable(self) -> str | None:
        """Why no request could be routed now, or None when some node can take
        one (registered, not draining, linked: what ``LegSender.submit`` picks from)."""
        if any(n.name in self.links for n in self.membership.routable()):
            return None
        nodes = self.membership.nodes
        if not nodes:
            return "no node is serving: none is registered"
        return (f"no node is serving: the {len(nodes)} registered node(s) are draining "
                f"or not linked yet")

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        await self.node_links.close()

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            for leg in stream.legs():
                self.node_links.send_abort(leg, request_id)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise InvalidParam("request_id", f"request id {request_id} is already in flight")
        request = protocol.GenerateRequest(id=request_id, request_id=request_id,
                                           prompt_token_ids=tuple(prompt_ids), sampling=params)
        try:
            header, _ = protocol.encode(request, self.limits)
            stream, node, refusal = await self.legs.submit(request, header, exclude=())
            if refusal is not None and refusal.code == "draining":
                # it began draining before its heartbeat said so: another node, once
                stream, node, refusal = await self.legs.submit(request, header, exclude=(node.name,))
        except protocol.MessageTooLarge as exc:         # nothing was sent, nothing is held
            yield error_output(request_id, prompt_ids, f"the request does not fit the cluster wire ({exc}); "
                                                       "shorten the prompt or the stop conditions")
            return
        if refusal is not None:
            self._ended_with_error += 1
            yield error_output(request_id, prompt_ids, refusal.message or refusal.code, refusal.code)
            return
        finished, pending = False, None
        try:
            while True:
                # bounded: a dead node's streams are failed by the detector
                item = pending if pending is not None else await stream.queue.get()
                pending = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, protocol.Error):
                    finished = True
                    self._ended_with_error += 1
                    yield error_output(request_id, prompt_ids, item.message or item.code, item.code)
                    return
                outs = stream.in_order(item)
                # what queued meanwhile (this loop fell behind the node) goes out as one output
                while not (outs and outs[-1].finished) and not stream.queue.empty():
                    item = stream.queue.get_nowait()
                    if not isinstance(item, protocol.TokenChunk):
                        pending = item
                        break
                    outs += stream.in_order(item)
                if not outs:
                    continue
                out = functools.reduce(RequestOutput.merge, outs)
                if out.finished:
                    finished = True
                    self.legs.maybe_return_kv(stream, out)
                yield out
                if out.finished:
                    return
        finally:
            legs = stream.legs()
            self._forget(request_id)
            if not finished:
                for leg in legs:
                    self.node_links.send_abort(leg, request_id)

    def stats(self) -> dict:
        """Engine-shaped stats for /metrics (engine/stats.py's keys): the
        nodes' last heartbeats, summed."""
        if self._stats_source is not None:
            return dict(self._stats_source(), in_flight=len(self._streams))
        summed = (*QUEUES, *COUNTERS)
        total: dict[str, Any] = dict.fromkeys(summed, 0)
        total.update(step_seconds=0.0, finished=collections.Counter(), kv={})
        for node in self.membership.nodes.values():
            s = node.heartbeat.stats if node.heartbeat else {}
            for key in summed:
                total[key] += int(s.get(key, 0))
            total["step_seconds"] += float(s.get("step_seconds", 0.0))
            total["finished"].update(s.get("finished", {}))
            for tier, values in s.get("kv", {}).items():
                if isinstance(values, dict):
                    agg = total["kv"].setdefault(tier, collections.Counter())
                    agg.update({k: v for k, v in values.items() if isinstance(v, int)})
        total["finished"] = dict(total["finished"])
        total["in_flight"] = len(self._streams)
        return total

    def _forget(self, request_id: str) -> None:
        forget(self._streams, self.load, request_id)

    def dispatch(self, node: str, msg: protocol.Message) -> None:
        """A message a node pushed: route it to its request's stream."""
        rid = getattr(msg, "request_id", None)
        stream = self._streams.get(rid) if rid else None
        if stream is None or node not in stream.legs():
            # finished, aborted or failed over: late chunks are dropped, and a node still
            # running a request that is not its own any more is told to stop (an Abort lost)
            if isinstance(msg, protocol.TokenChunk) and msg.finish_reason is None:
                self._abort_orphan(node, rid)
            return
        if isinstance(msg, protocol.Error) and msg.code == REFUSED:   # from either leg: the request ends
            for leg in stream.legs():
                self.node_links.send_abort(leg, rid, reason="a message about it was refused")
            stream.queue.put_nowait(msg)
            return
        if node != stream.node:            # the prefill leg: token 0; its errors are the decode node's to handle
            if isinstance(msg, protocol.TokenChunk):
                stream.queue.put_nowait(msg)
                self.load.uncount(rid, node)
            return
        if isinstance(msg, (protocol.TokenChunk, protocol.Error)):
            stream.queue.put_nowait(msg)

    # ------------------------------------------------------------ membership
    async def attach(self, node: NodeInfo, conn: Connection) -> None:
        """Start using ``conn`` for ``node`` (replacing an older link)."""
        await self.node_links.attach(node.name, conn)

    def in_flight(self) -> dict[str, str]:
        """request id -> the node that owns it, for every request in flight."""
        return {rid: stream.node for rid, stream in self._streams.items()}

    def streams_on(self, node: str) -> list[str]:
        """Request ids in flight on ``node``."""
        return [rid for rid, stream in self._streams.items() if stream.node == node]

    def fail_requests(self, node: str, request_ids: Iterable[str], reason: str) -> int:
        """End the named streams on ``node`` with EngineDead. Returns how many."""
        return self.failover.fail_requests(node, request_ids, reason)

    def lose_requests(self, node: str, request_ids: Iterable[str], reason: str) -> int:
        """``node`` lost the named streams: each is recovered or ended
        (``Failover.lose_requests``). Returns how many ended at once."""
        return self.failover.lose_requests(node, request_ids, reason)

    def lost_by_node(self, node: str, request_ids: Iterable[str]) -> int:
        """``node`` gave these requests up, their output undeliverable
        (``Failover.lost_by_node``). Returns how many ended at once."""
        return self.failover.lost_by_node(node, request_ids)

    def requests(self) -> dict[str, dict]:
        """Each request in flight: its node, prefill leg, tokens delivered,
        recoveries, and its fullest replica (holder, tokens) as last reported."""
        alive = set(self.membership.nodes)
        out = {}
        for rid, s in self._streams.items():
            holder, tokens = self.recovery.table.best(s.node, rid, alive) or ("", 0)
            out[rid] = {"node": s.node, "prefill": s.prefill or "", "tokens": len(s.tokens),
                        "recoveries": s.recoveries, "replica_holder": holder, "replicated_tokens": tokens}
        return out

    async def fail_node(self, node: NodeInfo, reason: str) -> int:
        """Recover (or end with EngineDead) every stream on ``node``; tell the
        decode nodes whose prefill leg it ran; drop its link and the replicas
        it held. Returns how many ended."""
        for rid, stream in list(self._streams.items()):
            if stream.prefill == node.name:
                self.legs.prefill_leg_lost(rid, stream, node.name)
        self.recovery.table.forget(node.name)
        n = self.lose_requests(node.name, self.streams_on(node.name), reason)
        await self.node_links.drop(node.name)
        return n

    async def node_left(self, node: NodeInfo, unfinished: Iterable[str], reason: str,
                        grace: float) -> int:
        """A node that said Goodbye: end the requests it gave up (``unfinished``)
        at once; wait up to ``grace`` seconds for the last chunks of the others,
        which travel on the data link and may trail the Goodbye; then end what
        is left and drop the link. Returns how many requests were lost."""
        n = self.lose_requests(node.name, unfinished, reason)
        deadline = time.monotonic() + grace
        while self.streams_on(node.name) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return n + await self.fail_node(node, reason)

    def _abort_orphan(self, node: str, request_id: str) -> None:
        """``node`` streams ``request_id``, which is not in flight there any
        more: Abort it there, once (a bounded memory of the orphans aborted)."""
        key = (node, request_id)
        if key in self._orphans:
            return
        self._orphans[key] = None
        while len(self._orphans) > MAX_ORPHANS:
            del self._orphans[next(iter(self._orphans))]
        self.orphans_aborted += 1
        self.node_links.send_abort(node, request_id, reason="not in flight there")
