"""Fault tolerance over real daemons (docs/cluster.md, "Failure semantics"):
every node streams its requests' KV to a ring peer; a node killed with
SIGKILL mid-stream costs its clients a pause, and the text they receive is
the uninterrupted run's, greedy and seeded. The holder killed instead, both
killed, a restarted node rejoining the ring, the ``reprefill`` policy, and a
stranger's forged replica. Blocks and replica budgets return to baseline."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import openai
import pytest

from engine.request import SamplingParams
from kvd import protocol

from .conftest import MODEL, Cluster, admin

NODES = ["n1", "n2", "n3"]
DEADLINE = 3.0
MAX_TOKENS = 500                 # long enough to outlive a kill, its detection and the recovery
NODE_FLAGS = ("--host-kv-blocks", "256", "--replication-interval", "0.05")
ON = ("--replicas", "1", "--recovery", "replica")            # not the defaults yet (docs/cluster.md)


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(n)]


def start(tmp, transport: str, extra: tuple[str, ...] = ON) -> Cluster:
    c = Cluster(tmp, transport, extra=extra)
    for name in NODES:
        c.start_node(name, *NODE_FLAGS)
    c.wait_nodes(NODES)
    return c


def references(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[str]:
    """The single-node engine's texts, all prompts in one batch (a batch
    gives each request its tokens alone: tests/engine, seeded sampling
    included)."""
    out: dict[str, list[int]] = {}
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"ref{i}", ids, p)
        out[f"ref{i}"] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [engine.tokenizer.decode(out[f"ref{i}"]) for i in range(len(prompts))]


def params_of(i: int) -> SamplingParams:
    """Even: greedy; odd: seeded sampling, temperatures 0.7 to 1.0, with top-p or top-k."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    k = i // 2
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=(0.7, 0.8, 0.9, 1.0)[k % 4],
                          top_p=0.95 if k % 2 == 0 else 1.0, top_k=40 if k % 2 else 0, seed=100 + i,
                          ignore_eos=True)


class Streams:
    """``n`` streaming completions in threads; each one's text, finish reason or error."""

    def __init__(self, c: Cluster, n: int, seed0: int = 0) -> None:
        self.client = c.client(timeout=120)
        self.prompts = [prompt(seed0 + i) for i in range(n)]
        self.results: dict[int, tuple] = {}
        self.ids: dict[int, str] = {}
        self.counts = [0] * n
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        p = params_of(i)
        text, finish = [], None
        try:
            kw = {"seed": p.seed, "top_p": p.top_p} if p.seed is not None else {}
            extra = {"ignore_eos": True, **({"top_k": p.top_k} if p.top_k else {})}
            for chunk in self.client.completions.create(model=MODEL, prompt=self.prompts[i], max_tokens=p.max_tokens,
                                                        temperature=p.temperature, stream=True,
                                                        extra_body=extra, **kw):
                self.ids[i] = chunk.id
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                    self.counts[i] += 1
            self.results[i] = ("ok", "".join(text), finish)
        except openai.APIError as exc:
            self.results[i] = ("error", "".join(text), str(exc))

    def join(self, timeout: float = 180) -> None:
        for t in self.threads:
            t.join(timeout)
        assert len(self.results) == len(self.threads), self.results


def decoding(c: Cluster, n: int, seed0: int, tokens: int = 5, timeout: float = 120) -> Streams:
    """``n`` streams started, once each has delivered ``tokens`` tokens; fails, with each
    stream's result so far, when one ends before or ``timeout`` seconds pass first."""
    s = Streams(c, n, seed0=seed0)
    deadline = time.monotonic() + timeout
    while sum(1 for k in s.counts if k >= tokens) < n:
        if s.results.keys() - {i for i, k in enumerate(s.counts) if k >= tokens} or time.monotonic() > deadline:
            raise AssertionError(f"streams did not all reach {tokens} tokens: counts {s.counts}, "
                                 f"ended {s.results}")
        time.sleep(0.02)
    return s


def requests(c: Cluster) -> dict[str, dict]:
    return admin(c.admin_socket, "requests")["requests"]


def wait_replicated(c: Cluster, node: str, tokens: int, timeout: float = 60) -> dict[str, dict]:
    """The requests on ``node``, once each has a replica of >= ``tokens`` tokens."""
    deadline = time.monotonic() + timeout
    seen: dict[str, dict] = {}
    while time.monotonic() < deadline:
        on = {rid: r for rid, r in requests(c).items() if r["node"] == node}
        if on and all(r["replicated_tokens"] >= tokens and r["replica_holder"] for r in on.values()):
            return on
        seen.update(on)
        time.sleep(0.05)
    replication = {n: admin(c.node_admin(n), "status")["replication"] for n, p in c.nodes.items() if p.alive()}
    raise AssertionError(f"replicas of {node}'s requests did not reach {tokens} tokens: last seen {seen}, "
                         f"now {requests(c)}; each node's replication: {replication}")


def busiest(c: Cluster) -> str:
    nodes = [r["node"] for r in requests(c).values()]
    return max(sorted(set(nodes)), key=nodes.count)


