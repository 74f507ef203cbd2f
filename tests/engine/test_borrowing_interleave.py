"""A request waiting for a creditor does not hold the queue: while every creditor says
no to the long request at the head of the queue, the short requests queued behind it
that fit in local blocks are admitted and served (counted in steps and loans, not
timed); once a creditor lends, the long request is served with the tokens of an engine
given enough blocks. A request that waits for this node's own memory still holds it."""

from __future__ import annotations

import concurrent.futures

from .test_borrowing import LOCAL_BLOCKS, Creditor, make
from .test_dist_attention import greedy, prompt, run, tiny_model  # noqa: F401

LONG, CHATS = (prompt(640, 7), greedy(20)), {f"chat{i}": (prompt(40, 9 + i), greedy(4)) for i in range(2)}


class ClosedCreditor(Creditor):
    """Says no while ``closed``."""

    closed = True

    def borrow(self, blocks: int):
        return None if self.closed else super().borrow(blocks)


def step_all(engine, got: dict[str, list[int]]) -> None:
    for out in engine.step():
        got.setdefault(out.request_id, []).extend(out.new_token_ids)


def test_chats_behind_a_refused_borrower_are_served(tiny_model, tokenizer):
    want = run(make(tiny_model, tokenizer, 128), {"long": LONG, **CHATS})
    engine = make(tiny_model, tokenizer, LOCAL_BLOCKS, borrow=64)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        creditor = ClosedCreditor(engine, 64, pool)
        borrowing = engine.enable_borrowing(creditor.borrow, creditor.give_back, deadline_s=10.0)
        borrowing.retry_s, borrowing.give_up_s = 0.0, float("inf")   # steps, not seconds, in this test
        got: dict[str, list[int]] = {}
        engine.add_request("long", *LONG)
        step_all(engine, got)                                          # the head asks and hears no
        assert borrowing.counts["refused"] == 1 and borrowing.refused(engine.requests["long"])
        for rid, (ids, params) in CHATS.items():
            engine.add_request(rid, ids, params)
        for _ in range(50):
            if all(len(got.get(rid, [])) == 4 for rid in CHATS):
                break
            step_all(engine, got)
        assert {rid: got.get(rid) for rid in CHATS} == {rid: want[rid] for rid in CHATS}
        assert "long" not in got and borrowing.counts["borrowed"] == 0 and borrowing.counts["refused"] > 1
        creditor.closed = False
        for _ in range(500):
            if not engine.has_unfinished():
                break
            step_all(engine, got)
    assert got["long"] == want["long"]
    assert borrowing.counts["borrowed"] == 1 and borrowing.counts["returned"] == 1 and not creditor.regions
    engine.check_integrity()


def test_a_request_short_of_local_memory_still_holds_the_queue(tiny_model, tokenizer):
    """The node's own blocks are what the head lacks (a running request holds them): FCFS,
    the chat behind it waits too, as without borrowing."""
    engine = make(tiny_model, tokenizer, LOCAL_BLOCKS, borrow=64)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        creditor = ClosedCreditor(engine, 64, pool)
        creditor.closed = False
        borrowing = engine.enable_borrowing(creditor.borrow, creditor.give_back, deadline_s=10.0)
        got: dict[str, list[int]] = {}
        engine.add_request("hog", prompt(300, 3), greedy(40))          # 22 of the 24 blocks
        step_all(engine, got)
        engine.add_request("long", *LONG)
        engine.add_request("chat0", *CHATS["chat0"])
        step_all(engine, got)
        assert not borrowing.refused(engine.requests["long"]) and borrowing.counts["refused"] == 0
        assert [r.request_id for r in engine.scheduler.waiting] == ["long", "chat0"]
        while engine.has_unfinished():
            step_all(engine, got)
    assert borrowing.counts["borrowed"] == 1 and len(got["long"]) == 20
    engine.check_integrity()
