"""A ring's native lane (kvd/node/ring_lane.py, kernels/csrc/ring_lane.cpp) against the
full path it stands in for: a request of the served step, any id and layer, is answered
in its reply slot with the bytes the full path writes there (protocol.encode's header,
``LentKV.step``'s partials) and its K/V row where ``step`` writes it; a request that is not
the step's, byte for byte (the Python StepTemplate is the oracle, every byte of the header
changed), or whose loan is gone, is left to the full path with nothing written."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from engine.dist_attention import LentKV
from engine.memory.kv_cache import KVCache
from engine.memory.mempool import MemPool
from engine.memory.rmanager import RManager
from kernels.dist_attention import Partials
from kernels.paged_attention import PagedAttention
from kvd import protocol
from kvd.node import ring_lane
from kernels.shm_wait import Doorbells
from kvd.node.attention_ring import _REPLY_BELL, REPLIES, REQUESTS, RingClient, Segment
from kvd.node.remote_attention import AttentionServer, StepLane, partials_of
from kvd.node.step_template import StepTemplate

LAYERS, H, KVH, HD, BS, LO = 3, 9, 3, 64, 16, 1
FIRST = 128 + 150                       # a decode position in the part's second chunk
pytestmark = pytest.mark.skipif(not ring_lane.available(), reason="no native ring lane on this host")


class Creditor:
    """An AttentionServer lending 24 blocks to "a", a ring segment, and the step's lane
    learnt from one message served in full (``layer`` 0)."""

    def __init__(self, kv_dtype: torch.dtype = torch.float32) -> None:
        self.kernel = PagedAttention.create()
        if self.kernel is None:
            pytest.skip("no paged attention kernel on this CPU")
        kv = KVCache(LAYERS, KVH, HD, block_size=BS, device_blocks=48, host_blocks=0, dtype=kv_dtype)
        self.pool = MemPool(48, 0, block_size=BS, storage=kv)
        self.rm = RManager(self.pool, lend_cap=48, lease_s=3600.0)
        self.loan = self.rm.lend("a", 24, "loan-a", time.monotonic())
        self.attention = AttentionServer(self.rm, self.kernel, HD ** -0.5, [None, 64, None], (H, KVH, HD),
                                         threading.Lock(), threads=1)
        self.seg = Segment.create(slots=4, slot_bytes=64 << 10)
        self.template = StepTemplate()
        self.g = torch.Generator().manual_seed(3)
        first = self.message("m0", 0)
        header, frames = self.post(0, first)
        reply = self.attention.serve(self.template_learn(header, frames), "a")
        assert reply.ok
        self.lane = self.attention.lane(first, "a", self.template.pieces, reply.tensors[-1].shape)

    def template_learn(self, header: bytes, frames: list) -> protocol.RemoteAttend:
        msg = protocol.decode(header, frames)
        self.template.learn(header, msg)
        return msg

    def message(self, ident: str, layer: int, dtype: torch.dtype = torch.float32) -> protocol.RemoteAttend:
        q, k, v = (torch.randn(1, n, HD, generator=self.g) for n in (H, KVH, KVH))
        return protocol.RemoteAttend(id=ident, deadline=1795990000.5, debtor="a", loan_id="loan-a",
                                     request_id="r", lo=LO, layer=layer, ctx=FIRST + 1, first=FIRST,
                                     tensors=(q, k.to(dtype), v.to(dtype)))

    def post(self, seq: int, msg: protocol.RemoteAttend, header: bytes | None = None) -> tuple[bytes, list]:
        h, frames = protocol.encode(msg)
        header = h if header is None else header
        assert self.seg.put(REQUESTS, seq, header, [memoryview(bytes(f)) for f in frames])
        got = self.seg.take(REQUESTS, seq, copy=True)
        return got

    def native(self, seq: int) -> int:
        return self.lane.serve(self.seg.slot_address(REQUESTS, seq), self.seg.slot_address(REPLIES, seq), seq,
                               self.seg.slot_bytes)

    def caches(self) -> list[bytes]:
        return [bytes(t.contiguous().view(torch.uint8).numpy()) for layer in range(LAYERS)
                for t in self.pool.layer_caches(layer)]

    def reply_slot(self, seq: int) -> bytes:
        at = self.seg.slot_address(REPLIES, seq) - self.seg.base
        return bytes(self.seg.view[at:at + self.seg.slot_bytes])

    def close(self) -> None:
        self.seg.unlink()
        self.seg.close()
        self.attention.close()


@pytest.fixture
def creditor():
    c = Creditor()
    assert c.lane is not None
    yield c
    c.close()


def mirror(c: Creditor) -> LentKV:
    """A LentKV over the same blocks of a pool of its own, brought to the creditor's state."""
    kv = KVCache(LAYERS, KVH, HD, block_size=BS, device_blocks=48, host_blocks=0)
    pool = MemPool(48, 0, block_size=BS, storage=kv)
    for layer in range(LAYERS):
        for mine, theirs in zip(pool.layer_caches(layer), c.pool.layer_caches(layer)):
            mine.copy_(theirs)
    return LentKV(pool, c.loan.region.block_ids, LO, c.kernel, HD ** -0.5, [None, 64, None], threads=1)


