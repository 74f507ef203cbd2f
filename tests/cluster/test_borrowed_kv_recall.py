"""Recall over real daemons (ZeroMQ with CURVE on loopback, the tiny model; DGFM off): a
node brings the KV of a loan home while the request on it decodes (``kvctl`` node
command ``recall``, what DGFM's moves run), its stream's text the single-node engine's,
greedy and seeded; the creditor frees the loan, the ledger sees it, and every node's
free blocks come back when the streams end.

Placement is made deterministic: routing is pinned by draining the other nodes, and a
request borrows because a "placeholder" loan (the test speaking for another node with
that node's key) holds part of its node's blocks at admission and is given back right
after, which leaves the room the recall lands in. Every node holds 192 blocks; a request
of 840 + 1200 tokens (128 blocks: the context), admitted with 52 blocks free, keeps 6
chunks (48 blocks) at home and borrows 80: its prompt's tail and its answer, long enough
to outlast the placements of test_dgfm.py.

Also: a RecallKV for a loan not lent to the sender is refused and counted; a creditor
killed mid-recall leaves the request to the step's recovery (its KV computed again) with
the same text.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from kvd import protocol

from . import test_borrowed_kv as borrowed_kv
from .conftest import MODEL, SEEDED, Cluster, admin, body_of
from .test_engine_death import long_reference  # noqa: F401 -- the fixture
from .test_lending import as_, ledger, ledger_line, wait_for

pytestmark = pytest.mark.timeout(600)
NODES = ["a", "b", "c"]
BLOCKS, LEND, BORROW = 192, 160, 192
PROMPT, MAX_TOKENS = 840, 1200                  # 2040 tokens = 128 blocks: 48 at home (6 chunks), 80 borrowed
LOCAL, REMOTE = 48, 80
ADMITTED_FREE = 52                              # free blocks at admission: 6 chunks, whatever the headroom


def start(c: Cluster, name: str, make_key: bool = True) -> None:
    c.start_node(name, "--kv-blocks", str(BLOCKS), "--lend-kv-blocks", str(LEND), "--borrow-kv-blocks", str(BORROW),
                 make_key=make_key)


def trio_cluster(tmp, dgfm: tuple[str, ...]) -> Cluster:
    c = Cluster(tmp, "zmq+tcp", extra=dgfm)
    for n in NODES:
        start(c, n)
    c.wait_nodes(NODES)
    wait_for(lambda: all(ledger_line(c, n).get("lendable") == LEND for n in NODES), "the caps in the ledger")
    return c


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    c = trio_cluster(tmp_path_factory.mktemp("recall"), ("--dgfm-interval", "0"))
    try:
        yield c
    finally:
        c.stop()


def prompt(seed: int) -> list[int]:
    return borrowed_kv.prompt(seed, PROMPT)


def want_text(reference, ids: list[int], sampling: dict | None) -> str:
    return borrowed_kv.want_text(reference, ids, sampling, MAX_TOKENS)


class Stream:
    """One streaming completion in a thread; ``tokens`` counts its chunks so far."""

    def __init__(self, c: Cluster, ids: list[int], sampling: dict | None) -> None:
        self.tokens = 0
        self.text: list[str] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(c, ids, sampling), daemon=True).start()

    def _run(self, c: Cluster, ids: list[int], sampling: dict | None) -> None:
        try:
            for chunk in c.client(timeout=120).completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS,
                                                                    stream=True, **body_of(sampling)):
                if chunk.choices:
                    self.text.append(chunk.choices[0].text)
                    self.tokens += 1
        except BaseException as exc:  # noqa: BLE001 -- the test reads it
            self.error = exc
        finally:
            self.done.set()

    def result(self, timeout: float = 180.0) -> str:
        assert self.done.wait(timeout), "the stream did not end"
        if self.error is not None:
            raise self.error
        return "".join(self.text)


def route_to(c: Cluster, node: str) -> None:
    """Pin routing to ``node``: every other node drained."""
    for n in NODES:
        admin(c.admin_socket, "undrain" if n == node else "drain", node=n)


def borrowed(c: Cluster, node: str) -> dict[str, int]:
    return admin(c.node_admin(node), "loans")["debtor"]["borrowed"]


def hold(c: Cluster, on: str, debtor: str, blocks: int) -> tuple[str, int]:
    """A placeholder loan of ``blocks`` on ``on`` in ``debtor``'s name (its daemon does not
    know it: it lapses at lease end unless ``let_go`` returns it first): its id, and what
    ``on`` lent ``debtor`` before it."""
    before = admin(c.node_admin(on), "loans")["creditor"]["lent"].get(debtor, 0)
    loan = as_(c, on, debtor, protocol.BorrowRequest(debtor=debtor, blocks=blocks))
    assert loan.ok, loan.reason
    return loan.loan_id, before


def let_go(c: Cluster, on: str, debtor: str, placeholder: tuple[str, int]) -> None:
    loan_id, before = placeholder
    as_(c, on, debtor, protocol.ReturnLoan(debtor=debtor, loan_id=loan_id))      # or it lapsed already
    wait_for(lambda: ledger_line(c, on).get("lent", {}).get(debtor, 0) == before,
             f"{on}'s placeholder gone from the ledger")


def borrowing_stream(c: Cluster, node: str, seed: int, sampling: dict | None, placeholder: tuple[str, int]) -> Stream:
    """A stream on ``node`` that borrows ``REMOTE`` blocks: ``placeholder`` (debtor, blocks)
    holds ``node``'s blocks while it is admitted."""
    route_to(c, node)
    loan = hold(c, node, *placeholder)
    s = Stream(c, prompt(seed), sampling)
    wait_for(lambda: sum(borrowed(c, node).values()) == REMOTE, f"{node}'s loan", timeout=60)
    let_go(c, node, placeholder[0], loan)
    return s


