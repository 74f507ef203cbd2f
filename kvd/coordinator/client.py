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
  recovery (kvd/coordinator/recovery.py, ``[cluster].recovery``): the
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
- Disaggregated prefill (docs/cluster.md): when the chosen node is a
  ``decode`` node and a ``prefill`` node is routable, the request has two
  legs. The decode node is asked first, naming the prefill node; when its
  ``Accepted`` carries a grant, the prefill node is sent the prompt and the
  grant. Chunks from either leg feed one stream, delivered in token order
  (a chunk that arrives early waits for the gap before it to fill) and once
  each. A prefill leg that cannot start, or whose node is declared dead, is
  reported to the decode node (``Abort(leg="prefill")``), which then
  computes the prompt itself or fails the request; nothing waits on it.
  Prefill nodes take whole requests only when no other node is routable.
  A prompt of n tokens goes to a prefill node only while that node's
  queue, the prompt tokens of the prefill legs in flight there, holds at
  most ``prefill_queue_factor * n`` tokens (0: no limit); when every
  prefill node's queue is longer the decode node computes the prompt
  itself (counted in ``prefill_queue_bypassed``), as when no prefill node
  is routable: a request never waits behind more than that many times its
  own prefill, and a short prompt never queues behind long ones.
- PD-Caching-3 (``kv_return``): when a disaggregated request finishes
  (stop or length), the decode node is asked (an owned task, after the
  client has its last token) to push the KV of the whole sequence, prompt
  and output, to the prefill node that computed the prompt, which inserts
  it into its prefix cache; the conversation's next turn, which the
  prompt-tree router sends there, prefills only its new tokens. Only the
  blocks the prefill node lacks travel (kvd/node/transfer.py). The outcome
  is counted (``kv_returns``), never waited on.

Imports no torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from engine.model.tokenizer import Tokenizer
from engine.request import INVALID_REQUEST, InvalidParam, RequestOutput, SamplingParams
from kvd import protocol
from kvd.coordinator.load import LoadBook
from kvd.coordinator.membership import Membership, NodeInfo
from kvd.coordinator.recovery import RecoveryPolicy
from kvd.coordinator.router import LeastLoadRouter, Router
from kvd.engine_client import EngineDead
from kvd.ratelog import RateLimitedLog
from transports import Connection, TransportClosed, TransportError

log = logging.getLogger("kvd.coordinator.client")


MAX_ORPHANS = 4096         # (node, request) pairs remembered as aborted orphans (_abort_orphan)

# Error.code of a request whose node sent a message about it that failed to decode here: its
# legs are aborted (the node still runs it) and the request ends with this error.
REFUSED = "refused_message"


def _error_output(request_id: str, prompt_ids: list[int], message: str, code: str = INVALID_REQUEST) -> RequestOutput:
    """The one output of a request that ends with an error (``code``: whose fault, as
    ``RequestOutput.error_code``; a node's ``Error.code``)."""
    return RequestOutput(request_id, [], "", True, "error", num_prompt_tokens=len(prompt_ids), error=message,
                         error_code=code)


class NodeLink:
    """The coordinator's connection to one node, and the task reading it."""

    def __init__(self, node: str, conn: Connection, dispatch: Callable[[str, protocol.Message], None],
                 bad_messages: collections.Counter, warn: RateLimitedLog | None = None) -> None:
        self.node = node
        self.conn = conn
        self._dispatch = dispatch
        self._bad = bad_messages
        self._warn = warn or RateLimitedLog(log)   # bad messages: counted each, logged rate-limited
        self.reader = asyncio.create_task(self._read(), name=f"link {node}")

    async def _read(self) -> None:
        while True:
            try:
                incoming = await self.conn.recv()
            except TransportError:
                return
            msg = protocol.decode(incoming.header, incoming.frames)
            if isinstance(msg, protocol.ProtocolError):
                self._bad[msg.reason] += 1
                self._warn.warning((self.node, msg.reason), "bad message from node %s: %s",
                                   self.node, msg.reason)
                if msg.request_id is not None:          # its request ends now, not at a deadline
                    self._dispatch(self.node, protocol.Error(
                        code=REFUSED, request_id=msg.request_id,
                        message=f"node {self.node} sent a {msg.type or 'message'} this coordinator refused "
                                f"({msg.reason}: {msg.detail})"))
                continue
            self._dispatch(self.node, msg)

    async def send(self, msg: protocol.Message) -> None:
        await self.conn.send(*protocol.encode(msg))

    async def call(self, header: bytes) -> protocol.Message | protocol.ProtocolError:
        """Send an encoded message as a request; its decoded reply. Raises
        TransportError (RequestTimeout past the link's request timeout)."""
        reply = await self.conn.request(header)
        return protocol.decode(reply.header, reply.frames)

    async def close(self) -> None:
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        await self.conn.close()


