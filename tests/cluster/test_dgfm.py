"""DGFM carried out over real daemons (ZeroMQ with CURVE on loopback, the tiny model).

A debt cycle among three nodes, made deterministic (routing pinned, placeholders as in
test_borrowed_kv_recall.py): a's request borrows 16 blocks from b, b's from c, c's from
a, so that a owes b, b owes c and c owes a. With DGFM off (``--dgfm-interval 0``) the
cycle stays while the streams run. With DGFM on (every 0.5 s) the coordinator's moves
bring every loan home (each debtor recalls in turn, into the room the move before freed)
and the cycle goes away while the streams run; every stream's text is the single-node
engine's (greedy and seeded) and every node's free blocks come back when they end;
``kvctl ledger`` and /metrics count the moves.
"""

from __future__ import annotations

import time

import pytest

from .conftest import SEEDED, admin
from .test_borrowed_kv_recall import (ADMITTED_FREE, BLOCKS, NODES, REMOTE, borrowing_stream, free_blocks,
                                      prompt, trio_cluster, want_text)
from .test_engine_death import long_reference  # noqa: F401 -- the fixture
from .test_lending import ledger, wait_for

pytestmark = pytest.mark.timeout(600)
# node, its placeholder at admission (debtor, blocks): what leaves it ADMITTED_FREE blocks. b's
# and c's are in the names of the nodes that owe them already (a -> b, b -> c): no other cycle
# forms, and a recall takes only the loans requests hold
CYCLE = [("a", ("c", BLOCKS - ADMITTED_FREE)), ("b", ("a", BLOCKS - REMOTE - ADMITTED_FREE)),
         ("c", ("b", BLOCKS - REMOTE - ADMITTED_FREE))]
EDGES = {("a", "b"), ("b", "c"), ("c", "a")}
SAMPLINGS = [None, SEEDED[0], SEEDED[1]]


@pytest.fixture(scope="module", params=["off", "on"])
def dgfm_trio(request, tmp_path_factory):
    on = request.param == "on"
    c = trio_cluster(tmp_path_factory.mktemp(f"dgfm-{request.param}"),
                     ("--dgfm-interval", "0.5" if on else "0", "--dgfm-min-blocks", "16"))
    try:
        yield c, on
    finally:
        c.stop()


def cycle_edges(c) -> set[tuple[str, str]]:
    return {(d["debtor"], d["creditor"]) for d in ledger(c)["debts"] if d["blocks"] >= REMOTE} & EDGES


def test_a_debt_cycle_among_three_nodes(dgfm_trio, long_reference):
    c, on = dgfm_trio
    streams = [borrowing_stream(c, node, 31 + i, SAMPLINGS[i], placeholder)
               for i, (node, placeholder) in enumerate(CYCLE)]
    for n in NODES:
        admin(c.admin_socket, "undrain", node=n)
    if on:
        wait_for(lambda: ledger(c)["dgfm_counts"]["moves_done"] >= 3, "DGFM's three moves", timeout=60)
        assert all(not s.done.is_set() for s in streams), "the streams ended before DGFM moved"
        wait_for(lambda: not cycle_edges(c), "the cycle gone from the ledger")
        assert all(not admin(c.node_admin(n), "loans")["debtor"]["borrowed"] for n in NODES)
    else:
        wait_for(lambda: cycle_edges(c) == EDGES, "the cycle in the ledger")
        time.sleep(2.0)                                 # four rounds, had DGFM been on
        assert all(not s.done.is_set() for s in streams), "the streams ended too soon to tell"
        assert cycle_edges(c) == EDGES
        assert [m["debtor"] for m in ledger(c)["dgfm"]] != []          # planned, never carried out
    for i, s in enumerate(streams):
        assert s.result() == want_text(long_reference, prompt(31 + i), SAMPLINGS[i]), i
    book = ledger(c)
    if on:
        assert book["dgfm_counts"]["moves_failed"] == 0
        assert book["dgfm_counts"]["loan_blocks"] == 3 * REMOTE and book["dgfm_counts"]["blocks_home"] >= 3
        assert {(m["debtor"], m["creditor"]) for m in book["dgfm_last_round"] if m["ok"]} == EDGES
        metrics = c.metrics()
        assert metrics['kvd_dgfm_total{kind="moves_done"}'] >= 3
    else:
        assert book["dgfm_counts"]["moves_done"] == 0
    assert free_blocks(c, NODES) == dict.fromkeys(NODES, BLOCKS)
