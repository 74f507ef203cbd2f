"""The ``[cluster]`` and ``[nodes.NAME]`` sections of a kvd TOML config.

``kvd.config`` reads ``[model]``, ``[engine]`` and ``[server]`` and skips these
two; this module reads only these two, with the same rules: unknown keys and
values of the wrong type are errors (``ConfigError``) naming the file and key.
It imports no torch (the coordinator reads it).

Example (see etc/kvd.example-cluster.toml, every option commented)::

    [cluster]
    transport = "zmq+tcp"
    coordinator = "zmq+tcp://127.0.0.1:5550"
    heartbeat_interval = 0.5
    heartbeat_deadline = 3.0

    [nodes.n1]
    address = "zmq+tcp://127.0.0.1:5561"
"""

from __future__ import annotations

import enum
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from transports.base import UCX_PROGRESS_MODES

TRANSPORTS = ("zmq+tcp", "zmq+ipc", "ucx", "inproc")
ROUTING_POLICIES = ("prompt-tree", "session", "least-load")   # kvd/coordinator/cache_router.py
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class ConfigError(ValueError):
    pass


COORDINATOR_NAME = "coordinator"   # the coordinator's key name; no node may take it
# The environment variable in which `kvd serve --nodes N` tells its node processes
# how many kvd nodes share the host (kvd.node.engine_driver.load_engine).
HOST_NODES_ENV = "KVD_HOST_NODES"


