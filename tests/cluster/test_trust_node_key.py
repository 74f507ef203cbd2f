"""What a node's own key can do beyond its role, tried over the real
ZeroMQ sockets of a running 3-node ring (docs/operations.md, "Trust
model"). The attacker holds one node's valid key -- its own, or a stolen
one -- and sends well-formed messages:

- a replica of another node's running request, with a victim prompt's
  tokens and forged KV, to a holder that is not its peer (and to its own
  peer for a request it does not run): refused for want of the
  coordinator's ticket; nothing reaches any prefix cache, and the victim
  prompt's greedy text over HTTP is the reference's;
- KV grants: one larger than its share of a node's blocks, and grants
  with a deadline 10^6 s away that are never filled: refused past the
  share, the others freed at the node's own ``kv_transfer_timeout``;
- with a node's stolen key: a Hello with a new incarnation from the
  attacker's address does not take the registration over (no user prompt
  reaches the attacker); heartbeats of another incarnation or with a far
  ahead ``seq`` are refused and the node's reported state keeps moving;
- and the node itself, restarted on a new port, registers again once its
  old process is declared dead.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from kvd import links, protocol
from kvd.cluster_config import ClusterConfig

from .conftest import MODEL, Cluster, admin, reference_tokens

pytestmark = pytest.mark.timeout(600)
NODES = ["n1", "n2", "n3"]                        # the replication ring: n1 -> n2 -> n3 -> n1
TRANSFER_TIMEOUT = 3.0                            # the nodes' own bound on a grant's life
GRANT_CAP = int(0.25 * 512)                       # kv_grant_share (default) of --kv-blocks 512


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("nodekey"), "zmq+tcp", extra=("--replicas", "1", "--recovery", "replica"))
    for name in NODES:
        c.start_node(name, "--kv-transfer-timeout", str(TRANSFER_TIMEOUT), "--replication-interval", "0.05")
    try:
        c.wait_nodes(NODES)
        yield c
    finally:
        c.stop()


def next_in_ring(name: str) -> str:
    return NODES[(NODES.index(name) + 1) % len(NODES)]


def nodes(c: Cluster) -> dict[str, dict]:
    return {n["name"]: n for n in admin(c.admin_socket, "nodes")["nodes"]}


def victim_prompt() -> list[int]:
    rng = random.Random(4646)
    return [rng.randrange(1, 40000) for _ in range(40)]


def forged_kv(blocks: int) -> torch.Tensor:
    from engine.model.config import tiny_config

    cfg = tiny_config()
    return torch.randn(cfg.num_layers, 2, blocks, 16, cfg.num_kv_heads, cfg.head_dim) * 50


async def call_as(c: Cluster, server: str, key: str, msg: protocol.Message) -> protocol.Message:
    """``msg`` to daemon ``server`` (a node name or "coordinator") under ``key``'s name; its reply."""
    conn = await c.connect(server, as_name=key)
    try:
        return await protocol.call(conn, msg, timeout=10)
    finally:
        await conn.close()


