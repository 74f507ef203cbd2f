"""Borrowing on the serving path (engine/borrowing.py), in process: an engine whose
``kv_blocks`` hold N tokens serves a request of about 1.8 N tokens with the rest of its
sequence in blocks another MemPool lends (an in-process lender), with the tokens of an
engine given enough blocks, greedy and seeded; a loan lost mid-stream is computed again
and the stream goes on with the same tokens; every block and loan comes back."""

from __future__ import annotations

import concurrent.futures

import pytest

from engine.borrowing import Loan
from engine.dist_attention import InProcessLender, LentKV, RemoteKVError
from engine.engine import EngineConfig, LLMEngine
from engine.memory.region import Purpose
from engine.request import SamplingParams

from .test_dist_attention import greedy, lender_pool, prompt, run, seeded, tiny_model  # noqa: F401

LOCAL_BLOCKS = 24                       # N = 384 tokens: 3 chunks


class Creditor:
    """Another engine's MemPool lending LENT regions, its micro-attention on a thread."""

    def __init__(self, engine: LLMEngine, blocks: int, executor) -> None:
        self.pool = lender_pool(engine, blocks)
        self.engine, self.executor = engine, executor
        self.regions: dict[str, object] = {}
        self.fail = False                   # a dead creditor: every part it holds refuses

    def borrow(self, blocks: int) -> Loan | None:
        region = self.pool.reserve_region((), num_blocks=blocks, purpose=Purpose.LENT)
        if region is None:
            return None
        loan_id = f"loan{len(self.regions)}"
        self.regions[loan_id] = region
        m = self.engine.model
        windows = [m.config.layer_window(i) for i in range(m.num_local_layers)]

        def lender(request_id: str, lo: int):
            creditor = self

            class Lender(InProcessLender):
                def start(self, *args):
                    if creditor.fail:
                        raise RemoteKVError("the creditor is gone")
                    return super().start(*args)
            return Lender(LentKV(self.pool, region.block_ids, lo, m.attention_kernel, m.scale, windows),
                          self.executor)
        return Loan(loan_id, blocks, lender)

    def give_back(self, loan_id: str) -> None:
        self.regions.pop(loan_id).commit()


def make(model, tokenizer, blocks: int, borrow: int = 0) -> LLMEngine:
    cfg = EngineConfig(model="tiny", dtype="float32", batch_invariant=True, kv_blocks=blocks, host_kv_blocks=0,
                       prefill_chunk_tokens=128, borrow_kv_blocks=borrow, max_num_seqs=4)
    return LLMEngine(cfg, model, tokenizer, "tiny")


@pytest.mark.parametrize("sampling", [greedy, seeded])
def test_a_request_past_the_node_borrows_and_matches(tiny_model, tokenizer, sampling):
    ids, params = prompt(640, 7), sampling(60)                     # 700 tokens ~ 1.8 N
    want = run(make(tiny_model, tokenizer, 128), {"long": (ids, params)})
    engine = make(tiny_model, tokenizer, LOCAL_BLOCKS, borrow=64)
    with pytest.raises(Exception):                                  # without borrowing it is refused
        make(tiny_model, tokenizer, LOCAL_BLOCKS).add_request("x", ids, params)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        creditor = Creditor(engine, 64, pool)
        borrowing = engine.enable_borrowing(creditor.borrow, creditor.give_back, deadline_s=10.0)
        got = run(engine, {"long": (ids, params), "short": (prompt(50, 8), sampling(5))})
    assert got["long"] == want["long"]
    assert borrowing.counts["borrowed"] == 1 and borrowing.counts["returned"] == 1
    assert not creditor.regions and creditor.pool.free_blocks("device") == 64
    assert engine.pool.free_blocks("device") + engine.pool.stats()["device"].get("cached", 0) == LOCAL_BLOCKS
    engine.check_integrity()


