"""Recall in process (engine/recall.py): a request borrowing the rest of its sequence
from another MemPool (an in-process creditor) has its remote part brought home while it
decodes (the loan's first blocks read from the creditor between ``begin`` and
``finish``, the steps in between recorded): the tokens of an engine given enough
blocks, greedy and seeded; every block and loan comes back. A recall that cannot
land (no room, an unknown loan, a prompt still computing) changes nothing."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from engine import recall
from engine.engine import EngineConfig, LLMEngine

from .test_borrowing import Creditor
from .test_dist_attention import greedy, prompt, run, seeded, tiny_model  # noqa: F401

BLOCKS, HELD = 64, 40                   # 64 blocks; 40 of them held while the request is admitted


def make(model, tokenizer) -> LLMEngine:
    cfg = EngineConfig(model="tiny", dtype="float32", batch_invariant=True, kv_blocks=BLOCKS, host_kv_blocks=0,
                       prefill_chunk_tokens=128, borrow_kv_blocks=64, max_num_seqs=4)
    return LLMEngine(cfg, model, tokenizer, "tiny")


def fetch(creditor: Creditor, plan: recall.RecallPlan) -> torch.Tensor | None:
    """What the creditor's RecallServer sends: the loan's first ``fetch_blocks`` blocks."""
    if not plan.fetch_blocks:
        return None
    ids = creditor.regions[plan.loan_id].block_ids[:plan.fetch_blocks]
    shape = creditor.pool.kv_layout().block_shape
    out = torch.empty(shape[0], 2, len(ids), *shape[2:], dtype=creditor.pool.kv_layout().dtype)
    creditor.pool.gather_blocks(ids, out, (0, shape[0]))
    return out


def borrowing_engine(model, tokenizer, pool, ids: list[int], params, tokens: int):
    """An engine whose request ``ids`` borrowed at admission (HELD blocks taken meanwhile),
    stepped to ``tokens`` tokens: (engine, creditor, borrowing, its tokens, the held blocks)."""
    engine = make(model, tokenizer)
    held = engine.pool.alloc_mem(HELD)
    creditor = Creditor(engine, 64, pool)
    borrowing = engine.enable_borrowing(creditor.borrow, creditor.give_back, deadline_s=10.0)
    engine.add_request("long", ids, params)
    got: list[int] = []
    step_until(engine, got, tokens)
    assert borrowing.holds(engine.requests["long"])
    return engine, creditor, borrowing, got, held


def step_until(engine: LLMEngine, got: list[int], n: int) -> None:
    while len(got) < n and engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids


@pytest.mark.parametrize("sampling", [greedy, seeded])
def test_a_remote_part_comes_home_mid_decode(tiny_model, tokenizer, sampling):
    ids, params = prompt(450, 3), sampling(120)
    want = run(make(tiny_model, tokenizer), {"long": (ids, params)})["long"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        engine, creditor, borrowing, got, held = borrowing_engine(tiny_model, tokenizer, pool, ids, params, 1)
        engine.pool.free_mem(held)                           # room for the part to come home
        loan_id = next(iter(recall.loans_of(engine)))
        assert isinstance(recall.begin(engine, "nope"), str)
        step_until(engine, got, 10)
        stale = recall.begin(engine, loan_id)               # a recall its caller gives up on
        assert not isinstance(stale, str)
        plan = recall.begin(engine, loan_id)                # the next one replaces it
        assert not isinstance(plan, str) and plan.fetch_blocks > 0
        assert "changed during its recall" in recall.finish(engine, stale, fetch(creditor, stale), spare=1)
        fetched = fetch(creditor, plan)
        step_until(engine, got, 30)                          # steps between the fetch and the switch
        taken = recall.finish(engine, plan, fetched, spare=1)
        assert isinstance(taken, int) and taken >= plan.fetch_blocks
        creditor.give_back(loan_id)
        assert not borrowing.holds(engine.requests["long"]) and borrowing.counts["recalled"] == 1
        step_until(engine, got, 10_000)
    assert got == want
    assert not creditor.regions and creditor.pool.free_blocks("device") == 64
    assert engine.pool.free_blocks("device") + engine.pool.stats()["device"].get("cached", 0) == BLOCKS
    engine.check_integrity()


def test_a_recall_without_room_changes_nothing(tiny_model, tokenizer):
    ids, params = prompt(450, 4), greedy(60)
    want = run(make(tiny_model, tokenizer), {"long": (ids, params)})["long"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        engine, creditor, borrowing, got, held = borrowing_engine(tiny_model, tokenizer, pool, ids, params, 5)
        loan_id = next(iter(recall.loans_of(engine)))
        plan = recall.begin(engine, loan_id)
        free = engine.pool.free_blocks("device")
        why = recall.finish(engine, plan, fetch(creditor, plan), spare=free)     # the spare takes every block
        assert isinstance(why, str) and "free blocks here" in why
        assert engine.pool.free_blocks("device") == free and borrowing.holds(engine.requests["long"])
        again = recall.begin(engine, loan_id)                                # its own lender back: it may
        assert not isinstance(again, str)
        recall.abort(engine, again)
        step_until(engine, got, 10_000)
        engine.pool.free_mem(held)
    assert got == want
    assert borrowing.counts["recalled"] == 0 and not creditor.regions
    engine.check_integrity()
