"""Recovery execution: moving the requests a node lost to other nodes.

``recovery.py`` decides (policy, the replica table, which node resumes a
request); ``Failover`` acts on a lost request: it is resumed on the holder of
its replica, or re-run with its tokens so far on another node, or, when it
cannot be (policy ``fail``, ``max_recoveries`` reached, no node left, each
candidate refused), ended with ``EngineDead`` naming the node. The stream
points at the new node before the request is sent (its chunks may overtake
the answer), and its tokens are deduplicated by index, so the client's
stream goes on with no gap and no duplicate. Nothing waits on a dead node.

A handoff (``hand_off``; the policy: kvd/coordinator/handoff.py) is the same
resume, planned: the request moves from a live node to its pair partner,
which resumes it from its redundant copy; the source is told to stop it.

Load is counted only through the ``LoadBook`` it is given. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

from kvd import protocol
from kvd.coordinator.links import NodeLinks
from kvd.coordinator.load import LoadBook
from kvd.coordinator.membership import Membership, NodeInfo
from kvd.coordinator.recovery import RecoveryPolicy
from kvd.coordinator.stream import Stream
from kvd.engine_client import EngineDead
from transports import TransportError

log = logging.getLogger("kvd.coordinator.client")

# the router's choice among nodes for (prompt, request id); None: none fits
Pick = Callable[[list[NodeInfo], Sequence[int], str], "NodeInfo | None"]


@dataclasses.dataclass(eq=False)
class Failover:
    membership: Membership
    links: NodeLinks
    load: LoadBook
    streams: dict[str, Stream]                  # shared with the client: request id -> its stream
    recovery: RecoveryPolicy
    pick: Pick
    failed_requests: int = 0                    # ended with EngineDead here

    def fail_requests(self, node: str, request_ids: Iterable[str], reason: str) -> int:
        """End the named streams on ``node`` with EngineDead. Returns how many."""
        n = 0
        for rid in request_ids:
            stream = self.streams.get(rid)
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
            stream = self.streams.get(rid)
            if stream is None or stream.node != node:
                continue
            if stream.recovering:               # its _recover call to ``node`` fails and it moves on
                stream.failed.add((node, stream.incarnation))
                continue
            if self.recovery.policy == "fail" or stream.recoveries >= self.recovery.max_recoveries:
                ended.append(rid)
                continue
            stream.failed.add((node, stream.incarnation))
            self.links.spawn(self._recover(rid, stream, node, reason))
        return self.fail_requests(node, ended, reason)

    def lost_by_node(self, node: str, request_ids: Iterable[str]) -> int:
        """``node`` gave these requests up, their output undeliverable (its
        heartbeat's ``lost``: the coordinator stalled past the node's send
        timeout). Each whose stream ``node`` serves is recovered or ended
        (``lose_requests``); each whose prefill leg ran there without
        delivering its first token ends with EngineDead (its decode node
        may already decode from that token) and its decode leg is aborted.
        Requests ``node`` does not serve (ended, moved) are ignored. Returns
        how many ended at once."""
        own, prefill_legs = [], 0
        for rid in request_ids:
            stream = self.streams.get(rid)
            if stream is None:
                continue
            if stream.node == node:
                own.append(rid)
            elif stream.prefill == node and stream.next_index == 0:
                for leg in stream.legs():
                    self.links.send_abort(leg, rid, reason="its prefill leg was lost")
                stream.queue.put_nowait(EngineDead(f"node {node} could not deliver the first token of "
                                                   f"request {rid} (the coordinator stalled); retry it"))
                self.failed_requests += 1
                prefill_legs += 1
        if own or prefill_legs:
            log.warning("node %s gave up %d request(s) it could not deliver (this coordinator stalled "
                        "past its send timeout)", node, len(own) + prefill_legs)
        return prefill_legs + self.lose_requests(node, own, "its output could not reach the coordinator")

    async def _recover(self, rid: str, stream: Stream, dead: str, reason: str) -> None:
        """Move ``rid`` off ``dead``: to the holder of its replica, or re-run
        it with its tokens so far elsewhere (RecoveryPolicy.target); a node
        that refuses or cannot be reached is excluded and the next tried, up
        to ``max_recoveries`` in all. While the task runs it owns the stream:
        a target that dies meanwhile (its link closed, so the call fails at
        once) is excluded, not recovered a second time."""
        stream.recovering = True
        try:
            await self._recover_once(rid, stream, dead, reason)
        finally:
            stream.recovering = False

    async def _recover_once(self, rid: str, stream: Stream, dead: str, reason: str) -> None:
        self.load.uncount(rid, dead)                # it moves off (a node that lost it may live on)
        if stream.prefill:                          # a prefill leg for the dead decode node: stop it
            self.links.send_abort(stream.prefill, rid)
            self.load.uncount(rid, stream.prefill)
            stream.prefill = None
        how = "reprefill"
        while stream.recoveries < self.recovery.max_recoveries and self.streams.get(rid) is stream:
            stream.recoveries += 1
            candidates = [n for n in self.membership.routable() if n.name in self.links.by_node]
            choice = self.recovery.target(rid, dead, stream.failed, candidates,
                                          lambda nodes: self.pick(nodes, stream.request.prompt_token_ids, rid))
            if choice is None:
                break
            node, replicated = choice
            how = "replica" if replicated else "reprefill"
            if await self._resume_on(rid, stream, node, dead, replicated, how, reason):
                return
        self.recovery.outcomes[(how, "failed")] += 1
        if self.streams.get(rid) is stream:
            stream.node = dead
            self.fail_requests(dead, [rid], f"{reason}; not recovered")

    async def _send_resume(self, rid: str, stream: Stream, node: NodeInfo, msg_id: str,
                           replica_from: str, **replica: str) -> protocol.Message | Exception:
        """Point ``stream`` at ``node`` and send it ``rid`` with the tokens the
        client has (its prompt alone when it has none); ``node``'s answer, or
        the exception that stood for one. ``replica``: the ResumeRequest's
        replica fields (where ``node`` replicates it)."""
        outputs = tuple(stream.tokens)
        msg = (protocol.ResumeRequest.of(stream.request, id=msg_id, output_token_ids=outputs,
                                         replica_from=replica_from, **replica)
               if outputs else dataclasses.replace(stream.request, id=msg_id))
        stream.node, stream.incarnation = node.name, node.incarnation
        self.load.count(rid, node)
        node.routed += 1
        try:
            return await self.links.by_node[node.name].call(protocol.encode(msg)[0])
        except (TransportError, KeyError, protocol.MessageTooLarge) as exc:
            return exc

    async def hand_off(self, rid: str, stream: Stream, source: NodeInfo, target: NodeInfo,
                       replica: dict[str, str], keep: Callable[[], Awaitable[object]] | None = None) -> str | None:
        """Move ``rid``, decoding on ``source``, to ``target`` (its pair
        partner, which holds its redundant copy): ``target`` resumes after
        the tokens the client has, from the copy; ``source`` is told to stop
        it (its slot and blocks freed; whatever it still streams is dropped
        here and deduplicated by index). Returns None when ``target`` took
        it, else why not; the request is then recovered away from
        ``target`` as a lost one (``source`` may have stopped it already:
        its chunks stopped counting at the send). ``keep``: awaited once
        ``target`` took it and before ``source`` is told to stop it (the
        source keeps its KV as the target's copy), in an owned task: the
        caller does not wait for it, and the stream's next token does not
        either. Owns the stream meanwhile."""
        stream.recovering = True
        try:
            reply = await self._send_resume(rid, stream, target, f"{rid}.h{time.monotonic_ns()}", source.name,
                                            **replica)
        finally:
            stream.recovering = False
        self.load.uncount(rid, source.name)
        took = isinstance(reply, protocol.Accepted) and (target.name, target.incarnation) not in stream.failed
        if took and keep is not None:
            self.links.spawn(self._keep_then_stop(rid, source.name, target.name, keep))
        else:
            self.links.send_abort(source.name, rid, reason="handed off to its partner")
        if took:
            return None
        why = _why(reply)
        self.load.uncount(rid, target.name)
        if self.streams.get(rid) is stream:
            stream.node, stream.incarnation = target.name, target.incarnation
            self.lose_requests(target.name, [rid], f"handoff from {source.name} refused: {why}")
        return why

    async def _keep_then_stop(self, rid: str, source: str, target: str,
                              keep: Callable[[], Awaitable[object]]) -> None:
        """``source``'s KV of ``rid`` becomes ``target``'s copy, then ``source``
        stops it (``keep`` logs its own failures: ``target`` then rebuilds
        the copy)."""
        try:
            await keep()
        finally:
            self.links.send_abort(source, rid, reason="handed off to its partner")

    async def _resume_on(self, rid: str, stream: Stream, node: NodeInfo, dead: str, replicated: bool,
                         how: str, reason: str) -> bool:
        """Send ``rid`` with its tokens so far to ``node``; True when it took
        it, else ``node`` is excluded from the request's next tries."""
        # no token yet: the request runs again from its prompt
        reply = await self._send_resume(rid, stream, node, f"{rid}.r{stream.recoveries}",
                                        dead if replicated else "")
        outputs = stream.tokens
        if isinstance(reply, protocol.Accepted) and (node.name, node.incarnation) in stream.failed:
            reply = f"{node.name} failed after accepting it"     # lose_requests skipped it: ours to move
        if isinstance(reply, protocol.Accepted):
            self.recovery.outcomes[(how, "resumed")] += 1
            log.warning("request %s: node %s failed (%s); resumed on %s after %d token(s), %d from "
                        "its replica", rid, dead, reason, node.name, len(outputs), reply.resumed_tokens)
            return True
        self.load.uncount(rid, node.name)
        stream.failed.add((node.name, node.incarnation))
        log.warning("request %s: recovery on %s failed: %s", rid, node.name, _why(reply))
        return False


def _why(reply: object) -> str:
    """A node's refusal (an Error, a ProtocolError) or a failed call, in words."""
    return str(getattr(reply, "message", None) or getattr(reply, "reason", None) or reply)
