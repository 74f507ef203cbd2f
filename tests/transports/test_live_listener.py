"""A live zmq listener running kvd.protocol.serve keeps serving through garbage."""

from __future__ import annotations

import asyncio
import collections

import pytest
import torch
import zmq
import zmq.asyncio

import transports
from kvd import protocol
from kvd.protocol import Error, GenerateRequest, Heartbeat, KVAck, KVData, TokenChunk
from transports.base import KIND_REQUEST, pack_envelope

pytestmark = pytest.mark.timeout(60)


async def handle(msg, incoming):
    if isinstance(msg, GenerateRequest):
        return TokenChunk(id=msg.id, request_id=msg.request_id, start_index=0,
                          token_ids=msg.prompt_token_ids[:1], text_ends=(0,))
    if isinstance(msg, KVData):
        (kv,) = msg.as_torch()
        return KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=True, inserted_tokens=int(kv.sum()))
    return None


@pytest.fixture
async def live(tmp_path):
    listener = await transports.listen(f"zmq+ipc://{tmp_path}/live.sock")
    rejected: collections.Counter[str] = collections.Counter()
    server = asyncio.create_task(protocol.serve(listener, handle, rejected=rejected))
    conn = await transports.connect(listener.url)
    yield listener, conn, rejected
    await conn.close()
    await listener.close()
    await asyncio.wait_for(server, 5)  # serve() returns once its listener closes


async def good_round_trip(conn, n: int) -> None:
    reply = await protocol.call(conn, GenerateRequest(id=f"g{n}", request_id=f"r{n}",
                                                      prompt_token_ids=(n, 2, 3)), timeout=5)
    assert isinstance(reply, TokenChunk) and reply.token_ids == (n,) and reply.id == f"g{n}"


async def test_bad_protocol_messages_get_error_replies_and_are_counted(live):
    listener, conn, rejected = live
    await good_round_trip(conn, 1)
    v = b'"v":%d' % protocol.PROTOCOL_VERSION
    bad = [
        (b"not json", []),
        (b'{"type":"GenerateRequest","v":99,"id":"x"}', []),
        (b'{"type":"Pickle",%s,"id":"y"}' % v, []),
        (b'{"type":"KVData",%s,"id":"z","transfer_id":"t",' % v
         + b'"frames":[{"dtype":"float32","shape":[4]}]}', [b"123"]),
        (b'{"type":"GenerateRequest",%s,"id":"w","request_id":"r","prompt_token_ids":[1],' % v
         + b'"sampling":{"temperature":"hot"}}', []),
    ]
    for header, frames in bad:
        reply = await conn.request(header, frames, timeout=5)
        error = protocol.decode(reply.header, reply.frames)
        assert isinstance(error, Error), error
        await good_round_trip(conn, 2)
    assert rejected == {"bad_json": 1, "bad_version": 1, "unknown_type": 1,
                        "size_mismatch": 1, "invalid_field": 1}
    # A rejected request's Error names the request id when it could be read.
    reply = await conn.request(bad[2][0], [], timeout=5)
    assert protocol.decode(reply.header, []).id == "y"


async def test_raw_garbage_on_the_socket_is_dropped_and_counted(live):
    listener, conn, rejected = live
    ctx = zmq.asyncio.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.connect(listener.url.removeprefix("zmq+"))
    try:
        await rogue.send_multipart([b"garbage"])            # no envelope at all
        await rogue.send_multipart([b"\x00" * 10, b"{}"])   # wrong magic
        await rogue.send_multipart([b"x"])                  # too few parts
        # valid envelope, protocol garbage: answered with an Error
        await rogue.send_multipart([pack_envelope(KIND_REQUEST, 7), b"\xff\xfe"])
        envelope, header = await asyncio.wait_for(rogue.recv_multipart(), 5)
        assert isinstance(protocol.decode(header, []), Error)
        await good_round_trip(conn, 3)
        assert listener.stats.malformed == 3
        assert rejected["bad_json"] == 1
    finally:
        rogue.close(0)
        ctx.destroy(0)


async def test_one_way_bad_messages_are_counted_silently(live):
    listener, conn, rejected = live
    await conn.send(b'{"type":"Heartbeat","v":%d}' % protocol.PROTOCOL_VERSION)  # missing fields, nobody waits
    hb = Heartbeat(node="n1", seq=1, load=0.5, running=1, waiting=0, free_blocks={"device": 3})
    await conn.send(*protocol.encode(hb))
    await good_round_trip(conn, 4)
    assert rejected == {"missing_field": 1}


async def test_kv_tensor_frames_over_the_live_listener(live):
    listener, conn, rejected = live
    kv = torch.ones(2, 16, 8, dtype=torch.bfloat16)
    reply = await protocol.call(conn, KVData(id="k", transfer_id="t1", tensors=(kv,)), timeout=5)
    assert isinstance(reply, KVAck) and reply.inserted_tokens == kv.numel()


async def test_expired_request_is_refused(live):
    listener, conn, rejected = live
    msg = GenerateRequest(id="old", request_id="r", prompt_token_ids=(1,), deadline=1.0)
    reply = await protocol.call(conn, msg, timeout=5)
    assert isinstance(reply, Error) and reply.code == "deadline_exceeded"
    assert rejected["deadline_exceeded"] == 1
