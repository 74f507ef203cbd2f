"""Cluster gauges and counters for the coordinator's /metrics, read at scrape time.

Imports no torch.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvd.coordinator.cache_sync import CacheSync
from kvd.coordinator.ledger import DebtLedger
from kvd.coordinator.membership import Membership, NodeInfo
from kvd.coordinator.prompt_tree import PromptTrees
from kvd.coordinator.roles import copy_memory, redundant_blocks

if TYPE_CHECKING:
    from kvd.api.connections import CappedSite
    from kvd.coordinator.client import RemoteEngineClient


@dataclasses.dataclass(eq=False)
class ClusterCollector:
    """Cluster gauges and counters for /metrics, read at scrape time from what
    it is given: ``bad_messages`` (the registration listener's refusals),
    ``http_site`` (the front door's site, None before it opens) and
    ``malformed_frames`` (the listener's count)."""

    client: RemoteEngineClient
    membership: Membership
    trees: PromptTrees
    cache_sync: CacheSync
    bad_messages: collections.Counter[str]
    _: dataclasses.KW_ONLY
    http_site: Callable[[], CappedSite | None]
    malformed_frames: Callable[[], int]
    ledger: DebtLedger | None = None      # the debt ledger of borrowed KV blocks (ledger.py)

    def describe(self):
        return []

    def collect(self):
        nodes = list(self.membership.nodes.values())
        yield from self._membership(nodes)
        yield from self._caches(nodes)
        yield from self._requests(nodes)
        yield from self._ledger()

    def _membership(self, nodes: list[NodeInfo]):
        """Nodes by state, failures, this loop's stalls, HTTP connections."""
        g = GaugeMetricFamily("kvd_cluster_nodes", "Registered nodes by state", labels=["state"])
        g.add_metric(["routable"], sum(not n.draining for n in nodes))
        g.add_metric(["draining"], sum(n.draining for n in nodes))
        yield g
        c = CounterMetricFamily("kvd_cluster_node_failures", "Nodes declared dead by heartbeat deadline")
        c.add_metric([], self.membership.failures)
        yield c
        c = CounterMetricFamily("kvd_coordinator_loop_stalls", "Event loop stalls excused to the nodes")
        c.add_metric([], self.membership.stalls)
        yield c
        c = CounterMetricFamily("kvd_coordinator_loop_stalled_seconds", "Time the event loop was stalled")
        c.add_metric([], self.membership.stalled_s)
        yield c
        site = self.http_site()
        if site is not None:
            g = GaugeMetricFamily("kvd_http_connections", "Open HTTP connections")
            g.add_metric([], site.open_connections)
            yield g
            c = CounterMetricFamily("kvd_http_connections_refused",
                                    "HTTP connections refused at max_connections")
            c.add_metric([], site.refused)
            yield c

    def _caches(self, nodes: list[NodeInfo]):
        """The nodes' prefix-cache hits and the global prompt trees."""
        c = CounterMetricFamily("kvd_node_prefix_cache_hit_tokens",
                                "Prompt tokens served from a node's prefix cache (its last heartbeat)",
                                labels=["node"])
        for n in nodes:
            hits = n.heartbeat.stats.get("prefix_hit_tokens", 0) if n.heartbeat else 0
            c.add_metric([n.name], hits if type(hits) is int else 0)
        yield c
        g = GaugeMetricFamily("kvd_prompt_tree_blocks", "Blocks a node caches, per the global prompt tree",
                              labels=["role", "node"])
        for role, tree in sorted(self.trees.trees.items()):
            for name in tree.nodes():
                g.add_metric([role, name], tree.num_blocks(name))
        yield g
        yield _counter("kvd_prompt_tree_events", "Node cache events applied to the prompt trees",
                       self.cache_sync.applied_events)
        yield _counter("kvd_prompt_tree_snapshots", "Node cache snapshots applied (resyncs)",
                       self.cache_sync.snapshots)

    def _requests(self, nodes: list[NodeInfo]):
        """Recoveries, KV returns, replication, failed requests, refused messages."""
        c = CounterMetricFamily("kvd_recoveries", "Requests moved off a failed node, by how (replica or "
                                "reprefill) and outcome (resumed or failed)", labels=["policy", "outcome"])
        for (how, outcome), n in sorted(self.client.recoveries.items()):
            c.add_metric([how, outcome], n)
        yield c
        yield _counter("kvd_prefill_queue_bypassed", "Prompts their decode node computed because every "
                       "prefill node's queue was longer than [cluster].prefill_queue_factor allows",
                       self.client.prefill_queue_bypassed)
        c = CounterMetricFamily("kvd_kv_returns", "Finished disaggregated sequences whose KV a decode node "
                                "was asked to return to their prefill node ([cluster].kv_return), by outcome "
                                "(done, nothing: none of it cached, failed)", labels=["outcome"])
        for outcome, n in sorted(self.client.kv_returns.items()):
            c.add_metric([outcome], n)
        yield c
        c = CounterMetricFamily("kvd_replication_bytes", "KV bytes a node sent to its replica peer "
                                "(its last heartbeat)", labels=["node"])
        g = GaugeMetricFamily("kvd_replication_lag_tokens", "Computed tokens of a node's requests not "
                              "replicated yet (its last heartbeat)", labels=["node"])
        for n in nodes:
            rep = n.heartbeat.stats.get("replication", {}) if n.heartbeat else {}
            rep = rep if isinstance(rep, dict) else {}
            c.add_metric([n.name], _int(rep.get("bytes")))
            g.add_metric([n.name], _int(rep.get("lag_tokens")))
        yield c
        yield g
        yield from self._pairs(nodes)
        c = CounterMetricFamily("kvd_cluster_failed_requests", "Requests ended by a node failure or error")
        c.add_metric([], self.client.failed_requests)
        yield c
        c = CounterMetricFamily("kvd_protocol_rejected", "Malformed or unexpected wire messages by reason",
                                labels=["reason"])
        for reason, n in sorted((self.bad_messages + self.client.bad_messages).items()):
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily("kvd_transport_malformed_frames", "Frames with a bad envelope, dropped")
        c.add_metric([], self.malformed_frames())
        yield c


    def _pairs(self, nodes: list[NodeInfo]):
        """Each node's role, pair, redundant blocks, role switches and handoffs
        (kvd/coordinator/roles.py), as ``kvctl nodes`` shows them."""
        recovery = self.client.recovery
        pairs = recovery.pairs
        g = GaugeMetricFamily("kvd_node_role", "1 for a node's current role (kvctl role switches it)",
                              labels=["node", "role", "pair"])
        b = GaugeMetricFamily("kvd_node_redundant_blocks", "KV blocks a node holds as copies of its partner's "
                              "(or ring peer's) requests (its last heartbeat)", labels=["node"])
        s = CounterMetricFamily("kvd_node_role_switches", "Run-time role switches of a node", labels=["node"])
        h = CounterMetricFamily("kvd_node_handoffs", "Decodes handed from a node to its pair partner",
                                labels=["node"])
        m = GaugeMetricFamily("kvd_node_copy_blocks", "KV blocks of a node's redundant copies, by tier (its last "
                              "heartbeat)", labels=["node", "tier"])
        r = CounterMetricFamily("kvd_node_copies_reclaimed", "Redundant copies a node gave up to its own work",
                                labels=["node"])
        for n in nodes:
            g.add_metric([n.name, n.role, pairs.announced.get(n.name, "")], 1)
            b.add_metric([n.name], redundant_blocks(recovery.table.by_holder, n))
            s.add_metric([n.name], pairs.switches[n.name])
            h.add_metric([n.name], pairs.handoffs[n.name])
            cost = copy_memory(n)
            for tier in ("device", "host"):
                m.add_metric([n.name, tier], cost[f"{tier}_blocks"])
            r.add_metric([n.name], cost["reclaimed"])
        yield from (g, b, s, h, m, r)
        c = CounterMetricFamily("kvd_handoffs_refused", "Handoffs not done, by reason", labels=["reason"])
        for reason, n in sorted(pairs.refused.items()):
            c.add_metric([reason], n)
        yield c


    def _ledger(self):
        """The debt ledger, as ``kvctl ledger`` shows it: free, lendable, lent
        and borrowed device blocks per node, and the debt graph's edges."""
        if self.ledger is None:
            return
        self.ledger.retain(self.membership.nodes)
        lines = self.ledger.describe()
        g = GaugeMetricFamily("kvd_ledger_blocks", "Device KV blocks per node in the debt ledger (its last "
                              "heartbeat): free, lendable (under its cap), lent, borrowed", labels=["node", "kind"])
        for n in lines["nodes"]:
            for kind, value in (("free", n["free"]), ("lendable", n["lendable"]),
                                ("lent", sum(n["lent"].values())), ("borrowed", sum(n["borrowed"].values()))):
                g.add_metric([n["node"], kind], value)
        yield g
        g = GaugeMetricFamily("kvd_ledger_debt_blocks", "Blocks a debtor holds on a creditor (the debt graph)",
                              labels=["debtor", "creditor"])
        for d in lines["debts"]:
            g.add_metric([d["debtor"], d["creditor"]], d["blocks"])
        yield g
        c = CounterMetricFamily("kvd_dgfm", "DGFM's recall-and-swap carried out: rounds, moves done and failed, "
                                "loan blocks recalled, local blocks their KV took (blocks_home)", labels=["kind"])
        for kind, value in lines["dgfm_counts"].items():
            c.add_metric([kind], value)
        yield c
        c = CounterMetricFamily("kvd_ledger_queries", "Creditor queries answered, and those with no candidate",
                                labels=["outcome"])
        c.add_metric(["answered"], lines["queries"] - lines["unanswered"])
        c.add_metric(["unanswered"], lines["unanswered"])
        yield c


def _int(value: object) -> int:
    """A node-reported count, or 0 when it is not an int."""
    return value if type(value) is int and value >= 0 else 0


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    """A counter without labels, at ``value``."""
    c = CounterMetricFamily(name, help_)
    c.add_metric([], value)
    return c
