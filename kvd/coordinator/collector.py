"""Cluster gauges and counters for the coordinator's /metrics, read at scrape time.

Imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from kvd.coordinator.daemon import CoordinatorDaemon


class ClusterCollector:
    """Cluster gauges and counters for /metrics, read at scrape time."""

    def __init__(self, daemon: CoordinatorDaemon) -> None:
        self.d = daemon

    def describe(self):
        return []

    def collect(self):
        d = self.d
        g = GaugeMetricFamily("kvd_cluster_nodes", "Registered nodes by state", labels=["state"])
        nodes = list(d.membership.nodes.values())
        g.add_metric(["routable"], sum(not n.draining for n in nodes))
        g.add_metric(["draining"], sum(n.draining for n in nodes))
        yield g
        c = CounterMetricFamily("kvd_cluster_node_failures", "Nodes declared dead by heartbeat deadline")
        c.add_metric([], d.membership.failures)
        yield c
        c = CounterMetricFamily("kvd_coordinator_loop_stalls", "Event loop stalls excused to the nodes")
        c.add_metric([], d.membership.stalls)
        yield c
        c = CounterMetricFamily("kvd_coordinator_loop_stalled_seconds", "Time the event loop was stalled")
        c.add_metric([], d.membership.stalled_s)
        yield c
        if d.site is not None:
            g = GaugeMetricFamily("kvd_http_connections", "Open HTTP connections")
            g.add_metric([], d.site.open_connections)
            yield g
            c = CounterMetricFamily("kvd_http_connections_refused",
                                    "HTTP connections refused at max_connections")
            c.add_metric([], d.site.refused)
            yield c
        c = CounterMetricFamily("kvd_node_prefix_cache_hit_tokens",
                                "Prompt tokens served from a node's prefix cache (its last heartbeat)",
                                labels=["node"])
        for n in nodes:
            hits = n.heartbeat.stats.get("prefix_hit_tokens", 0) if n.heartbeat else 0
            c.add_metric([n.name], hits if type(hits) is int else 0)
        yield c
        g = GaugeMetricFamily("kvd_prompt_tree_blocks", "Blocks a node caches, per the global prompt tree",
                              labels=["role", "node"])
        for role, tree in sorted(d.trees.trees.items()):
            for name in tree.nodes():
                g.add_metric([role, name], tree.num_blocks(name))
        yield g
        yield _counter("kvd_prompt_tree_events", "Node cache events applied to the prompt trees",
                       d.cache_sync.applied_events)
        yield _counter("kvd_prompt_tree_snapshots", "Node cache snapshots applied (resyncs)",
                       d.cache_sync.snapshots)
        c = CounterMetricFamily("kvd_recoveries", "Requests moved off a failed node, by how (replica or "
                                "reprefill) and outcome (resumed or failed)", labels=["policy", "outcome"])
        for (how, outcome), n in sorted(d.client.recovery.outcomes.items()):
            c.add_metric([how, outcome], n)
        yield c
        yield _counter("kvd_prefill_queue_bypassed", "Prompts their decode node computed because every "
                       "prefill node's queue was longer than [cluster].prefill_queue_factor allows",
                       d.client.prefill_queue_bypassed)
        c = CounterMetricFamily("kvd_kv_returns", "Finished disaggregated sequences whose KV a decode node "
                                "was asked to return to their prefill node ([cluster].kv_return), by outcome "
                                "(done, nothing: none of it cached, failed)", labels=["outcome"])
        for outcome, n in sorted(d.client.kv_returns.items()):
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
        c = CounterMetricFamily("kvd_cluster_failed_requests", "Requests ended by a node failure or error")
        c.add_metric([], d.client.failed_requests)
        yield c
        c = CounterMetricFamily("kvd_protocol_rejected", "Malformed or unexpected wire messages by reason",
                                labels=["reason"])
        for reason, n in sorted((d.bad_messages + d.client.bad_messages).items()):
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily("kvd_transport_malformed_frames", "Frames with a bad envelope, dropped")
        c.add_metric([], d.listener.stats.malformed if d.listener else 0)
        yield c


def _int(value: object) -> int:
    """A node-reported count, or 0 when it is not an int."""
    return value if type(value) is int and value >= 0 else 0


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    """A counter without labels, at ``value``."""
    c = CounterMetricFamily(name, help_)
    c.add_metric([], value)
    return c
