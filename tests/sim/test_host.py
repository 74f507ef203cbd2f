"""A host's cores shared by colocated simulated nodes (kvd/sim/host.py): steps
placed core by core, as the operating system places single-threaded steps."""

from __future__ import annotations

import pytest

from kvd.sim.events import EventQueue
from kvd.sim.host import SimHost


class Stepper:
    """The part of a SimNode a host reads and drives: one step of ``work`` seconds at a time."""

    def __init__(self, host: SimHost, name: str, threads: int = 1) -> None:
        self.host, self.name, self.threads = host, name, threads
        self.work_left: float | None = None
        self.since, self.rate, self.generation = 0.0, 1.0, 0
        self.ended: list[float] = []
        self.then: list[float] = []              # the works of steps that follow at once, in order
        host.nodes.append(self)

    def start(self, work: float, *then: float) -> None:
        self.work_left, self.since, self.then = work, self.host.events.now, list(then)
        self.host.reschedule()

    def end_shared_step(self, generation: int) -> None:
        if generation != self.generation or self.work_left is None:
            return
        self.ended.append(self.host.events.now)
        self.work_left = None
        if self.then:                              # the node steps again at once: it keeps its core
            self.work_left, self.since = self.then.pop(0), self.host.events.now
        self.host.reschedule()


def host_of(cores: int, *names: str, threads: int = 1) -> tuple[EventQueue, list[Stepper]]:
    events = EventQueue()
    host = SimHost(cores, events)
    return events, [Stepper(host, n, threads) for n in names]


def test_a_running_step_keeps_its_core_and_two_newcomers_share_the_other():
    events, (a, b, c) = host_of(2, "a", "b", "c")
    events.after(0.0, a.start, 1.0)
    events.after(0.1, b.start, 0.2)
    events.after(0.1, c.start, 0.2)
    events.run()
    assert a.ended == [pytest.approx(1.0)]                   # alone on its core throughout
    assert b.ended == c.ended == [pytest.approx(0.5)]        # half speed each: 0.4 s for 0.2 s of work


def test_a_node_stepping_again_at_once_stays_on_its_core():
    events, (a, b, c) = host_of(2, "a", "b", "c")
    events.after(0.0, a.start, 0.3, 0.3, 0.4)               # three steps back to back
    events.after(0.1, b.start, 0.2)
    events.after(0.1, c.start, 0.2)
    events.run()
    assert a.ended == [pytest.approx(0.3), pytest.approx(0.6), pytest.approx(1.0)]
    assert b.ended == c.ended == [pytest.approx(0.5)]


def test_an_emptied_core_pulls_a_step_from_the_crowded_one():
    events, (a, b, c) = host_of(2, "a", "b", "c")
    events.after(0.0, a.start, 0.3)
    events.after(0.1, b.start, 0.3)
    events.after(0.1, c.start, 0.3)
    events.run()
    assert a.ended == [pytest.approx(0.3)]
    # 0.1 s of work each by 0.3 (half speed), then a core each: 0.2 s more
    assert b.ended == c.ended == [pytest.approx(0.5)]


def test_steps_of_several_threads_share_the_cores_fairly():
    events, (a, b, c) = host_of(2, "a", "b", "c", threads=2)
    for n in (a, b, c):
        events.after(0.0, n.start, 0.2)
    events.run()
    assert a.ended == b.ended == c.ended == [pytest.approx(0.6)]     # 6 threads on 2 cores: a third each


def test_as_many_cores_as_steps_run_each_at_full_speed():
    events, steppers = host_of(3, "a", "b", "c")
    for i, n in enumerate(steppers):
        events.after(0.05 * i, n.start, 0.2)
    events.run()
    assert [n.ended for n in steppers] == [[pytest.approx(0.2 + 0.05 * i)] for i in range(3)]