class LongStream:
    """One greedy streaming completion in a thread, until ``stop``."""

    def __init__(self, c: Cluster, seed: int) -> None:
        self.client = c.client(timeout=120)
        self.rid = ""
        self.tokens = 0
        self._stop = threading.Event()
        rng = random.Random(seed)
        self.prompt = [rng.randrange(1, 40000) for _ in range(40)]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        stream = self.client.completions.create(model=MODEL, prompt=self.prompt, max_tokens=1900, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        with stream:
            for chunk in stream:
                self.rid = chunk.id
                self.tokens += 1
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(60)


def test_a_replica_without_the_coordinators_ticket_never_reaches_a_cache(ring, reference_engine):
    c = ring
    ids = victim_prompt()
    ref = reference_engine.tokenizer.decode(reference_tokens(reference_engine, [ids], 12)[0])
    deadline = time.monotonic() + 60
    for seed in range(1, 100):
        # a stream whose own replica reaches its holder (the coordinator's tickets work) while it
        # still runs; on a fast host one may end first: then another
        stream = LongStream(c, seed=seed)
        while not (stream.rid and stream.rid in admin(c.admin_socket, "requests")["requests"]):
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.05)
        serving = admin(c.admin_socket, "requests")["requests"][stream.rid]["node"]
        holder = next_in_ring(serving)                      # the request's real replica holder
        attacker = next(n for n in NODES if n not in (serving, holder))   # its peer is `serving`, not `holder`
        while (now := admin(c.admin_socket, "requests")["requests"].get(stream.rid)) is not None \
                and now["replica_holder"] != holder:
            assert time.monotonic() < deadline, admin(c.admin_socket, "requests")
            time.sleep(0.05)
        if now is not None:
            break
        stream.stop()
    try:
        before = {n: admin(c.node_admin(n), "status")["replication"]["holder"] for n in NODES}
        kv_before = {n: admin(c.node_admin(n), "cache stats")["kv"]["host"] for n in NODES}

        def replica(rid: str, **kw) -> protocol.ReplicaData:
            return protocol.ReplicaData(id=f"forged-{rid}", source=attacker, block_size=16, request_ids=(rid,),
                                        starts=(0,), counts=(2,), token_ids=tuple(ids[:32]),
                                        tensors=(forged_kv(2),), **kw)
        forged = [
            (holder, replica(stream.rid)),                                   # the issue's: no ticket at all
            (holder, replica(stream.rid, owner=serving,                      # "a prefill leg", a made-up ticket
                             tickets={stream.rid: "ab" * 16})),
            (serving, replica("victim-request")),                            # its real peer, a request it lacks
        ]
        for target, msg in forged:
            ack = asyncio.run(call_as(c, target, attacker, msg))
            rid = msg.request_ids[0]
            assert isinstance(ack, protocol.ReplicaAck), ack
            assert not ack.held and "ticket" in ack.refused[rid], ack
        after = {n: admin(c.node_admin(n), "status")["replication"]["holder"] for n in NODES}
        assert after[holder]["no_ticket"] == before[holder]["no_ticket"] + 2
        assert after[serving]["no_ticket"] == before[serving]["no_ticket"] + 1
        for n in NODES:                                   # no replica of the attacker's is held anywhere
            assert admin(c.node_admin(n), "cache stats")["kv"]["host"]["cached"] == kv_before[n]["cached"]
    finally:
        stream.stop()
    client = c.client(timeout=60)
    for _ in range(6):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref


def test_a_peer_gets_a_bounded_share_of_a_nodes_blocks_for_a_bounded_time(ring, reference_engine):
    c = ring
    target, attacker = "n2", "n1"
    layers = len(forged_kv(1))

    def free() -> int:
        return admin(c.node_admin(target), "cache stats")["kv"]["device"]["free"]

    def grant(tid: str, blocks: int) -> protocol.Message:
        return asyncio.run(call_as(c, target, attacker, protocol.KVTransferRequest(
            transfer_id=tid, src_node=attacker, dst_node=target, token_ids=tuple(range(1, 1 + 16 * blocks)),
            num_blocks=blocks, num_layers=layers, dtype="float32", deadline=time.time() + 1e6)))

    base = free()
    hog = grant("hog-2040", 500)                          # the issue's, scaled to this node's 512 blocks
    assert isinstance(hog, protocol.KVAllocReply) and not hog.ok and "kv_grant_share" in hog.reason, hog
    assert free() == base
    first = grant("hold-1", GRANT_CAP - 28)               # within the share: granted ...
    assert isinstance(first, protocol.KVAllocReply) and first.ok, first
    assert free() == base - (GRANT_CAP - 28)
    second = grant("hold-2", 100)                         # ... but not a second one past it
    assert isinstance(second, protocol.KVAllocReply) and not second.ok and "kv_grant_share" in second.reason
    # never filled: freed at the node's kv_transfer_timeout, not at the sender's deadline
    t0 = time.monotonic()
    while free() != base:
        assert time.monotonic() - t0 < TRANSFER_TIMEOUT + 5, (free(), base)
        time.sleep(0.2)
    transfers = admin(c.node_admin(target), "status")["transfers"]
    assert transfers["peer_refused"] == 2 and transfers["failed"] >= 1
    ids = victim_prompt()[:20]
    ref = reference_engine.tokenizer.decode(reference_tokens(reference_engine, [ids], 6)[0])
    for _ in range(3):
        r = c.client(timeout=60).completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                                    extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref


