"""A decode node killed and restarted on a new port, over real daemons: the
prefill node's link to it is keyed by its address and process, so the first
split request after the restart streams its KV to the new process (not to the
dead one's address, waiting out ``kv_transfer_timeout``) and gives the
single-node engine's text. Nothing stays counted on any node afterwards,
after a client that leaves mid-stream too."""

from __future__ import annotations

import time

from .conftest import MODEL, Cluster, admin, reference_tokens
from .test_coordinator_stall import settled
from .test_disagg import node_status, prompt, stream

KV_TRANSFER_TIMEOUT = 300.0         # a request that waited for it would time the client out first
CLIENT_TIMEOUT = 60.0


def test_a_restarted_decode_node_gets_the_kv_of_the_next_split_request(tmp_path, reference_engine):
    c = Cluster(tmp_path, "zmq+tcp", extra=("--prefill-queue-factor", "0"))
    flags = ("--prefill-threshold", "0", "--kv-transfer-timeout", str(KV_TRANSFER_TIMEOUT))
    c.start_node("p1", "--role", "prefill", *flags)
    c.start_node("d1", "--role", "decode", *flags)
    try:
        c.wait_nodes(["d1", "p1"])
        client = c.client(timeout=CLIENT_TIMEOUT)
        prompts = [prompt(i, 40) for i in range(3)]
        want = [reference_engine.tokenizer.decode(t) for t in reference_tokens(reference_engine, prompts, 12)]
        assert stream(client, prompts[0], 12)[0] == want[0]           # p1 now has a link to d1
        old = admin(c.admin_socket, "nodes")["nodes"]

        c.nodes["d1"].kill9()
        c.wait_gone("d1", 15)
        c.start_node("d1", "--role", "decode", *flags, url=c.url("d1"))   # a new process on a new port
        c.wait_nodes(["d1", "p1"])
        new = {n["name"]: n for n in admin(c.admin_socket, "nodes")["nodes"]}
        assert new["d1"]["address"] != next(n["address"] for n in old if n["name"] == "d1")

        for p, w in zip(prompts[1:], want[1:]):
            t0 = time.monotonic()
            text, finish, _ = stream(client, p, 12)
            assert (text, finish) == (w, "length")
            assert time.monotonic() - t0 < KV_TRANSFER_TIMEOUT / 5     # not a transfer timeout's wait
        decode = node_status(c, "d1")["disaggregation"]["decode"]
        assert decode["remote"] == 2 and decode["failed"] == 0      # the KV came from p1, both times

        # a client that leaves mid-stream: its legs end, nothing stays counted
        chunks = client.completions.create(model=MODEL, prompt=prompt(50, 40), max_tokens=500, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(chunks):
            if i == 3:
                break
        chunks.response.close()
        settled(c)
    finally:
        c.stop()
