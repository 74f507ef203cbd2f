"""A real creditor's answers on the shared-memory ring (kvd/node/attention_ring.py with
kvd/node/remote_attention.py's AttentionServer over a MemPool, on loopback without keys):
partials computed into the reply's slot are ``LentKV.step``'s bits, one slot's reply
layout serves each reply of its shape whatever the id, and what a debtor may not do on
its ring -- another debtor's name, another debtor's loan, frames of the wrong heads -- is
refused and counted as before the fast path, the ring going on. The creditor's ring
thread asks whether its engine is idle before it spins (``RingPolicy.engine_idle``)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import pytest
import torch
import zmq

from engine.dist_attention import LentKV, RemoteKVError
from engine.memory.kv_cache import KVCache
from engine.memory.mempool import MemPool
from engine.memory.rmanager import RManager
from kernels.dist_attention import Partials
from kernels.paged_attention import PagedAttention
from kvd import protocol
from kvd.node import attention_ring, ring_lane
from kvd.node.attention_channel import ChannelClient, ChannelServer
from kvd.node.attention_ring import RingPolicy, Segment
from kvd.node.remote_attention import AttentionServer, ChannelLender, partials_of

from .test_borrowed_kv_ring import offer_of, pytestmark, segments  # noqa: F401 -- the same skip

LAYERS, H, KVH, HD, BS = 2, 9, 3, 64, 16
IDS = itertools.count()


@pytest.fixture
def creditor():
    """(channel server, client with a ring, attention server, loans of "a" and "b", calls
    of engine_idle): a creditor lending 24 blocks to each of a and b."""
    kernel = PagedAttention.create()
    if kernel is None:
        pytest.skip("no paged attention kernel on this CPU")
    kv = KVCache(LAYERS, KVH, HD, block_size=BS, device_blocks=48, host_blocks=0)
    pool = MemPool(48, 0, block_size=BS, storage=kv)
    rm = RManager(pool, lend_cap=48, lease_s=3600.0)
    loans = {d: rm.lend(d, 24, f"loan-{d}", time.monotonic()).loan_id for d in "ab"}
    attention = AttentionServer(rm, kernel, HD ** -0.5, [None] * LAYERS, (H, KVH, HD), threading.Lock(), threads=1)
    idle_calls = []
    policy = RingPolicy(lambda loan, debtor: None if loans.get(debtor) == loan else "no such loan",
                        lambda debtor: True, lambda: idle_calls.append(1) or True)
    server = ChannelServer("127.0.0.1", attention.serve, None, policy, attention.lane)
    ctx = zmq.Context()
    client = ChannelClient(ctx, server.url, None)
    try:
        assert client.open_ring("a", loans["a"], 10.0)
        yield server, client, attention, loans, idle_calls
    finally:
        client.close()
        server.close()
        attention.close()
        ctx.term()
    assert not segments()


def mirror_of(attention: AttentionServer, loan_id: str) -> LentKV:
    """A LentKV over the loan's blocks in a pool of its own (empty, as the creditor's)."""
    own = KVCache(LAYERS, KVH, HD, block_size=BS, device_blocks=48, host_blocks=0)
    return LentKV(MemPool(48, 0, block_size=BS, storage=own), attention.rmanager.loans[loan_id].region.block_ids, 1,
                  attention.kernel, HD ** -0.5, [None] * LAYERS)


def attend(debtor: str, loan: str, layer: int, first: int, heads: int = H, seed: int = 0) -> protocol.RemoteAttend:
    g = torch.Generator().manual_seed(seed)
    return protocol.RemoteAttend(id=f"m{next(IDS)}", debtor=debtor, loan_id=loan, request_id="r", lo=1,
                                 layer=layer, ctx=first + 1, first=first,
                                 tensors=(torch.randn(1, heads, HD, generator=g), torch.randn(1, KVH, HD, generator=g),
                                          torch.randn(1, KVH, HD, generator=g)))


def ask(client: ChannelClient, msg: protocol.RemoteAttend) -> protocol.Message:
    client.send(msg, 10.0, reply_bytes=64 << 10)
    return client.wait(msg.id, 10.0)


def test_ring_replies_are_the_lent_parts_bits(creditor):
    """A decode's positions through 3 blocks and both layers, on the ring: each reply is what a
    LentKV over the same blocks computes in this process."""
    server, client, attention, loans, idle_calls = creditor
    mirror = mirror_of(attention, loans["a"])
    for first in range(128, 128 + 40):
        for layer in range(LAYERS):
            msg = attend("a", loans["a"], layer, first, seed=first * 7 + layer)
            got = partials_of(ask(client, msg), 1, 1, first + 1, HD)
            q, k, v = (t.to_torch() for t in msg.tensors)
            want = mirror.step(layer, q, first + 1, torch.tensor([first]), k, v)
            assert all(torch.equal(a, b) for a, b in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))
    assert client.counts["ring"] == 80 and server.counts["ring_served"] == 80
    # each position's second layer answered natively (kvd/node/ring_lane.py), where it builds
    assert server.counts["ring_native"] == (40 if ring_lane.available() else 0)
    assert len(idle_calls) >= 79                         # asked before each spin for the next request


def test_a_decode_row_whose_k_and_v_dtypes_differ_is_written_as_each_converts(creditor):
    """One K/V row of mixed dtypes (k fp32, v fp16: a well-formed message) goes into the lent
    blocks converted, as the general write does, never copied as raw bytes of the cache's dtype."""
    server, client, attention, loans, _ = creditor
    mirror = mirror_of(attention, loans["a"])
    for first in (300, 301):
        msg = attend("a", loans["a"], 0, first, seed=first)
        q, k, v = (t.to_torch() for t in msg.tensors)
        mixed = dataclasses.replace(msg, tensors=(q, k, v.half()))
        got = partials_of(ask(client, mixed), 1, 1, first + 1, HD)
        want = mirror.step(0, q, first + 1, torch.tensor([first]), k, v.half().float())
        assert all(torch.equal(a, b) for a, b in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))


