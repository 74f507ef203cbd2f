"""Membership's bookkeeping against what a node's key can forge: a Hello
with a new incarnation or address does not take over a live registration
(a restart on the same address does; another address does once the old
entry is declared dead); heartbeats count only for the registered
incarnation, and a far-ahead ``seq`` is refused instead of freezing the
node's state. Pure: no I/O."""

from __future__ import annotations

import pytest

from kvd import protocol
from kvd.coordinator.membership import SEQ_SLACK, Membership, Refused

DEADLINE, INTERVAL = 3.0, 0.5


def hello(incarnation: str = "i1", address: str = "zmq+tcp://127.0.0.1:5001") -> protocol.Hello:
    return protocol.Hello(node="n1", address=address, incarnation=incarnation, blocks_per_tier={"device": 64},
                          block_size=16)


def beat(seq: int, incarnation: str = "i1", running: int = 0) -> protocol.Heartbeat:
    return protocol.Heartbeat(node="n1", incarnation=incarnation, seq=seq, load=0.0, running=running, waiting=0,
                              free_blocks={"device": 64})


@pytest.fixture
def members() -> Membership:
    m = Membership(DEADLINE, INTERVAL)
    m.register(hello(), now=100.0)
    return m


def test_a_new_incarnation_from_another_address_does_not_take_over_a_live_node(members):
    for forged in (hello("attacker", "zmq+tcp://10.0.0.9:6666"), hello("i1", "zmq+tcp://10.0.0.9:6666")):
        with pytest.raises(Refused, match="registered at zmq\\+tcp://127.0.0.1:5001"):
            members.register(forged, now=101.0)
    info = members.nodes["n1"]
    assert (info.address, info.incarnation, members.joins) == ("zmq+tcp://127.0.0.1:5001", "i1", 1)
    # the real node's beats still count, its entry unchanged
    assert members.beat(beat(1), now=101.5) is info and info.last_seen == 101.5


def test_a_restart_on_the_same_address_replaces_the_entry_at_once(members):
    old = members.nodes["n1"]
    info, replaced = members.register(hello("i2"), now=101.0)
    assert replaced is old and info.incarnation == "i2" and members.nodes["n1"] is info
    with pytest.raises(Refused, match="incarnation"):            # the old process's beats no longer count
        members.beat(beat(5, "i1"), now=101.2)


def test_a_node_restarted_on_a_new_port_registers_once_the_old_one_is_declared_dead(members):
    moved = hello("i2", "zmq+tcp://127.0.0.1:5999")
    with pytest.raises(Refused):
        members.register(moved, now=101.0)
    assert [n.name for n in members.expired(now=100.0 + DEADLINE + 0.1)] == ["n1"]
    info, replaced = members.register(moved, now=103.2)
    assert replaced is None and info.address == moved.address and info.incarnation == "i2"


def test_a_heartbeat_of_another_incarnation_is_refused_and_keeps_nothing_alive(members):
    info = members.nodes["n1"]
    members.beat(beat(1, running=2), now=101.0)
    with pytest.raises(Refused, match="incarnation"):
        members.beat(beat(2, "attacker", running=9), now=102.0)
    assert info.last_seen == 101.0 and info.heartbeat.running == 2
    assert members.expired(now=101.0 + DEADLINE + 0.1) == [info]


def test_a_far_ahead_seq_is_refused_and_the_real_beats_go_on_counting(members):
    info = members.nodes["n1"]
    members.beat(beat(1, running=1), now=100.5)
    with pytest.raises(Refused, match="seq"):
        members.beat(beat(10 ** 15, running=7), now=101.0)
    assert info.heartbeat.running == 1 and info.seq == 1
    for seq in range(2, 6):                                        # the node's own beats, every interval
        assert members.beat(beat(seq, running=seq), now=100.5 + seq * INTERVAL) is info
    assert info.heartbeat.running == 5 and info.seq == 5
    # a beat early (kicked) or a few lost in between is within the slack
    assert members.beat(beat(5 + SEQ_SLACK, running=3), now=103.1) is info
    # a late or repeated beat is not applied and keeps the node alive no longer
    members.beat(beat(4, running=0), now=103.2)
    assert info.heartbeat.running == 3 and info.last_seen == 103.1


def test_a_registration_restarts_the_count(members):
    """The node counts its beats from 1 in each registration (Heartbeater);
    a repeated Hello (the node lost its link) restarts the coordinator's
    count too, so its next beats are taken."""
    info = members.nodes["n1"]
    for seq in range(1, 40):
        members.beat(beat(seq), now=100.0 + seq * INTERVAL)
    assert info.seq == 39
    again, replaced = members.register(hello(), now=121.0)
    assert again is info and replaced is None
    assert members.beat(beat(1, running=4), now=121.5) is info and info.heartbeat.running == 4


def test_an_unknown_node_must_register():
    assert Membership(DEADLINE, INTERVAL).beat(beat(1)) is None