@pytest.mark.parametrize("ident, layer", [("m1", 1), ("x" * 64, 2), ("Z-_9", 0)])
def test_a_request_of_the_step_is_answered_with_the_full_paths_bytes(creditor, ident, layer):
    c = creditor
    want_lent = mirror(c)
    msg = c.message(ident, layer)
    seq = 5
    c.post(seq, msg)
    assert c.native(seq) == ring_lane.SERVED and c.attention.counts["served"] == 2
    header, frames = c.seg.take(REPLIES, seq, copy=True)
    reply = protocol.decode(header, frames)
    q, k, v = (t.to_torch() for t in msg.tensors)
    want = want_lent.step_from(layer, q, FIRST + 1, FIRST, k, v)
    assert header == protocol.encode(protocol.RemotePartials(id=ident, ok=True, tensors=(want.m, want.l, want.o)))[0]
    got = partials_of(reply, 1, LO, FIRST + 1, HD)
    assert all(torch.equal(a, b) for a, b in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))
    # the K/V row went where step_from writes it, and nowhere else
    assert c.caches() == [bytes(t.contiguous().view(torch.uint8).numpy()) for layer_ in range(LAYERS)
                          for t in want_lent.pool.layer_caches(layer_)]


def test_every_byte_of_another_header_is_checked_as_the_template_checks_it(creditor):
    """Each byte of a request's header changed in turn: the native lane serves exactly the
    headers the Python template takes, and with those its id and layer; for every other it
    writes nothing."""
    c = creditor
    msg = c.message("m1", 1)
    header, frames = protocol.encode(msg)
    views = [memoryview(bytes(f)) for f in frames]
    seq, served = 1, 0
    for i in range(len(header)):
        for b in {b"0"[0], b"Z"[0], b'"'[0], b","[0], header[i] ^ 1} - {header[i]}:
            forged = header[:i] + bytes([b]) + header[i + 1:]
            oracle = c.template.match(forged, views)
            if oracle is not None and oracle.layer >= LAYERS:
                oracle = None                        # the lane serves the model's layers only
            caches, slot = c.caches(), c.reply_slot(seq)
            c.post(seq, msg, header=forged)
            got = c.native(seq)
            if oracle is None:
                assert got == ring_lane.NOT_MINE, forged
                assert c.caches() == caches and c.reply_slot(seq) == slot
            else:
                assert got == ring_lane.SERVED, forged
                reply = protocol.decode(*c.seg.take(REPLIES, seq, copy=True))
                assert reply.ok and reply.id == oracle.id
                served += 1
            seq += 1
    assert served >= 5                          # the id's and the layer's own bytes