def test_what_a_debtor_may_not_do_on_its_ring_is_refused_and_counted(creditor):
    server, client, attention, loans, _ = creditor
    forged = ask(client, attend("b", loans["b"], 0, 200))             # b's name on a's ring
    assert not forged.ok and forged.reason.startswith("forbidden")
    assert server.counts["forbidden"] == 1
    theirs = ask(client, attend("a", loans["b"], 0, 200))             # b's loan, in a's own name
    assert not theirs.ok and "no loan" in theirs.reason
    assert attention.rmanager.counts["forbidden"] >= 1 and attention.counts["refused"] == 1
    wrong = ask(client, attend("a", loans["a"], 0, 200, heads=4))     # not this model's heads
    assert not wrong.ok and "heads" in wrong.reason and attention.counts["refused"] == 2
    huge = dataclasses.replace(attend("a", loans["a"], 0, 200), ctx=1 << 40)   # a table of 2^36 blocks
    refused = ask(client, huge)
    assert not refused.ok and "past the model's context" in refused.reason and attention.counts["refused"] == 3
    assert ask(client, attend("a", loans["a"], 0, 200)).ok            # the ring goes on
    assert client.counts["ring"] == 5


def test_a_slots_reply_layout_serves_every_id_of_its_shape():
    """``reply_into`` gives one slot the same views for each reply of a shape and id length
    (a debtor's ids have one), its header written for each id; an id of another length (as
    JSON), another slot or shape, other views. Every reply decodes as its own."""
    seg = Segment.create(slots=2, slot_bytes=64 << 10)
    try:
        other = Segment.attach(offer_of(seg))
        first = seg.reply_into(4, "a", (1, 3, 9, 64))
        for seq, msg_id in ((4, "a"), (6, "b"), (8, "c" * 40), (10, 'c"\\d')):
            out = seg.reply_into(seq, msg_id, (1, 3, 9, 64))
            assert (out is first) == (len(msg_id) == 1)
            out.m.fill_(seq), out.l.fill_(1.0), out.o.fill_(2.0)
            header, frames = protocol.encode(protocol.RemotePartials(id=msg_id, ok=True, tensors=out.frames))
            assert seg.put(attention_ring.REPLIES, seq, header, frames)
            got = protocol.decode(*other.take(attention_ring.REPLIES, seq, copy=True))
            assert got.id == msg_id and float(got.tensors[0].to_torch()[0, 0, 0]) == seq
        assert seg.reply_into(5, "a", (1, 3, 9, 64)) is not first
        assert seg.reply_into(4, "a", (1, 4, 9, 64)) is not first
        del first, out, got
        other.close()
    finally:
        seg.unlink()
        seg.close()
    assert seg._places == {}


def test_a_ring_spins_long_only_while_it_is_the_creditors_only_one(creditor):
    """Two debtors' rings: neither thread spins for its next request (they would take the
    time of each other's answers); one ring again once the other closes."""
    server, client, attention, loans, _ = creditor
    assert server._may_spin()
    ctx = zmq.Context()
    other = ChannelClient(ctx, server.url, None)
    try:
        assert other.open_ring("b", loans["b"], 10.0)
        assert ask(other, attend("b", loans["b"], 0, 200)).ok
        assert server.counts["rings_open"] == 2 and not server._may_spin()
    finally:
        other.close()
        ctx.term()
    for _ in range(100):
        if server.counts["rings_open"] == 1:
            break
        time.sleep(0.02)
    assert server._may_spin()


