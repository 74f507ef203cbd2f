"""Borrowing from a creditor whose pool is full of cached prefixes, over real daemons
(ZeroMQ with CURVE on loopback, the tiny model, the prefix cache on as by default): the
three nodes of test_borrowed_kv.py (N = 768 tokens each) first serve distinct chats until
finished chats' cached blocks leave each pool fewer free blocks than a loan needs; a
request of about 1.8 N tokens is then served to completion with the single-node
engine's greedy text, its tail in blocks another node lends by evicting its unlocked
cached blocks (least recently used first), and every node's blocks come back.
"""

from __future__ import annotations

import random

import pytest

from .conftest import MODEL, Cluster, admin
from .test_borrowed_kv import BLOCKS, LEND, MAX_TOKENS, NODES, PROMPT, trio, want_text  # noqa: F401 -- the fixture
from .test_engine_death import long_reference  # noqa: F401 -- the fixture
from .test_lending import ledger_line, wait_for

pytestmark = pytest.mark.timeout(600)
CHAT, CHAT_TOKENS = 300, 8                    # a finished chat leaves 19 cached blocks
LENT = -(-(PROMPT + MAX_TOKENS) // 16) - 6 * 8  # the blocks past the 6 whole 128-token chunks at home


def ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(length)]


def device(c: Cluster, node: str) -> dict:
    return admin(c.node_admin(node), "cache stats")["kv"]["device"]


def test_a_creditor_full_of_cached_prefixes_still_lends(trio, long_reference):
    c = trio
    client = c.client(timeout=120)
    for seed in range(100, 112):                  # distinct chats until every pool is mostly cache
        if all(device(c, n)["free"] < LENT for n in NODES):
            break
        client.completions.create(model=MODEL, prompt=ids(seed, CHAT), max_tokens=CHAT_TOKENS, temperature=0.0)
    before = {n: device(c, n) for n in NODES}
    assert all(s["free"] < LENT <= s["free"] + s["evictable"] for s in before.values()), before
    # the ledger counts the unlocked cached blocks as free, so both nodes stay candidates
    wait_for(lambda: all(ledger_line(c, n).get("lendable") == LEND for n in NODES), "cached blocks as lendable")

    long_ids = ids(1, PROMPT)
    out = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=MAX_TOKENS, temperature=0.0)
    assert out.choices[0].text == want_text(long_reference, long_ids, None)

    loans = {n: admin(c.node_admin(n), "loans") for n in NODES}
    creditors = [n for n in NODES if loans[n]["creditor"]["counts"]["granted"] > 0]
    assert len(creditors) == 1 and loans[creditors[0]]["creditor"]["counts"]["returned"] >= 1
    assert all(s["creditor"]["counts"]["refused"] == 0 for s in loans.values())
    creditor = creditors[0]
    after = device(c, creditor)
    assert after["cached"] < before[creditor]["cached"]          # the loan evicted cached blocks
    # nothing leaked: every block is free or cached again once the loan came home
    wait_for(lambda: all(device(c, n)["request_owned"] == 0 for n in NODES), "every loan and request ended")
    for n in NODES:
        s = device(c, n)
        assert s["free"] + s["cached"] == BLOCKS, (n, s)
