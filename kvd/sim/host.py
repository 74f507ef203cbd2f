"""The cores of one host, shared by the simulated nodes on it (``--colocated``).

A node's running step is a thread the operating system keeps on one core
(a step's length in the profile is its work alone on a core):

- a step that starts on a node that was idle goes to the core with the
  fewest running steps; among those, the one that took a step most
  recently (threads that wake together land together: the scheduler puts a
  wakee where the last wakeup went, and leaves a running thread alone);
- a node that steps again at once keeps its core (a busy thread stays put);
- a core left empty pulls a step from the most crowded core (an idle core
  steals runnable work);
- ``k`` steps on one core each advance at ``1/k`` of their own speed.

So three single-threaded nodes on two cores run one alone and two at half
speed, not all three at two thirds: which ones depends on who was running.
Nodes whose steps use more than one thread (``threads`` > 1) are not placed
core by core: their steps share the host's cores fairly, each advancing at
``cores / demand`` (demand: the running steps' threads) while the demand
exceeds the cores.

Whenever a step starts or ends on the host, every running step's remaining
work is brought up to date and its end moved to where the new rate puts it;
an end event of an earlier schedule is ignored (its generation is stale).
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
        self.placed: dict[str, int] = {}          # node name -> its running step's core
        self._last_core = 0                        # the core that took a waking step last

    def rate(self) -> float:
        """The fair-share rate of every running step (nodes of several threads)."""
        demand = sum(n.threads for n in self.nodes if n.work_left is not None)
        return min(1.0, self.cores / demand) if demand else 1.0

    def rates(self) -> dict[str, float]:
        """Each running node's rate, its steps placed on cores (module docstring)."""
        running = [n for n in self.nodes if n.work_left is not None]
        if any(n.threads > 1 for n in running):
            self.placed.clear()
            r = self.rate()
            return {n.name: r for n in running}
        names = {n.name for n in running}
        for name in [k for k in self.placed if k not in names]:
            del self.placed[name]
        load = [0] * self.cores
        for core in self.placed.values():
            load[core] += 1
        for n in running:
            if n.name not in self.placed:
                least = min(load)
                ties = [c for c in range(self.cores) if load[c] == least]
                core = self._last_core if self._last_core in ties else ties[0]
                self.placed[n.name], self._last_core = core, core
                load[core] += 1
        while 0 in load and max(load) > 1:
            empty, crowded = load.index(0), load.index(max(load))
            mover = next(k for k in reversed(self.placed) if self.placed[k] == crowded)
            self.placed[mover] = empty
            load[crowded] -= 1
            load[empty] += 1
        return {n.name: 1.0 / load[self.placed[n.name]] for n in running}

    def reschedule(self) -> None:
        """A step started or ended here: move every running step's end."""
        now = self.events.now
        rates = self.rates()
        for n in self.nodes:
            if n.work_left is None:
                continue
            n.work_left = max(0.0, n.work_left - (now - n.since) * n.rate)
            n.since, n.rate = now, rates[n.name]
            n.generation += 1
            self.events.after(n.work_left / n.rate, n.end_shared_step, n.generation)