def test_a_steps_lane_sends_protocols_bytes_and_reads_the_same_bits_without_a_decode(creditor, monkeypatch):
    """A ChannelLender over buffers a step rewrites at every layer (the plan executor's):
    each layer's message is the bytes protocol.encode gives for it, and after the first
    reply each is read off the ring as it lies (no decode) with the lent part's bits.
    A refusal in the middle of a step (a layer the part does not serve) is decoded and
    raised with its reason, and the next layer is read fast again."""
    server, client, attention, loans, _ = creditor
    mirror = mirror_of(attention, loans["a"])
    lender = ChannelLender(client, "a", loans["a"], "r", 1, 10.0)
    fast = []
    wait_as = client.wait_as
    monkeypatch.setattr(client, "wait_as", lambda *a: fast.append(isinstance(r := wait_as(*a), Partials)) or r)
    g = torch.Generator().manual_seed(5)
    for first in range(250, 250 + 12):                             # ctx crosses a chunk at 256
        q, k, v = torch.empty(1, H, HD), torch.empty(1, KVH, HD), torch.empty(1, KVH, HD)
        positions = torch.tensor([first])
        for layer in range(LAYERS):
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=g))
            handle = lender.start(layer, q, first + 1, positions, k, v)
            got = handle.partials(10.0)
            want = mirror.step(layer, q.clone(), first + 1, positions, k.clone(), v.clone())
            assert all(torch.equal(a, b) for a, b in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))
            lane = lender._lane
            msg = protocol.RemoteAttend(id=handle.msg_id, deadline=lane.renew_at + 5.0, debtor="a",
                                        loan_id=loans["a"], request_id="r", lo=1, layer=layer, ctx=first + 1,
                                        first=first, tensors=(q, k, v))
            assert lane.header(handle.msg_id, layer) == protocol.encode(msg)[0]
        if first == 255:                                            # a layer the part does not serve
            with pytest.raises(RemoteKVError, match="layer 9 out of range"):
                lender.start(9, q, first + 1, positions, k, v).partials(10.0)
    # the first reply teaches its shape, which each next step expects (its context in the same
    # chunks): every other reply is read as it lies, but the refusal, decoded in full
    assert fast.count(True) == 12 * LAYERS - 1 and fast.count(False) == 1
    assert client.counts["ring"] == 12 * LAYERS + 1 and server.counts["ring_served"] == 12 * LAYERS + 1
    # the creditor decoded each step's first message in full and took the others by its pattern
    assert server.counts["ring_templated"] == 12 * (LAYERS - 1) + 1
    assert server.counts["ring_native"] == (12 * (LAYERS - 1) if ring_lane.available() else 0)


def test_a_steps_lane_posts_and_takes_natively_into_the_gather_with_the_lent_parts_bits(creditor):
    """The engine's way (``DistStep.gather_remote``): each layer's request posted by one
    native call, each reply the lane expects copied straight into the step's gather; a reply
    it does not expect (a refusal, a shape grown by a chunk) decoded in full, its reason
    raised, and the gather's other slots untouched."""
    server, client, attention, loans, _ = creditor
    mirror = mirror_of(attention, loans["a"])
    lender = ChannelLender(client, "a", loans["a"], "r", 1, 10.0)
    g = torch.Generator().manual_seed(9)
    native = ring_lane.available()
    for first in range(250, 250 + 12):                             # ctx crosses a chunk at 256
        q, k, v = torch.empty(1, H, HD), torch.empty(1, KVH, HD), torch.empty(1, KVH, HD)
        positions = torch.tensor([first])
        gather = Partials.empty(1, 4, H, HD)                       # slot 0: a local chunk, never written here
        for layer in range(LAYERS):
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=g))
            handle = lender.start(layer, q, first + 1, positions, k, v)
            handle.partials_into(lambda width: gather.slots(slice(0, 1), 1, width), 10.0)
            want = mirror.step(layer, q.clone(), first + 1, positions, k.clone(), v.clone())
            width = want.m.shape[1]
            got = gather.slots(slice(0, 1), 1, width)
            assert all(torch.equal(a, b) for a, b in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))
            assert torch.all(gather.m[:, 0] == -torch.inf) and not gather.o[:, 0].any()
        if first == 255:
            with pytest.raises(RemoteKVError, match="layer 9 out of range"):
                lender.start(9, q, first + 1, positions, k, v).partials_into(
                    lambda width: gather.slots(slice(0, 1), 1, width), 10.0)
    # every request posted natively (the refusal's too); every reply taken natively but the first
    # (no shape known yet) and the refusal (the step past the chunk boundary expects its chunk more)
    assert client.counts["ring_posted"] == (12 * LAYERS + 1 if native else 0)
    assert client.counts["ring_taken"] == (12 * LAYERS - 1 if native else 0)
    assert server.counts["ring_native"] == (12 * (LAYERS - 1) if native else 0)
