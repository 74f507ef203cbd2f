"""The engine's stats: one definition of the keys that travel from the engine
through the node's driver and heartbeats to the coordinator and /metrics.

``EngineStats`` holds the counters since start; ``snapshot`` is their plain
dict form, what the node's driver publishes beside the scheduler's queue
lengths (``QUEUES``) and KV usage (``kv``, per tier). ``COUNTERS``: the
integer keys a coordinator sums over its nodes. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.request import FinishReason

QUEUES = ("running", "waiting", "swapped")     # requests in each scheduler queue, at the snapshot


@dataclass
class EngineStats:
    """Counters since start, read by /metrics (plain ints: the reader copies them)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    host_blocks_swapped_in: int = 0     # host-tier blocks of prefix hits: swapped in at admission,
    host_blocks_recomputed: int = 0     # or recomputed (host_hit_policy, the caching cost model)
    handed_off: int = 0                 # prefilled here, decoded elsewhere (engine.stream)
    finished: dict = field(default_factory=lambda: {r.value: 0 for r in FinishReason})
    steps: int = 0
    step_seconds: float = 0.0           # wall time of those steps (schedule, model, sampling, outputs)

    def snapshot(self) -> dict:
        """The counters as a new plain dict (``finished`` copied)."""
        return {f.name: dict(self.finished) if f.name == "finished" else getattr(self, f.name)
                for f in fields(self)}


# the integer counters, by stats key (a coordinator sums them over its nodes)
COUNTERS = tuple(f.name for f in fields(EngineStats) if f.type in (int, "int"))
