"""Borrowed KV memory when a debtor or a creditor dies (kill -9), over real
daemons (ZeroMQ, CURVE, the tiny model): the debtors' own daemons borrow
(the node's ``borrow`` admin command: the coordinator's candidates, then
the creditors in turn) and renew their leases every heartbeat interval.

- a loan its debtor keeps renewing outlives many leases;
- a creditor killed: its debtor drops the loan once a lease passes
  without an answer, and the ledger shows it borrows nothing;
- a debtor killed: its creditor frees the loan at lease end, and its free
  block count is back where it started.
"""

from __future__ import annotations

import time

import pytest

from .conftest import Cluster, admin
from .test_lending import LEASE_S, ledger, ledger_line, wait_for

pytestmark = pytest.mark.timeout(300)
CAP = 64


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("lending-faults"), "zmq+tcp")
    c.start_node("a")
    c.start_node("b", "--lend-kv-blocks", str(CAP))
    c.start_node("c", "--lend-kv-blocks", str(CAP))
    try:
        c.wait_nodes(["a", "b", "c"])
        wait_for(lambda: ledger_line(c, "b").get("lendable") == CAP and ledger_line(c, "c").get("lendable") == CAP
                 and "borrowed" in ledger_line(c, "a"), "every node in the ledger, the lenders with their caps")
        yield c
    finally:
        c.stop()


def loans(c: Cluster, node: str) -> dict:
    return admin(c.node_admin(node), "loans")


def test_debtors_renew_and_deaths_free_every_block(trio):
    c = trio
    free_b = ledger_line(c, "b")["free"]
    # a borrows: b and c lend as much, b comes first by name; never a itself
    loan_a = admin(c.node_admin("a"), "borrow", blocks=8)
    assert loan_a["creditor"] == "b" and loan_a["blocks"] == 8, loan_a
    wait_for(lambda: ledger_line(c, "a").get("borrowed") == {"b": 8} and ledger_line(c, "b")["lent"] == {"a": 8},
             "a's loan in the ledger")
    time.sleep(2.5 * LEASE_S)                       # several leases: a's renewals keep it
    assert loans(c, "b")["creditor"]["lent"] == {"a": 8}
    assert loans(c, "b")["creditor"]["counts"]["expired"] == 0
    # b borrows in turn: only c may lend to it
    loan_b = admin(c.node_admin("b"), "borrow", blocks=4)
    assert loan_b["creditor"] == "c", loan_b
    wait_for(lambda: ledger_line(c, "c")["lent"] == {"b": 4}, "b's loan in the ledger")
    assert {"debtor": "b", "creditor": "c", "blocks": 4} in ledger(c)["debts"]
    bad = admin(c.node_admin("a"), "borrow", blocks=10 * CAP)
    assert "error" in bad and "no creditor" in bad["error"]

    # the creditor c dies: b loses its loan once a lease passes unanswered
    c.nodes["c"].kill9()
    wait_for(lambda: loans(c, "b")["debtor"]["borrowed"] == {}, "b drops the loan of the dead c",
             timeout=LEASE_S + 10)
    assert loans(c, "b")["debtor"]["counts"]["lost"] == 1
    wait_for(lambda: "c" not in {n["node"] for n in ledger(c)["nodes"]} and ledger_line(c, "b")["borrowed"] == {},
             "the ledger without c", timeout=30)

    # the debtor a dies: b frees a's loan at lease end, every block back
    c.nodes["a"].kill9()
    wait_for(lambda: loans(c, "b")["creditor"]["lent"] == {}, "b frees the dead a's loan", timeout=LEASE_S + 10)
    assert loans(c, "b")["creditor"]["counts"]["expired"] == 1
    wait_for(lambda: (n := ledger_line(c, "b"))["free"] == free_b and n["lent"] == {}, "b's free blocks back")