def wait_baseline(c: Cluster, names, timeout: float = 30.0) -> None:
    """No request-owned device blocks and no replica held, on every node."""
    deadline = time.monotonic() + timeout
    while True:
        st = {n: admin(c.node_admin(n), "status") for n in names}
        kv = {n: admin(c.node_admin(n), "cache stats")["kv"] for n in names}
        held = {n: s["replication"]["holder"]["replicas"] for n, s in st.items()}
        owned = {n: (k["device"]["request_owned"], k["host"]["request_owned"]) for n, k in kv.items()}
        if not any(held.values()) and all(o == (0, 0) for o in owned.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not back to baseline: replicas {held}, request-owned blocks {owned}")
        time.sleep(0.2)


def check_texts(streams: Streams, engine) -> None:
    """Every stream ended with its whole length and the uninterrupted run's text, greedy
    and seeded: a recovery recomputes some KV (a reprefill all of it, a replica the tail
    past its last block) as a prefill, which gives a token the bits its decode gave it
    (engine/exactness.py), so every later draw is the same. (A model the engine does not
    compute with one arithmetic, ``kernels()["same_bits"]`` not "yes", is held to it for
    its greedy streams only: a seeded draw within rounding of a boundary may move.)"""
    refs = references(engine, streams.prompts, [params_of(i) for i in range(len(streams.prompts))])
    exact = engine.kernels()["same_bits"] == "yes"
    for i, ref in enumerate(refs):
        kind, text, finish = streams.results[i]
        assert kind == "ok", (i, finish)
        assert finish == "length"
        if exact or params_of(i).greedy:
            assert text == ref, f"stream {i} ({'greedy' if params_of(i).greedy else 'seeded'}) differs"


@pytest.fixture(scope="module")
def reference_engine():
    """The plain single-node engine with the cluster's context length."""
    from engine.engine import EngineConfig, LLMEngine

    return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=512,
                                              host_kv_blocks=0, max_model_len=2048, num_threads=1,
                                              batch_invariant=True))


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    c = start(tmp_path_factory.mktemp("ring"), "zmq+tcp")
    yield c
    c.stop()


def restart_all(c: Cluster) -> None:
    for name in NODES:
        if not c.nodes[name].alive():
            c.start_node(name, *NODE_FLAGS)
    c.wait_nodes(NODES)


def test_kill9_mid_stream_resumes_on_the_replica_with_the_uninterrupted_text(ring, reference_engine):
    c = ring
    before = admin(c.admin_socket, "status")["recoveries"]
    s = decoding(c, 6, seed0=0)
    victim = busiest(c)
    on_victim = wait_replicated(c, victim, 64)
    c.nodes[victim].kill9()
    s.join()
    check_texts(s, reference_engine)
    rec = admin(c.admin_socket, "status")["recoveries"]
    assert rec.get("replica/resumed", 0) - before.get("replica/resumed", 0) == len(on_victim)
    assert not any(k.endswith("/failed") for k in rec)
    survivors = [n for n in NODES if n != victim]
    wait_baseline(c, survivors)
    restart_all(c)


def kill_the_busiest_and_resume(c: Cluster, s: Streams, engine, names: list[str], replicated: int,
                                before_kill=None) -> None:
    """Once the busiest node's requests have ``replicated`` tokens at their
    holder, ``kill -9`` it: every stream ends with the uninterrupted text,
    each of its requests resumed on a replica, and the other nodes of
    ``names`` are back to baseline."""
    before = admin(c.admin_socket, "status")["recoveries"].get("replica/resumed", 0)
    victim = busiest(c)
    on_victim = wait_replicated(c, victim, replicated)
    if before_kill is not None:
        before_kill()
    c.nodes[victim].kill9()
    s.join()
    check_texts(s, engine)
    assert admin(c.admin_socket, "status")["recoveries"].get("replica/resumed", 0) - before == len(on_victim)
    wait_baseline(c, [n for n in names if n != victim])


def streaming_with_a_replica(c: Cluster, seed0: int) -> tuple[Streams, str, str]:
    """All nodes up (whatever an earlier test left dead), 4 streams started and
    decoding; (streams, the busiest node, the holder of its replicas)."""
    restart_all(c)
    s = decoding(c, 4, seed0=seed0)
    source = busiest(c)
    return s, source, next(iter(wait_replicated(c, source, 32).values()))["replica_holder"]


def test_the_holder_killed_instead_keeps_the_requests_and_gives_a_new_peer(ring, reference_engine):
    c = ring
    s, source, holder = streaming_with_a_replica(c, seed0=20)
    c.nodes[holder].kill9()
    c.wait_gone(holder, DEADLINE + 5)
    third = next(n for n in NODES if n not in (source, holder))
    deadline = time.monotonic() + 10
    while admin(c.node_admin(source), "status")["replication"]["sender"]["peer"] != third:
        assert time.monotonic() < deadline, "the source got no new replica peer"
        time.sleep(0.1)
    s.join()
    check_texts(s, reference_engine)
    # the restarted holder rejoins the ring: someone replicates to it again
    c.start_node(holder, *NODE_FLAGS)
    c.wait_nodes(NODES)
    s2 = Streams(c, 3, seed0=40)
    deadline = time.monotonic() + 30
    while admin(c.node_admin(holder), "status")["replication"]["holder"]["received_blocks"] == 0:
        assert time.monotonic() < deadline, "the restarted node holds no replica"
        time.sleep(0.1)
    s2.join()
    check_texts(s2, reference_engine)
    wait_baseline(c, NODES)


