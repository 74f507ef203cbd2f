"""The remote-attention channel's addresses (kvd/node/attention_channel.py): which
listeners get a channel, which URLs a debtor accepts, and a round trip on loopback
over IPv4 and IPv6 without keys (an insecure cluster's), a silent channel failing the
wait by its deadline. The channel over real daemons with CURVE: test_borrowed_kv.py."""

from __future__ import annotations

import time

import pytest
import zmq

from engine.dist_attention import RemoteKVError
from kvd import protocol
from kvd.node.attention_channel import ChannelClient, ChannelServer, channel_host, check_channel_url


@pytest.mark.parametrize("address, host", [
    ("zmq+tcp://127.0.0.1:7000", "127.0.0.1"), ("zmq+tcp://[::1]:7000", "[::1]"), ("zmq+tcp://10.0.0.5:0", "10.0.0.5"),
    ("zmq+tcp://0.0.0.0:7000", None), ("zmq+tcp://*:7000", None), ("zmq+ipc:///run/kvd/n1", None),
    ("inproc://n1", None), ("ucx://10.0.0.5:7000", None)])
def test_a_channel_beside_a_named_tcp_listener_only(address, host):
    assert channel_host(address) == host


@pytest.mark.parametrize("url", ["", "tcp://", "tcp://h", "tcp://h:", "tcp://h:0", "tcp://h:70000", "tcp://:5",
                                 "ipc:///x", "zmq+tcp://h:5", "tcp://h:5x"])
def test_a_bad_channel_url_is_refused(url):
    with pytest.raises(ValueError, match="tcp://host:port"):
        check_channel_url(url)


def attend() -> protocol.RemoteAttend:
    import torch

    return protocol.RemoteAttend(id=f"m{time.monotonic_ns()}", debtor="a", loan_id="l", request_id="r", lo=1,
                                 layer=0, ctx=200, first=199, tensors=(torch.zeros(1, 2, 4), torch.zeros(1, 1, 4),
                                                                       torch.zeros(1, 1, 4)))


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_a_round_trip_and_a_silent_channel(host):
    seen = []

    def serve(msg, debtor):
        seen.append((msg.layer, debtor))
        return protocol.RemotePartials(id=msg.id, ok=False, reason="no loan here")
    try:
        server = ChannelServer(host, serve, None)
    except zmq.ZMQError as exc:                       # a host without IPv6 loopback
        pytest.skip(f"{host}: {exc}")
    ctx = zmq.Context()
    client = ChannelClient(ctx, server.url, None)
    try:
        msg = attend()
        client.send(msg, 10.0)
        reply = client.wait(msg.id, 10.0)
        assert not reply.ok and reply.reason == "no loan here" and seen == [(0, "a")]   # insecure: named by its claim
        server.close()                                # silent from here on
        msg = attend()
        client.send(msg, 1.0)                         # queued for the peer gone
        t = time.monotonic()
        with pytest.raises(RemoteKVError, match="no result within 0.5 s"):
            client.wait(msg.id, 0.5)
        assert time.monotonic() - t < 5
    finally:
        client.close()
        server.close()
        ctx.term()
