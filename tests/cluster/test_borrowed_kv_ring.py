"""The remote-attention channel's shared-memory ring (kvd/node/attention_ring.py) on
loopback, without keys: the segment's mode and name lifetime, what a debtor refuses to
map, round trips on the ring beside the zmq channel (what does not fit, a full ring), a
garbled slot and a forged message refused and counted, an open for a loan the debtor
does not hold refused and counted, and a creditor closing it failing the wait at once
and leaving nothing in /dev/shm. Over real daemons with CURVE (the same-host fast path
of every borrowed-KV stream, exact tokens, a stranger's open, a killed creditor):
test_borrowed_kv.py."""

from __future__ import annotations

import glob
import itertools
import os
import stat
import time

import pytest

from engine.dist_attention import RemoteKVError
from kernels.dist_attention import Partials
from kernels.shm_wait import Doorbells
from kvd import protocol
from kvd.node import attention_ring
from kvd.node.attention_channel import ChannelClient, ChannelServer
from kvd.node.attention_ring import REPLIES, REQUESTS, RingPolicy, Segment, host_id

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or not host_id() or Doorbells.create() is None,
                                reason="no /dev/shm, boot id or doorbells on this host")


def segments() -> set[str]:
    return {os.path.basename(p) for p in glob.glob("/dev/shm/kvd-ring-*")}


def offer_of(seg: Segment, **change) -> protocol.RingOffer:
    fields = {"name": seg.name, "nonce": seg.nonce.hex(), "slots": seg.slots, "slot_bytes": seg.slot_bytes} | change
    return protocol.RingOffer(ok=True, **fields)


def test_a_segment_is_the_users_alone_and_its_name_goes_when_the_debtor_maps_it():
    seg = Segment.create(slots=2, slot_bytes=4096)
    try:
        st = os.stat(f"/dev/shm/{seg.name}")
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        other = Segment.attach(offer_of(seg))
        assert seg.name not in segments()                       # mapped twice, named nowhere
        assert seg.put(REQUESTS, 7, b"{}", [memoryview(b"abc")])
        assert other.take(REQUESTS, 7, copy=True) == (b"{}", [b"abc"])
        assert other.take(REQUESTS, 9, copy=True) == "slot 1 holds message 7, not 9"
        other.close()
    finally:
        seg.unlink()
        seg.close()


def test_a_reply_computed_in_its_slot_is_posted_without_a_copy():
    """``reply_into``'s views are where ``put`` puts the frames of the answer they make: what
    the debtor takes is what was computed there (and a reply that does not fit gets none)."""
    import torch

    seg = Segment.create(slots=2, slot_bytes=8192)
    try:
        other = Segment.attach(offer_of(seg))
        out = seg.reply_into(5, "r5", (2, 3, 4, 16))
        out.m.copy_(torch.arange(24.0).view(2, 3, 4)), out.l.fill_(1.0), out.o.fill_(2.0)
        reply = protocol.RemotePartials(id="r5", ok=True, tensors=(out.m, out.l, out.o))
        header, frames = protocol.encode(reply)
        assert all(seg.base <= attention_ring._address(f) < seg.base + seg.size for f in frames)   # the slot's own
        assert seg.put(REPLIES, 5, header, frames, placed=True)
        got = protocol.decode(*other.take(REPLIES, 5, copy=True))
        assert got.id == "r5" and got.ok
        m, l, o = (t.to_torch() for t in got.tensors)
        assert torch.equal(m, torch.arange(24.0).view(2, 3, 4)) and bool((l == 1).all()) and bool((o == 2).all())
        assert seg.reply_into(6, "r6", (2, 64, 4, 16)) is None          # past the slot's 8 KiB
        del out, reply, frames, m, l, o, got
        other.close()
    finally:
        seg.unlink()
        seg.close()


def test_a_debtor_maps_only_the_offered_segment():
    seg = Segment.create(slots=2, slot_bytes=4096)
    try:
        for change, why in (({"name": "../kvd-ring-" + "0" * 32}, "not a ring's name"),
                            ({"name": "kvd-ring-zz"}, "not a ring's name"),
                            ({"slots": 3}, "not a ring segment"),
                            ({"slot_bytes": 1 << 30}, "a ring of"),
                            ({"nonce": "00" * 16}, "not the offered ring"),
                            ({"nonce": "xyz"}, "not hex")):
            with pytest.raises(ValueError, match=why):
                Segment.attach(offer_of(seg, **change))
        os.chmod(f"/dev/shm/{seg.name}", 0o644)                 # readable by others: not ours to trust
        with pytest.raises(ValueError, match="mode 0600"):
            Segment.attach(offer_of(seg))
        assert seg.name in segments()                           # a refused attach unlinks nothing
    finally:
        seg.unlink()
        seg.close()
    with pytest.raises(FileNotFoundError):
        Segment.attach(offer_of(seg))


IDS = itertools.count()


def attend(debtor: str = "a", rows: int = 1) -> protocol.RemoteAttend:
    import torch

    ctx = max(200, rows)
    return protocol.RemoteAttend(id=f"m{next(IDS)}", debtor=debtor, loan_id="l", request_id="r", lo=1,
                                 layer=0, ctx=ctx, first=ctx - 1, tensors=(torch.ones(rows, 2, 4),
                                                                       torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)))


