"""Borrowed KV memory over real daemons: ZeroMQ with CURVE on loopback, the
tiny model. Node b lends (``--lend-kv-blocks``); a borrows from it through
the coordinator's creditor candidates; c is another, valid peer, and a
stranger holds a key nobody authorized. The test speaks for a with a's own
key (as its daemon would), so a's daemon never renews the loan: a silent
debtor, whose loan b frees when its lease runs out.

- the ledger (``kvctl ledger``) recommends b, never a itself, and shows the loan;
- a's loan takes a's writes; beyond b's cap a gets "no" at once;
- forged messages -- a stranger's, c's in a's name, c's in its own name on
  a's loan -- are refused, counted, and change nothing on b;
- a returned loan and an expired one each give b its free blocks back.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvd import protocol

from .conftest import Cluster, admin
from .test_trust import NO_REPLY_S, _raw_request, _tcp
from .test_trust_node_key import call_as

pytestmark = pytest.mark.timeout(300)
CAP = 64
LEASE_S = 3.0                                  # the cluster's heartbeat deadline (conftest HEARTBEAT)


@pytest.fixture(scope="module")
def lenders(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("lending"), "zmq+tcp")
    c.start_node("a")
    c.start_node("b", "--lend-kv-blocks", str(CAP))
    c.start_node("c")
    try:
        c.wait_nodes(["a", "b", "c"])
        wait_for(lambda: ledger_line(c, "b").get("lendable") == CAP, "b's cap in the ledger")
        yield c
    finally:
        c.stop()


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


def ledger(c: Cluster) -> dict:
    return admin(c.admin_socket, "ledger")


def ledger_line(c: Cluster, node: str) -> dict:
    return next((n for n in ledger(c)["nodes"] if n["node"] == node), {})


def creditor_stats(c: Cluster, node: str) -> dict:
    return admin(c.node_admin(node), "status")["lending"]["creditor"]


def as_(c: Cluster, server: str, key: str, msg: protocol.Message) -> protocol.Message:
    return asyncio.run(call_as(c, server, key, msg))


def kv(blocks: int) -> torch.Tensor:
    from engine.model.config import tiny_config

    cfg = tiny_config()
    return torch.randn(cfg.num_layers, 2, blocks, 16, cfg.num_kv_heads, cfg.head_dim)


def borrow(c: Cluster, blocks: int) -> protocol.BorrowReply:
    """a asks the coordinator for creditors, then the first one: as a's daemon does (lending.py)."""
    cands = as_(c, "coordinator", "a", protocol.CreditorQuery(node="a", blocks=blocks))
    assert isinstance(cands, protocol.Creditors) and cands.candidates[0] == "b", cands
    assert "a" not in cands.candidates
    return as_(c, "b", "a", protocol.BorrowRequest(debtor="a", blocks=blocks))


def test_the_debtor_borrows_writes_and_returns(lenders):
    c = lenders
    free0 = ledger_line(c, "b")["free"]
    loan = borrow(c, 8)
    assert loan.ok and loan.blocks == 8 and loan.lease_s == LEASE_S
    line = wait_for(lambda: (n := ledger_line(c, "b")) and n["lent"] == {"a": 8} and n, "the loan in the ledger")
    assert line["free"] == free0 - 8
    assert {"debtor": "a", "creditor": "b", "blocks": 8} in ledger(c)["debts"]
    write = protocol.LoanWrite(debtor="a", loan_id=loan.loan_id, start=6, layer_start=0, layer_end=2,
                               tensors=(kv(2)[:2],))
    assert as_(c, "b", "a", write).ok
    over = as_(c, "b", "a", protocol.BorrowRequest(debtor="a", blocks=CAP))
    assert not over.ok and "cap" in over.reason
    assert as_(c, "b", "a", protocol.ReturnLoan(debtor="a", loan_id=loan.loan_id)).ok
    assert creditor_stats(c, "b")["lent"] == {}
    wait_for(lambda: ledger_line(c, "b")["free"] == free0, "b's free blocks back")


