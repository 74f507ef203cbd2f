"""Cluster membership: who is registered, alive, draining, and what it runs.

Pure bookkeeping (no I/O, no asyncio): the coordinator daemon feeds it Hello,
Heartbeat and Goodbye messages and asks, on a timer, which nodes missed their
deadline. A node is *routable* when it is registered, its last heartbeat is
younger than ``deadline`` seconds and it is not draining.

A Hello from a known name with a new ``incarnation`` means the process
restarted: the old incarnation's requests are lost, so ``register`` returns
the replaced entry for the caller to fail them.

The coordinator's own stalls never count against a node: while its event loop
was blocked it could neither receive heartbeats nor judge them, so the
detector reports each stall (``excuse``) and a node's silence is measured
without that time. A node that really died is still declared dead, one
deadline of the coordinator's *running* time after its last beat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvd import protocol


@dataclass
class NodeInfo:
    name: str
    address: str
    incarnation: str
    model_name: str
    max_model_len: int
    block_size: int
    blocks_per_tier: dict[str, int]
    last_seen: float                       # time.monotonic() of the last Hello/Heartbeat
    joined_at: float = field(default_factory=time.time)
    heartbeat: protocol.Heartbeat | None = None
    admin_drained: bool = False            # drained by an operator through the coordinator
    excused: float = 0.0                   # seconds of coordinator stall since last_seen, not counted
    in_flight: set[str] = field(default_factory=set)   # request ids routed here (either leg)
    routed: int = 0                        # requests routed here since it joined
    role: str = "mixed"                    # protocol.ROLES, from its Hello

    @property
    def draining(self) -> bool:
        return self.admin_drained or (self.heartbeat is not None and self.heartbeat.draining)

    @property
    def load(self) -> int:
        """Requests this coordinator has in flight there (exact, no heartbeat lag)."""
        return len(self.in_flight)

    def silence(self, now: float) -> float:
        """Seconds without a beat, the coordinator's stalls left out."""
        return now - self.last_seen - self.excused

    def seen(self, now: float) -> None:
        self.last_seen = now
        self.excused = 0.0

    def describe(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        hb = self.heartbeat
        return {"name": self.name, "role": self.role, "address": self.address, "incarnation": self.incarnation,
                "draining": self.draining, "in_flight": len(self.in_flight), "routed": self.routed,
                "last_heartbeat_age_s": round(now - self.last_seen, 3),
                "running": hb.running if hb else 0, "waiting": hb.waiting if hb else 0,
                "blocks_per_tier": dict(self.blocks_per_tier),
                "free_blocks": dict(hb.free_blocks) if hb else {},
                "cached_blocks": hb.cached_blocks if hb else 0}


class Membership:
    def __init__(self, deadline: float) -> None:
        if deadline <= 0:
            raise ValueError("deadline must be > 0")
        self.deadline = deadline
        self.nodes: dict[str, NodeInfo] = {}
        self.failures = 0                  # nodes declared dead since start
        self.joins = 0
        self.stalls = 0                    # coordinator stalls excused (see excuse)
        self.stalled_s = 0.0

    def register(self, hello: protocol.Hello, now: float | None = None
                 ) -> tuple[NodeInfo, NodeInfo | None]:
        """Add or refresh ``hello.node``. Returns (entry, replaced entry or None)."""
        now = time.monotonic() if now is None else now
        old = self.nodes.get(hello.node)
        if old is not None and old.incarnation == hello.incarnation and old.address == hello.address:
            old.seen(now)                      # a repeated Hello (lost Welcome): same node
            return old, None
        info = NodeInfo(hello.node, hello.address, hello.incarnation, hello.model_name,
                        hello.max_model_len, hello.block_size, dict(hello.blocks_per_tier), now,
                        role=hello.role)
        self.nodes[hello.node] = info
        self.joins += 1
        return info, old

    def beat(self, hb: protocol.Heartbeat, now: float | None = None) -> NodeInfo | None:
        """Record a heartbeat. None when the node is unknown (it must register)."""
        info = self.nodes.get(hb.node)
        if info is None:
            return None
        if info.heartbeat is None or hb.seq > info.heartbeat.seq or hb.seq <= 1:
            info.heartbeat = hb
        info.seen(time.monotonic() if now is None else now)
        return info

    def remove(self, name: str) -> NodeInfo | None:
        return self.nodes.pop(name, None)

    def expired(self, now: float | None = None) -> list[NodeInfo]:
        """Remove and return every node whose last beat is older than the deadline."""
        now = time.monotonic() if now is None else now
        dead = [n for n in self.nodes.values() if n.silence(now) > self.deadline]
        for n in dead:
            del self.nodes[n.name]
        self.failures += len(dead)
        return dead

    def excuse(self, seconds: float) -> None:
        """The coordinator could not run for ``seconds`` (its event loop was
        blocked): that time is not counted in any node's silence. Heartbeats
        that queued meanwhile are read after, within the deadline left."""
        for n in self.nodes.values():
            n.excused += seconds
        self.stalls += 1
        self.stalled_s += seconds

    def routable(self) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if not n.draining]
