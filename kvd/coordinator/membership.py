"""Cluster membership: who is registered, alive, draining, and what it runs.

Pure bookkeeping (no I/O, no asyncio): the coordinator daemon feeds it Hello,
Heartbeat and Goodbye messages and asks, on a timer, which nodes missed their
deadline. A node is *routable* when it is registered, its last heartbeat is
younger than ``deadline`` seconds and it is not draining.

A Hello from a known name with a new ``incarnation`` means the process
restarted: the old incarnation's requests are lost, so ``register`` returns
the replaced entry for the caller to fail them. A node's key is all that
names a Hello's sender, so a registration is not taken over on its word:
a new incarnation (or a new address) replaces a live entry only from the
address that entry registered (a restart on the same address, faster than
the deadline); from anywhere else it is refused (``Refused``) until the old
entry is gone -- declared dead, said Goodbye, or its process seen to exit.
A node restarted on a new port therefore re-registers within one
``deadline``: its Hello is retried every heartbeat interval.

Heartbeats count only for the registered process: a beat names its
``incarnation`` (another is refused) and its ``seq`` must advance, from 0 at
each registration, by at most ``SEQ_SLACK`` plus ``SEQ_RATE`` beats per
heartbeat interval of time since the last beat counted. A beat outside that
is refused: the node registers again (its counter restarts with the
registration) rather than a forged far-ahead ``seq`` freezing the state
the coordinator keeps of it. A beat that does not advance (a late or
repeated one) keeps the node alive no longer and is not applied.

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
from kvd.cluster_config import Role

MAX_DEPARTED = 1024        # departed nodes whose last address is kept (the oldest forgotten first)
SEQ_SLACK = 16             # beats a heartbeat's seq may run ahead of the time since the last one counted
SEQ_RATE = 4.0             # ... plus this many per heartbeat interval (a node beats early when kicked)


class Refused(ValueError):
    """A Hello or Heartbeat the membership does not take (the reason)."""


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
    role: str = Role.MIXED.value           # protocol.ROLES, from its Hello
    seq: int = 0                           # the last heartbeat seq counted (0: none since registering)
    fingerprint: str = ""                  # its build fingerprint, from its Hello (engine/fingerprint.py)
    seq_at: float = 0.0                    # time.monotonic() it was counted (or the registration)

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
    def __init__(self, deadline: float, interval: float = 0.5) -> None:
        if deadline <= 0 or interval <= 0:
            raise ValueError("deadline and interval must be > 0")
        self.deadline = deadline
        self.interval = interval           # the heartbeat interval nodes are told (for SEQ_RATE)
        self.nodes: dict[str, NodeInfo] = {}
        self.failures = 0                  # nodes declared dead since start
        self.joins = 0
        self.stalls = 0                    # coordinator stalls excused (see excuse)
        self.stalled_s = 0.0
        # name -> last address of a node removed (declared dead, left) and not
        # registered since: where an operator's `fail resume` can still reach it
        self.departed: dict[str, str] = {}

    def _depart(self, info: NodeInfo) -> None:
        self.departed.pop(info.name, None)
        self.departed[info.name] = info.address
        while len(self.departed) > MAX_DEPARTED:
            del self.departed[next(iter(self.departed))]

    def register(self, hello: protocol.Hello, now: float | None = None
                 ) -> tuple[NodeInfo, NodeInfo | None]:
        """Add or refresh ``hello.node``. Returns (entry, replaced entry or
        None); raises ``Refused`` (nothing changed) for a Hello from another
        address than a live entry's (module docstring)."""
        now = time.monotonic() if now is None else now
        old = self.nodes.get(hello.node)
        if old is not None and old.incarnation == hello.incarnation and old.address == hello.address:
            old.seen(now)                      # a repeated Hello (lost Welcome, lost link): same node
            old.seq, old.seq_at = 0, now       # its beats count from 1 again
            return old, None
        if old is not None and old.address != hello.address:
            raise Refused(f"node {hello.node} is registered at {old.address} (incarnation {old.incarnation}) "
                          f"and alive: a new registration is taken from that address, or from another once "
                          f"the old one is declared dead ({self.deadline:g}s without a heartbeat)")
        info = NodeInfo(hello.node, hello.address, hello.incarnation, hello.model_name,
                        hello.max_model_len, hello.block_size, dict(hello.blocks_per_tier), now,
                        role=hello.role, seq_at=now, fingerprint=hello.fingerprint)
        self.nodes[hello.node] = info
        self.departed.pop(hello.node, None)
        self.joins += 1
        return info, old

    def beat(self, hb: protocol.Heartbeat, now: float | None = None) -> NodeInfo | None:
        """Record a heartbeat. None when the node is unknown (it must
        register); raises ``Refused`` (nothing changed; the node must
        register again) for another incarnation's beat or a ``seq`` that
        jumps too far (module docstring)."""
        info = self.nodes.get(hb.node)
        if info is None:
            return None
        now = time.monotonic() if now is None else now
        if hb.incarnation != info.incarnation:
            raise Refused(f"a heartbeat of incarnation {hb.incarnation!r}; {info.incarnation!r} is registered")
        if hb.seq <= info.seq:
            return info                        # late or repeated: neither applied nor counted as alive
        allowed = SEQ_SLACK + SEQ_RATE * (now - info.seq_at) / self.interval
        if hb.seq - info.seq > allowed:
            raise Refused(f"heartbeat seq {hb.seq} after {info.seq}, {now - info.seq_at:.1f}s later: "
                          "register again")
        info.heartbeat, info.seq, info.seq_at = hb, hb.seq, now
        info.seen(now)
        return info

    def remove(self, name: str) -> NodeInfo | None:
        info = self.nodes.pop(name, None)
        if info is not None:
            self._depart(info)
        return info

    def expired(self, now: float | None = None) -> list[NodeInfo]:
        """Remove and return every node whose last beat is older than the deadline."""
        now = time.monotonic() if now is None else now
        dead = [n for n in self.nodes.values() if n.silence(now) > self.deadline]
        for n in dead:
            del self.nodes[n.name]
            self._depart(n)
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