def test_a_stolen_node_key_cannot_take_over_its_registration_nor_freeze_its_state(ring):
    c = ring
    victim = "n3"
    real = nodes(c)[victim]

    async def attack() -> list[str]:
        attacker_url = c.url("attacker")
        cfg = ClusterConfig(curve_keys_dir=str(c.keys_dir))
        listener = await links.listen(attacker_url, cfg, victim)       # the attacker serves as n3
        seen: list[str] = []

        async def record() -> None:
            while True:
                incoming = await listener.recv()
                seen.append(protocol.decode(incoming.header, incoming.frames).TYPE)
        recording = asyncio.create_task(record())
        try:
            reply = await call_as(c, "coordinator", victim, protocol.Hello(
                node=victim, address=listener.url, incarnation="attacker", blocks_per_tier={"device": 512},
                block_size=16, max_model_len=2048))
            assert isinstance(reply, protocol.Welcome) and not reply.accepted, reply
            assert "registered at" in reply.reason and reply.replica_key == ""
            client = c.client(timeout=30)
            for i in range(6):                        # user prompts: none goes to the attacker
                r = await asyncio.to_thread(client.completions.create, model=MODEL, prompt=f"user prompt {i}",
                                            max_tokens=3)
                assert r.usage.completion_tokens == 3
            await asyncio.sleep(1.0)
            return seen
        finally:
            recording.cancel()
            await listener.close()
    assert asyncio.run(attack()) == []
    now = nodes(c)[victim]
    assert (now["address"], now["incarnation"]) == (real["address"], real["incarnation"])

    def heartbeat(**kw) -> protocol.Message:
        fields = dict(node=victim, incarnation=real["incarnation"], seq=2, load=0.9, running=123, waiting=7,
                      free_blocks={"device": 1}) | kw
        return asyncio.run(call_as(c, "coordinator", victim, protocol.Heartbeat(**fields)))
    for forged in (heartbeat(incarnation="attacker"), heartbeat(seq=10 ** 15)):
        assert isinstance(forged, protocol.Welcome) and not forged.accepted, forged
    time.sleep(1.0)
    assert nodes(c)[victim]["running"] == 0
    # the node's own beats still move its state: a drain on its own socket reaches the coordinator
    for draining in (True, False):
        admin(c.node_admin(victim), "drain" if draining else "undrain")
        deadline = time.monotonic() + 5
        while nodes(c)[victim]["draining"] != draining:
            assert time.monotonic() < deadline, nodes(c)[victim]
            time.sleep(0.1)
    assert admin(c.admin_socket, "status")["bad_messages"]["refused_hello"] >= 1


def test_a_node_restarted_on_a_new_port_registers_once_the_old_process_is_dead(ring):
    c = ring
    victim = "n3"
    old = nodes(c)[victim]
    c.nodes[victim].kill9()
    new_url = c.url(victim)
    c.start_node(victim, "--kv-transfer-timeout", str(TRANSFER_TIMEOUT), "--replication-interval", "0.05",
                 url=new_url)
    deadline = time.monotonic() + 120
    while (now := nodes(c).get(victim)) is None or now["address"] == old["address"]:
        assert time.monotonic() < deadline, nodes(c)
        assert c.nodes[victim].alive(), c.nodes[victim].log_text()[-2000:]
        time.sleep(0.2)
    assert now["incarnation"] != old["incarnation"] and now["address"] == new_url
    r = c.client(timeout=60).completions.create(model=MODEL, prompt="back", max_tokens=3)
    assert r.usage.completion_tokens == 3