def test_node_and_holder_killed_at_once_reprefill_elsewhere(ring, reference_engine):
    c = ring
    s, source, holder = streaming_with_a_replica(c, seed0=60)
    before = admin(c.admin_socket, "status")["recoveries"]
    c.nodes[source].kill9()
    c.nodes[holder].kill9()
    s.join()
    check_texts(s, reference_engine)
    rec = admin(c.admin_socket, "status")["recoveries"]
    assert rec.get("reprefill/resumed", 0) > before.get("reprefill/resumed", 0)
    third = next(n for n in NODES if n not in (source, holder))
    wait_baseline(c, [third])
    restart_all(c)


def test_a_forged_replica_from_another_nodes_key_is_refused(ring):
    """A node's key may only write its own replicas: ReplicaData naming
    another source is forbidden at the gate; one naming its own needs the
    coordinator's ticket for that request at that holder (the attacker's
    view: tests/cluster/test_trust_node_key.py)."""
    c = ring
    restart_all(c)

    async def forge():
        conn = await c.connect("n2", as_name="n1")
        try:
            kv = __import__("torch").zeros((2, 2, 1, 16, 2, 8))
            forged = protocol.ReplicaData(id="x", source="n3", block_size=16, request_ids=("r",), starts=(0,),
                                          counts=(1,), token_ids=tuple(range(16)), tensors=(kv,))
            reply = await protocol.call(conn, forged, timeout=10)
            assert isinstance(reply, protocol.Error) and reply.code == "forbidden", reply
            own = protocol.ReplicaData(id="y", source="n1", block_size=16, request_ids=("r",), starts=(0,),
                                       counts=(1,), token_ids=tuple(range(16)), tensors=(kv,))
            reply = await protocol.call(conn, own, timeout=10)
            assert isinstance(reply, protocol.ReplicaAck) and "ticket" in reply.refused["r"], reply
        finally:
            await conn.close()
    asyncio.run(forge())
    assert admin(c.node_admin("n2"), "status")["replication"]["holder"]["replicas"] == 0


def test_kill9_over_ucx_resumes_on_the_replica(tmp_path, reference_engine):
    c = start(tmp_path, "ucx")
    try:
        kill_the_busiest_and_resume(c, decoding(c, 2, seed0=80), reference_engine, NODES, 32)
    finally:
        c.stop()


def test_reprefill_policy_resumes_without_replicas(tmp_path, reference_engine):
    c = start(tmp_path, "zmq+tcp", extra=("--replicas", "0", "--recovery", "reprefill"))
    try:
        s = decoding(c, 2, seed0=90, tokens=20)
        victim = busiest(c)
        assert all(r["replica_holder"] == "" for r in requests(c).values())
        c.nodes[victim].kill9()
        s.join()
        check_texts(s, reference_engine)
        assert admin(c.admin_socket, "status")["recoveries"].get("reprefill/resumed", 0) >= 1
        assert all(admin(c.node_admin(n), "status")["replication"]["holder"]["received_blocks"] == 0
                   for n in NODES if n != victim)
    finally:
        c.stop()


def test_disaggregated_prompt_replica_comes_from_the_prefill_node(tmp_path, reference_engine):
    """1P2D with replicas: the prefill node writes each prompt's replica to
    the decode node's peer; the decode node adopts it and sends only the
    blocks it generates; killed mid-stream, its requests resume on that
    replica with the uninterrupted text."""
    roles = {"p1": "prefill", "d1": "decode", "d2": "decode"}
    c = Cluster(tmp_path, "zmq+tcp", extra=ON)
    for name, role in roles.items():
        c.start_node(name, "--role", role, "--prefill-threshold", "0", *NODE_FLAGS)
    c.wait_nodes(sorted(roles))
    try:
        def the_prompts_came_from_p1() -> None:
            # the decode nodes' counters are read over their admin sockets one after the other,
            # while requests may still be changing hands: poll them to a deadline
            deadline = time.monotonic() + 10
            while True:
                senders = {n: admin(c.node_admin(n), "status")["replication"]["sender"] for n in ("d1", "d2")}
                if sum(st["adopted"] for st in senders.values()) == 4 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert admin(c.node_admin("p1"), "status")["disaggregation"]["prompt_replicas"] == {"sent": 4}
            assert sum(st["adopted"] for st in senders.values()) == 4, senders
            assert all(st["adopt_fallbacks"] == 0 for st in senders.values())
        kill_the_busiest_and_resume(c, decoding(c, 4, seed0=110), reference_engine, list(roles), 64,
                                    before_kill=the_prompts_came_from_p1)
    finally:
        c.stop()
