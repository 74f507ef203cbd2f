"""A dead debtor's shared-memory ring (kvd/node/attention_ring.py): the creditor ends it
when the debtor's last loans there end with their lease, not ``IDLE_S`` later.

On loopback, without keys: ``ChannelServer.close_ring`` ends a debtor's ring without
waiting, and the debtor's next message goes on the zmq channel. Over real daemons (two
nodes, ZeroMQ with CURVE, the tiny model, every node holding 768 tokens): a request of
about 1.8 times that streams with its tail borrowed, its decode steps on the ring; the
debtor is killed (-9) mid-stream; by its loan's lease end the creditor has freed the
loan's blocks (its free count back where it started), ended the ring (no ring open, the
segment mapped nowhere in its process) and nothing is left in /dev/shm."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from kernels.shm_wait import Doorbells
from kvd.node.attention_ring import IDLE_S, host_id

from .conftest import Cluster, admin
from .test_borrowed_kv import BLOCKS, borrowing, free_blocks, prompt, start, stream
from .test_borrowed_kv_ring import ask, attend, channel  # noqa: F401 -- channel: the fixture
from .test_lending import LEASE_S, ledger_line, wait_for

pytestmark = [pytest.mark.skipif(not os.path.isdir("/dev/shm") or not host_id() or Doorbells.create() is None,
                                 reason="no /dev/shm, boot id or doorbells on this host"),
              pytest.mark.timeout(300)]
NODES = ["a", "b"]


def mapped_rings(pid: int | str) -> list[str]:
    """The ring segments process ``pid`` maps."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "kvd-ring-" in line]


def test_close_ring_ends_a_debtors_ring_without_waiting(channel):  # noqa: F811 -- the fixture
    server, client = channel
    assert client.open_ring("a", "l", 10.0) and server.counts["rings_open"] == 1
    assert ask(client, attend()).ok and client.counts["ring"] == 1
    server.close_ring("nobody")                                 # no ring of its own: nothing happens
    assert server.counts["rings_open"] == 1 and not client.ring.closed
    server.close_ring("a")
    wait_for(lambda: server.counts["rings_open"] == 0, "the ring's end", timeout=5)
    assert client.ring.closed
    assert ask(client, attend()).ok and client.ring is None     # the channel serves; the debtor unmapped it
    assert client.counts["ring"] == 1 and not mapped_rings("self")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("borrowed-kv-ring-faults"), "zmq+tcp")
    for n in NODES:
        start(c, n)
    try:
        c.wait_nodes(NODES)
        wait_for(lambda: all(ledger_line(c, n).get("lendable") for n in NODES), "the caps in the ledger")
        yield c
    finally:
        c.stop()
    assert not glob.glob("/dev/shm/kvd-ring-*")               # no shared-memory ring outlives its nodes


def creditor_side(c: Cluster, node: str) -> dict:
    return admin(c.node_admin(node), "loans")["creditor"]


def test_a_debtor_killed_mid_stream_leaves_no_ring_by_its_lease_end(pair):
    c = pair
    assert free_blocks(c, NODES) == dict.fromkeys(NODES, BLOCKS)
    killed: list = []

    def kill_the_debtor(i: int) -> None:
        if i == 10 and not killed:                              # decoding: its steps on the ring
            debtor = next(n for n in NODES if borrowing(c, n))
            creditor = next(iter(borrowing(c, debtor)))
            killed.extend([debtor, creditor, creditor_side(c, creditor)["channel"]])
            c.nodes[debtor].kill9()
    with pytest.raises(Exception):                              # the stream's node is gone ([cluster].recovery = fail)
        stream(c, prompt(5), None, kill_the_debtor)
    debtor, creditor, ring = killed
    assert ring["rings_open"] == 1 and ring["ring_served"] > 0
    wait_for(lambda: creditor_side(c, creditor)["lent"] == {}, "the lapsed loan", timeout=LEASE_S + 10)
    # the ring goes with the loan (IDLE_S later before), its thread and mapping with it
    wait_for(lambda: creditor_side(c, creditor)["channel"]["rings_open"] == 0, "the ring's end",
             timeout=IDLE_S / 6)
    assert not mapped_rings(c.nodes[creditor].proc.pid)
    assert not glob.glob("/dev/shm/kvd-ring-*")
    assert free_blocks(c, [creditor]) == {creditor: BLOCKS}
