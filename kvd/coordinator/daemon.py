"""The coordinator daemon (``kvd coordinator``): front door, membership, routing.

Tasks, owned by one TaskGroup in ``run``: the registration listener (Hello,
Heartbeat, Goodbye, decoded by ``kvd.protocol.serve``, each from a node's key
about that node only, kvd/trust.py; bad and refused messages counted by
reason), the failure detector (every ``heartbeat_interval / 2``: nodes
silent for ``heartbeat_deadline`` are declared dead and their in-flight
requests end with an error), the HTTP front door (``FrontDoor``,
unchanged for clients) over a ``RemoteEngineClient``, and the systemd notify
task (READY=1 once HTTP is bound, then STATUS= lines; STOPPING=1 when the
drain begins). Admin commands are served on the admin socket by
``CoordinatorAdmin`` (kvd/coordinator/admin_commands.py); /metrics adds the
cluster's series through ``ClusterCollector`` (kvd/coordinator/collector.py).

Imports no torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import signal
import socket
import time
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from kvd import links, protocol, trust
from kvd.api.connections import CappedSite, fit_open_files, reserve_port, runner_options
from kvd.api.http import FrontDoor
from kvd.cluster_config import COORDINATOR_NAME, ClusterConfig
from kvd.config import ServerConfig
from kvd.coordinator.admin_commands import CoordinatorAdmin
from kvd.coordinator.cache_router import CostWeights, make_router
from kvd.coordinator.cache_sync import CacheSync
from kvd.coordinator.client import RemoteEngineClient
from kvd.coordinator.collector import ClusterCollector
from kvd.coordinator.dgfm_rounds import DGFMRounds
from kvd.coordinator.ledger import DebtLedger
from kvd.coordinator.membership import Membership, NodeInfo, Refused
from kvd.coordinator.pairs import PairRouter, PairScheduler
from kvd.coordinator.prompt_tree import PromptTrees
from kvd.coordinator.recovery import RecoveryPolicy
from kvd.coordinator.router import Router
from kvd.ratelog import RateLimitedLog
from kvd.sdnotify import Notifier, report_status
from transports import Connection, InprocRegistry, Listener, TransportError, TransportOptions

log = logging.getLogger("kvd.coordinator")

GOODBYE_GRACE_S = 1.5      # how long a leaving node's last chunks may trail its Goodbye
STALL_MIN_S = 0.1          # a failure-detector wake-up this late is a stall of this loop: excused
STALL_WARN_S = 1.0         # ... and logged as a warning from this long
# Shutdown, after drain_timeout: requests still open get END_GRACE_S to write
# their final error event; then aiohttp gets HTTP_CLOSE_S per phase to close
# connections (its default, 60 s for each of two phases, outlasted any drain).
END_GRACE_S = 2.0
HTTP_CLOSE_S = 1.0


class CoordinatorDaemon:
    def __init__(self, cluster: ClusterConfig, server: ServerConfig, model_name: str, tokenizer: Any, *,
                 registry: InprocRegistry | None = None, router: Router | None = None,
                 admin_socket: str | None = None, default_max_model_len: int = 2048,
                 stats_source=None, notifier: Notifier | None = None,
                 http_sockets: list[socket.socket] | None = None) -> None:
        self.cluster = cluster
        self.server = server
        self.notifier = notifier or Notifier(None)
        self.registry = registry
        self.admin_socket = admin_socket if admin_socket is not None else cluster.admin_socket
        self.membership = Membership(cluster.heartbeat_deadline, cluster.heartbeat_interval)
        self.trees = PromptTrees(pending_ttl=cluster.routing_pending_ttl)   # global prompt trees
        self.ledger = DebtLedger()          # the global debt ledger of borrowed KV blocks (ledger.py)
        self.cache_sync = CacheSync(self.trees)
        # where lost requests go, and the replica table behind it (kvd/coordinator/recovery.py)
        self.recovery = RecoveryPolicy(cluster.recovery, cluster.max_recoveries, replicas=cluster.replicas)
        self.client = RemoteEngineClient(model_name, tokenizer, self.membership,
                                         router or PairRouter(self.recovery.pairs, self.make_router(cluster.routing),
                                                              queue_factor=cluster.prefill_queue_factor),
                                         prefill_router=self.make_router(cluster.routing),
                                         default_max_model_len=default_max_model_len,
                                         stats_source=stats_source,
                                         recovery=self.recovery,
                                         kv_return=cluster.kv_return,
                                         kv_return_timeout=2 * cluster.request_timeout,
                                         prefill_queue_factor=cluster.prefill_queue_factor)
        if isinstance(self.client.router, PairRouter):      # a pair's prompts: its nodes' prefill queues
            self.client.router.queued = self.client.prefill_queue
        self.options = TransportOptions(request_timeout=cluster.request_timeout,
                                        send_timeout=cluster.request_timeout,
                                        ucx_progress_mode=cluster.ucx_progress_mode)
        self.bad_messages: collections.Counter[str] = collections.Counter()
        self._warn = RateLimitedLog(log)    # refused registrations and beats: one line per node per 10 s
        self.listener: Listener | None = None
        self.front: FrontDoor | None = None
        self.runner: web.AppRunner | None = None
        self.site: CappedSite | None = None
        self.http_sockets: list[socket.socket] = http_sockets or []   # reserve_http's; closed by cleanup
        self.admin = None
        self.commands = CoordinatorAdmin(self.client, self.membership, cluster, self.trees, self.cache_sync,
                                         status=self.status, set_draining=self._set_draining,
                                         connect=self.connect_node, make_router=self.make_router,
                                         ledger=self.ledger)
        # DGFM carried out (dgfm_rounds.py): each move's debtor recalls through its `recall` command
        self.dgfm = DGFMRounds(self.ledger, lambda debtor, creditor, blocks: self.commands.forward(
            debtor, "recall", {"creditor": creditor, "blocks": blocks}, timeout=4 * cluster.request_timeout),
            lambda: self.membership.nodes, cluster.dgfm_interval_s, cluster.dgfm_min_blocks)
        self.commands.dgfm_rounds = self.dgfm
        self.port: int | None = None
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._ready = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None

    def make_router(self, policy: str, **weights: float) -> Router:
        """A router for ``policy`` with this cluster's settings, ``weights``
        (CostWeights fields) overriding them; ValueError for an unknown policy
        or a bad weight."""
        c = self.cluster
        base = CostWeights(c.routing_overlap_weight, c.routing_load_weight, c.routing_max_imbalance,
                           c.routing_recent_weight, c.routing_load_decay)
        return make_router(policy, self.trees, affinity_tokens=c.affinity_tokens,
                           weights=dataclasses.replace(base, **weights))

    @property
    def address(self) -> str:
        return self.listener.url if self.listener else self.cluster.coordinator

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind the registration listener, then the HTTP front door and admin socket."""
        await self.start_registration()
        await self.start_http()

    async def start_registration(self) -> None:
        if self.listener is None:
            self.listener = await links.listen(self.cluster.coordinator, self.cluster, COORDINATOR_NAME,
                                               registry=self.registry, options=self.options)

    def reserve_http(self) -> None:
        """Bind the HTTP port now (``reserve_port``), before nodes start and
        register: a taken port fails here, and no node's data port can take
        it meanwhile. ``start_http`` opens it. Idempotent."""
        if not self.http_sockets:
            self.http_sockets = reserve_port(self.server.host, self.server.port)

    async def start_http(self) -> None:
        srv = self.server
        self.reserve_http()
        self.front = FrontDoor(self.client, api_key=srv.resolved_api_key(),
                               served_model_name=srv.served_model_name,
                               max_body_bytes=srv.max_body_bytes, body_timeout=srv.body_timeout)
        self.front.metrics.registry.register(ClusterCollector(
            self.client, self.membership, self.trees, self.cache_sync, self.bad_messages,
            http_site=lambda: self.site,
            malformed_frames=lambda: self.listener.stats.malformed if self.listener else 0, ledger=self.ledger))
        self.runner = web.AppRunner(self.front.make_app(), handler_cancellation=True, access_log=None,
                                    shutdown_timeout=HTTP_CLOSE_S, **runner_options(srv.header_timeout))
        await self.runner.setup()
        self.site = CappedSite(self.runner, self.http_sockets,
                               max_connections=fit_open_files(srv.max_connections))
        await self.site.start()
        self.port = self.site.port
        if self.admin_socket:
            await self._start_admin()
        log.info("coordinator: nodes register at %s; serving %s on http://%s:%d/v1", self.address,
                 self.front.model_name, self.server.host, self.port)

    async def run(self, install_signals: bool = False, expect_nodes: int = 0,
                  nodes_timeout: float = 300.0, after_drain=None) -> None:
        """Serve until ``request_stop``. With ``expect_nodes``, the HTTP port
        opens only once that many nodes registered (``kvd serve``: /health is
        200 only when requests can run). Then ``drain``, then ``after_drain()``
        (awaited while nodes can still say Goodbye: ``kvd serve`` stops its
        nodes there), then ``cleanup``. A stop requested while waiting for the
        nodes skips straight to cleanup."""
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            self.reserve_http()
            await self.start_registration()
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                serving = tg.create_task(protocol.serve(self.listener, self._handle,
                                                        rejected=self.bad_messages, gate=self._gate),
                                         name="registration")
                detecting = tg.create_task(self._detect_failures(), name="failure-detector")
                scheduling = tg.create_task(PairScheduler(self.client, self.commands.handoffs).run(),
                                            name="pair scheduler") if self.cluster.pair_scheduler else None
                recalling = tg.create_task(self.dgfm.run(), name="dgfm")
                if expect_nodes:
                    await self.wait_for_nodes(expect_nodes, nodes_timeout)
                if self.runner is None and not self._stop.is_set():
                    await self.start_http()
                if self.front is not None:
                    self._ready.set()
                    notifying = tg.create_task(self._notify(), name="notify")
                    await self._stop.wait()
                    notifying.cancel()
                    await self.drain()
                if after_drain is not None:
                    await after_drain()
                serving.cancel()
                detecting.cancel()
                if scheduling is not None:
                    scheduling.cancel()
                recalling.cancel()
        finally:
            await self.cleanup()

    async def wait_for_nodes(self, n: int, timeout: float) -> None:
        """Until ``n`` nodes are registered or a stop is requested; TimeoutError past ``timeout``."""
        async with asyncio.timeout(timeout):
            while (len(self.membership.nodes) < n or len(self.client.links) < n) and not self._stop.is_set():
                await asyncio.sleep(0.02)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            await self._ready.wait()

    def request_stop(self) -> None:
        """First call (SIGTERM): drain. Second call: end the drain now."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    async def drain(self) -> None:
        """New requests get 503; open ones may finish until ``drain_timeout`` has
        passed or a second stop is requested; those still open then are ended
        (``FrontDoor.end_requests``: an error event and [DONE] on each stream, a
        503 for the others, an Abort to their nodes) and get END_GRACE_S to say
        so. Returns within drain_timeout + END_GRACE_S."""
        front = self.front
        front.draining = True
        self.notifier.stopping(f"draining: {front.open_requests} request(s) in flight")
        log.info("draining: %d request(s) in flight, %gs to finish", front.open_requests,
                 self.server.drain_timeout)
        await _until(lambda: not front.open_requests or self._force.is_set(), self.server.drain_timeout)
        if front.open_requests:
            why = "second signal" if self._force.is_set() else f"drain_timeout {self.server.drain_timeout:g}s"
            n = front.end_requests(f"the server is shutting down ({why}); retry the request")
            log.warning("drain: ending %d request(s) still in flight (%s)", n, why)
            await _until(lambda: not front.open_requests, END_GRACE_S)

    async def _notify(self) -> None:
        """READY=1 (HTTP and admin are bound), then a STATUS= line when it changes."""
        await report_status(self.notifier, self.status_line)

    def status_line(self) -> str:
        """One line for ``systemctl status``."""
        routable = len(self.membership.routable())
        line = f"serving {len(self.membership.nodes)} nodes, {self.front.in_flight} requests"
        if routable != len(self.membership.nodes):
            line += f" ({routable} routable)"
        return line + (", draining" if self.front.draining else "")

    async def cleanup(self) -> None:
        if self.admin is not None:
            await self.admin.close()
        if self.runner is not None:
            await self.runner.cleanup()
        for sock in self.http_sockets:        # reserved but never served, or closed already
            sock.close()
        await self.client.stop()
        if self.listener is not None:
            await self.listener.close()

    # -------------------------------------------------------- registration
    def _gate(self, msg: protocol.Message, incoming) -> str | None:
        """Why the sender may not send ``msg`` here (kvd/trust.py: a node speaks
        for itself only), or None."""
        return trust.coordinator_refusal(msg, incoming.identity, self.listener.authenticated)

    async def _handle(self, msg: protocol.Message, incoming) -> protocol.Message | None:
        if isinstance(msg, protocol.Heartbeat):
            try:
                known = self.membership.beat(msg)
            except Refused as exc:        # another incarnation's, or a seq out of step: register again
                self.bad_messages["refused_heartbeat"] += 1
                self._warn.warning(("heartbeat", msg.node), "heartbeat of %s refused: %s", msg.node, exc)
                return protocol.Welcome(id=msg.id, node=msg.node, accepted=False, reason=str(exc))
            if known is None:
                return protocol.Welcome(id=msg.id, node=msg.node, accepted=False, reason="unknown node")
            if msg.lost:                  # requests it gave up, undeliverable: ended or recovered now
                self.client.lost_by_node(msg.node, msg.lost)
            self.ledger.update(known.address, msg)
            return self._assignments(msg)
        if isinstance(msg, protocol.CreditorQuery):
            self.ledger.retain(self.membership.nodes)
            best = self.ledger.candidates(msg.node, msg.blocks, msg.exclude)
            return protocol.Creditors(id=msg.id, candidates=tuple(e.node for e in best),
                                      addresses=tuple(e.address for e in best))
        if isinstance(msg, protocol.CacheEvents):
            return self.cache_sync.handle(msg)
        if isinstance(msg, protocol.Hello):
            return await self._register(msg)
        if isinstance(msg, protocol.Goodbye):
            info = self.membership.remove(msg.node)       # routable no more, from now on
            self.cache_sync.gone(msg.node)
            if info is None:
                return protocol.Welcome(id=msg.id, node=msg.node, accepted=False, reason="goodbye")
            self._tg.create_task(self._farewell(info, msg, incoming), name=f"goodbye {msg.node}")
            return None
        self.bad_messages["unexpected_type"] += 1
        return protocol.Error(id=msg.id, code="unexpected_type",
                              message=f"the coordinator does not serve {msg.TYPE}")

    def _assignments(self, hb: protocol.Heartbeat) -> protocol.Welcome:
        """The reply to a beat: the node's replica peer (the ring of
        kvd/coordinator/recovery.py; none with ``replicas = 0``) and the
        replicas it holds that may go (their requests ended)."""
        table = self.recovery.table
        table.update(hb.node, hb.replicas)
        peer = self.recovery.peer_of(hb.node, self.membership.nodes.values())
        stale = table.stale(hb.node, self.client.in_flight())
        return protocol.Welcome(id=hb.id, node=hb.node, accepted=True,
                                heartbeat_interval=self.cluster.heartbeat_interval,
                                replica_peer=peer.name if peer else "", replica_address=peer.address if peer else "",
                                drop_replicas=stale,
                                replica_tickets=self.recovery.tickets(peer, hb.node, self.client.streams_on(hb.node)))

    async def _farewell(self, info: NodeInfo, bye: protocol.Goodbye, incoming) -> None:
        """Answer a Goodbye once the node's finished streams have delivered their
        last chunks (they trail the Goodbye on the data link), so the node closes
        its listener only after the coordinator has everything it sent."""
        n = await self.client.node_left(info, bye.unfinished, f"left: {bye.reason}",
                                        grace=min(GOODBYE_GRACE_S, self.cluster.heartbeat_deadline))
        log.info("node %s left (%s); %d request(s) lost", bye.node, bye.reason, n)
        if incoming.request_id:
            reply = protocol.Welcome(id=bye.id, node=bye.node, accepted=False, reason="goodbye")
            try:
                await self.listener.reply(incoming, *protocol.encode_reply(reply))
            except TransportError as exc:
                log.info("goodbye reply to %s not delivered: %s", bye.node, exc)

    async def _register(self, hello: protocol.Hello) -> protocol.Welcome:
        if hello.model_name and hello.model_name != self.client.model_name:
            return protocol.Welcome(id=hello.id, node=hello.node, accepted=False,
                                    reason=f"model {hello.model_name!r} != {self.client.model_name!r}")
        try:
            info, replaced = self.membership.register(hello)
        except Refused as exc:            # a live registration is not taken over from elsewhere
            self.bad_messages["refused_hello"] += 1
            self._warn.warning(("hello", hello.node), "registration of %s from %s refused: %s",
                               hello.node, hello.address, exc)
            return protocol.Welcome(id=hello.id, node=hello.node, accepted=False, reason=str(exc))
        if replaced is not None:
            n = await self.client.fail_node(replaced, "restarted")
            log.warning("node %s re-registered as a new process; %d request(s) lost", hello.node, n)
        if info.name not in self.client.links:
            try:
                conn = await asyncio.wait_for(self.connect_node(hello.address, hello.node),
                                              self.cluster.request_timeout)
            except (TransportError, TimeoutError, OSError) as exc:
                self.membership.remove(hello.node)
                self.cache_sync.gone(hello.node)
                return protocol.Welcome(id=hello.id, node=hello.node, accepted=False,
                                        reason=f"cannot reach {hello.address}: {exc}")
            await self.client.attach(info, conn)
            log.info("node %s joined at %s", hello.node, hello.address)
        self.cache_sync.registered(hello.node, hello.block_size, hello.role)   # its snapshot follows
        self.recovery.pairs.announce(hello.node, hello.pair)
        return protocol.Welcome(id=hello.id, node=hello.node, accepted=True,
                                heartbeat_interval=self.cluster.heartbeat_interval,
                                replica_key=self.recovery.holder_key(info))

    async def _detect_failures(self) -> None:
        """Every half interval, declare dead the nodes silent past the deadline.

        A wake-up later than asked means this loop was blocked for that long (a
        slow handler, a paused process): the lag is excused to every node
        first (``Membership.excuse``), since no heartbeat could be read
        meanwhile; those that queued are read before the node's deadline,
        moved by the lag, passes."""
        period = self.cluster.heartbeat_interval / 2
        while True:
            asleep = time.monotonic()
            await asyncio.sleep(period)
            lag = time.monotonic() - asleep - period
            if lag >= STALL_MIN_S:
                self.membership.excuse(lag)
                (log.warning if lag >= STALL_WARN_S else log.info)(
                    "coordinator event loop stalled %.2fs: not counted against the nodes", lag)
            for info in self.membership.expired():
                self.cache_sync.gone(info.name)
                n = await self.client.fail_node(info, f"no heartbeat for {self.cluster.heartbeat_deadline:g}s")
                log.error("node %s declared dead: no heartbeat for %.1fs; %d request(s) failed",
                          info.name, self.cluster.heartbeat_deadline, n)

    async def node_exited(self, name: str, how: str) -> None:
        """The process of node ``name`` exited (``how``: "killed by SIGKILL"), as
        the supervisor of ``kvd serve --nodes`` saw: it is dead now, not a
        heartbeat deadline later; its requests end with an error at once."""
        info = self.membership.remove(name)
        if info is None:
            return
        self.cache_sync.gone(name)
        self.membership.failures += 1
        n = await self.client.fail_node(info, f"its process {how}")
        log.error("node %s declared dead: its process %s; %d request(s) failed", name, how, n)

    def connect_node(self, address: str, node: str) -> Awaitable[Connection]:
        """A new link to ``node`` at ``address``, on this cluster's transport and keys."""
        return links.connect(address, self.cluster, COORDINATOR_NAME, node,
                             registry=self.registry, options=self.options)

    def _set_draining(self, draining: bool) -> None:
        self.front.draining = draining

    def status(self) -> dict[str, Any]:
        """The coordinator's state and counters (``kvctl status``)."""
        client, members = self.client, self.membership
        return {"role": "coordinator", "address": self.address, "http_port": self.port,
                "model": client.model_name, "fingerprint": client.fingerprint, "nodes": sorted(members.nodes),
                "in_flight": self.front.in_flight if self.front else 0,
                "draining": bool(self.front and self.front.draining),
                "node_failures": members.failures, "joins": members.joins, "loop_stalls": members.stalls,
                "failed_requests": client.failed_requests,
                "recoveries": {f"{how}/{outcome}": n for (how, outcome), n in sorted(client.recoveries.items())},
                "kv_returns": dict(client.kv_returns),
                "prefill_queue_bypassed": client.prefill_queue_bypassed,
                "bad_messages": dict(self.bad_messages + client.bad_messages),
                "malformed_frames": self.listener.stats.malformed if self.listener else 0,
                # the embedded kvd serve's engine: {"state", "error"} (None: the nodes' engines, `nodes`)
                "engine": client.stats().get("engine")}

    async def _start_admin(self) -> None:
        from kvd.api.admin import AdminServer, as_admin_errors

        self.admin = AdminServer(self.admin_socket, name="kvd-coordinator")
        for name, (handler, help_, schema) in self.commands.handlers().items():
            self.admin.register(name, as_admin_errors(handler), help=help_, args_schema=schema)
        await self.admin.start()


async def _until(done, timeout: float) -> None:
    """Poll ``done()`` every 50 ms until it is true or ``timeout`` seconds passed."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.05)
