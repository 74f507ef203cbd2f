"""The simulator's clock and event queue (kvd/sim/events.py)."""

import math

import pytest

from kvd.sim.events import EventQueue


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    q = EventQueue()
    seen = []
    q.at(2.0, seen.append, "c")
    q.at(1.0, seen.append, "a")
    q.at(1.0, seen.append, "b")
    q.after(0.5, seen.append, "first")
    assert q.run() == 4
    assert seen == ["first", "a", "b", "c"]
    assert q.now == 2.0 and q.clock() == 2.0 and len(q) == 0


def test_an_event_may_schedule_more_and_the_clock_follows():
    q = EventQueue()
    times = []

    def tick(n):
        times.append(q.now)
        if n:
            q.after(0.25, tick, n - 1)

    q.at(1.0, tick, 3)
    q.run()
    assert times == [1.0, 1.25, 1.5, 1.75]


def test_run_until_stops_the_clock_there_and_keeps_later_events():
    q = EventQueue()
    seen = []
    q.at(1.0, seen.append, 1)
    q.at(5.0, seen.append, 5)
    assert q.run(until=3.0) == 1
    assert q.now == 3.0 and seen == [1] and len(q) == 1
    assert q.run(max_events=1) == 1 and seen == [1, 5]


def test_the_past_and_nan_are_refused():
    q = EventQueue(start=10.0)
    with pytest.raises(ValueError):
        q.at(9.0, print)
    with pytest.raises(ValueError):
        q.at(math.nan, print)
    with pytest.raises(ValueError):
        q.after(-1.0, print)
    assert len(q) == 0