def test_forged_messages_are_refused_counted_and_change_nothing(lenders):
    from transports.keys import CurveClient, generate_keypair, load_keypair

    c = lenders
    loan = borrow(c, 4)
    assert loan.ok
    before = creditor_stats(c, "b")
    status0 = admin(c.node_admin("b"), "status")
    # a stranger: a key nobody authorized gets no answer at all
    generate_keypair(c.tmp / "stranger", "stranger")
    stranger = CurveClient(*load_keypair(c.tmp / "stranger" / "stranger.key_secret"),
                           server_key=load_keypair(c.keys_dir / "b.key")[0])
    for msg in (protocol.BorrowRequest(debtor="stranger", blocks=4),
                protocol.ReturnLoan(debtor="a", loan_id=loan.loan_id)):
        assert asyncio.run(_raw_request(_tcp(c.node_urls["b"]), msg, stranger, timeout=NO_REPLY_S)) is None
        assert as_(c, "b", "a", protocol.LeaseRenew(debtor="a", loan_ids=(loan.loan_id,))).renewed == 1
    # another peer in a's name: the trust gate refuses it (its key is c's)
    write = dict(loan_id=loan.loan_id, start=0, layer_start=0, layer_end=1, tensors=(kv(1)[:1],))
    for msg in (protocol.BorrowRequest(debtor="a", blocks=4), protocol.ReturnLoan(debtor="a", loan_id=loan.loan_id),
                protocol.LoanWrite(debtor="a", **write), protocol.LeaseRenew(debtor="a", loan_ids=(loan.loan_id,))):
        reply = as_(c, "b", "c", msg)
        assert isinstance(reply, protocol.Error) and reply.code == "forbidden", reply
    # another peer in its own name, on a's loan: no such loan of c's
    assert not as_(c, "b", "c", protocol.ReturnLoan(debtor="c", loan_id=loan.loan_id)).ok
    assert not as_(c, "b", "c", protocol.LoanWrite(debtor="c", **write)).ok
    renew = as_(c, "b", "c", protocol.LeaseRenew(debtor="c", loan_ids=(loan.loan_id,)))
    assert not renew.ok and renew.gone == (loan.loan_id,) and renew.renewed == 0
    after = creditor_stats(c, "b")
    assert after["lent"] == before["lent"] == {"a": 4}
    assert after["counts"]["forbidden"] == before["counts"]["forbidden"] + 2
    status = admin(c.node_admin("b"), "status")
    assert status["refused_peers"] > status0["refused_peers"]
    assert status["bad_messages"].get("forbidden", 0) == status0["bad_messages"].get("forbidden", 0) + 4
    assert as_(c, "b", "a", protocol.ReturnLoan(debtor="a", loan_id=loan.loan_id)).ok


def test_a_silent_debtor_loses_its_loan_at_lease_end(lenders):
    c = lenders
    free0 = wait_for(lambda: (n := ledger_line(c, "b"))["lent"] == {} and n["free"], "no loans in the ledger")
    loan = borrow(c, 16)
    assert loan.ok
    t0 = time.monotonic()
    # a's daemon does not know this loan: nobody renews it; a renewal by c is no renewal
    as_(c, "b", "c", protocol.LeaseRenew(debtor="c", loan_ids=(loan.loan_id,)))
    wait_for(lambda: creditor_stats(c, "b")["lent"] == {}, "the loan expired", timeout=LEASE_S + 10)
    assert time.monotonic() - t0 >= LEASE_S - 0.5
    assert creditor_stats(c, "b")["counts"]["expired"] >= 1
    wait_for(lambda: ledger_line(c, "b")["free"] == free0, "b's free blocks back")
    assert not as_(c, "b", "a", protocol.ReturnLoan(debtor="a", loan_id=loan.loan_id)).ok   # gone


def test_kvctl_ledger_and_metrics(lenders):
    c = lenders
    out = ledger(c)
    assert {n["node"] for n in out["nodes"]} == {"a", "b", "c"} and out["dgfm"] == []
    bad = admin(c.admin_socket, "ledger", min_blocks=0)
    assert not bad["ok"] and "min_blocks" in bad["error"]
    m = c.metrics()
    assert m.get('kvd_ledger_blocks{kind="lendable",node="b"}') == CAP
