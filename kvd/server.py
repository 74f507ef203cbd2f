"""``kvd serve``: the embedded cluster — a coordinator and one node in ONE process.

The node's engine runs in its own thread; coordinator and node talk over
``inproc://`` (asyncio queues, no copies), through exactly the protocol and
code paths of a real cluster. Lifecycle (aiohttp's runner pattern): load the
model, start the node, register it, then open HTTP (so /health is 200 only
when requests can run); on SIGTERM/SIGINT drain — /health turns 503, new
generation requests get 503, in-flight ones finish — until none are left or
``drain_timeout`` passes; requests still open are then ended (streams with an
error event and [DONE]), the node is stopped, HTTP closed. A second signal
skips the wait. The timeline: docs/operations.md ("Shutdown"). The HTTP port
is bound before the model loads (``reserve_port``), so a taken port fails at
once; it listens only once the node registered.

If the node's engine thread dies (a bug; ``kvctl fail n0 --mode engine``),
nothing can run in this process any more: /health and new requests answer
503 ``engine_dead`` naming the cause at once, the open requests end with it
(the node's Goodbye names them lost), the server drains and stops as on
SIGTERM, and ``run`` raises EngineDead: ``kvd serve`` exits with status 3
(``ENGINE_DEAD_EXIT``) for systemd to restart it (docs/operations.md).

systemd notify: the process's one notifier belongs to the coordinator (READY=1
once HTTP is bound, which is after the node registered; STATUS=; STOPPING=1);
the embedded node stays silent. The watchdog task starts before the model
loads.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from kvd.api.connections import reserve_port
from kvd.cluster_config import ClusterConfig, with_overrides
from kvd.config import KvdConfig
from kvd.coordinator.daemon import CoordinatorDaemon
from kvd.engine_client import EngineDead
from kvd.node.daemon import NodeDaemon
from kvd.sdnotify import Notifier, run_watchdog
from transports import InprocRegistry

log = logging.getLogger("kvd.serve")


def embedded_cluster(cluster: ClusterConfig | None = None) -> ClusterConfig:
    """The cluster settings of the embedded mode: inproc, no CURVE, the file's heartbeats."""
    base = cluster or ClusterConfig()
    return with_overrides(base, transport="inproc", coordinator="inproc://coordinator",
                          curve_keys_dir="")


class Server:
    """Setup and cleanup mirror each other; ``run`` returns when drained, or
    raises EngineDead after draining when the engine died."""

    def __init__(self, config: KvdConfig, cluster: ClusterConfig | None = None,
                 notifier: Notifier | None = None, watchdog: float | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier(None)
        self.watchdog = watchdog                 # seconds between WATCHDOG=1; None: off
        self.cluster = embedded_cluster(cluster)
        self.registry = InprocRegistry()
        self.node: NodeDaemon | None = None
        self.coordinator: CoordinatorDaemon | None = None
        self._stops = 0                          # signals taken before the coordinator existed

    @property
    def port(self) -> int | None:
        return self.coordinator.port if self.coordinator else None

    def request_stop(self) -> None:
        """First call: drain. Second call: stop without waiting (the coordinator's
        ``request_stop``; a signal during start-up is passed on once it exists)."""
        if self.coordinator is not None:
            self.coordinator.request_stop()
        else:
            self._stops += 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        cfg = self.config
        sockets = reserve_port(cfg.server.host, cfg.server.port)
        try:
            await self._run(sockets)
        finally:
            for sock in sockets:                 # the coordinator's cleanup closed them, unless it never ran
                sock.close()

    async def _run(self, sockets: list[socket.socket]) -> None:
        cfg = self.config
        async with asyncio.TaskGroup() as tg:
            pinging = tg.create_task(run_watchdog(self.notifier, self.watchdog), name="watchdog")
            self.notifier.status(f"loading {cfg.engine.model}")
            self.node = NodeDaemon(cfg.engine, self.cluster, "n0", address="inproc://node-n0",
                                   registry=self.registry, drain_timeout=cfg.server.drain_timeout)
            await self.node.start()
            driver = self.node.driver
            self.coordinator = CoordinatorDaemon(
                self.cluster, cfg.server, driver.model_name, driver.tokenizer, registry=self.registry,
                default_max_model_len=driver.max_model_len, stats_source=driver.stats,
                notifier=self.notifier, http_sockets=sockets)
            for _ in range(self._stops):
                self.coordinator.request_stop()
            self.node.on_engine_dead = self._engine_died
            if self.node.engine_failure:         # it died before the hook was set
                self._engine_died(self.node.engine_failure)
            node_task = tg.create_task(self.node.run(), name="node n0")

            async def stop_node() -> None:
                # the front door is drained and aborted what it ended: nothing to wait for
                self.node.request_stop(force=True)
                await node_task

            await self.coordinator.run(expect_nodes=1, after_drain=stop_node)
            pinging.cancel()
        if self.node.engine_failure:
            raise EngineDead(f"the engine died: {self.node.engine_failure}")

    def _engine_died(self, cause: str) -> None:
        """The node's engine thread died (``NodeDaemon.on_engine_dead``, before
        its streams end): the front door answers 503 ``engine_dead`` from now
        on, and the server stops (a drain: what is open ends at once, since
        nothing runs)."""
        log.error("the engine died (%s): stopping, for a supervisor to restart kvd serve", cause)
        if self.coordinator.front is not None:
            self.coordinator.front.engine_died(cause)
        self.coordinator.request_stop()
