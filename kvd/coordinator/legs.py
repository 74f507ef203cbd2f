"""Sending a request's legs: submission, the prefill-queue bound, KV return.

``LegSender.submit`` routes a request to a node and waits for its answer.
When that node is a ``decode`` node and a ``prefill`` node is routable, the
request has two legs (docs/cluster.md): the decode node is asked first,
naming the prefill node; when its ``Accepted`` carries a grant, the prefill
node is sent the prompt and the grant (an owned task). A prefill leg that
cannot start, or whose node is declared dead, is reported to the decode node
(``Abort(leg="prefill")``), which then computes the prompt itself or fails
the request. Prefill nodes take whole requests only when no other node is
routable.

The prefill-queue bound: a prompt of n tokens goes to a prefill node only
while that node's queue, the prompt tokens of the prefill legs in flight
there, holds at most ``prefill_queue_factor * n`` tokens (0: no limit);
when every prefill node's queue is longer the decode node computes the
prompt itself (counted in ``prefill_queue_bypassed``).

KV return (``kv_return``; PD-Caching-3 in the paper): when a disaggregated
request finishes (stop or length), its decode node is asked (an owned task)
to push the KV of the whole sequence to the prefill node that computed the
prompt, which inserts it into its prefix cache. The outcome is counted
(``kv_returns``: done | nothing | failed), never waited on.

Load is counted only through the ``LoadBook`` it is given. Imports no torch.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence

from engine.request import FinishReason, RequestOutput
from kvd import protocol
from kvd.cluster_config import Role
from kvd.coordinator.links import NodeLink, NodeLinks
from kvd.coordinator.load import LoadBook
from kvd.coordinator.membership import Membership, NodeInfo
from kvd.coordinator.recovery import RecoveryPolicy
from kvd.coordinator.router import Router
from kvd.coordinator.stream import Stream, forget
from kvd.engine_client import EngineDead
from transports import TransportError

log = logging.getLogger("kvd.coordinator.client")

# finish reasons after which the sequence's KV is complete and worth returning
_RETURNABLE = (FinishReason.STOP.value, FinishReason.LENGTH.value)

Submitted = tuple[Stream, NodeInfo, "protocol.Error | None"]


class LegSender:
    def __init__(self, membership: Membership, links: NodeLinks, load: LoadBook, streams: dict[str, Stream],
                 recovery: RecoveryPolicy, router: Router, prefill_router: Router, *, kv_return: bool,
                 kv_return_timeout: float, prefill_queue_factor: float) -> None:
        self.membership = membership
        self.links = links
        self.load = load
        self.streams = streams                  # shared with the client: request id -> its stream
        self.recovery = recovery
        self.router = router                    # the node that serves a request (or its decode leg)
        # the prefill leg's node, among the prefill nodes: its own router of the same policy, so
        # that prompt-tree routing scores the prefill role's tree (where a repeated prefix is
        # cached) and session affinity keeps one session table per leg
        self.prefill_router = prefill_router
        self.kv_return = kv_return              # [cluster].kv_return
        self.kv_return_timeout = kv_return_timeout
        self.kv_returns: collections.Counter[str] = collections.Counter()   # done | nothing | failed
        self.prefill_queue_factor = prefill_queue_factor     # [cluster].prefill_queue_factor; 0: no limit
        self.prefill_queue_bypassed = 0        # prompts their decode node computed: prefill queues too long

    async def submit(self, request: protocol.GenerateRequest, header: bytes,
                     exclude: tuple[str, ...]) -> Submitted:
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
                      if n.name not in exclude and n.name in self.links.by_node]
        whole = [n for n in candidates if n.role != Role.PREFILL] or candidates
        node = self.router.pick(whole, prompt_ids, request_id)
        if node is None:
            raise EngineDead("no node is available to serve the request; retry later")
        prefill = self._pick_prefill(candidates, prompt_ids, request_id) if node.role == Role.DECODE else None
        # with replication, the node's ticket to replicate the request at its ring peer (kvd/trust.py)
        replica = self.recovery.replica_fields(node.name, request_id, self.membership.nodes.values())
        if prefill is not None or replica:
            header, _ = protocol.encode(protocol.DecodeLeg.of(request, prefill_node=prefill.name, **replica)
                                        if prefill is not None else dataclasses.replace(request, **replica))
        if prefill is not None:
            # the leg is the prefill node's load from the pick (the router follows it there), not
            # from the decode node's grant; dropped again when the decode node prefills itself
            self.load.count(request_id, prefill)
        stream = Stream(node.name, request, node.incarnation)
        self.streams[request_id] = stream
        self.load.count(request_id, node)
        node.routed += 1
        accepted = False
        try:
            reply = await self.links.by_node[node.name].call(header)
            accepted = isinstance(reply, protocol.Accepted) and reply.request_id == request_id
            return stream, node, self._answered(request, stream, node, prefill, reply)
        except TransportError as exc:
            self.links.send_abort(node.name, request_id)
            raise EngineDead(f"node {node.name} did not take request {request_id}: {exc}") from None
        except BaseException:                 # cancelled (the client left) while waiting
            self.links.send_abort(node.name, request_id)
            raise
        finally:
            if not accepted:
                forget(self.streams, self.load, request_id)

    def _answered(self, request: protocol.GenerateRequest, stream: Stream, node: NodeInfo,
                  prefill: NodeInfo | None, reply: protocol.Message | protocol.ProtocolError) -> protocol.Error | None:
        """``node``'s answer to ``request``: None when it accepted (starting
        the prefill leg on a grant), else the Error that ends the request."""
        request_id = request.request_id
        if isinstance(reply, protocol.Accepted) and reply.request_id == request_id:
            if prefill is not None and reply.kv_transfer_id:
                self._start_prefill_leg(request, stream, node, prefill, reply)
            elif prefill is not None:
                self.load.uncount(request_id, prefill.name)
            return None
        if isinstance(reply, protocol.Error):
            return reply
        what = reply.reason if isinstance(reply, protocol.ProtocolError) else reply.TYPE
        self.links.bad_messages["bad_reply"] += 1
        log.warning("node %s answered request %s with %s", node.name, request_id, what)
        self.links.send_abort(node.name, request_id)
        return protocol.Error(code="bad_reply", request_id=request_id,
                              message=f"node {node.name} answered the request with {what}")

    def _pick_prefill(self, candidates: list[NodeInfo], prompt_ids: Sequence[int],
                      request_id: str) -> NodeInfo | None:
        """The routable prefill node for the prompt (``prefill_router``: with
        prompt-tree routing the one whose cache holds most of it, within the
        load guard) among those whose queue is short enough for it
        (``prefill_queue_factor``), or None when there is none."""
        prefills = [n for n in candidates if n.role == Role.PREFILL]
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
            stream = self.streams.get(rid)
            if stream is not None and not stream.tokens:
                queued += stream.prompt_len
        return queued

    def _start_prefill_leg(self, request: protocol.GenerateRequest, stream: Stream, decode: NodeInfo,
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
        leg = protocol.PrefillLeg.of(
            request, id=f"{rid}.prefill", kv_to_node=decode.name, kv_to_address=decode.address,
            kv_to_incarnation=decode.incarnation,
            kv_transfer_id=grant.kv_transfer_id, kv_block_ids=grant.kv_block_ids,
            kv_have_blocks=grant.kv_have_blocks, kv_num_layers=grant.kv_num_layers, kv_dtype=grant.kv_dtype,
            **self.recovery.replica_fields(decode.name, rid, nodes, holder) if holder else {})

        async def send() -> None:
            why = None
            try:
                reply = await self.links.by_node[prefill.name].call(protocol.encode(leg)[0])
                if not isinstance(reply, protocol.Accepted):
                    why = getattr(reply, "message", None) or getattr(reply, "reason", None) or repr(reply)
            except (TransportError, KeyError) as exc:
                why = f"unreachable: {exc}"
            except protocol.MessageTooLarge as exc:
                why = str(exc)
            if why is not None:
                log.warning("request %s: prefill node %s did not take the prompt (%s); %s computes it",
                            rid, prefill.name, why, decode.name)
                self.prefill_leg_lost(rid, stream, prefill.name)
        self.links.spawn(send())

    def prefill_leg_lost(self, rid: str, stream: Stream, prefill: str) -> None:
        """The prefill leg of ``rid`` will not deliver: tell its decode node."""
        if stream.prefill != prefill:
            return
        stream.prefill = stream.prefilled_by = None
        self.load.uncount(rid, prefill)
        if self.streams.get(rid) is stream:
            self.links.send(stream.node, protocol.Abort(request_id=rid, reason="prefill leg lost", leg="prefill"))

    def maybe_return_kv(self, stream: Stream, out: RequestOutput) -> None:
        """``stream`` finished on its decode node: with ``kv_return``, have
        that node push the sequence's KV to the prefill node that computed
        its prompt (an owned task)."""
        if not (self.kv_return and stream.prefilled_by and out.finish_reason in _RETURNABLE
                and stream.recoveries == 0):
            return
        prefill = self.membership.nodes.get(stream.prefilled_by)
        link = self.links.get(stream.node)
        if prefill is None or link is None or prefill.draining:
            return
        tokens = [*stream.request.prompt_token_ids, *stream.tokens]
        self.links.spawn(self._return_kv(link, prefill, tokens))

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
        self.links.warn.warning(("kv-return", link.node), "returning KV from %s to %s failed: %s", link.node,
                                prefill.name, getattr(reply, "error", None) or getattr(reply, "message", None)
                                or reply)
