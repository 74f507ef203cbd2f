"""``kvd serve --nodes N``: a coordinator here and N node processes on this machine.

With ``--prefill P`` nodes n1..nP are prefill nodes and the others decode
nodes (disaggregated prefill, docs/cluster.md); else all are mixed.

The node processes run ``kvd node`` with the same config file and engine
flags, named n1..nN, listening on loopback (``[cluster].transport``: zmq+tcp
on 127.0.0.1 with a free port, zmq+ipc under a private runtime directory, or
ucx) and registering with this coordinator, which binds its registration
address first. Every link is authenticated: unless the config names a
``curve_keys_dir`` (or says ``insecure``), a keypair for the coordinator and
for each node is generated in the private (0700) runtime directory, which is
removed, keys and all, when ``kvd serve`` ends. SIGTERM drains the front
door (``drain_timeout``, then what is still open is ended), then stops the
nodes (kvd/supervisor.py: SIGTERM and SIGINT, SIGKILL after
NODE_STOP_TIMEOUT_S), then closes HTTP. A node process that exits is reaped
and its exit logged; it is declared dead at once and requests go to the
survivors, and unless ``[cluster].restart_nodes`` is off
(``--no-restart-nodes``) it is started again, with a backoff, and rejoins.
If this process is killed outright, each node gets SIGTERM from the kernel
(``$KVD_PARENT``, see ``kvd.cli``) and exits rather than live on orphaned.

Each node computes on its own share of the CPUs (``node_cpu_sets``,
``[cluster].split_cpus``): ``--cpus`` with whole cores (mixed nodes) or, for
prefill and decode nodes, whole NUMA nodes where the CPUs span N of them, and
``$KVD_HOST_NODES`` = 1, since no other node's team shares them. Otherwise
every node runs on all of them and ``$KVD_HOST_NODES`` = N lets their teams
sleep between steps.

systemd notify: READY=1 once all N nodes registered and HTTP is bound (the
coordinator's), the watchdog from this loop; the node processes get no
``$NOTIFY_SOCKET`` (the CLI removed it from the environment).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile

from engine.cpus import allowed, check_allowed, format_cpulist, host_places, parse_cpulist, split
from kvd.cluster_config import COORDINATOR_NAME, HOST_NODES_ENV, ClusterConfig, with_overrides
from kvd.coordinator.daemon import CoordinatorDaemon
from kvd.coordinator.settings import CoordinatorSettings, load_tokenizer
from kvd.sdnotify import Notifier, run_watchdog
from kvd.supervisor import NodeSupervisor

log = logging.getLogger("kvd.local")

# The nodes are stopped after the front door drained (nothing left to finish
# there): they leave at once, this only bounds a node that hangs.
NODE_STOP_TIMEOUT_S = 10.0


def node_cpu_sets(num_nodes: int, cpus: str, split_cpus: str, disaggregated: bool = False) -> list[str] | None:
    """Each of ``num_nodes`` nodes' CPU list, ``cpus`` (``[engine].cpus``; "" = every CPU
    this process may use) cut by ``split_cpus`` ("cores": into whole cores; "numa": into
    whole NUMA nodes where there are at least ``num_nodes`` of them; "auto": "numa" for
    ``disaggregated`` nodes (prefill and decode roles), else "cores"; engine.cpus.split).
    None where the nodes share them instead: one node, "off", or too few NUMA nodes or
    cores (logged). Raises ValueError on a bad ``cpus`` or CPUs this process may not use."""
    pool = parse_cpulist(cpus) if cpus else allowed()
    if cpus:
        check_allowed(pool, cpus)
    if num_nodes < 2 or split_cpus == "off":
        return None
    if split_cpus == "auto":
        split_cpus = "numa" if disaggregated else "cores"
    places = host_places(pool)
    numa_nodes = len({p.numa for p in places.values()})
    if split_cpus == "numa" and numa_nodes < num_nodes:
        log.info("%d nodes on %d NUMA node(s) (CPUs %s): every node runs on all of them and their teams "
                 "sleep between steps ([cluster].split_cpus = \"cores\" gives each cores of its own)",
                 num_nodes, numa_nodes, format_cpulist(pool))
        return None
    sets = split(pool, num_nodes, places, by="numa" if split_cpus == "numa" else "core")
    if sets is None:
        log.warning("%d nodes on fewer cores (CPUs %s): every node runs on all of them, and their "
                    "teams sleep between steps", num_nodes, format_cpulist(pool))
        return None
    return [format_cpulist(s) for s in sets]


def local_cluster(cluster: ClusterConfig, runtime_dir: str) -> ClusterConfig:
    scheme = cluster.transport if cluster.transport != "inproc" else "zmq+tcp"
    if scheme == "zmq+ipc":
        coordinator = f"zmq+ipc://{runtime_dir}/coordinator.sock"
    else:
        coordinator = f"{scheme}://127.0.0.1:0"
    return with_overrides(cluster, transport=scheme, coordinator=coordinator)


def cluster_keys(cluster: ClusterConfig, runtime_dir: str, node_names: list[str]) -> ClusterConfig:
    """``cluster`` with a keys directory: the configured one, or (unless
    insecure) a fresh keypair for the coordinator and each of ``node_names``
    in ``runtime_dir``/keys (0700, inside a 0700 directory)."""
    if cluster.curve_keys_dir or cluster.insecure:
        return cluster
    from transports.keys import generate_keypair

    keys = os.path.join(runtime_dir, "keys")
    for name in [COORDINATOR_NAME, *node_names]:
        generate_keypair(keys, name)
    return with_overrides(cluster, curve_keys_dir=keys)


class LocalCluster:
    def __init__(self, settings: CoordinatorSettings, cluster: ClusterConfig, num_nodes: int,
                 node_args: list[str], notifier: Notifier | None = None,
                 watchdog: float | None = None, prefill: int = 0,
                 node_cpus: list[str] | None = None) -> None:
        self.settings = settings
        self.notifier = notifier or Notifier(None)
        self.watchdog = watchdog                 # seconds between WATCHDOG=1; None: off
        self.runtime_dir = tempfile.mkdtemp(prefix="kvd-")      # mode 0700
        self.cluster = cluster_keys(local_cluster(cluster, self.runtime_dir), self.runtime_dir,
                                    [f"n{i + 1}" for i in range(num_nodes)])
        self.num_nodes = num_nodes
        self.prefill = prefill                   # n1..nP prefill nodes, the rest decode nodes
        self.node_args = node_args
        self.node_cpus = node_cpus               # node i's --cpus (node_cpu_sets); None: all share them
        if self.node_cpus:
            log.info("node CPUs: %s", ", ".join(f"n{i + 1} {c}" for i, c in enumerate(self.node_cpus)))
        self.supervisor: NodeSupervisor | None = None
        self.coordinator: CoordinatorDaemon | None = None

    def _command(self, name: str, coordinator_url: str) -> list[str]:
        scheme = self.cluster.transport
        listen = (f"zmq+ipc://{self.runtime_dir}/{name}.sock" if scheme == "zmq+ipc"
                  else f"{scheme}://127.0.0.1:0")
        cmd = [sys.executable, "-m", "kvd.cli", "node", "--name", name, "--coordinator", coordinator_url,
               "--listen", listen, *self.node_args]
        if self.prefill:
            cmd += ["--role", "prefill" if int(name[1:]) <= self.prefill else "decode"]
        if self.cluster.pairs:                   # n1-n2, n3-n4, ...
            i = int(name[1:])
            cmd += ["--pair", f"n{i + 1 if i % 2 else i - 1}"]
        if self.node_cpus:
            cmd += ["--cpus", self.node_cpus[int(name[1:]) - 1]]          # the last flag wins
        if self.cluster.curve_keys_dir:
            cmd += ["--curve-keys-dir", self.cluster.curve_keys_dir]     # the last flag wins
        return cmd

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                pinging = tg.create_task(run_watchdog(self.notifier, self.watchdog), name="watchdog")
                try:
                    await self._run(tg)
                finally:
                    pinging.cancel()
        finally:
            # the generated secret keys (and ipc sockets) do not outlive this cluster
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    async def _run(self, tg: asyncio.TaskGroup) -> None:
        model_name, tokenizer, context_length = await asyncio.to_thread(load_tokenizer, self.settings.model)
        self.coordinator = CoordinatorDaemon(self.cluster, self.settings.server, model_name, tokenizer,
                                             default_max_model_len=self.settings.assumed_max_model_len(
                                                 context_length),
                                             notifier=self.notifier)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.coordinator.request_stop)
        self.coordinator.reserve_http()           # before any node binds a port
        await self.coordinator.start_registration()
        url = self.coordinator.address
        self.supervisor = NodeSupervisor(
            {f"n{i + 1}": self._command(f"n{i + 1}", url) for i in range(self.num_nodes)},
            restart=self.cluster.restart_nodes,
            env={**os.environ, "KVD_PARENT": str(os.getpid()),
                 HOST_NODES_ENV: "1" if self.node_cpus else str(self.num_nodes)},
            on_exit=self.coordinator.node_exited)
        tg.create_task(self.supervisor.run(), name="node processes")
        self.notifier.status(f"starting {self.num_nodes} node processes")
        try:
            await self.coordinator.run(expect_nodes=self.num_nodes, after_drain=self._stop_nodes)
        finally:
            await self._stop_nodes()       # done already, unless the coordinator failed

    async def _stop_nodes(self) -> None:
        await self.supervisor.stop(NODE_STOP_TIMEOUT_S)
