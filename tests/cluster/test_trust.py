"""The attacker's view of a node's data port (issue 9, item 1).

Real daemons, real sockets, forged clients: a local process without keys
reaches nothing; a process holding a *node's* key may not send what only the
coordinator sends (admin commands, requests) nor speak for another node; and
a well-formed KVData that belongs to no allocation the node granted to that
very link is refused and leaves the prefix cache as it was: the same greedy
prompt over HTTP (the openai client) gives the same text, with no cached
prefix it did not compute itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
import torch
import zmq
import zmq.asyncio

from kvd import protocol

from .conftest import MODEL, ROOT, TINY, Cluster, admin, free_port, reference_tokens, running_cluster

pytestmark = pytest.mark.timeout(300)
NO_REPLY_S = 2.0        # how long a forged request waits for the reply that must not come


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("trust"), "zmq+tcp", ["a", "b"]) as c:
        yield c


def _tcp(url: str) -> str:
    return url.replace("zmq+tcp://", "tcp://")


async def _raw_request(endpoint: str, msg: protocol.Message, curve=None, timeout: float = NO_REPLY_S):
    """A forged request from a bare zmq socket (no kvd code on the sending
    side but the encoder): the decoded reply, or None when none came."""
    from transports.base import KIND_REQUEST, pack_envelope, unpack_envelope

    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = (curve.public_key, curve.secret_key,
                                                                   curve.server_key)
    try:
        s.connect(endpoint)
        header, frames = protocol.encode(msg)
        try:
            # the send has the deadline too: a DEALER whose handshake the server already
            # refused has no pipe left, and its send waits for a reconnect
            await asyncio.wait_for(s.send_multipart([pack_envelope(KIND_REQUEST, 7), header, *frames]), timeout)
            parts = await asyncio.wait_for(s.recv_multipart(), timeout)
        except TimeoutError:
            return None
        assert unpack_envelope(parts[0])[1] == 7
        return protocol.decode(parts[1], parts[2:])
    finally:
        s.close(0)
        ctx.term()


def _alive_and_serving(c: Cluster, node: str) -> dict:
    status = admin(c.node_admin(node), "status")
    assert c.nodes[node].alive() and status["registered"] and not status["draining"], status
    return status


def test_a_process_without_an_authorized_key_gets_nothing_through(pair):
    from transports.keys import CurveClient, generate_keypair, load_keypair

    stranger_dir = pair.tmp / "stranger"
    generate_keypair(stranger_dir, "stranger")
    unknown = CurveClient(*load_keypair(stranger_dir / "stranger.key_secret"),
                          server_key=load_keypair(pair.keys_dir / "a.key")[0])
    before = admin(pair.node_admin("a"), "status")
    for curve in (None, unknown):                       # no CURVE at all; a key nobody authorized
        for msg in (protocol.AdminCommand(command="fail", args={"mode": "exit"}),
                    protocol.AdminCommand(command="drain")):
            assert asyncio.run(_raw_request(_tcp(pair.node_urls["a"]), msg, curve)) is None
    status = _alive_and_serving(pair, "a")
    assert status["refused_peers"] > before["refused_peers"]     # the unknown key, turned away
    assert status["bad_messages"] == before["bad_messages"]      # nothing was even decoded


def test_a_node_key_may_not_send_what_only_the_coordinator_sends(pair):
    b_to_a = pair.client_keys("a", as_name="b")                 # node b's own, valid key
    endpoint = _tcp(pair.node_urls["a"])
    before = admin(pair.node_admin("a"), "status")["bad_messages"].get("forbidden", 0)
    forged = [protocol.AdminCommand(command="fail", args={"mode": "exit"}),
              protocol.AdminCommand(command="drain"),
              protocol.AdminCommand(command="cache flush"),
              protocol.GenerateRequest(request_id="forged-1", prompt_token_ids=(1, 2, 3),
                                       sampling={"max_tokens": 4}),
              protocol.Abort(request_id="anything")]
    for msg in forged:
        reply = asyncio.run(_raw_request(endpoint, msg, b_to_a, timeout=10))
        assert isinstance(reply, protocol.Error) and reply.code == "forbidden", (msg, reply)
        assert "coordinator" in reply.message
    status = _alive_and_serving(pair, "a")
    assert status["bad_messages"]["forbidden"] == before + len(forged)
    assert status["in_flight"] == 0                               # the forged request never ran
    # the same key may not speak for another node at the coordinator either
    b_to_coordinator = pair.client_keys("coordinator", as_name="b")
    for msg in (protocol.Goodbye(node="a", reason="forged"),
                protocol.Hello(node="a", address="zmq+tcp://127.0.0.1:9", blocks_per_tier={"device": 1},
                               block_size=16, model_name=MODEL),
                protocol.Heartbeat(node="a", seq=1, load=0.0, running=0, waiting=0, free_blocks={})):
        reply = asyncio.run(_raw_request(_tcp(pair.coordinator_url), msg, b_to_coordinator, timeout=10))
        assert isinstance(reply, protocol.Error) and reply.code == "forbidden", (msg, reply)
    time.sleep(1.0)
    assert pair.nodes_up() == ["a", "b"]
    assert admin(pair.admin_socket, "status")["bad_messages"]["forbidden"] >= 3


def _kv_frame(num_layers: int, blocks: int) -> protocol.RawTensor:
    """A well-formed KV payload for the cluster's tiny model (random values)."""
    from engine.model.config import tiny_config

    cfg = tiny_config()
    t = torch.randn(num_layers, 2, blocks, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32) * 50
    return protocol.RawTensor.from_torch(t)


