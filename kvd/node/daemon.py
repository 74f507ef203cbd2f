"""The node daemon (``kvd node``): one engine, reached over a transport.

Tasks, all owned by one TaskGroup in ``run``::

    serve      decode messages from the listener and dispatch them
    heartbeat  register with the coordinator, beat every interval
    reaper     release KV allocations whose transfer never completed
    notify     READY=1 once registered, then STATUS= lines when they change
    one task per request   a leg (kvd/node/legs.py) -> TokenChunk stream to that peer
    one task per transfer/admin command (they reply when done)

Messages served on the listener, each by its own handler (``_handlers``:
message type -> handler):

- a leg of a request (``GenerateRequest``, ``DecodeLeg``, ``PrefillLeg``,
  ``ResumeRequest``; a transport request) -> the reply ``Accepted``, or an
  ``Error`` (draining, duplicate, undecodable), then a stream of ``TokenChunk``
  pushed to the sender (every chunk carries ``start_index``, the index of its
  first token), ending with a chunk whose ``finish_reason`` is set, or one
  ``Error`` with the request id. The legs themselves: kvd/node/legs.py.
- ``Abort`` -> the request stops and frees its blocks.
- ``KVTransferRequest`` / ``KVData`` / ``KVCommit`` / ``ReplicaData`` -> the
  node's one KV inbox (kvd/node/inbox.py), the receiving half of a KV
  transfer, a disaggregated prompt or a replica.
- ``AdminCommand`` -> ``AdminReply`` (kvd/node/admin_commands.py); the same
  handlers serve the admin Unix socket.

Who may send what is checked before any handler runs (kvd/trust.py, the
gate of ``protocol.serve``): requests, aborts and admin commands from the
coordinator's key only, KV transfer messages from a node's key only, and a
``KVData`` is taken only into a region reserved for its own link (inbox.py).
Malformed and refused messages are answered with ``Error``, counted by
reason (``bad_messages``), logged rate-limited, and never stop the loop.
SIGTERM drains: STOPPING=1 to systemd, the node says so in its heartbeat
(nothing new is routed here), finishes its requests (up to
``drain_timeout``), says Goodbye and exits.

Fault injection (admin ``fail``, kvd/node/admin_commands.py): ``exit``,
``stop`` (heartbeats), ``drop-transfers`` (sets ``transfers.drop``: this
node refuses KV transfers both ways), ``resume``, ``engine`` (the engine
thread raises; ``_engine_died`` follows).

When the engine thread dies, the node leaves at once: no new request, a
Goodbye naming the cause and every request in flight as lost (the
coordinator recovers or ends them), then ``run`` returns with
``engine_failure`` set, and ``kvd node`` exits with status 3.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from engine.engine import EngineConfig
from engine.memory.rmanager import RManager
from kvd import links, protocol, trust
from kvd.cluster_config import COORDINATOR_NAME, ClusterConfig, Role
from kvd.engine_client import EngineDead
from kvd.node.admin_commands import NodeAdmin, TransferFaults, serve_admin_socket
from kvd.node.engine_driver import EngineDriver, describe_failure, load_engine
from kvd.node.cache_shipper import CacheShipper
from kvd.node.heartbeat import Heartbeater
from kvd.node.inbox import MESSAGES as INBOX_MESSAGES, KVInbox
from kvd.node.lending import Borrower, Lender, admin_commands as lending_commands, keep_leases, serve_borrowing
from kvd.node.recall import Recaller, admin_commands as recall_commands
from kvd.node.peers import PeerLinks
from kvd.node.legs import Legs, internal_error
from kvd.node.replication import Replicator
from kvd.sdnotify import Notifier, report_status
from transports import InprocRegistry, Listener, TransportError, TransportOptions

log = logging.getLogger("kvd.node")

# the messages a node refuses while it drops KV transfers (fault injection)
KV_MESSAGES = frozenset(INBOX_MESSAGES)


class NodeDaemon:
    def __init__(self, engine_config: EngineConfig, cluster: ClusterConfig, name: str, *,
                 address: str | None = None, coordinator: str | None = None,
                 registry: InprocRegistry | None = None, admin_socket: str | None = None,
                 drain_timeout: float = 30.0, notifier: Notifier | None = None,
                 role: str | None = None, host_nodes: int = 1) -> None:
        node_cfg = cluster.node(name)
        self.name = name
        self.role = role or node_cfg.role
        self.engine_config = engine_config
        self.host_nodes = host_nodes       # kvd nodes on this host (load_engine)
        self.cluster = cluster
        self.address = address or node_cfg.address or cluster.default_address(name)
        self.coordinator_url = coordinator or cluster.coordinator
        self.registry = registry
        self.admin_socket = admin_socket if admin_socket is not None else node_cfg.admin_socket
        self.drain_timeout = drain_timeout
        self.incarnation = uuid.uuid4().hex[:12]
        self.options = TransportOptions(request_timeout=cluster.request_timeout,
                                        send_timeout=cluster.request_timeout,
                                        ucx_progress_mode=cluster.ucx_progress_mode)
        self.driver: EngineDriver | None = None
        self.listener: Listener | None = None
        self.heartbeat: Heartbeater | None = None
        self.cache_shipper: CacheShipper | None = None   # cache events -> the global prompt tree
        self.admin = None                              # the admin Unix socket's server
        self.commands: NodeAdmin | None = None         # the admin commands (socket and AdminCommand)
        self.bad_messages: collections.Counter[str] = collections.Counter()
        self.notifier = notifier or Notifier(None)     # disabled: the embedded node of `kvd serve`
        self.draining = False
        self.transfers = TransferFaults()              # fault injection: refuse KV transfers; counts
        self.streams: dict[str, asyncio.Task] = {}
        self.inbox: KVInbox | None = None              # every way KV arrives here (kvd/node/inbox.py)
        self.rmanager: RManager | None = None          # blocks lent and borrowed (engine/memory/rmanager.py)
        self.borrower: Borrower | None = None          # this node as a debtor (lending.py)
        self.recaller: Recaller | None = None          # its loans' KV brought home (recall.py)
        self._ledger_link = None                       # to the coordinator, for CreditorQuery
        self.replicator: Replicator | None = None      # this node's KV -> its replica peer
        self.legs: Legs | None = None                  # the legs of requests run here
        self.peer_links = PeerLinks(lambda node, address: links.connect(   # to other nodes: KV, replicas
            address, cluster, name, node, registry=registry, options=self.options))
        self._tg: asyncio.TaskGroup | None = None
        self._stop = asyncio.Event()
        self._force = asyncio.Event()                  # end the drain now
        self._ready = asyncio.Event()
        self.engine_failure: str | None = None          # what killed the engine thread: the node left
        self.on_engine_dead = None                      # called with engine_failure (the embedded server)
        self._lost: tuple[str, ...] = ()                # the requests in flight when the engine died
        self._dispatch = self._handlers()

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the engine, start its thread, bind the listener and admin socket."""
        t0 = time.perf_counter()
        self.notifier.status(f"node {self.name}: loading {self.engine_config.model}")
        engine = await asyncio.to_thread(load_engine, self.engine_config, self.host_nodes)
        self.driver = EngineDriver(engine)
        self.driver.on_dead = self._engine_died
        await self.driver.start()
        self.listener = await links.listen(self.address, self.cluster, self.name,
                                           registry=self.registry, options=self.options)
        self.address = self.listener.url
        self.inbox = KVInbox(self.driver, authenticated=self.listener.authenticated,
                             max_peer_blocks=max(1, int(self.cluster.kv_grant_share * engine.config.kv_blocks)),
                             transfer_timeout=self.cluster.kv_transfer_timeout,
                             request_timeout=self.cluster.request_timeout,
                             replica_blocks=self.cluster.replica_kv_blocks)
        self.inbox.replicas.partner = self.cluster.partner_of(self.name)   # the trust gate of a pair's copies
        # borrowed KV memory (lending.py): a debtor silent for a heartbeat deadline loses its loans here
        self.rmanager = RManager(engine.pool, engine.config.lend_kv_blocks, lease_s=self.cluster.heartbeat_deadline)
        self.inbox.lending = Lender(self.driver, self.rmanager, authenticated=self.listener.authenticated)
        self.inbox.lending.open_channel(self.address, links.curve_server(self.cluster, self.name))
        self.borrower = Borrower(self.name, self.rmanager, self._ask_coordinator, self.peer_links.get,
                                 self.cluster.request_timeout)
        self.recaller = Recaller(self.driver, self.borrower, self.cluster.request_timeout)
        if engine.config.borrow_kv_blocks:      # requests past the free blocks borrow (engine/borrowing.py)
            serve_borrowing(engine, self.borrower, asyncio.get_running_loop(),
                            min(self.cluster.request_timeout, self.cluster.heartbeat_deadline),
                            channel_keys=lambda peer: links.curve_client(self.cluster, self.name, peer))
        if self.cluster.replicas and self.role != Role.PREFILL:
            self.replicator = Replicator(self.name, self.driver, self._peer, self._drop_peer,
                                         self.cluster.replication_interval, self.cluster.request_timeout)
            self.replicator.partner = self.cluster.partner_of(self.name)   # copies to it are current to the step
            self.replicator.rate = self.cluster.replication_rate
        self.heartbeat = Heartbeater(self.name, self._connect_coordinator, self._hello, self._beat,
                                     self.cluster.heartbeat_interval, self.cluster.request_timeout,
                                     beat_timeout=self.cluster.heartbeat_deadline, on_reply=self._assigned)
        self.cache_shipper = CacheShipper(self.name, self.driver, self.heartbeat, engine.config.block_size,
                                          self.cluster.cache_events_interval, self.cluster.heartbeat_deadline)
        self.legs = Legs(self.name, self.cluster, self.driver, send=self._send, answer=self._answer,
                         report_lost=self.heartbeat.report_lost, peers=self.peer_links,
                         inbox=self.inbox, replicator=self.replicator)
        self.commands = NodeAdmin(self.name, self.driver, self.heartbeat, self.cache_shipper, self._connect_node,
                                  self.cluster.request_timeout, status=self.status, streams=self.streams,
                                  set_draining=self.set_draining, transfers=self.transfers,
                                  set_role=lambda role: setattr(self, "role", role), replicas=self.inbox.replicas,
                                  replicator=self.replicator)
        self.commands.extra.update(recall_commands(self.recaller))
        if self.admin_socket:
            await self._start_admin()
        log.info("node %s: %s loaded in %.1fs, listening on %s; kernels: %s", self.name, engine.model_name,
                 time.perf_counter() - t0, self.address, ", ".join(f"{k} {v}" for k, v in engine.kernels().items()))

    async def run(self) -> None:
        """Serve until ``request_stop``; then drain and clean up. Calls ``start`` if needed.

        The systemd watchdog is not pinged here but by the process's entry point
        (``kvd.cli``), from before the model loads."""
        if self.driver is None:
            await self.start()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                serving = tg.create_task(protocol.serve(self.listener, self._handle,
                                                        rejected=self.bad_messages, gate=self._gate),
                                         name="serve")
                beating = tg.create_task(self.heartbeat.run(), name="heartbeat")
                shipping = tg.create_task(self.cache_shipper.run(), name="cache-events")
                reaping = tg.create_task(self._reap(), name="reaper")
                leasing = tg.create_task(keep_leases(self.inbox.lending, self.borrower,
                                                     self.cluster.heartbeat_interval), name="leases")
                notifying = tg.create_task(self._notify(), name="notify")
                replicating = tg.create_task(self.replicator.run(), name="replication") if self.replicator else None
                self._ready.set()
                await self._stop.wait()
                notifying.cancel()
                await self._drain()
                reason = f"engine dead: {self.engine_failure}" if self.engine_failure else "shutdown"
                await self.heartbeat.goodbye(reason, tuple(dict.fromkeys(self._lost + tuple(self.streams))))
                for task in (serving, beating, shipping, reaping, leasing, replicating, *self.streams.values()):
                    if task is not None:
                        task.cancel()
                await self.listener.close()
        finally:
            self._tg = None
            await self.cleanup()

    def set_draining(self, draining: bool) -> None:
        """Take no new request (True), or take them again; the coordinator
        hears it from the next heartbeat, sent at once."""
        self.draining = draining
        self.heartbeat.kick()

    def request_stop(self, force: bool = False) -> None:
        """First call (SIGTERM): drain, up to ``drain_timeout``. A second call, or
        ``force``: end the drain now, even one already under way."""
        if force or self._stop.is_set():
            self._force.set()
        self._stop.set()

    def _engine_died(self, exc: BaseException) -> None:
        """The engine thread died (``EngineDriver.on_dead``, before the open
        streams end): nothing can run here any more. Take no new request,
        note the requests in flight (the Goodbye names them lost) and stop at
        once (module docstring)."""
        self.engine_failure = describe_failure(exc)
        self._lost = tuple(self.streams)
        self.draining = True
        log.critical("node %s: the engine died (%s); leaving, %d request(s) in flight lost",
                     self.name, self.engine_failure, len(self._lost))
        if self.on_engine_dead is not None:
            self.on_engine_dead(self.engine_failure)
        self.request_stop(force=True)

    async def wait_ready(self, timeout: float = 300.0) -> None:
        async with asyncio.timeout(timeout):
            await self._ready.wait()

    async def _drain(self) -> None:
        self.draining = True
        self.heartbeat.kick()
        self.notifier.stopping(f"node {self.name}: draining {len(self.streams)} request(s)")
        log.info("node %s draining: %d request(s) in flight", self.name, len(self.streams))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.drain_timeout):
                while self.streams and not self._force.is_set():
                    await asyncio.sleep(0.05)
        if self.streams:
            log.warning("node %s: drain ended with %d request(s) in flight; they are given up",
                        self.name, len(self.streams))

    async def _notify(self) -> None:
        """READY=1 once registered with the coordinator (listener bound, requests
        can arrive), then a STATUS= line whenever it changes."""
        self.notifier.status(f"node {self.name}: registering with {self.coordinator_url}")
        await self.heartbeat.joined.wait()
        await report_status(self.notifier, self.status_line)

    def status_line(self) -> str:
        """One line for ``systemctl status``."""
        snap = self.driver.stats()
        kv = snap.get("kv", {})
        line = (f"node {self.name}: running {snap.get('running', 0)}, waiting {snap.get('waiting', 0)}, "
                f"free blocks {kv.get('device', {}).get('free', 0)}")
        if self.draining:
            line += ", draining"
        if not self.heartbeat.registered:
            line += ", not registered"
        return line

    async def cleanup(self) -> None:
        await self.peer_links.close()
        if self.inbox is not None and self.inbox.lending is not None:
            await asyncio.to_thread(self.inbox.lending.close)     # joins the channel's thread
        if self._ledger_link is not None:
            await self._ledger_link.close()
        if self.admin is not None:
            await self.admin.close()
        if self.listener is not None:
            await self.listener.close()
        if self.driver is not None:
            await self.driver.stop()

    # ----------------------------------------------------------- registration
    async def _connect_coordinator(self):
        return await links.connect(self.coordinator_url, self.cluster, self.name, COORDINATOR_NAME,
                                   registry=self.registry, options=self.options)

    def _hello(self) -> protocol.Hello:
        config = self.driver.config
        return protocol.Hello(
            id=f"hello-{self.name}", deadline=time.time() + self.cluster.request_timeout,
            node=self.name, address=self.address, role=self.role,
            blocks_per_tier={"device": config.kv_blocks, "host": config.host_kv_blocks},
            block_size=config.block_size, model_name=self.driver.model_name,
            max_model_len=self.driver.max_model_len, incarnation=self.incarnation,
            fingerprint=self.driver.fingerprint, pair=self.cluster.partner_of(self.name))

    async def _beat(self, seq: int) -> protocol.Heartbeat:
        events = self.cache_shipper.events_since_beat()   # the events themselves: CacheShipper
        snap = self.driver.stats()
        kv = snap.get("kv", {})
        max_seqs = self.driver.config.max_num_seqs
        return protocol.Heartbeat(
            id=f"hb-{self.name}-{seq}", deadline=time.time() + self.cluster.request_timeout,
            node=self.name, incarnation=self.incarnation, seq=seq, load=(snap["running"] + snap["waiting"]) / max_seqs,
            running=snap["running"], waiting=snap["waiting"],
            # free: what an allocation or a loan may take, unlocked cached blocks included
            free_blocks={t: kv.get(t, {}).get("free", 0) + kv.get(t, {}).get("evictable", 0) for t in protocol.TIERS},
            draining=self.draining,
            cached_blocks=sum(kv.get(t, {}).get("cached", 0) for t in protocol.TIERS),
            cache_events=events, replicas=self.inbox.replicas.report(),
            lend_cap=self.rmanager.lend_cap, lent=dict(self.inbox.lending.lent),
            borrowed=self.rmanager.borrowed_per_creditor(),
            stats=dict(snap, replication=self.replicator.stats() if self.replicator else {},
                       copies=self.inbox.replicas.stats()))

    def _assigned(self, welcome: protocol.Welcome) -> None:
        """The coordinator's reply to a beat: this node's replica peer and its
        tickets there, and the replicas held here whose requests are no
        longer in flight; to a registration: this node's replica key."""
        if welcome.replica_key:
            self.inbox.replicas.key = welcome.replica_key
        if self.replicator is not None:
            self.replicator.set_peer(welcome.replica_peer, welcome.replica_address, welcome.replica_tickets)
        if welcome.drop_replicas and self._tg is not None:
            self._tg.create_task(self._drop_replicas(welcome.drop_replicas), name="drop replicas")

    async def _drop_replicas(self, request_ids: tuple[str, ...]) -> None:
        with contextlib.suppress(TimeoutError, EngineDead):
            await self.inbox.replicas.drop(request_ids)

    # ------------------------------------------------------------- messages
    def _gate(self, msg: protocol.Message, incoming) -> str | None:
        """Why the sender may not send ``msg`` here (kvd/trust.py), or None."""
        if isinstance(msg, protocol.KVTransferRequest) and msg.dst_node != self.name:
            return f"transfer addressed to {msg.dst_node!r}, this is node {self.name!r}"
        return trust.node_refusal(msg, incoming.identity, self.listener.authenticated)

    def _handlers(self) -> dict[type[protocol.Message], Any]:
        """Message type -> its handler ``(msg, incoming) -> the reply, or None``
        (a handler that answers later does so from a task it starts)."""
        return {
            protocol.GenerateRequest: self._on_generate,
            protocol.DecodeLeg: self._on_decode_leg,
            protocol.PrefillLeg: self._on_prefill_leg,
            protocol.ResumeRequest: self._on_resume,
            protocol.Abort: self._on_abort,
            **dict.fromkeys(INBOX_MESSAGES, self._on_kv),
            protocol.AdminCommand: self._on_admin_command,
        }

    async def _handle(self, msg: protocol.Message, incoming) -> protocol.Message | None:
        handler = self._dispatch.get(type(msg))
        if handler is None:
            self.bad_messages["unexpected_type"] += 1
            return protocol.Error(id=msg.id, code="unexpected_type", message=f"a node does not serve {msg.TYPE}")
        if type(msg) in KV_MESSAGES and self.transfers.drop:
            # Refused with an answer rather than ignored: the sender learns at once
            # instead of holding its prefix lock for a whole request_timeout. An
            # allocation made before the fault is released by the reaper.
            self.transfers.dropped += 1
            return protocol.Error(id=msg.id, code="transfer_refused",
                                  message=f"node {self.name} drops KV transfers (fault injection)")
        return handler(msg, incoming)

    def _refusal(self, msg: protocol.LegRequest) -> protocol.Error | None:
        """Why this node takes no new leg of ``msg``'s request now (draining,
        or the request already runs here), or None."""
        if self.draining:
            why = f"its engine died: {self.engine_failure}" if self.engine_failure else "is draining"
            return protocol.Error(id=msg.id, code="draining", request_id=msg.request_id,
                                  message=f"node {self.name} {why}")
        if msg.request_id in self.streams:
            return protocol.Error(id=msg.id, code="duplicate", request_id=msg.request_id,
                                  message="request id already in flight")
        return None

    def _start(self, msg: protocol.LegRequest, leg: Coroutine[Any, Any, Any], replicate: bool = True) -> None:
        """Run ``leg`` as the request's task; with ``replicate``, the request's
        KV is replicated to ``msg.replica_to`` (when this node replicates)."""
        self.streams[msg.request_id] = self._tg.create_task(self._leg(msg.request_id, leg),
                                                            name=f"req {msg.request_id}")
        if replicate and msg.replica_to and self.replicator is not None:
            self.replicator.grant(msg.request_id, msg.replica_to, msg.replica_ticket)

    def _on_generate(self, msg: protocol.GenerateRequest, incoming) -> protocol.Message:
        if refusal := self._refusal(msg):
            return refusal
        self._start(msg, self.legs.whole(msg, incoming.peer))
        return protocol.Accepted(id=msg.id, request_id=msg.request_id)

    def _on_decode_leg(self, msg: protocol.DecodeLeg, incoming) -> protocol.Message | None:
        if refusal := self._refusal(msg):
            return refusal
        self._start(msg, self.legs.decode(msg, incoming))
        return None               # the reply (with or without a grant) comes from the leg

    def _on_prefill_leg(self, msg: protocol.PrefillLeg, incoming) -> protocol.Message:
        if refusal := self._refusal(msg):
            return refusal
        if why := self.legs.prefill_refusal(msg):
            return protocol.Error(id=msg.id, code="bad_grant", request_id=msg.request_id, message=why)
        self._start(msg, self.legs.prefill(msg, incoming.peer), replicate=False)   # replica_to: the decode node's
        return protocol.Accepted(id=msg.id, request_id=msg.request_id)

    def _on_resume(self, msg: protocol.ResumeRequest, incoming) -> protocol.Message:
        if refusal := self._refusal(msg):
            return refusal
        leg, resumed = self.legs.resume(msg, incoming.peer)
        self._start(msg, leg)
        return protocol.Accepted(id=msg.id, request_id=msg.request_id, resumed_tokens=resumed)

    def _on_abort(self, msg: protocol.Abort, incoming) -> None:
        if msg.leg == "prefill":
            self.legs.abort_prefill_wait(msg.request_id)
            return None
        task = self.streams.get(msg.request_id)
        if task is not None:
            task.cancel()
        return None

    def _on_kv(self, msg: protocol.Message, incoming) -> protocol.Message | None:
        """Every KV message goes to the inbox: answered right here when it
        needs no task (a commit, a refusal, an idle engine), else from one."""
        try:
            reply = self.inbox.answer_now(msg, incoming)
        except Exception as exc:  # noqa: BLE001 -- answered as _reply_later answers a failure
            return internal_error(msg, exc)
        if reply is not None:
            return reply
        return self._reply_later(msg, incoming, lambda: self.inbox.answer(msg, incoming))

    def _on_admin_command(self, msg: protocol.AdminCommand, incoming) -> None:
        return self._reply_later(msg, incoming, lambda: self.commands.answer(msg))

    async def _send(self, peer: bytes, msg: protocol.Message) -> None:
        await self.listener.send(peer, *protocol.encode(msg))

    async def _leg(self, rid: str, leg) -> None:
        """Run one request's leg (a coroutine); forget the request at its end.
        One whose message to the coordinator could not be sent is reported lost."""
        try:
            await leg
        except TransportError as exc:
            log.info("request %s: coordinator unreachable (%s); aborted", rid, exc)
            self.heartbeat.report_lost(rid)
        finally:
            self.streams.pop(rid, None)

    async def _connect_node(self, node: str, address: str):
        """A one-off link to ``node`` at ``address`` (the caller closes it)."""
        return await links.connect(address, self.cluster, self.name, node,
                                   registry=self.registry, options=self.options)

    async def _peer(self, node: str, address: str, incarnation: str = ""):
        """The link to ``node`` at ``address`` (kvd/node/peers.py: one per peer process)."""
        return await self.peer_links.get(node, address, incarnation)

    async def _drop_peer(self, node: str) -> None:
        await self.peer_links.drop(node)

    async def _answer(self, incoming, reply: protocol.Message) -> None:
        """The reply to a transport request, from a task."""
        if incoming.request_id:
            try:
                await self.listener.reply(incoming, *protocol.encode_reply(reply))
            except TransportError as exc:
                log.info("reply to %s not delivered: %s", reply.TYPE, exc)

    def _reply_later(self, msg: protocol.Message, incoming,
                     answer: Callable[[], Awaitable[protocol.Message]]) -> None:
        """Answer ``msg`` from a task: ``answer()``'s reply, or an ``internal``
        Error when it raised. Returns None (no reply now)."""
        async def reply() -> None:
            try:
                reply = await answer()
            except Exception as exc:  # noqa: BLE001
                reply = internal_error(msg, exc)
            await self._answer(incoming, reply)
        self._tg.create_task(reply(), name=f"{msg.TYPE} {msg.id}")
        return None

    async def _ask_coordinator(self, msg: protocol.CreditorQuery) -> protocol.Message:
        """The coordinator's reply to ``msg``, over a link of its own (the
        heartbeat's link carries only beats)."""
        if self._ledger_link is None or self._ledger_link.closed:
            self._ledger_link = await asyncio.wait_for(self._connect_coordinator(), self.cluster.request_timeout)
        return await protocol.call(self._ledger_link, msg, timeout=self.cluster.request_timeout)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(Exception):
                if n := await self.inbox.expire():
                    log.warning("released %d KV allocation(s) whose transfer never completed", n)

    # ---------------------------------------------------------------- admin
    async def _start_admin(self) -> None:
        self.admin = await serve_admin_socket(self.admin_socket, f"kvd-node-{self.name}",
                                              {**self.commands.handlers(),
                                               **lending_commands(self.inbox.lending, self.borrower)})

    def status(self) -> dict[str, Any]:
        snap = self.driver.stats() if self.driver else {}
        lst = self.listener.stats if self.listener else None
        return {"node": self.name, "role": self.role, "address": self.address, "incarnation": self.incarnation,
                "draining": self.draining, "registered": bool(self.heartbeat and self.heartbeat.registered),
                "heartbeats_paused": bool(self.heartbeat and self.heartbeat.paused),
                "kernels": self.driver.kernels() if self.driver else {},
                "fingerprint": self.driver.fingerprint if self.driver else "", "in_flight": len(self.streams),
                "running": snap.get("running", 0), "waiting": snap.get("waiting", 0),
                "generation_tokens": snap.get("generation_tokens", 0),
                "bad_messages": dict(self.bad_messages),
                "malformed_frames": lst.malformed if lst else 0,
                "refused_peers": lst.refused if lst else 0,
                "drop_transfers": self.transfers.drop,
                "engine": self.driver.state() if self.driver else {"state": "stopped", "error": None},
                "cache_events": self.cache_shipper.stats() if self.cache_shipper else {},
                "transfers": {"sent": self.transfers.sent, "dropped": self.transfers.dropped,
                              **(self.inbox.prefix_counts if self.inbox else
                                 dict.fromkeys(("received", "failed", "refused", "peer_refused"), 0))},
                "disaggregation": {"decode": self.inbox.prompt_stats() if self.inbox else {},
                                   "prefill": dict(self.legs.prefill_legs) if self.legs else {},
                                   "prompt_replicas": dict(self.legs.prompt_replicas) if self.legs else {}},
                "replication": {"sender": self.replicator.stats() if self.replicator else {},
                                "holder": self.inbox.replicas.stats() if self.inbox else {}},
                "lending": {"creditor": self.inbox.lending.stats() if self.inbox and self.inbox.lending else {},
                            "debtor": self.borrower.stats() if self.borrower else {},
                            "recall": self.recaller.stats() if self.recaller else {}}}