class Role(str, enum.Enum):
    """What a node computes: whole requests, prompts only (the prefill leg of a
    disaggregated request), or decodes (asking a prefill node for the prompt).
    A str: it compares equal to, and travels as, its value."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


ROLES = tuple(r.value for r in Role)
SPLIT_CPUS = ("auto", "numa", "cores", "off")     # kvd serve --nodes N's placement (kvd/local_cluster.py)
KV_LOAD_FAILURE = ("recompute", "fail")
KV_STREAMS = ("layers", "request")     # how a prefill node sends a prompt's KV (kv_stream)
RECOVERY_POLICIES = ("replica", "reprefill", "fail")   # kvd/coordinator/recovery.py


def check_role(where: str, role: str) -> None:
    _check_one_of(where, role, ROLES)


def _check_one_of(where: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ConfigError naming ``where`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{where} must be one of {choices}, got {value!r}")


def check_node_name(name: str) -> None:
    """Raise ConfigError unless ``name`` may name a node (and its key file)."""
    if not _NAME.match(name):
        raise ConfigError(f"node name {name!r} must match {_NAME.pattern}")
    if name == COORDINATOR_NAME:
        raise ConfigError(f"node name {name!r} is the coordinator's key name; pick another")


@dataclass(frozen=True)
class NodeConfig:
    """One ``[nodes.NAME]`` table: where that node listens."""

    name: str
    address: str = ""                 # transport URL; "" = transport on 127.0.0.1, any port
    admin_socket: str = ""            # Unix socket path; "" = no admin socket
    role: str = Role.MIXED.value      # ROLES: whole requests, prompts only, or decodes
    pair: str = ""                    # the node it is paired with (AcceLLM §4): "" = none

    def __post_init__(self) -> None:
        check_node_name(self.name)
        check_role(f"nodes.{self.name}.role", self.role)
        if self.pair:
            check_node_name(self.pair)
        if self.address:
            _check_url(f"nodes.{self.name}.address", self.address)


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: how daemons find and trust each other.

    transport: scheme for addresses kvd picks itself (``kvd serve --nodes N``).
    coordinator: URL the coordinator listens on for node registration.
    heartbeat_interval / heartbeat_deadline: a node beats every interval; the
        coordinator declares it dead when no beat arrived for deadline seconds
        and ends its in-flight requests with an error.
    request_timeout: seconds a control request (register, admin) may take.
    affinity_tokens: prompt tokens hashed into the session-affinity key.
    curve_keys_dir: a directory of CURVE key files (ZPL, ``kvctl keys``) that
        authenticates every link (zmq+tcp, zmq+ipc: CURVE; ucx: the handshake
        of transports/ucx_auth.py): every ``NAME.key`` there authorizes the
        daemon NAME ("coordinator" or a node name) to connect, under that
        name, ``NAME.key`` is also the server key used to reach NAME, and
        ``SELF.key_secret`` is this daemon's own secret. "" = none, which a
        daemon refuses unless ``insecure`` (kvd/links.py).
    insecure: true lets a daemon run its port without authentication (no
        ``curve_keys_dir``): any process that reaches the port may then send
        it anything, admin commands included. For debugging on a trusted
        host only; off by default.
    admin_socket: the coordinator's admin Unix socket ("" = none).
    ucx_progress_mode: how ucxx drives UCX in each daemon ("blocking", the
        default: the event loop wakes on the worker's fd; "thread": a polling
        progress thread, which takes a core; "polling", "thread-polling").
    restart_nodes: ``kvd serve --nodes N`` starts a node process that exited
        again, with a backoff (kvd/supervisor.py); off: a dead node stays dead.
    split_cpus: how ``kvd serve --nodes N`` places its nodes on the CPUs
        (``[engine].cpus``, else every CPU it may use; engine/cpus.py):
        "cores" binds each node to whole cores of its own (SMT siblings
        together, in order of NUMA node); "numa" to whole NUMA nodes of its
        own where the CPUs span at least N of them, else every node runs on
        all of them; "off" never binds; "auto" (the default) is "cores" for
        mixed nodes, whose loads are alike, and "numa" with ``--prefill P``,
        where a decode node would leave its share idle to a prefill node that
        waits for prompts (docs/benchmarks.md). Nodes that share CPUs sleep
        between steps (``$KVD_HOST_NODES``).
    prefill_threshold: a decode node computes a prompt itself when fewer
        than this many of its tokens are not in its prefix cache (the rest
        go to a prefill node); 0 sends every prompt to a prefill node.
        The default, 64, is measured (tools/bench/cluster/bench_disagg.py, docs/benchmarks.md).
    prefill_queue_factor: the coordinator sends a prompt of n tokens to a
        prefill node only while that node's queue (the prompt tokens of the
        prefill legs in flight there) holds at most ``factor * n`` tokens;
        when every prefill node's queue is longer, the decode node computes
        the prompt itself, as when no prefill node is routable. A request
        never waits behind more than ``factor`` times its own prefill, and
        a short prompt is not queued behind long ones. 0: no limit.
    kv_load_failure: what a decode node does when the prompt's KV does not
        arrive (prefill node dead, transfer past its deadline, refused):
        "recompute" the prompt itself (the request completes), or "fail" it.
    kv_transfer_timeout: seconds from a decode node's reservation to the
        prefill node's commit (prefill and transfer, queueing included); also
        the longest a node keeps blocks granted to a peer's KV transfer
        waiting for their data, whatever deadline the peer asked for.
    kv_grant_share: the fraction of a node's device KV blocks that one peer
        (one node key) may hold at once in grants for KV transfers it asked
        for (prefix transfers, the KV a decode node returns); a request past
        it is refused, so no peer can take a node's memory.
    kv_stream: how a prefill node sends a prompt's KV: "layers" (each layer
        as soon as it is computed, overlapped with the next layer's compute),
        or "request" (all layers once the prefill ends: the baseline of
        tools/bench/cluster/bench_disagg.py).
    kv_return: when a disaggregated request
        finishes, its decode node pushes the KV of the whole sequence (prompt
        and output) to the prefill node that computed the prompt, off the
        request's path, so the conversation's next turn prefills only its new
        tokens there (MemServe's PD-Caching-3). Off: prefill nodes cache
        prompts only (PD-Caching-2).
    routing: the coordinator's policy, "prompt-tree" (cache-aware, on the
        global prompt trees), "session" (least load + session affinity) or
        "least-load"; ``kvctl routing POLICY`` switches at run time.
    routing_overlap_weight / routing_load_weight / routing_max_imbalance /
    routing_recent_weight / routing_load_decay:
        prompt-tree cost = overlap_weight * blocks to prefill + load_weight *
        requests in flight + recent_weight * blocks of work finished there
        lately (each request's decaying as exp(-age / load_decay) from its
        end), among nodes
        at most max_imbalance requests above the least loaded
        (kvd/coordinator/cache_router.py); load_decay 0 drops the recent term.
    routing_pending_ttl: seconds a routed prompt counts as cached on its node
        before the node's events confirm it.
    cache_events_interval: seconds between a node's pushes of its cache
        events to the coordinator's prompt trees.
    replicas: 1 streams the KV of every request a node decodes to a peer
        (a ring over the live nodes that decode), so that a node's death
        costs its requests a pause, not an error; 0 replicates nothing.
    recovery: what happens to the requests of a node declared dead:
        "replica" (resume on the replica holder, recomputing only what was
        not replicated; reprefill where no replica is usable), "reprefill"
        (re-run prompt and tokens so far on another node) or "fail" (end
        them with an error).
    max_recoveries: recoveries one request may go through; past it, it fails.
    replica_kv_blocks: host-tier KV blocks a node may hold as replicas of its
        peers' requests; a replica past the budget is refused and reported.
    replication_interval: seconds between a node's replication rounds (each
        sends the KV blocks its requests filled since, in one message).
    replication_rate: KV blocks per second, at most, that a node's
        replication sends of what its peer does not hold yet (a new prompt's
        blocks; every copy again when a restarted partner rejoins), so the
        gathers between its steps stay small and its decodes do not slow;
        0 (the default): unbounded.
    pairs: group the nodes in pairs (AcceLLM §4; docs/cluster.md, "Pairs and
        roles"), in the order of their ``[nodes.NAME]`` tables (n1-n2, n3-n4,
        ...; ``kvd serve --nodes 2N --pairs``); ``[nodes.NAME].pair`` pairs
        two nodes by name instead. A paired node replicates to its partner
        (not the ring), so every request a pair serves has its KV on both
        nodes and can move between them (a handoff); pairs turn ``replicas``
        on.
    pair_scheduler: the coordinator moves decodes within each pair
        (kvd/coordinator/pairs.py, AcceLLM §4.2.1): a node computing a prompt
        hands its decodes to its partner, and the two rebalance after;
        off: decodes move only by ``kvctl handoff`` and ``kvctl role``.
    dgfm_interval_s: seconds between the coordinator's DGFM rounds, which bring
        borrowed KV home by recall-and-swap along the debt graph's cycles
        (kvd/coordinator/dgfm_rounds.py); 0: off.
    dgfm_min_blocks: DGFM resolves cycles whose every edge holds at least this
        many blocks (smaller moves cost more than they bring).
    """

    transport: str = "zmq+tcp"
    coordinator: str = "zmq+tcp://127.0.0.1:5550"
    heartbeat_interval: float = 0.5
    heartbeat_deadline: float = 3.0
    request_timeout: float = 10.0
    affinity_tokens: int = 64
    curve_keys_dir: str = ""
    insecure: bool = False
    admin_socket: str = ""
    ucx_progress_mode: str = "blocking"
    restart_nodes: bool = True
    split_cpus: str = "auto"
    prefill_threshold: int = 64
    prefill_queue_factor: float = 4.0
    kv_load_failure: str = "recompute"
    kv_transfer_timeout: float = 60.0
    kv_grant_share: float = 0.25
    kv_stream: str = "layers"
    kv_return: bool = True
    routing: str = "prompt-tree"
    routing_overlap_weight: float = 1.0
    routing_load_weight: float = 4.0
    routing_max_imbalance: int = 4
    routing_recent_weight: float = 0.25
    routing_load_decay: float = 60.0
    routing_pending_ttl: float = 30.0
    cache_events_interval: float = 0.05
    replicas: int = 0
    recovery: str = "fail"
    max_recoveries: int = 3
    replica_kv_blocks: int = 1024
    replication_interval: float = 0.05
    replication_rate: float = 0.0
    pairs: bool = False
    pair_scheduler: bool = True
    dgfm_interval_s: float = 5.0
    dgfm_min_blocks: int = 16
    nodes: dict[str, NodeConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_one_of("cluster.transport", self.transport, TRANSPORTS)
        _check_url("cluster.coordinator", self.coordinator)
        if not self.heartbeat_interval > 0:
            raise ConfigError("cluster.heartbeat_interval must be > 0")
        if not self.heartbeat_deadline > self.heartbeat_interval:
            raise ConfigError("cluster.heartbeat_deadline must be > heartbeat_interval")
        if not self.request_timeout > 0:
            raise ConfigError("cluster.request_timeout must be > 0")
        if self.affinity_tokens < 0:
            raise ConfigError("cluster.affinity_tokens must be >= 0")
        _check_one_of("cluster.routing", self.routing, ROUTING_POLICIES)
        routing = (self.routing_overlap_weight, self.routing_load_weight, self.routing_max_imbalance,
                   self.routing_pending_ttl, self.routing_recent_weight, self.routing_load_decay)
        if not all(math.isfinite(v) and v >= 0 for v in routing):
            raise ConfigError("cluster.routing_* weights, max_imbalance, pending_ttl and load_decay "
                              "must be finite and >= 0")
        if not self.cache_events_interval > 0:
            raise ConfigError("cluster.cache_events_interval must be > 0")
        _check_one_of("cluster.ucx_progress_mode", self.ucx_progress_mode, UCX_PROGRESS_MODES)
        _check_one_of("cluster.split_cpus", self.split_cpus, SPLIT_CPUS)
        if self.prefill_threshold < 0:
            raise ConfigError("cluster.prefill_threshold must be >= 0")
        if not (math.isfinite(self.prefill_queue_factor) and self.prefill_queue_factor >= 0):
            raise ConfigError("cluster.prefill_queue_factor must be a finite number >= 0")
        _check_one_of("cluster.kv_load_failure", self.kv_load_failure, KV_LOAD_FAILURE)
        if self.kv_stream not in KV_STREAMS:
            raise ConfigError(f"cluster.kv_stream must be 'layers' or 'request', got {self.kv_stream!r}")
        if not self.kv_transfer_timeout > 0:
            raise ConfigError("cluster.kv_transfer_timeout must be > 0")
        if not 0 < self.kv_grant_share <= 1:
            raise ConfigError(f"cluster.kv_grant_share must be in (0, 1], got {self.kv_grant_share}")
        if self.replicas not in (0, 1):
            raise ConfigError(f"cluster.replicas must be 0 or 1, got {self.replicas}")
        _check_one_of("cluster.recovery", self.recovery, RECOVERY_POLICIES)
        if self.max_recoveries < 0 or self.replica_kv_blocks < 0:
            raise ConfigError("cluster.max_recoveries and cluster.replica_kv_blocks must be >= 0")
        if not self.replication_interval > 0:
            raise ConfigError("cluster.replication_interval must be > 0")
        if not (math.isfinite(self.replication_rate) and self.replication_rate >= 0):
            raise ConfigError(f"cluster.replication_rate must be a finite number >= 0, got {self.replication_rate}")
        if not (math.isfinite(self.dgfm_interval_s) and self.dgfm_interval_s >= 0):
            raise ConfigError(f"cluster.dgfm_interval_s must be a finite number >= 0, got {self.dgfm_interval_s}")
        if self.dgfm_min_blocks < 1:
            raise ConfigError(f"cluster.dgfm_min_blocks must be >= 1, got {self.dgfm_min_blocks}")
        if self.curve_keys_dir and self.transport == "inproc":
            raise ConfigError("cluster.curve_keys_dir authenticates zmq+ and ucx links, not inproc")
        from kvd.cluster_pairs import pair_map   # it reads this class: imported when one is made

        if pair_map(self) or self.pairs:
            object.__setattr__(self, "replicas", 1)   # a pair keeps every request's KV on both nodes

    def partner_of(self, name: str) -> str:
        """The node ``name`` is paired with ("" = none; kvd/cluster_pairs.py ``pair_map``)."""
        from kvd.cluster_pairs import pair_map

        return pair_map(self).get(name, "")

    def node(self, name: str) -> NodeConfig:
        """The ``[nodes.NAME]`` table, or defaults for a node the file does not list."""
        return self.nodes.get(name) or NodeConfig(name)

    def default_address(self, name: str, runtime_dir: str | None = None) -> str:
        """Where a node listens when its table names no address."""
        if self.transport == "zmq+ipc":
            base = runtime_dir or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
            return f"zmq+ipc://{base}/kvd-{name}.sock"
        if self.transport == "inproc":
            return f"inproc://node-{name}"
        return f"{self.transport}://127.0.0.1:0"


def _check_url(where: str, url: str) -> None:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in TRANSPORTS or not rest:
        raise ConfigError(f"{where} must be a URL with a scheme in {TRANSPORTS}, got {url!r}")


def _typed(where: str, value: Any, ftype: str) -> Any:
    base = ftype.replace("| None", "").strip()
    expected = {"int": int, "float": (int, float), "str": str, "bool": bool}.get(base)
    if expected is None:
        raise ConfigError(f"{where}: not settable here")
    if isinstance(value, bool) and base != "bool" or not isinstance(value, expected):
        raise ConfigError(f"{where} must be {base}, got {type(value).__name__} {value!r}")
    return float(value) if base == "float" else value


def _table(cls: type, where: str, table: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    known = {f.name: str(f.type) for f in fields(cls) if f.name not in skip and f.name != "name"}
    out = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}")
        out[key] = _typed(f"{where}.{key}", value, known[key])
    return out


def parse_cluster(data: dict[str, Any], source: str = "<config>",
                  overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Build a ClusterConfig from parsed TOML (other sections are ignored)."""
    kwargs = _table(ClusterConfig, f"{source}: cluster", data.get("cluster", {}), skip=("nodes",))
    nodes_table = data.get("nodes", {})
    if not isinstance(nodes_table, dict):
        raise ConfigError(f"{source}: [nodes] must hold [nodes.NAME] tables")
    nodes = {}
    for name, table in nodes_table.items():
        try:
            nodes[name] = NodeConfig(name, **_table(NodeConfig, f"{source}: nodes.{name}", table))
        except TypeError as exc:
            raise ConfigError(f"{source}: nodes.{name}: {exc}") from None
    kwargs.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return ClusterConfig(nodes=nodes, **kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def load_cluster_config(path: str | os.PathLike | None,
                        overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Read ``[cluster]``/``[nodes.*]`` from ``path`` (None: defaults) plus overrides."""
    if path is None:
        return parse_cluster({}, overrides=overrides)
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return parse_cluster(data, str(path), overrides)


def with_overrides(cfg: ClusterConfig, **kw: Any) -> ClusterConfig:
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})