def lose_the_first_creditor(engine: LLMEngine, ids: list[int], params: SamplingParams, after: int,
                            asked: list[int]):
    """Serve request "long" on ``engine`` borrowing from two creditors of 64 blocks, the
    first of which fails once ``after`` tokens are out (killed mid-stream): (its tokens,
    the engine's Borrowing); each loan's size asked is appended to ``asked``."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first, second = Creditor(engine, 64, pool), Creditor(engine, 64, pool)

        def borrow(blocks):
            asked.append(blocks)
            return next((loan for c in (first, second) if not c.fail and (loan := c.borrow(blocks))), None)

        def give_back(loan_id):
            for c in (first, second):
                if loan_id in c.regions:
                    c.give_back(loan_id)
        borrowing = engine.enable_borrowing(borrow, give_back, deadline_s=10.0)
        engine.add_request("long", ids, params)
        got = []
        while engine.has_unfinished():
            for out in engine.step():
                got += out.new_token_ids
            if len(got) == after and not first.fail:
                first.fail = True
    assert not first.regions and not second.regions
    return got, borrowing


def test_a_lost_loan_is_computed_again(tiny_model, tokenizer):
    ids, params = prompt(600, 9), seeded(40)
    want = run(make(tiny_model, tokenizer, 128), {"long": (ids, params)})
    engine = make(tiny_model, tokenizer, LOCAL_BLOCKS, borrow=128)
    got, borrowing = lose_the_first_creditor(engine, ids, params, 10, [])
    assert got == want["long"]
    assert borrowing.counts["lost"] == 1 and borrowing.counts["borrowed"] == 2
    engine.check_integrity()


def test_a_request_computed_again_at_a_block_boundary_borrows_what_it_first_did(tiny_model, tokenizer):
    """Lost after 8 tokens (600 + 8: its tokens end a block), a request keeps its 3 local
    chunks: its own next token takes no block it is not given at once (its local chunks,
    whole, or the remote part), so no room is kept for it (which would cost a chunk, and a
    bigger loan than a creditor may lend)."""
    ids, params = prompt(600, 9), greedy(40)
    engine = make(tiny_model, tokenizer, LOCAL_BLOCKS, borrow=128)
    asked: list[int] = []
    got, borrowing = lose_the_first_creditor(engine, ids, params, 8, asked)
    assert len(got) == 40 and borrowing.counts["lost"] == 1
    assert asked == [asked[0]] * 2, asked
    engine.check_integrity()


def test_no_creditor_fails_what_only_borrowed_blocks_hold(tiny_model, tokenizer):
    """Nobody lends: a request longer than the whole MemPool fails with the reason once
    ``give_up_s`` passes, and the request queued behind it runs; nothing leaks."""
    engine = make(tiny_model, tokenizer, LOCAL_BLOCKS, borrow=64)
    asked = []
    borrowing = engine.enable_borrowing(lambda blocks: asked.append(blocks), lambda loan_id: None, deadline_s=1.0)
    borrowing.retry_s = borrowing.give_up_s = 0.05
    engine.add_request("long", prompt(640, 7), greedy(20))
    engine.add_request("short", prompt(50, 8), greedy(5))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert asked and outs["long"][-1].finish_reason == "error"
    assert "no node lends the rest" in outs["long"][-1].error
    assert sum(len(o.new_token_ids) for o in outs["short"]) == 5
    engine.check_integrity()


def test_a_decode_growing_past_the_node_borrows_instead_of_preempting(tiny_model, tokenizer):
    """A 250-token prompt fits; its decode reaches the last free block at a chunk boundary
    (key 384) and borrows the rest instead of being preempted: the same tokens."""
    ids, params = prompt(250, 5), seeded(300)
    want = run(make(tiny_model, tokenizer, 128), {"grow": (ids, params)})
    engine = make(tiny_model, tokenizer, LOCAL_BLOCKS, borrow=64)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        creditor = Creditor(engine, 64, pool)
        borrowing = engine.enable_borrowing(creditor.borrow, creditor.give_back, deadline_s=10.0)
        got = run(engine, {"grow": (ids, params)})
    assert got == want
    assert borrowing.counts["borrowed"] == 1 and engine.stats.preemptions == 0
    assert not creditor.regions
    engine.check_integrity()


@pytest.mark.parametrize("bad", [{"borrow_kv_blocks": -1}, {"borrow_kv_blocks": True}, {"borrow_kv_blocks": 1.5},
                                 {"borrow_kv_blocks": 8, "dtype": "bfloat16"}])
def test_borrow_kv_blocks_is_validated(bad):
    with pytest.raises(ValueError, match="borrow_kv_blocks"):
        EngineConfig(model="tiny", **bad)
