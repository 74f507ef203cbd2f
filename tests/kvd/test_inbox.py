"""The node's one KV inbox on a real engine: a PREFIX region is bound to the
link that asked and to the peer's share of blocks, filled from that link
only, committed by its last layer, reaped at its deadline; a PROMPT region
is filled by the named prefill node only and ended by its KVCommit; a
ReplicaData goes through the same door. Every region ends with the pool as
it was (or its KV indexed)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from engine.memory.region import Purpose
from kvd import protocol, trust
from kvd.node.inbox import KVInbox, grant_seconds
from kvd.transfer_state import COMMIT_STATUSES, TransferState

from .tiny_driver import running_driver

BS = 16


@pytest.fixture
async def inbox():
    async with running_driver(block_size=BS, kv_blocks=16, host_kv_blocks=16) as driver:
        yield KVInbox(driver, authenticated=True, max_peer_blocks=6, transfer_timeout=5.0, replica_blocks=8)


def link(peer: bytes, identity: str | None) -> SimpleNamespace:
    return SimpleNamespace(peer=peer, identity=identity)


def ask(inbox: KVInbox, tid: str, blocks: int, first: int = 1) -> protocol.KVTransferRequest:
    layout = inbox.driver.engine.pool.kv_layout()
    return protocol.KVTransferRequest(id=tid, transfer_id=tid, src_node="a", dst_node="b",
                                      token_ids=tuple(range(first, first + blocks * BS)), num_blocks=blocks,
                                      num_layers=layout.num_layers, dtype=protocol.dtype_name(layout.dtype))


def data(inbox: KVInbox, tid: str, block_ids: tuple[int, ...], fill: float = 1.0) -> protocol.KVData:
    layout = inbox.driver.engine.pool.kv_layout()
    kv = torch.full((layout.num_layers, 2, len(block_ids), *layout.block_shape[2:]), fill, dtype=layout.dtype)
    return protocol.KVData(id=f"{tid}.0", transfer_id=tid, seq=0, layer_start=0, layer_end=layout.num_layers,
                           block_ids=block_ids, last=True, tensors=(kv,))


async def test_a_prefix_region_is_its_links_and_commits_on_its_last_layer(inbox):
    a = link(b"a", "node-a")
    reply = await inbox.answer(ask(inbox, "t1", 2), a)
    assert reply.ok and len(reply.block_ids) == 2 and inbox.receivers["t1"].purpose is Purpose.PREFIX
    assert (await inbox.answer(ask(inbox, "t1", 2), a)).reason == "duplicate transfer id"
    # another key, or the same key over another link, touches nothing
    for other in (link(b"a", "node-c"), link(b"x", "node-a")):
        refused = await inbox.answer(data(inbox, "t1", reply.block_ids), other)
        assert isinstance(refused, protocol.Error) and refused.code == "no_grant"
    assert inbox.prefix_counts["refused"] == 2
    ack = await inbox.answer(data(inbox, "t1", reply.block_ids), a)
    assert ack.ok and ack.inserted_tokens == 2 * BS and not inbox.receivers
    assert inbox.prefix_counts["received"] == 1
    assert await inbox.driver.call(lambda e: e.pool.cached_tokens(list(range(1, 1 + 2 * BS)))) == 2 * BS


async def test_a_peers_share_is_bounded_and_an_expired_region_is_reaped(inbox):
    a = link(b"a", "node-a")
    pool = inbox.driver.engine.pool
    free = pool.stats()["device"]["free"]
    assert (await inbox.answer(ask(inbox, "t1", 4, first=1000), a)).ok
    over = await inbox.answer(ask(inbox, "t2", 3, first=2000), a)          # 4 + 3 > 6
    assert not over.ok and "kv_grant_share" in over.reason and inbox.prefix_counts["peer_refused"] == 1
    assert (await inbox.answer(ask(inbox, "t3", 3, first=3000), link(b"c", "node-c"))).ok   # another peer's share
    inbox.receivers["t1"].region.deadline = time.monotonic() - 1
    assert await inbox.expire() == 1
    assert inbox.receivers.keys() == {"t3"} and inbox.prefix_counts["failed"] == 1
    assert pool.stats()["device"]["free"] == free - 3
    assert grant_seconds(time.time() + 100, 5.0) == 5.0 and grant_seconds(None, 5.0) == 5.0


async def test_a_prompt_region_is_filled_by_its_prefill_node_and_ended_by_its_commit(inbox):
    pool = inbox.driver.engine.pool
    before = pool.stats()["device"]["free"]
    prompt = list(range(1, 41))
    region = await inbox.driver.call(lambda e: e.pool.reserve_region(prompt, purpose=Purpose.PROMPT))
    rx = inbox.open_prompt("r1", region, "node-p", pool.kv_layout().num_layers)
    p = link(b"p", "node-p")
    refused = await inbox.answer(data(inbox, rx.transfer_id, tuple(region.block_ids)), link(b"q", "node-q"))
    assert refused.code == "no_grant" and inbox.prompt_counts["refused"] == 1
    assert inbox.answer_now(data(inbox, rx.transfer_id, tuple(region.block_ids)), p) is None   # from a task
    assert (await inbox.answer(data(inbox, rx.transfer_id, tuple(region.block_ids)), p)).ok
    commit = protocol.KVCommit(id="c", transfer_id=rx.transfer_id, request_id="r1", status="failed", reason="x")
    assert inbox.answer_now(commit, p).ok and rx.state is TransferState.FAILED
    await inbox.release(rx, handed_to_engine=False)
    assert not inbox.receivers and pool.stats()["device"]["free"] == before
    assert inbox.prompt_counts["failed"] == 1 and "failed" in COMMIT_STATUSES
    stray = protocol.KVCommit(id="d", transfer_id="nope", request_id="r1", status="done", first_token=1)
    assert inbox.answer_now(stray, p).code == "no_grant"


async def test_a_replica_goes_through_the_same_door(inbox):
    key = trust.holder_key(b"secret", "b", "inc")
    inbox.replicas.key = key
    layout = inbox.driver.engine.pool.kv_layout()
    kv = torch.ones((layout.num_layers, 2, 2, *layout.block_shape[2:]), dtype=layout.dtype)
    msg = protocol.ReplicaData(source="a", block_size=BS, request_ids=("r",), starts=(0,), counts=(2,),
                               token_ids=tuple(range(1, 1 + 2 * BS)), tensors=(kv,),
                               tickets={"r": trust.replica_ticket(key, "a", "r")})
    assert inbox.answer_now(msg, link(b"a", "a")) is None
    ack = await inbox.answer(msg, link(b"a", "a"))
    assert ack.held == {"r": 2 * BS} and inbox.replicas.replicas[("a", "r")].region.purpose is Purpose.REPLICA
