"""RemoteEngineClient: the EngineClient the coordinator's front door talks to.

Each request is routed to one node (``Router``), sent there as a
``GenerateRequest`` over that node's ``NodeLink``, and its ``TokenChunk``s
come back as ``RequestOutput`` deltas — the HTTP layer cannot tell it from an
in-process engine. Contracts:

- Tokens are deduplicated by index (``TokenChunk.start_index``): a chunk that
  repeats tokens already delivered is trimmed, so a later replay/recovery can
  resend safely.
- A node declared dead (``fail_node``) ends each of its streams with
  ``EngineDead`` naming the node: the front door turns it into a 503 or an
  SSE error event. Nothing waits on a dead node.
- A node that leaves on purpose (``node_left``) loses only the requests it
  says it gave up; the others end normally, their last chunks arriving after
  its Goodbye.
- Closing a stream early sends ``Abort`` to the node (an owned task).
- Every request ends, and at once when a node will not serve it: a
  ``GenerateRequest`` is a transport request that the node answers with
  ``Accepted`` or an ``Error`` (draining, duplicate, a message it could not
  decode), and one it does not answer within the link's request timeout ends
  with ``EngineDead``. A request whose encoded header exceeds the protocol
  limit is refused here, before it is sent.
- A node that refuses a request because it just started draining is retried
  once on another node, before any token was delivered.

Imports no torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from engine.model.tokenizer import Tokenizer
from engine.request import InvalidParam, RequestOutput, SamplingParams
from kvd import protocol
from kvd.coordinator.membership import Membership, NodeInfo
from kvd.coordinator.router import Router
from kvd.engine_client import EngineDead
from kvd.ratelog import RateLimitedLog
from transports import Connection, TransportClosed, TransportError

log = logging.getLogger("kvd.coordinator.client")


def _error_output(request_id: str, prompt_ids: list[int], message: str) -> RequestOutput:
    """The one output of a request that ends before it ran (the front door's 400)."""
    return RequestOutput(request_id, [], "", True, "error", num_prompt_tokens=len(prompt_ids), error=message)


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
    __slots__ = ("node", "queue", "next_index", "prompt_len")

    def __init__(self, node: str, prompt_len: int) -> None:
        self.node = node
        self.queue: asyncio.Queue = asyncio.Queue()
        self.next_index = 0
        self.prompt_len = prompt_len


class RemoteEngineClient:
    def __init__(self, model_name: str, tokenizer: Tokenizer, membership: Membership, router: Router,
                 *, default_max_model_len: int = 2048,
                 stats_source: Callable[[], dict] | None = None,
                 limits: protocol.ProtocolLimits = protocol.DEFAULT_LIMITS) -> None:
        self.model_name = model_name
        self.limits = limits                   # what a node's decode accepts
        self.tokenizer = tokenizer
        self.membership = membership
        self.router = router
        self.default_max_model_len = default_max_model_len
        self.links: dict[str, NodeLink] = {}
        self.bad_messages: collections.Counter[str] = collections.Counter()
        self._warn = RateLimitedLog(log)       # one line per (node, reason) per interval
        self._streams: dict[str, _Stream] = {}
        self._stats_source = stats_source
        self._tasks: set[asyncio.Task] = set()
        self.failed_requests = 0

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
            self._send_abort(stream.node, request_id)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise InvalidParam("request_id", f"request id {request_id} is already in flight")
        header, _ = protocol.encode(protocol.GenerateRequest(
            id=request_id, request_id=request_id, prompt_token_ids=tuple(prompt_ids),
            sampling=params))
        if len(header) > self.limits.max_header_bytes:
            yield _error_output(request_id, prompt_ids, (
                f"the request takes {len(header)} bytes on the cluster wire, over the "
                f"{self.limits.max_header_bytes}-byte limit; shorten the prompt or the stop conditions"))
            return
        stream, node, refusal = await self._submit(request_id, header, prompt_ids, exclude=())
        if refusal is not None and refusal.code == "draining":
            # it began draining before its heartbeat said so: another node, once
            stream, node, refusal = await self._submit(request_id, header, prompt_ids,
                                                       exclude=(node.name,))
        if refusal is not None:
            self.failed_requests += 1
            yield _error_output(request_id, prompt_ids, refusal.message or refusal.code)
            return
        finished = False
        try:
            while True:
                item = await stream.queue.get()  # bounded: a dead node's streams are failed by the detector
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, protocol.Error):
                    finished = True
                    self.failed_requests += 1
                    yield _error_output(request_id, prompt_ids, item.message or item.code)
                    return
                out = self._to_output(stream, item)
                if out is None:
                    continue
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self._forget(request_id, node)
            if not finished:
                self._send_abort(node.name, request_id)

    def stats(self) -> dict:
        """Engine-shaped stats for /metrics: the nodes' last heartbeats, summed."""
        if self._stats_source is not None:
            return dict(self._stats_source(), in_flight=len(self._streams))
        total: dict[str, Any] = {"running": 0, "waiting": 0, "swapped": 0, "prompt_tokens": 0,
                                 "generation_tokens": 0, "prefix_hit_tokens": 0, "preemptions": 0,
                                 "finished": collections.Counter(), "kv": {}}
        for node in self.membership.nodes.values():
            s = node.heartbeat.stats if node.heartbeat else {}
            for key in ("running", "waiting", "swapped", "prompt_tokens", "generation_tokens",
                        "prefix_hit_tokens", "preemptions"):
                total[key] += int(s.get(key, 0))
            total["finished"].update(s.get("finished", {}))
            for tier, values in s.get("kv", {}).items():
                if isinstance(values, dict):
                    agg = total["kv"].setdefault(tier, collections.Counter())
                    agg.update({k: v for k, v in values.items() if isinstance(v, int)})
        total["finished"] = dict(total["finished"])
        total["in_flight"] = len(self._streams)
        return total

    # --------------------------------------------------------------- routing
    async def _submit(self, request_id: str, header: bytes, prompt_ids: list[int],
                      exclude: tuple[str, ...]) -> tuple[_Stream, NodeInfo, protocol.Error | None]:
        """Route the encoded GenerateRequest ``header`` to a node and wait for
        its answer (at most the link's request timeout).

        Returns (stream, node, None) once the node accepted, (stream, node,
        Error) when it refused; the stream is registered before the send (a
        chunk may overtake the answer) and forgotten again unless accepted.
        Raises EngineDead when no node can take the request, or the chosen one
        is unreachable or does not answer (then it is sent an Abort, in case
        only its answer was lost)."""
        candidates = [n for n in self.membership.routable()
                      if n.name not in exclude and n.name in self.links]
        node = self.router.pick(candidates, prompt_ids)
        if node is None:
            raise EngineDead("no node is available to serve the request; retry later")
        stream = _Stream(node.name, len(prompt_ids))
        self._streams[request_id] = stream
        node.in_flight.add(request_id)
        node.routed += 1
        accepted = False
        try:
            reply = await self.links[node.name].call(header)
            if isinstance(reply, protocol.Accepted) and reply.request_id == request_id:
                accepted = True
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
                self._forget(request_id, node)

    def _forget(self, request_id: str, node: NodeInfo) -> None:
        self._streams.pop(request_id, None)
        node.in_flight.discard(request_id)

    def _to_output(self, stream: _Stream, chunk: protocol.TokenChunk) -> RequestOutput | None:
        skip = stream.next_index - chunk.start_index   # tokens already delivered (dedup)
        if skip < 0:
            log.error("gap in the token stream of %s at %d", chunk.request_id, stream.next_index)
            skip = 0
        tokens = list(chunk.token_ids[skip:])
        if not tokens and chunk.finish_reason is None and skip > 0:
            return None
        stream.next_index = chunk.start_index + len(chunk.token_ids)
        usage = chunk.usage or {}
        return RequestOutput(chunk.request_id, tokens, chunk.text if skip == 0 else "",
                             chunk.finish_reason is not None, chunk.finish_reason, chunk.stop_reason,
                             num_prompt_tokens=usage.get("prompt_tokens", stream.prompt_len),
                             num_output_tokens=usage.get("completion_tokens", stream.next_index),
                             num_cached_tokens=usage.get("cached_tokens", 0))

    def dispatch(self, node: str, msg: protocol.Message) -> None:
        """A message a node pushed: route it to its request's stream."""
        rid = getattr(msg, "request_id", None)
        stream = self._streams.get(rid) if rid else None
        if stream is None or stream.node != node:
            return  # finished, aborted or failed over: late chunks are dropped
        if isinstance(msg, (protocol.TokenChunk, protocol.Error)):
            stream.queue.put_nowait(msg)

    # ------------------------------------------------------------ membership
    async def attach(self, node: NodeInfo, conn: Connection) -> None:
        """Start using ``conn`` for ``node`` (replacing an older link)."""
        old = self.links.pop(node.name, None)
        if old is not None:
            await old.close()
        self.links[node.name] = NodeLink(node.name, conn, self.dispatch, self.bad_messages, self._warn)

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

    async def fail_node(self, node: NodeInfo, reason: str) -> int:
        """End every stream on ``node`` with EngineDead; drop its link. Returns how many."""
        n = self.fail_requests(node.name, self.streams_on(node.name), reason)
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
        n = self.fail_requests(node.name, unfinished, reason)
        deadline = time.monotonic() + grace
        while self.streams_on(node.name) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return n + await self.fail_node(node, reason)

    def _send_abort(self, node: str, request_id: str) -> None:
        link = self.links.get(node)
        if link is None:
            return

        async def send() -> None:
            with contextlib.suppress(TransportError, TransportClosed, TimeoutError):
                async with asyncio.timeout(2.0):
                    await link.send(protocol.Abort(request_id=request_id, reason="client closed"))
        task = asyncio.get_running_loop().create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