def test_forged_kv_data_is_refused_and_the_cache_stays_clean(pair, reference_engine):
    """The poisoning of issue 9: KV forged for the first 32 tokens of a prompt
    must not become that prompt's cached prefix on any node."""
    from engine.model.config import tiny_config

    layers = tiny_config().num_layers
    rng = random.Random(99)
    ids = [rng.randrange(1, 40000) for _ in range(40)]
    ref = reference_engine.tokenizer.decode(reference_tokens(reference_engine, [ids], 12)[0])
    client = pair.client(timeout=60)

    def greedy():
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.prompt_tokens_details

    forged_frame = _kv_frame(layers, 2)
    for node, key_name in (("a", "b"), ("b", "a")):            # each node, by the other's valid key
        curve = pair.client_keys(node, as_name=key_name)
        endpoint = _tcp(pair.node_urls[node])
        before = admin(pair.node_admin(node), "status")["transfers"]
        # 1. the old one-shot shape: KV plus the token ids it claims to be, no grant asked
        header, frames = protocol.encode(protocol.KVData(
            transfer_id="poison-1", layer_start=0, layer_end=layers, last=True, tensors=(forged_frame,)))
        body = orjson.loads(header)
        body["token_ids"] = ids[:32]
        reply = asyncio.run(_raw_bytes(endpoint, orjson.dumps(body), frames, curve))
        assert isinstance(reply, protocol.Error), reply
        # 2. a well-formed KVData into blocks this node never granted
        reply = asyncio.run(_raw_request(endpoint, protocol.KVData(
            transfer_id="poison-2", block_ids=(0, 1), layer_start=0, layer_end=layers, last=True,
            tensors=(forged_frame,)), curve, timeout=10))
        assert isinstance(reply, protocol.Error) and reply.code == "no_grant", reply
        # 3. a grant that exists, but was made to another link: refused, the grant untouched
        assert asyncio.run(_hijack(pair, node, key_name, ids[:32], layers, forged_frame))
        after = admin(pair.node_admin(node), "status")["transfers"]
        assert after["received"] == before["received"]                  # nothing was inserted
        assert after["refused"] == before["refused"] + 2
    text, details = greedy()
    assert text == ref
    cached = getattr(details, "cached_tokens", 0) if details else 0
    assert not cached                       # no prefix of this prompt was ever computed: none cached
    assert greedy()[0] == ref


