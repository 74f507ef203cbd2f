"""Prometheus metrics for the front door and the engine behind it.

One ``CollectorRegistry`` per server (no module-global registry): request
counters and latency histograms are observed by the HTTP layer; engine gauges
(KV blocks, queue lengths, token counters) are read from the engine client's
snapshot at scrape time by a custom collector, so the engine thread never
touches Prometheus objects.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.memory.mempool import TIERS

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self.requests = Counter("kvd_requests", "HTTP generation requests by endpoint and outcome",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("kvd_time_to_first_token_seconds", "Time to first token",
                              registry=self.registry, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("kvd_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              registry=self.registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("kvd_e2e_request_latency_seconds", "End-to-end request latency",
                             registry=self.registry, buckets=LATENCY_BUCKETS)
        self.registry.register(_EngineCollector(engine_stats, labels))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], labels: dict) -> None:
        self._stats = stats
        self._labels = labels

    def describe(self):
        return []

    def collect(self):
        s = self._stats()
        names, values = list(self._labels), list(self._labels.values())
        for key, help_ in (("running", "Requests decoding"), ("waiting", "Requests queued"),
                           ("swapped", "Requests preempted to the host tier"),
                           ("in_flight", "Requests with an open stream")):
            g = GaugeMetricFamily(f"kvd_num_requests_{key}", help_, labels=names)
            g.add_metric(values, s.get(key, 0))
            yield g
        kv = s.get("kv", {})
        for key, help_ in (("used", "KV blocks in use (requests + cache)"),
                           ("cached", "KV blocks held by the prefix cache"),
                           ("request_owned", "KV blocks held by running or swapped requests"),
                           ("total", "KV blocks in the pool")):
            g = GaugeMetricFamily(f"kvd_kv_blocks_{key}", help_, labels=names + ["tier"])
            for tier in TIERS:
                g.add_metric(values + [tier], kv.get(tier, {}).get(key, 0))
            yield g
        # (series, stats key, help); engine_step_seconds / engine_steps is the mean step: one
        # stream's TPOT exceeds it by what the serving path adds
        for name, key, help_ in (
                ("prompt_tokens", "prompt_tokens", "Prompt tokens admitted"),
                ("generation_tokens", "generation_tokens", "Tokens generated"),
                ("prefix_hit_tokens", "prefix_hit_tokens", "Prompt tokens served from the prefix cache"),
                ("preemptions", "preemptions", "Requests preempted for memory"),
                ("host_blocks_swapped_in", "host_blocks_swapped_in", "Host-tier prefix blocks swapped in at admission"),
                ("host_blocks_recomputed", "host_blocks_recomputed",
                 "Host-tier prefix blocks recomputed instead (the caching cost model)"),
                ("engine_steps", "steps", "Engine steps run"),
                ("engine_step_seconds", "step_seconds",
                 "Wall time inside engine steps (schedule, model, sampling, outputs)")):
            c = CounterMetricFamily(f"kvd_{name}", help_, labels=names)
            c.add_metric(values, s.get(key, 0))
            yield c
        c = CounterMetricFamily("kvd_requests_finished", "Requests finished by reason",
                                labels=names + ["finish_reason"])
        for reason, n in s.get("finished", {}).items():
            c.add_metric(values + [reason], n)
        yield c