@pytest.mark.parametrize("forge", ["seq", "frame size", "frames", "layer", "leading zero", "long id", "empty id"])
def test_a_slot_that_is_not_the_steps_is_left_to_the_full_path(creditor, forge):
    c = creditor
    msg = c.message("m1", 1)
    header, frames = protocol.encode(msg)
    frames = [memoryview(bytes(f)) for f in frames]
    if forge == "frame size":
        frames[0] = frames[0][:-4]
    elif forge == "frames":
        frames = frames[:2]
    elif forge == "layer":
        header = header.replace(b'"layer":1,', b'"layer":%d,' % LAYERS)
    elif forge == "leading zero":
        header = header.replace(b'"layer":1,', b'"layer":01,')
    elif forge == "long id":
        header = header.replace(b'"id":"m1"', b'"id":"' + b"m" * 65 + b'"')
    elif forge == "empty id":
        header = header.replace(b'"id":"m1"', b'"id":""')
    assert c.seg.put(REQUESTS, 2, header, frames)
    caches, slot = c.caches(), c.reply_slot(2)
    seq = 6 if forge == "seq" else 2                # slot 2 holds message 2, not 6
    assert c.native(seq) == ring_lane.NOT_MINE
    assert c.caches() == caches and c.reply_slot(2) == slot and c.attention.counts["served"] == 1


def test_a_returned_loan_is_not_served_natively(creditor):
    c = creditor
    c.post(1, c.message("m1", 1))
    with c.attention.lock:
        assert c.rm.give_back("a", "loan-a") is None
    caches = c.caches()
    assert c.native(1) == ring_lane.NOT_MINE and c.caches() == caches


def test_no_lane_for_a_step_the_native_path_does_not_take():
    """K/V rows of another dtype than the caches' (converted on the full path), or a
    prefill chunk's rows, get no lane."""
    c = Creditor()
    try:
        msg = c.message("h1", 0, dtype=torch.float16)
        reply = c.attention.serve(msg, "a")
        assert reply.ok and c.attention.lane(msg, "a", c.template.pieces, reply.tensors[-1].shape) is None
    finally:
        c.close()


def test_float16_caches_are_answered_natively_with_the_full_paths_bits():
    c = Creditor(kv_dtype=torch.float16)
    try:
        msg = c.message("h0", 0, dtype=torch.float16)
        c.post(0, msg)
        reply = c.attention.serve(c.template_learn(*c.seg.take(REQUESTS, 0, copy=True)), "a")
        lane = c.attention.lane(msg, "a", c.template.pieces, reply.tensors[-1].shape)
        assert lane is not None
        c.lane = lane
        kv = KVCache(LAYERS, KVH, HD, block_size=BS, device_blocks=48, host_blocks=0, dtype=torch.float16)
        pool = MemPool(48, 0, block_size=BS, storage=kv)
        for layer in range(LAYERS):
            for mine, theirs in zip(pool.layer_caches(layer), c.pool.layer_caches(layer)):
                mine.copy_(theirs)
        want_lent = LentKV(pool, c.loan.region.block_ids, LO, c.kernel, HD ** -0.5, [None, 64, None], threads=1)
        nxt = c.message("h1", 1, dtype=torch.float16)
        c.post(1, nxt)
        assert c.native(1) == ring_lane.SERVED
        got = partials_of(protocol.decode(*c.seg.take(REPLIES, 1, copy=True)), 1, LO, FIRST + 1, HD)
        q, k, v = (t.to_torch() for t in nxt.tensors)
        want = want_lent.step_from(1, q, FIRST + 1, FIRST, k, v)
        assert all(torch.equal(a, b) for a, b in zip((got.m, got.l, got.o), (want.m, want.l, want.o)))
    finally:
        c.close()


# ---------------------------------------------------------------- the debtor's end

