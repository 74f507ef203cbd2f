"""The legs of a request on a node: what runs once the daemon took a leg
message (kvd/node/daemon.py dispatches; kvd/protocol.py ``LegRequest``)::

    GenerateRequest ─▶ whole     prompt and decode here
    DecodeLeg       ─▶ decode    reserve blocks, answer the grant (or none:
                                 prefill here), wait for the prompt's KV,
                                 decode from token 1
    PrefillLeg      ─▶ prefill   compute the prompt, stream its KV layer by
                                 layer into the decode node's grant, commit
    ResumeRequest   ─▶ resume    continue after the client's tokens, from
                                 the dead node's replica held here

Every leg ends in the engine's stream piped to the coordinator as
``TokenChunk``s (each with ``start_index``), or one ``Error`` with the
request id. The legs reach the engine through ``EngineDriver`` verbs only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from engine.request import ENGINE_ERROR, INVALID_REQUEST, InvalidParam, RequestOutput
from kvd import protocol
from kvd.cluster_config import ClusterConfig
from kvd.engine_client import EngineDead
from kvd.node.disagg import LayerSender
from kvd.node.engine_driver import EngineDriver
from kvd.node.inbox import KVInbox
from kvd.node.kvmove import FINAL, TransferState
from kvd.node.peers import PeerLinks
from kvd.node.replication import Replicator, send_prompt_replica
from kvd.ratelog import RateLimitedLog
from transports import Incoming, TransportError

log = logging.getLogger("kvd.node")

COPY_WAIT_S = 0.1      # a handoff waits this long at most for its copy to hold every token but the last

Send = Callable[[bytes, protocol.Message], Awaitable[None]]        # a message to a peer of the listener
Answer = Callable[[Incoming, protocol.Message], Awaitable[None]]   # the reply to a transport request


# eq=False: a Legs is one node's, compared and hashed by identity; repr=False: its
# collaborators (the driver, the links) are not a value to print.
@dataclass(eq=False, repr=False)
class Legs:
    """Runs the legs of requests on one node. Each ``whole``/``decode``/
    ``prefill``/``resume`` returns the leg's coroutine (the daemon owns its
    task) and does nothing until it runs, but ``resume``, which takes the
    replica at once. ``send``/``answer`` reach the coordinator;
    ``report_lost`` names a request whose chunks could not be delivered
    (the heartbeat tells the coordinator)."""

    name: str
    cluster: ClusterConfig
    driver: EngineDriver
    _: KW_ONLY
    send: Send
    answer: Answer
    report_lost: Callable[[str], None]
    peers: PeerLinks                    # links to other nodes (one per peer process)
    inbox: KVInbox                      # the decode legs' PROMPT regions; its peers' replicas
    replicator: Replicator | None       # this node's KV -> its replica peer (None: not replicating)
    # outcomes of the prefill legs, and of the prompt replicas (sent | empty | refused | failed)
    prefill_legs: collections.Counter[str] = field(default_factory=collections.Counter, init=False)
    prompt_replicas: collections.Counter[str] = field(default_factory=collections.Counter, init=False)
    _warn: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log), init=False)

    # ------------------------------------------------------------------ whole
    def whole(self, msg: protocol.GenerateRequest, peer: bytes) -> Coroutine[Any, Any, Any]:
        return self.pipe(msg.request_id, peer,
                         self.driver.generate(msg.request_id, list(msg.prompt_token_ids), msg.sampling))

    async def pipe(self, rid: str, peer: bytes, outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        """Send ``outputs`` (an engine stream) to the coordinator as TokenChunks;
        an engine error as one Error. Returns the last output (None when the
        stream failed). Closing early (cancel) aborts the request in the engine."""
        last = None
        try:
            # the sampling parameters were validated by the engine's own SamplingParams on decode
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    if out.error is not None:
                        await self.send(peer, protocol.Error(code=out.error_code or INVALID_REQUEST,
                                                             request_id=rid, message=out.error))
                        return None
                    last = out
                    await self.send(peer, _chunk(rid, out))
        except TransportError as exc:
            log.info("request %s: coordinator unreachable (%s); aborted", rid, exc)
            self.report_lost(rid)          # the coordinator ends or recovers it (heartbeat.py)
        except protocol.MessageTooLarge as exc:      # its next chunk cannot travel: the request ends now
            log.warning("request %s: %s", rid, exc)
            try:
                await self.send(peer, protocol.Error(code=protocol.CODE_TOO_LARGE, request_id=rid, message=str(exc)))
            except TransportError:
                self.report_lost(rid)
        except EngineDead:
            pass                  # the engine died: the node's Goodbye names this request lost
        except Exception as exc:  # noqa: BLE001 -- one request's failure stays its own
            log.exception("request %s failed", rid)
            try:
                await self.send(peer, protocol.Error(code=ENGINE_ERROR, request_id=rid, message=str(exc)))
            except TransportError:
                self.report_lost(rid)
        return last

    # ----------------------------------------------------------------- resume
    def resume(self, msg: protocol.ResumeRequest, peer: bytes) -> tuple[Coroutine[Any, Any, Any], int]:
        """A request recovered from a dead node, or handed off here by the
        partner: (its leg, the tokens whose KV the replica held here gives,
        as it is now). The replica's lock is released once
        the resumed request produced its first output (its prefix match
        holds the blocks from then on) or ended."""
        rid, outputs = msg.request_id, list(msg.output_token_ids)
        store, driver = self.inbox.replicas, self.driver
        known = list(msg.prompt_token_ids) + outputs
        # a handoff from the partner (alive: it writes the copy still) waits a moment for the copy to
        # hold every token but the last; a recovery takes the replica as it is, at once
        handoff = bool(msg.replica_from) and msg.replica_to == msg.replica_from
        rep = store.take(msg.replica_from, rid) if msg.replica_from and not handoff else None
        shown = rep or (store.replicas.get((msg.replica_from, rid)) if handoff else None)
        usable = shown.usable(known) if shown is not None else 0

        async def resumed():
            taken, reservation = rep, None
            try:
                if handoff:
                    taken = await store.take_current(msg.replica_from, rid, len(known) - 1, COPY_WAIT_S)
                if taken is not None:        # the copy to the token: decode from it; else its agreeing
                    reservation = store.reservation(taken, known)   # blocks become cached KV
                    if reservation is None:
                        log.info("request %s: its copy holds %d of the %d tokens computed; computing the rest",
                                 rid, taken.usable(known), len(known) - 1)
                        await store.commit(taken, known)
                async for out in driver.generate_resumed(rid, list(msg.prompt_token_ids), outputs, msg.sampling,
                                                         reservation):
                    if taken is not None:
                        await store.release(taken)
                    yield out
            finally:
                if taken is not None:
                    await asyncio.shield(store.release(taken))
        if handoff and self.replicator is not None:
            # a handoff from the partner: its own KV (every token here but the last, at least) becomes
            # this request's copy there (ReplicaStore.keep)
            self.replicator.kept(rid, msg.replica_from, len(known) - 1)
        log.info("request %s: resuming after %d token(s), %d from the replica of %s", rid, len(outputs),
                 usable, msg.replica_from or "-")
        return self.pipe(rid, peer, resumed()), usable

    # ---------------------------------------------------------------- prefill
    def prefill_refusal(self, msg: protocol.PrefillLeg) -> str | None:
        """Why this node cannot fill the decode node's grant (layout, block
        count), or None."""
        layout = self.driver.kv_layout()
        if msg.kv_num_layers != layout.num_layers or msg.kv_dtype != protocol.dtype_name(layout.dtype):
            return (f"KV layout mismatch: the decode node has {msg.kv_num_layers} layers of {msg.kv_dtype}, "
                    f"this node {layout.num_layers} of {protocol.dtype_name(layout.dtype)}")
        blocks = -(-len(msg.prompt_token_ids) // layout.block_shape[2])
        if msg.kv_have_blocks + len(msg.kv_block_ids) != blocks:
            return f"the grant covers {msg.kv_have_blocks + len(msg.kv_block_ids)} blocks, the prompt {blocks}"
        return None

    async def prefill(self, msg: protocol.PrefillLeg, peer: bytes) -> None:
        """Compute the prompt here, stream its KV into the decode node's grant
        layer by layer, send token 0 to the coordinator and the commit to the
        decode node. Every path ends the decode node's wait: a commit (done,
        finished or failed) or, when it is unreachable, its deadline."""
        rid, loop = msg.request_id, asyncio.get_running_loop()
        deadline = msg.deadline or time.time() + self.cluster.kv_transfer_timeout
        sender = None
        try:
            conn = await self.peers.get(msg.kv_to_node, msg.kv_to_address, msg.kv_to_incarnation)
            sender = LayerSender(transfer_id=msg.kv_transfer_id, request_id=rid, conn=conn,
                                 block_ids=msg.kv_block_ids, have_blocks=msg.kv_have_blocks,
                                 num_layers=msg.kv_num_layers, deadline=deadline, loop=loop,
                                 by_request=self.cluster.kv_stream == "request")
            out = await self.pipe(rid, peer, self.driver.generate(
                rid, list(msg.prompt_token_ids), msg.sampling, kv_out=sender))
            if out is not None and out.handed_off:
                replica = self._prompt_replica(msg, sender)
                try:
                    state = await sender.commit("done", out.new_token_ids[0], out.num_cached_tokens,
                                                replica_to=msg.replica_to if replica else "",
                                                keep_staging=replica is not None)
                finally:
                    if replica is not None:
                        await asyncio.shield(self._end_prompt_replica(msg, replica, sender))
            elif out is not None and out.finished:
                state = await sender.commit("finished")
            else:
                state = await sender.commit("failed", reason="the prefill node could not run the prompt")
        except asyncio.CancelledError:
            if sender is not None:          # aborted: the decode node stops waiting (its own abort may trail)
                await asyncio.shield(sender.commit("failed", reason="prefill leg aborted"))
            raise
        except TransportError as exc:
            await self.peers.drop(msg.kv_to_node)
            log.warning("request %s: decode node %s unreachable: %s", rid, msg.kv_to_node, exc)
            state = TransferState.FAILED
        if state in (TransferState.FAILED, TransferState.TIMED_OUT) and sender is not None:
            log.warning("request %s: KV to %s %s: %s", rid, msg.kv_to_node, state.value, sender.reason)
        self.prefill_legs[state.value] += 1

    def _prompt_replica(self, msg: protocol.PrefillLeg, sender: LayerSender) -> asyncio.Task | None:
        """Start sending the prompt's replica to the decode node's replica peer
        (``msg.replica_to``), reading the KV staged for the decode node; None
        when there is none to send."""
        kv = sender.staged
        if not msg.replica_to or kv is None:
            return None

        async def run() -> tuple[str, str]:
            try:
                conn = await self.peers.get(msg.replica_to, msg.replica_address)
            except TransportError as exc:
                return "failed", str(exc)
            outcome, why = await send_prompt_replica(
                conn, source=self.name, owner=msg.kv_to_node, request_id=msg.request_id, ticket=msg.replica_ticket,
                prompt=list(msg.prompt_token_ids), kv=kv, block_size=self.driver.config.block_size,
                timeout=self.cluster.request_timeout)
            if outcome == "failed":
                await self.peers.drop(msg.replica_to)
            return outcome, why
        return asyncio.get_running_loop().create_task(run(), name=f"prompt replica {msg.request_id}")

    async def _end_prompt_replica(self, msg: protocol.PrefillLeg, replica: asyncio.Task,
                                  sender: LayerSender) -> None:
        """Wait for the prompt replica's send (its own deadline) and give the
        staging buffers back once nothing reads them."""
        try:
            outcome, why = await replica
        except Exception as exc:  # noqa: BLE001 -- the replica is best effort: the decode node sends it then
            outcome, why = "failed", str(exc)
        self.prompt_replicas[outcome] += 1
        if outcome in ("failed", "refused"):
            self._warn.warning(("prompt replica", outcome), "request %s: the prompt replica to %s %s: %s",
                               msg.request_id, msg.replica_to, outcome, why)
        sender.release_staging(reusable=outcome != "failed")   # a failed send may still sit in a queue

    # ----------------------------------------------------------------- decode
    async def decode(self, msg: protocol.DecodeLeg, incoming: Incoming) -> None:
        """Reserve blocks for the prompt and answer the coordinator with the
        grant (or none: the prompt is computed here); wait for the KV; then
        decode from token 1, or compute the prompt here when the KV does not
        come (``[cluster].kv_load_failure = "recompute"``), or fail."""
        rid, prompt, params = msg.request_id, list(msg.prompt_token_ids), msg.sampling
        try:
            res, why_local = await self.driver.reserve_prompt(prompt, params, self.cluster.prefill_threshold,
                                                              timeout=self.cluster.request_timeout)
        except InvalidParam as exc:
            await self.answer(incoming, protocol.Error(id=msg.id, code=INVALID_REQUEST, request_id=rid,
                                                       message=str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 -- answered; the coordinator ends the request
            await self.answer(incoming, internal_error(msg, exc))
            return
        if res is None:           # no transfer: the prefill leg's node is told by Accepted without a grant
            self.inbox.count_local(why_local)
            await self.answer(incoming, protocol.Accepted(id=msg.id, request_id=rid))
            await self.pipe(rid, incoming.peer, self.driver.generate(rid, prompt, params))
            return
        await self._decode_prefilled(msg, incoming, res)

    async def _decode_prefilled(self, msg: protocol.DecodeLeg, incoming: Incoming, res: Any) -> None:
        """The decode leg once blocks are reserved (``res``): answer the grant,
        wait for the prompt's KV, then decode from token 1 (or recompute, or
        fail). The region is cancelled on every path the engine did not
        take it over."""
        rid, prompt, params, peer = msg.request_id, list(msg.prompt_token_ids), msg.sampling, incoming.peer
        layout = self.driver.kv_layout()
        rx = self.inbox.open_prompt(rid, res, msg.prefill_node, layout.num_layers)
        handed = False
        try:
            await self.answer(incoming, protocol.Accepted(
                id=msg.id, request_id=rid, kv_transfer_id=rx.transfer_id, kv_block_ids=tuple(res.block_ids),
                kv_have_blocks=res.have_blocks, kv_num_layers=layout.num_layers,
                kv_dtype=protocol.dtype_name(layout.dtype)))
            state = await rx.wait()
            if state is TransferState.DONE:
                handed = True
                if rx.replica_to and self.replicator is not None:
                    self.replicator.expect_prompt(rid, writer=msg.prefill_node, holder=rx.replica_to)
                await self.pipe(rid, peer, self.driver.generate_prefilled(
                    rid, prompt, params, res, rx.first_token, rx.cached_tokens))
                return
            if state is TransferState.FINISHED:
                return                      # token 0 ended it; the coordinator has it from the prefill node
            log.warning("request %s: prompt KV from %s %s (%s); %s", rid, msg.prefill_node, state.value,
                        rx.reason, self.cluster.kv_load_failure)
            await self.inbox.release(rx, handed_to_engine=False)
            if self.cluster.kv_load_failure == "fail":
                await self.send(peer, protocol.Error(code="kv_load_failed", request_id=rid,
                                                     message=f"the prompt's KV did not arrive: {rx.reason}"))
                return
            await self.pipe(rid, peer, self.driver.generate(rid, prompt, params))
        finally:
            if rx.state not in FINAL:
                rx.end(TransferState.CANCELLED, "request aborted")
            if rx.transfer_id in self.inbox.receivers:
                await asyncio.shield(self.inbox.release(rx, handed_to_engine=handed))

    def abort_prefill_wait(self, rid: str) -> None:
        """The coordinator could not start ``rid``'s prefill leg: its decode
        leg stops waiting for the KV (``Abort(leg="prefill")``)."""
        self.inbox.abort_prompt(rid, "the coordinator could not start the prefill leg")


def _chunk(rid: str, out: RequestOutput) -> protocol.TokenChunk:
    """The TokenChunk of one engine output (the last one, unless handed off, ends the request)."""
    ends = out.finished and not out.handed_off
    return protocol.TokenChunk(
        request_id=rid, start_index=out.num_output_tokens - len(out.new_token_ids),
        token_ids=tuple(out.new_token_ids), text=out.text, text_ends=tuple(out.text_ends),
        finish_reason=out.finish_reason if ends else None, stop_reason=out.stop_reason if ends else None,
        usage={"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
               "cached_tokens": out.num_cached_tokens},
        logprobs=tuple(out.logprobs) if out.logprobs is not None else None,
        prompt_logprobs=tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None)


def internal_error(msg: protocol.Message, exc: Exception) -> protocol.Error:
    """The reply to a message whose handling failed (logged with its traceback)."""
    log.exception("%s %s failed", msg.TYPE, msg.id)
    return protocol.Error(id=msg.id, code="internal", message=f"{type(exc).__name__}: {exc}")