def free_blocks(c: Cluster, nodes: list[str]) -> dict[str, int]:
    """Each node's free device blocks once its prefix cache is flushed (its heartbeat's)."""
    for n in nodes:
        admin(c.node_admin(n), "cache flush")
    time.sleep(1.2)
    return {n: ledger_line(c, n)["free"] for n in nodes}


@pytest.mark.parametrize("sampling", [None, SEEDED[1]], ids=["greedy", "seeded"])
def test_a_loan_comes_home_mid_stream_with_the_same_text(trio, long_reference, sampling):
    c = trio
    seed = 11 if sampling is None else 12
    s = borrowing_stream(c, "a", seed, sampling, ("c", BLOCKS - ADMITTED_FREE))
    creditor = next(iter(borrowed(c, "a")))
    wait_for(lambda: s.tokens >= 5, "the first tokens", timeout=60)
    got = admin(c.node_admin("a"), "recall", creditor=creditor, blocks=1, timeout=60)
    assert got.get("loan_blocks") == REMOTE and got["blocks_home"] >= 1, got
    assert borrowed(c, "a") == {}
    wait_for(lambda: ledger_line(c, creditor).get("lent") == {}, "the loan gone from the ledger")
    assert s.result() == want_text(long_reference, prompt(seed), sampling)
    status = admin(c.node_admin("a"), "status")["lending"]
    assert status["recall"]["recalled"] >= 1 and status["debtor"]["requests"]["recalled"] >= 1
    assert admin(c.node_admin(creditor), "loans")["creditor"]["recall"]["served"] >= 1
    assert free_blocks(c, NODES) == dict.fromkeys(NODES, BLOCKS)


def test_a_recall_is_the_loans_debtors_only(trio):
    """b's loan to a: a's RecallKV gets its blocks; c's for a's loan is refused and
    counted, c's in a's name is the trust gate's; nothing changes on b."""
    c = trio
    loan = as_(c, "b", "a", protocol.BorrowRequest(debtor="a", blocks=4))
    assert loan.ok
    before = admin(c.node_admin("b"), "loans")["creditor"]
    got = as_(c, "b", "a", protocol.RecallKV(debtor="a", loan_id=loan.loan_id, start=0, blocks=2))
    assert got.ok and tuple(got.tensors[0].shape)[1:3] == (2, 2)
    stolen = as_(c, "b", "c", protocol.RecallKV(debtor="c", loan_id=loan.loan_id, blocks=2))
    assert not stolen.ok and "no loan" in stolen.reason
    forged = as_(c, "b", "c", protocol.RecallKV(debtor="a", loan_id=loan.loan_id, blocks=2))
    assert isinstance(forged, protocol.Error) and forged.code == "forbidden"
    past = as_(c, "b", "a", protocol.RecallKV(debtor="a", loan_id=loan.loan_id, start=3, blocks=2))
    assert not past.ok and "of a loan of 4" in past.reason
    after = admin(c.node_admin("b"), "loans")["creditor"]
    assert after["recall"]["served"] == before["recall"]["served"] + 1
    assert after["recall"]["refused"] == before["recall"]["refused"] + 2
    assert after["counts"]["forbidden"] == before["counts"]["forbidden"] + 1
    assert after["lent"] == {"a": 4}
    assert as_(c, "b", "a", protocol.ReturnLoan(debtor="a", loan_id=loan.loan_id)).ok
    bad = admin(c.node_admin("a"), "recall", creditor="b", blocks=0)
    assert "blocks must be an int >= 1" in bad.get("error", ""), bad
    none = admin(c.node_admin("a"), "recall", creditor="b", blocks=1)
    assert "no request here holds a loan from 'b'" in none.get("error", ""), none


def test_a_creditor_killed_mid_recall(trio, long_reference):
    """The creditor stopped, a recall started, the creditor killed: the recall fails,
    the request's KV is computed again (the step's recovery) and its text is the same."""
    c = trio
    s = borrowing_stream(c, "a", 13, None, ("c", BLOCKS - ADMITTED_FREE))
    creditor = next(iter(borrowed(c, "a")))
    wait_for(lambda: s.tokens >= 5, "the first tokens", timeout=60)
    c.nodes[creditor].pause()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        recall = pool.submit(admin, c.node_admin("a"), "recall", creditor=creditor, blocks=1, timeout=60)
        time.sleep(0.5)
        c.nodes[creditor].kill9()
        assert recall.result(timeout=60).get("ok") is False      # failed, or past the socket's deadline
    assert s.result() == want_text(long_reference, prompt(13), None)
    assert admin(c.node_admin("a"), "loans")["debtor"]["requests"]["lost"] >= 1
    live = [n for n in NODES if n != creditor]
    c.wait_gone(creditor, timeout=30)
    assert free_blocks(c, live) == dict.fromkeys(live, BLOCKS)
    start(c, creditor, make_key=False)
    c.wait_nodes(NODES)
    wait_for(lambda: ledger_line(c, creditor).get("lendable") == LEND, "the restarted node's cap")
    for n in NODES:
        admin(c.admin_socket, "undrain", node=n)
    assert ledger(c)["debts"] == []