def debtor_ring():
    bells = Doorbells.create()
    if bells is None:
        pytest.skip("no doorbells on this host")
    seg = Segment.create(slots=4, slot_bytes=64 << 10)
    return seg, bells, RingClient(seg, bells)


def test_a_posted_request_is_protocols_bytes_and_a_taken_reply_the_slots():
    seg, bells, client = debtor_ring()
    try:
        q, k, v = torch.randn(1, H, HD), torch.randn(1, KVH, HD), torch.randn(1, KVH, HD)
        lender = types.SimpleNamespace(debtor="a", loan_id="loan-a", request_id="r", lo=LO, timeout=5.0)
        lane = StepLane(lender, q, FIRST + 1, torch.tensor([FIRST]), k, v)
        for seq, (ident, layer) in enumerate([("ab12", 0), ("x" * 64, 29), ("c", 123456)]):
            assert client.send_step(ident, lane.request, layer, 16 << 10)
            header, frames = seg.take(REQUESTS, seq, copy=True)
            want = protocol.RemoteAttend(id=ident, deadline=lane.renew_at + 2.5, debtor="a", loan_id="loan-a",
                                         request_id="r", lo=LO, layer=layer, ctx=FIRST + 1, first=FIRST,
                                         tensors=(q, k, v))
            assert header == protocol.encode(want)[0]
            assert [bytes(f) for f in frames] == [bytes(t.numpy().tobytes()) for t in (q, k, v)]
        assert not client.send_step("y" * 65, lane.request, 1, 16 << 10)           # not an id the ring takes
        assert not client.send_step("r", lane.request, 1, 64 << 10)                 # its reply would not fit
        assert client.send_step("d", lane.request, 3, 16 << 10)                     # the fourth slot
        assert not client.send_step("e", lane.request, 4, 16 << 10)                 # the ring full: nothing sent
        assert client.sent == 4 and list(client._ids) == ["ab12", "x" * 64, "c", "d"]
        # replies, in order: the one expected, copied; anything else left for a full decode
        shape = (1, 3, H, HD)
        want = [torch.randn(1, 3, H), torch.rand(1, 3, H), torch.randn(1, 3, H, HD)]
        gather = lambda: Partials.empty(1, 5, H, HD)                             # noqa: E731
        replies = [protocol.RemotePartials(id="ab12", ok=True, tensors=tuple(want)),
                   protocol.RemotePartials(id="someone", ok=True, tensors=tuple(want)),      # another id
                   protocol.RemotePartials(id="c", ok=True, tensors=(want[0][:, :2], want[1][:, :2],
                                                                      want[2][:, :2]))]      # another shape
        for seq, reply in enumerate(replies):
            header, frames = protocol.encode(reply)
            assert seg.put(REPLIES, seq, header, [memoryview(bytes(f)) for f in frames])
        bells.post(seg.bell(_REPLY_BELL), 3)
        first = gather()
        assert client.next_reply_into(shape, first.slots(slice(0, 1), 1, 3), time.monotonic() + 5) is True
        assert torch.equal(first.m[:, 1:4], want[0]) and torch.equal(first.o[:, 1:4], want[2])
        assert torch.all(first.m[:, 0] == -torch.inf) and torch.all(first.m[:, 4] == -torch.inf)
        for _ in range(2):
            untouched = gather()
            got = client.next_reply_into(shape, untouched.slots(slice(0, 1), 1, 3), time.monotonic() + 5)
            assert isinstance(got, tuple) and got[1] is not None            # (id, header, frames): decoded
            assert torch.all(untouched.m == -torch.inf) and not untouched.o.any()
        with pytest.raises(ValueError, match="contiguous"):
            client.sent += 1
            client._ids.append("z")
            client.next_reply_into(shape, Partials(*(t.transpose(1, 2) for t in (first.m, first.l)), first.o),
                                   time.monotonic() + 5)
    finally:
        seg.unlink()
        seg.close()