async def _raw_bytes(endpoint: str, header: bytes, frames, curve):
    from transports.base import KIND_REQUEST, pack_envelope

    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve.public_key, curve.secret_key, curve.server_key
    try:
        s.connect(endpoint)
        await asyncio.wait_for(s.send_multipart([pack_envelope(KIND_REQUEST, 3), header, *frames]), 10)
        parts = await asyncio.wait_for(s.recv_multipart(), 10)
        return protocol.decode(parts[1], parts[2:])
    finally:
        s.close(0)
        ctx.term()


async def _hijack(c: Cluster, node: str, key_name: str, tokens: list[int], layers: int, frame) -> bool:
    """Link X asks ``node`` for a grant; link Y (same key, another connection)
    sends KV for it. Y is refused; X's grant is still there (its own KVData
    would then be taken: here X lets it expire instead)."""
    x = await c.connect(node, as_name=key_name)
    y = await c.connect(node, as_name=key_name)
    try:
        grant = await protocol.call(x, protocol.KVTransferRequest(
            transfer_id="grant-x", src_node=key_name, dst_node=node, token_ids=tuple(tokens),
            num_blocks=2, num_layers=layers, dtype="float32", deadline=time.time() + 3))
        assert isinstance(grant, protocol.KVAllocReply) and grant.ok, grant
        stolen = await protocol.call(y, protocol.KVData(
            transfer_id="grant-x", block_ids=grant.block_ids, layer_start=0, layer_end=layers, last=True,
            tensors=(frame,)), timeout=10)
        assert isinstance(stolen, protocol.Error) and stolen.code == "no_grant", stolen
        # a KVTransferRequest claiming to come from another node is refused outright
        spoofed = await protocol.call(y, protocol.KVTransferRequest(
            transfer_id="grant-z", src_node="somebody-else", dst_node=node, token_ids=tuple(tokens),
            num_blocks=2, num_layers=layers, dtype="float32"), timeout=10)
        assert isinstance(spoofed, protocol.Error) and spoofed.code == "forbidden", spoofed
        return True
    finally:
        await x.close()
        await y.close()


def test_kvd_serve_nodes_authenticates_its_cluster_by_default(tmp_path):
    """`kvd serve --nodes 2` with no keys configured: a local process that
    reaches a node's port (shown by `kvctl nodes`) cannot drain or kill it;
    the generated keys are private and gone after the cluster stops."""
    port = free_port()
    sock = tmp_path / "admin.sock"
    conf = tmp_path / "kvd.toml"
    conf.write_text(f'[cluster]\nadmin_socket = "{sock}"\n')
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "-c", str(conf), "--nodes", "2",
                             "--port", str(port), *TINY], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "kvd serve --nodes 2 did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        nodes = admin(sock, "nodes")["nodes"]
        assert len(nodes) == 2
        for node in nodes:
            assert node["address"].startswith("zmq+tcp://127.0.0.1:")
            for msg in (protocol.AdminCommand(command="drain"),
                        protocol.AdminCommand(command="fail", args={"mode": "exit"})):
                assert asyncio.run(_raw_request(_tcp(node["address"]), msg)) is None
        time.sleep(0.5)
        nodes = admin(sock, "nodes")["nodes"]
        assert len(nodes) == 2 and not any(n["draining"] for n in nodes), nodes
        client = openai_client(port)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
        # the keys: in the cluster's private runtime directory, the secrets owner-only
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        cmdline = Path(f"/proc/{children[0]}/cmdline").read_bytes().split(b"\0")
        keys = Path(cmdline[cmdline.index(b"--curve-keys-dir") + 1].decode())
        assert stat.S_IMODE(keys.parent.stat().st_mode) == 0o700
        assert sorted(p.name for p in keys.glob("*.key")) == ["coordinator.key", "n1.key", "n2.key"]
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys.glob("*.key_secret"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not keys.exists()                         # no secret outlives the cluster
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def openai_client(port: int):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)


def test_the_coordinator_refuses_to_run_open_without_keys(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "coordinator", "--model", MODEL,
                        "--listen", f"zmq+tcp://127.0.0.1:{free_port()}", "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "refusing to listen" in r.stderr, r.stderr
    assert json.dumps(r.stderr).count("\\n") == 1          # one line