class _Stream:
    """One request's chunks: ``node`` owns it (its death recovers or ends the
    request), ``prefill`` names its prefill leg's node, if any (chunks from
    it count too). ``tokens``: every token delivered, what a recovery resumes
    after."""

    __slots__ = ("node", "incarnation", "prefill", "prefilled_by", "queue", "next_index", "prompt_len", "early",
                 "request", "tokens", "recoveries", "failed", "recovering")

    def __init__(self, node: str, request: protocol.GenerateRequest, incarnation: str = "") -> None:
        self.node = node
        self.incarnation = incarnation                      # of the node process serving it now
        self.prefill: str | None = None
        self.prefilled_by: str | None = None                # the prefill leg's node, kept after it ends
        self.queue: asyncio.Queue = asyncio.Queue()
        self.next_index = 0
        self.prompt_len = len(request.prompt_token_ids)
        self.early: dict[int, protocol.TokenChunk] = {}   # chunks past a gap, by start_index
        self.request = request
        self.tokens: list[int] = []
        self.recoveries = 0
        self.failed: set[tuple[str, str]] = set()          # (node, incarnation) that lost this request
        self.recovering = False                            # a _recover task owns it

    def legs(self) -> tuple[str, ...]:
        return (self.node, self.prefill) if self.prefill else (self.node,)


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
        self.router = router                   # the node that serves a request (or its decode leg)
        # the prefill leg's node, among the prefill nodes: its own router of the same policy, so
        # that prompt-tree routing scores the prefill role's tree (where a repeated prefix is
        # cached) and session affinity keeps one session table per leg
        self.prefill_router = prefill_router or LeastLoadRouter(0)
        self.default_max_model_len = default_max_model_len
        self.links: dict[str, NodeLink] = {}
        self.bad_messages: collections.Counter[str] = collections.Counter()
        self._warn = RateLimitedLog(log)       # one line per (node, reason) per interval
        self._streams: dict[str, _Stream] = {}
        self.load = LoadBook()                 # the one writer of every NodeInfo.in_flight
        self._orphans: dict[tuple[str, str], None] = {}   # (node, request id) aborted as orphans, oldest first
        self.orphans_aborted = 0               # chunks of requests not in flight on their node: Abort sent
        self._stats_source = stats_source
        self._tasks: set[asyncio.Task] = set()
        self.failed_requests = 0
        self.recovery = recovery or RecoveryPolicy("fail")    # the coordinator passes [cluster].recovery
        self.kv_return = kv_return                 # PD-Caching-3 ([cluster].kv_return)
        self.kv_return_timeout = kv_return_timeout
        self.kv_returns: collections.Counter[str] = collections.Counter()   # done | nothing | failed
        self.prefill_queue_factor = prefill_queue_factor     # [cluster].prefill_queue_factor; 0: no limit
        self.prefill_queue_bypassed = 0        # prompts their decode node computed: prefill queues too long

    # ------------------------------------------------------------ EngineClient
    @property
    def max_model_len(self) -> int:
        lens = [n.max_model_len for n in self.membership.nodes.values() if n.max_model_len]
        return min(lens) if lens else self.default_max_model_len

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
        one (registered, not draining, linked: what ``_submit`` picks from)."""
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
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            for leg in stream.legs():
                self._send_abort(leg, request_id)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise InvalidParam("request_id", f"request id {request_id} is already in flight")
        request = protocol.GenerateRequest(id=request_id, request_id=request_id,
                                           prompt_token_ids=tuple(prompt_ids), sampling=params)
        header, _ = protocol.encode(request)
        if len(header) > self.limits.max_header_bytes:
            yield _error_output(request_id, prompt_ids, (
                f"the request takes {len(header)} bytes on the cluster wire, over the "
                f"{self.limits.max_header_bytes}-byte limit; shorten the prompt or the stop conditions"))
            return
        stream, node, refusal = await self._submit(request, header, exclude=())
        if refusal is not None and refusal.code == "draining":
            # it began draining before its heartbeat said so: another node, once
            stream, node, refusal = await self._submit(request, header, exclude=(node.name,))
        if refusal is not None:
            self.failed_requests += 1
            yield _error_output(request_id, prompt_ids, refusal.message or refusal.code, refusal.code)
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
                    self.failed_requests += 1
                    yield _error_output(request_id, prompt_ids, item.message or item.code, item.code)
                    return
                outs = self._in_order(stream, item)
                # what queued meanwhile (this loop fell behind the node) goes out as one output
                while not (outs and outs[-1].finished) and not stream.queue.empty():
                    item = stream.queue.get_nowait()
                    if not isinstance(item, protocol.TokenChunk):
                        pending = item
                        break
                    outs += self._in_order(stream, item)
                if not outs:
                    continue
                out = functools.reduce(RequestOutput.merge, outs)
                if out.finished:
                    finished = True
                    self._maybe_return_kv(stream, out)
                yield out
                if out.finished:
                    return
        finally:
            legs = stream.legs()
            self._forget(request_id)
            if not finished:
                for leg in legs:
                    self._send_abort(leg, request_id)

    def stats(self) -> dict:
        """Engine-shaped stats for /metrics: the nodes' last heartbeats, summed."""
        if self._stats_source is not None:
            return dict(self._stats_source(), in_flight=len(self._streams))
        total: dict[str, Any] = {"running": 0, "waiting": 0, "swapped": 0, "prompt_tokens": 0,
                                 "generation_tokens": 0, "prefix_hit_tokens": 0, "preemptions": 0,
                                 "host_blocks_swapped_in": 0, "host_blocks_recomputed": 0, "steps": 0,
                                 "step_seconds": 0.0, "finished": collections.Counter(), "kv": {}}
        for node in self.membership.nodes.values():
            s = node.heartbeat.stats if node.heartbeat else {}
            for key in ("running", "waiting", "swapped", "prompt_tokens", "generation_tokens",
                        "prefix_hit_tokens", "preemptions", "host_blocks_swapped_in",
                        "host_blocks_recomputed", "steps"):
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

    # --------------------------------------------------------------- routing
    async def _submit(self, request: protocol.GenerateRequest, header: bytes,
                      exclude: tuple[str, ...]) -> tuple[_Stream, NodeInfo, protocol.Error | None]:
        """Route ``request`` (``header``: it encoded) to a node and wait for
        its answer (at most the link's request timeout); a decode node is
        asked with a prefill node named, and its grant starts the prefill leg.

        Returns (stream, node, None) once the node accepted, (stream, node,
        Error) when it refused; the stream is registered before the send (a
        chunk may overtake the answer) and forgotten again unless accepted.
        Raises EngineDead when no node can take the request, or the chosen one
        is unreachable or does not answer (then it is sent an Abort, in case
        only its answer was lost)."""
        request_id, prompt_ids = request.request_id, request.prompt_token_ids
        candidates = [n for n in self.membership.routable()
                      if n.name not in exclude and n.name in self.links]
        whole = [n for n in candidates if n.role != "prefill"] or candidates
        node = self.router.pick(whole, prompt_ids, request_id)
        if node is None:
            raise EngineDead("no node is available to serve the request; retry later")
        prefill = self._pick_prefill(candidates, prompt_ids, request_id) if node.role == "decode" else None
        # with replication, the node's ticket to replicate the request at its ring peer (kvd/trust.py)
        replica = self.recovery.replica_fields(node.name, request_id, self.membership.nodes.values())
        if prefill is not None or replica:
            header, _ = protocol.encode(dataclasses.replace(
                request, prefill_node=prefill.name if prefill is not None else "", **replica))
        if prefill is not None:
            # the leg is the prefill node's load from the pick (the router follows it there), not
            # from the decode node's grant; dropped again when the decode node prefills itself
            self.load.count(request_id, prefill)
        stream = _Stream(node.name, request, node.incarnation)
        self._streams[request_id] = stream
        self.load.count(request_id, node)
        node.routed += 1
        accepted = False
        try:
            reply = await self.links[node.name].call(header)
            if isinstance(reply, protocol.Accepted) and reply.request_id == request_id:
                accepted = True
                if prefill is not None and reply.kv_transfer_id:
                    self._start_prefill_leg(request, stream, node, prefill, reply)
                elif prefill is not None:
                    self.load.uncount(request_id, prefill.name)
                return stream, node, None
            if isinstance(reply, protocol.Error):
                return stream, node, reply
            what = reply.reason if isinstance(reply, protocol.ProtocolError) else reply.TYPE
            self.bad_messages["bad_reply"] += 1
            log.warning("node %s answered request %s with %s", node.name, request_id, what)
            self._send_abort(node.name, request_id)
            return stream, node, protocol.Error(code="bad_reply", request_id=request_id,
                                                message=f"node {node.name} answered the request with {what}")
        except TransportError as exc:
            self._send_abort(node.name, request_id)
            raise EngineDead(f"node {node.name} did not take request {request_id}: {exc}") from None
        except BaseException:                 # cancelled (the client left) while waiting
            self._send_abort(node.name, request_id)
            raise
        finally:
            if not accepted:
                self._forget(request_id)

    def _pick_prefill(self, candidates: list[NodeInfo], prompt_ids: Sequence[int],
                      request_id: str) -> NodeInfo | None:
        """The routable prefill node for the prompt (``prefill_router``: with
        prompt-tree routing the one whose cache holds most of it, within the
        load guard) among those whose queue is short enough for it
        (``prefill_queue_factor``), or None when there is none."""
        prefills = [n for n in candidates if n.role == "prefill"]
        if prefills and self.prefill_queue_factor > 0:
            bound = self.prefill_queue_factor * len(prompt_ids)
            prefills = [n for n in prefills if self.prefill_queue(n) <= bound]
            if not prefills:
                self.prefill_queue_bypassed += 1
        return self.prefill_router.pick(prefills, prompt_ids, request_id) if prefills else None

    def prefill_queue(self, node: NodeInfo) -> int:
        """Prompt tokens of the requests in flight on ``node`` that have not
        had their first token (on a prefill node: its prefill legs, queued or
        computing)."""
        queued = 0
        for rid in node.in_flight:
            stream = self._streams.get(rid)
            if stream is not None and not stream.tokens:
                queued += stream.prompt_len
        return queued

    def _start_prefill_leg(self, request: protocol.GenerateRequest, stream: _Stream, decode: NodeInfo,
                           prefill: NodeInfo, grant: protocol.Accepted) -> None:
        """Send the prefill leg (an owned task); if the prefill node does not
        take it, the decode node is told at once (``Abort(leg="prefill")``)."""
        rid = request.request_id
        stream.prefill = stream.prefilled_by = prefill.name
        prefill.routed += 1
        # with replication the prefill node also writes the prompt's replica to the decode
        # node's peer (from block 0 only: it stages no KV of blocks the decode node had)
        nodes = self.membership.nodes.values()
        holder = None if grant.kv_have_blocks else self.recovery.peer_of(decode.name, nodes)
        leg = dataclasses.replace(
            request, id=f"{rid}.prefill", kv_to_node=decode.name, kv_to_address=decode.address,
            kv_to_incarnation=decode.incarnation,
            kv_transfer_id=grant.kv_transfer_id, kv_block_ids=grant.kv_block_ids,
            kv_have_blocks=grant.kv_have_blocks, kv_num_layers=grant.kv_num_layers, kv_dtype=grant.kv_dtype,
            **self.recovery.replica_fields(decode.name, rid, nodes, holder) if holder else {})

        async def send() -> None:
            why = None
            try:
                reply = await self.links[prefill.name].call(protocol.encode(leg)[0])
                if not isinstance(reply, protocol.Accepted):
                    why = getattr(reply, "message", None) or getattr(reply, "reason", None) or repr(reply)
            except (TransportError, KeyError) as exc:
                why = f"unreachable: {exc}"
            if why is not None:
                log.warning("request %s: prefill node %s did not take the prompt (%s); %s computes it",
                            rid, prefill.name, why, decode.name)
                self._prefill_leg_lost(rid, stream, prefill.name)
        self._spawn(send())

    def _prefill_leg_lost(self, rid: str, stream: _Stream, prefill: str) -> None:
        """The prefill leg of ``rid`` will not deliver: tell its decode node."""
        if stream.prefill != prefill:
            return
        stream.prefill = stream.prefilled_by = None
        self.load.uncount(rid, prefill)
        link = self.links.get(stream.node)
        if link is not None and self._streams.get(rid) is stream:
            self._spawn(self._send_quietly(link, protocol.Abort(request_id=rid, reason="prefill leg lost",
                                                                leg="prefill")))

    def _maybe_return_kv(self, stream: _Stream, out: RequestOutput) -> None:
        """PD-Caching-3: ``stream`` finished on its decode node; have that node
        push the sequence's KV to the prefill node that computed its prompt."""
        if not (self.kv_return and stream.prefilled_by and out.finish_reason in ("stop", "length")
                and stream.recoveries == 0):
            return
        prefill = self.membership.nodes.get(stream.prefilled_by)
        link = self.links.get(stream.node)
        if prefill is None or link is None or prefill.draining:
            return
        tokens = [*stream.request.prompt_token_ids, *stream.tokens]
        self._spawn(self._return_kv(link, prefill, tokens))

    async def _return_kv(self, link: NodeLink, prefill: NodeInfo, tokens: list[int]) -> None:
        args = {"token_ids": tokens, "to": prefill.name, "address": prefill.address}
        try:
            reply = await protocol.call(link.conn, protocol.AdminCommand(
                id=f"kv-return-{time.monotonic_ns()}", command="transfer", args=args),
                timeout=self.kv_return_timeout)
        except (TransportError, TimeoutError) as exc:
            reply = exc
        if isinstance(reply, protocol.AdminReply) and reply.ok:
            self.kv_returns["done" if reply.result.get("transferred") else "nothing"] += 1
            return
        self.kv_returns["failed"] += 1
        self._warn.warning(("kv-return", link.node), "returning KV from %s to %s failed: %s", link.node,
                           prefill.name, getattr(reply, "error", None) or getattr(reply, "message", None) or reply)

    def _forget(self, request_id: str) -> None:
        """``request_id`` ended: no stream, counted on no node."""
        self._streams.pop(request_id, None)
        self.load.release(request_id)

    def _in_order(self, stream: _Stream, chunk: protocol.TokenChunk) -> list[RequestOutput]:
        """The outputs ``chunk`` makes deliverable, in token order: a chunk
        past a gap (the decode leg's token 1 overtaking the prefill leg's
        token 0) waits in ``early`` until the gap fills."""
        if chunk.start_index > stream.next_index:
            stream.early[chunk.start_index] = chunk
            return []
        outs = []
        while chunk is not None:
            out = self._to_output(stream, chunk)
            if out is not None:
                outs.append(out)
            chunk = stream.early.pop(stream.next_index, None)
        return outs

    def _to_output(self, stream: _Stream, chunk: protocol.TokenChunk) -> RequestOutput | None:
        skip = stream.next_index - chunk.start_index   # tokens already delivered (dedup)
        tokens = list(chunk.token_ids[skip:])
        if not tokens and chunk.finish_reason is None and skip > 0:
            return None
        stream.next_index = chunk.start_index + len(chunk.token_ids)
        stream.tokens.extend(tokens)
        usage = chunk.usage or {}
        repeated = min(skip, len(chunk.token_ids))
        kept = chunk.text_ends[repeated - 1] if repeated > 0 else 0   # their text was delivered too
        return RequestOutput(chunk.request_id, tokens, chunk.text[kept:],
                             chunk.finish_reason is not None, chunk.finish_reason, chunk.stop_reason,
                             num_prompt_tokens=usage.get("prompt_tokens", stream.prompt_len),
                             num_output_tokens=usage.get("completion_tokens", stream.next_index),
                             num_cached_tokens=usage.get("cached_tokens", 0),
                             text_ends=[e - kept for e in chunk.text_ends[repeated:]])

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
                self._send_abort(leg, rid, reason="a message about it was refused")
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
        old = self.links.pop(node.name, None)
        if old is not None:
            await old.close()
        self.links[node.name] = NodeLink(node.name, conn, self.dispatch, self.bad_messages, self._warn)

    def in_flight(self) -> dict[str, str]:
        """request id -> the node that owns it, for every request in flight."""
        return {rid: stream.node for rid, stream in self._streams.items()}

    def streams_on(self, node: str) -> list[str]:
        """Request ids in flight on ``node``."""
        return [rid for rid, stream in self._streams.items() if stream.node == node]

    def fail_requests(self, node: str, request_ids: Iterable[str], reason: str) -> int:
        """End the named streams on ``node`` with EngineDead. Returns how many."""
        n = 0
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None and stream.node == node:
                stream.queue.put_nowait(EngineDead(f"node {node} failed ({reason}); "
                                                   f"request {rid} was lost, retry it"))
                n += 1
        self.failed_requests += n
        return n

    def lose_requests(self, node: str, request_ids: Iterable[str], reason: str) -> int:
        """``node`` lost the named streams: each is recovered (an owned task,
        ``_recover``) or, when it cannot be, ended with EngineDead. Returns
        how many ended at once."""
        ended = []
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is None or stream.node != node:
                continue
            if stream.recovering:               # its _recover call to ``node`` fails and it moves on
                stream.failed.add((node, stream.incarnation))
                continue
            if self.recovery.policy == "fail" or stream.recoveries >= self.recovery.max_recoveries:
                ended.append(rid)
                continue
            stream.failed.add((node, stream.incarnation))
            self._spawn(self._recover(rid, stream, node, reason))
        return self.fail_requests(node, ended, reason)

    async def _recover(self, rid: str, stream: _Stream, dead: str, reason: str) -> None:
        """Move ``rid`` off ``dead``: to the holder of its replica, or re-run
        it with its tokens so far elsewhere (RecoveryPolicy.target); a node
        that refuses or cannot be reached is excluded and the next tried, up
        to ``max_recoveries`` in all. The stream points at the new node
        before the request is sent (its chunks may overtake the answer); while
        the task runs it owns the stream: a target that dies meanwhile (its
        link closed, so the call fails at once) is excluded, not recovered
        a second time."""
        stream.recovering = True
        try:
            await self._recover_once(rid, stream, dead, reason)
        finally:
            stream.recovering = False

    async def _recover_once(self, rid: str, stream: _Stream, dead: str, reason: str) -> None:
        self.load.uncount(rid, dead)                # it moves off (a node that lost it may live on)
        if stream.prefill:                          # a prefill leg for the dead decode node: stop it
            self._send_abort(stream.prefill, rid)
            self.load.uncount(rid, stream.prefill)
            stream.prefill = None
        how = "reprefill"
        while stream.recoveries < self.recovery.max_recoveries and self._streams.get(rid) is stream:
            stream.recoveries += 1
            candidates = [n for n in self.membership.routable() if n.name in self.links]
            choice = self.recovery.target(rid, dead, stream.failed, candidates,
                                          lambda nodes: self.router.pick(nodes, stream.request.prompt_token_ids, rid))
            if choice is None:
                break
            node, replicated = choice
            how = "replica" if replicated else "reprefill"
            outputs = tuple(stream.tokens)
            msg = dataclasses.replace(stream.request, id=f"{rid}.r{stream.recoveries}", output_token_ids=outputs,
                                      replica_from=dead if replicated and outputs else "")
            stream.node, stream.incarnation = node.name, node.incarnation
            self.load.count(rid, node)
            node.routed += 1
            try:
                reply = await self.links[node.name].call(protocol.encode(msg)[0])
            except (TransportError, KeyError) as exc:
                reply = exc
            if isinstance(reply, protocol.Accepted) and (node.name, node.incarnation) in stream.failed:
                reply = f"{node.name} failed after accepting it"     # lose_requests skipped it: ours to move
            if isinstance(reply, protocol.Accepted):
                self.recovery.outcomes[(how, "resumed")] += 1
                log.warning("request %s: node %s failed (%s); resumed on %s after %d token(s), %d from "
                            "its replica", rid, dead, reason, node.name, len(outputs), reply.resumed_tokens)
                return
            self.load.uncount(rid, node.name)
            stream.failed.add((node.name, node.incarnation))
            log.warning("request %s: recovery on %s failed: %s", rid, node.name,
                        getattr(reply, "message", None) or getattr(reply, "reason", None) or reply)
        self.recovery.outcomes[(how, "failed")] += 1
        if self._streams.get(rid) is stream:
            stream.node = dead
            self.fail_requests(dead, [rid], f"{reason}; not recovered")

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
                self._prefill_leg_lost(rid, stream, node.name)
        self.recovery.table.forget(node.name)
        n = self.lose_requests(node.name, self.streams_on(node.name), reason)
        link = self.links.pop(node.name, None)
        if link is not None:
            await link.close()
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
        self._send_abort(node, request_id, reason="not in flight there")

    def lost_by_node(self, node: str, request_ids: Iterable[str]) -> int:
        """``node`` gave these requests up, their output undeliverable (its
        heartbeat's ``lost``: this coordinator stalled past the node's send
        timeout). Each whose stream ``node`` serves is recovered or ended
        (``lose_requests``); each whose prefill leg ran there without
        delivering its first token ends with EngineDead (its decode node
        may already decode from that token) and its decode leg is aborted.
        Requests ``node`` does not serve (ended, moved) are ignored. Returns
        how many ended at once."""
        own, prefill_legs = [], 0
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if stream.node == node:
                own.append(rid)
            elif stream.prefill == node and stream.next_index == 0:
                for leg in stream.legs():
                    self._send_abort(leg, rid, reason="its prefill leg was lost")
                stream.queue.put_nowait(EngineDead(f"node {node} could not deliver the first token of "
                                                   f"request {rid} (the coordinator stalled); retry it"))
                self.failed_requests += 1
                prefill_legs += 1
        if own or prefill_legs:
            log.warning("node %s gave up %d request(s) it could not deliver (this coordinator stalled "
                        "past its send timeout)", node, len(own) + prefill_legs)
        return prefill_legs + self.lose_requests(node, own, "its output could not reach the coordinator")

    def _send_abort(self, node: str, request_id: str, reason: str = "client closed") -> None:
        link = self.links.get(node)
        if link is not None:
            self._spawn(self._send_quietly(link, protocol.Abort(request_id=request_id, reason=reason)))

    @staticmethod
    async def _send_quietly(link: NodeLink, msg: protocol.Message) -> None:
        with contextlib.suppress(TransportError, TransportClosed, TimeoutError):
            async with asyncio.timeout(2.0):
                await link.send(msg)

    def _spawn(self, coro) -> None:
        """An owned task (awaited, at most briefly, by ``stop``)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
