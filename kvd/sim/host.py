"""The cores of one host, shared by the simulated nodes on it (``--colocated``).

Processor sharing: while the compute threads of the nodes running a step
outnumber the host's cores, each of those steps advances at ``cores /
demand`` of its own speed (a step's length in the profile is its work at
full speed). Whenever a step starts or ends on the host, every running
step's remaining work is brought up to date and its end moved to where the
new rate puts it; an end event of an earlier schedule is ignored (its
generation is stale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.sim.events import EventQueue

if TYPE_CHECKING:
    from kvd.sim.node import SimNode


class SimHost:
    def __init__(self, cores: int, events: EventQueue) -> None:
        if cores < 1:
            raise ValueError(f"a host has at least one core, got {cores}")
        self.cores, self.events = cores, events
        self.nodes: list[SimNode] = []

    def rate(self) -> float:
        demand = sum(n.threads for n in self.nodes if n.work_left is not None)
        return min(1.0, self.cores / demand) if demand else 1.0

    def reschedule(self) -> None:
        """A step started or ended here: move every running step's end."""
        now = self.events.now
        rate = self.rate()
        for n in self.nodes:
            if n.work_left is None:
                continue
            n.work_left = max(0.0, n.work_left - (now - n.since) * n.rate)
            n.since, n.rate = now, rate
            n.generation += 1
            self.events.after(n.work_left / rate, n.end_shared_step, n.generation)