@pytest.fixture
def channel():
    """A creditor's channel on loopback whose ``serve`` answers q's sum as m (no keys: the
    debtor is named by its claim; the ring's checks name it by its open)."""
    import torch

    def serve(msg: protocol.RemoteAttend, debtor: str, into=None) -> protocol.RemotePartials:
        total = float(msg.tensors[0].to_torch().sum())
        out = into((1, 1, 2, 4)) if into is not None else None       # on the ring: in the reply's slot
        out = out or Partials(torch.empty(1, 1, 2), torch.empty(1, 1, 2), torch.empty(1, 1, 2, 4))
        out.m.fill_(total), out.l.zero_(), out.o.zero_()
        return protocol.RemotePartials(id=msg.id, ok=True, tensors=(out.m, out.l, out.o))
    policy = RingPolicy(lambda loan, debtor: None if (loan, debtor) == ("l", "a") else f"no loan {loan!r} of {debtor!r}",
                        lambda debtor: True)
    server = ChannelServer("127.0.0.1", serve, None, policy)
    import zmq

    ctx = zmq.Context()
    client = ChannelClient(ctx, server.url, None)
    try:
        yield server, client
    finally:
        client.close()
        server.close()
        ctx.term()
    assert not segments()


def total(reply: protocol.Message) -> float:
    """The sum of q the channel's ``serve`` saw."""
    assert reply.ok, reply.reason
    return float(reply.tensors[0].to_torch()[0, 0, 0])


def ask(client: ChannelClient, msg: protocol.Message, reply_bytes: int = 4096, timeout: float = 10.0):
    client.send(msg, timeout, reply_bytes)
    return client.wait(msg.id, timeout)


def test_round_trips_on_the_ring_and_what_does_not_fit_on_the_channel(channel):
    server, client = channel
    assert client.open_ring("a", "l", 10.0) and not segments()
    assert total(ask(client, attend())) == 8.0
    assert client.counts == {"ring": 1, "channel": 1, "ring_posted": 0, "ring_taken": 0}   # the open on the channel
    assert ask(client, attend(), reply_bytes=1 << 20).ok         # a reply past a slot: the channel
    big = attend(rows=20_000)                                    # a request past a slot: the channel
    assert total(ask(client, big)) == 20_000 * 8
    assert client.counts == {"ring": 1, "channel": 3, "ring_posted": 0, "ring_taken": 0}
    # more in flight than slots: the rest on the channel; every reply to its own request
    sent = [attend(rows=i + 1) for i in range(attention_ring.SLOTS + 2)]
    for msg in sent:
        client.send(msg, 10.0, 4096)
    for msg in reversed(sent):
        rows = msg.tensors[0].shape[0]
        assert total(client.wait(msg.id, 10.0)) == rows * 8
    assert client.counts == {"ring": 1 + attention_ring.SLOTS, "channel": 5, "ring_posted": 0, "ring_taken": 0}
    assert server.counts["ring_served"] == 1 + attention_ring.SLOTS and server.counts["rings"] == 1


def post_raw(client: ChannelClient, header: bytes, frames: list, seq_shift: int = 0) -> str:
    """Put what a broken or hostile debtor would into the ring's next request slot."""
    ring = client.ring
    msg_id = f"raw{ring.sent}"
    assert ring.seg.put(REQUESTS, ring.sent + seq_shift, header, frames)
    ring.sent += 1
    ring._ids.append(msg_id)
    client._waiting.add(msg_id)
    client._on_ring.add(msg_id)
    ring.bells.post(ring.seg.bell(attention_ring._REQUEST_BELL), ring.sent)
    return msg_id


def test_a_garbled_slot_and_a_forged_message_are_refused_and_counted(channel):
    server, client = channel
    assert client.open_ring("a", "l", 10.0)
    garbled = client.wait(post_raw(client, b"{not json", []), 10.0)
    assert not garbled.ok and garbled.reason.startswith("ring: ")
    shifted = client.wait(post_raw(client, b"{}", [], seq_shift=attention_ring.SLOTS), 10.0)
    assert not shifted.ok and "holds message" in shifted.reason
    header, frames = protocol.encode(attend())
    short = client.wait(post_raw(client, header, frames[:2]), 10.0)            # a frame missing
    assert not short.ok and "frame" in short.reason
    assert server.counts["rejected"] == 3
    forged = ask(client, attend(debtor="b"))                                   # on a's ring, in b's name
    assert not forged.ok and forged.reason.startswith("forbidden: debtor 'b' is not the sender's key 'a'")
    assert server.counts["forbidden"] == 1
    assert ask(client, attend()).ok and server.counts["ring_served"] == 1       # the ring goes on


def test_an_open_for_a_loan_not_held_is_refused_and_counted(channel):
    server, client = channel
    assert not client.open_ring("a", "someone-elses", 10.0) and client.ring is None
    assert not client.open_ring("c", "l", 10.0)
    assert server.counts["ring_refused"] == 2 and server.counts["rings"] == 0 and not segments()
    offer = ask(client, protocol.RingOpen(id="o1", debtor="a", loan_id="l", host="another-boot-id"))
    assert not offer.ok and offer.reason == "another host"
    assert ask(client, attend()).ok and client.counts["ring"] == 0             # the channel serves


def test_a_creditor_closing_its_ring_fails_the_wait_at_once(channel):
    server, client = channel
    assert client.open_ring("a", "l", 10.0)
    ring = client.ring
    for debtor_ring in server._rings.values():
        debtor_ring.close()                                    # as when its debtor went idle
    assert ring.closed
    msg = attend()
    ring._ids.append(msg.id)                                   # as if posted just before
    ring.sent += 1
    client._waiting.add(msg.id)
    client._on_ring.add(msg.id)
    t = time.monotonic()
    with pytest.raises(RemoteKVError, match="closed the shared-memory ring"):
        client.wait(msg.id, 20.0)
    assert time.monotonic() - t < 5
    assert ask(client, attend()).ok and client.ring is None   # the next goes on the channel
    assert client.open_ring("a", "l", 10.0) and server.counts["rings"] == 2    # and a new ring is had
