"""Instance pairs over real daemons (docs/cluster.md, "Pairs and roles"): two
paired nodes hold each other's requests as redundant copies, a running decode
moves to the partner (a handoff) with the stream going on token-exactly, a
prompt runs with no decode held for it in its steps,
greedy and seeded, and a role switch mid-stream hands a node's decodes over
without losing or duplicating a token. Bad switches change nothing; a copy
written by a node that is not the partner is refused and counted."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvd import protocol

from .conftest import MODEL, SEEDED, Cluster, admin, body_of, reference_tokens
from .pair_pacing import Throttle, pace, tokens_per_second
from .test_recovery import wait_baseline

NODES = ["n1", "n2"]
FLAGS = ("--host-kv-blocks", "256", "--replication-interval", "0.05", "--replication-rate", "512")
MAX_TOKENS = 240
LONG = 400                        # prompt + LONG within the reference engine's context (512)
SPAN_S = 8.0                      # a paced stream of LONG tokens lasts at least this long


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("pair"), "zmq+tcp", extra=("--recovery", "replica"))
    c.make_key("n3")                  # a stranger's key: a node of this cluster that is not n2's partner
    c.start_node("n1", *FLAGS, "--pair", "n2")
    c.start_node("n2", *FLAGS, "--pair", "n1")
    try:
        c.wait_nodes(NODES)
        yield c
    finally:
        c.stop()


def nodes(c: Cluster) -> dict[str, dict]:
    return {n["name"]: n for n in admin(c.admin_socket, "nodes")["nodes"]}


def in_flight(c: Cluster) -> dict[str, dict]:
    return admin(c.admin_socket, "requests")["requests"]


class Stream(threading.Thread):
    """One streaming completion; its tokens' text, finish reason or error."""

    def __init__(self, c: Cluster, prompt: list[int], sampling: dict | None, max_tokens: int = MAX_TOKENS) -> None:
        super().__init__(daemon=True)
        self.client, self.prompt, self.sampling = c.client(timeout=120), prompt, sampling
        self.max_tokens = max_tokens
        self.text: list[str] = []
        self.finish = self.error = None
        self.start()

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(model=MODEL, prompt=self.prompt, max_tokens=self.max_tokens,
                                                        stream=True, **body_of(self.sampling)):
                if chunk.choices:
                    self.text.append(chunk.choices[0].text)
                    self.finish = chunk.choices[0].finish_reason or self.finish
        except Exception as exc:  # noqa: BLE001 -- reported by the test
            self.error = repr(exc)


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 1 for i in range(40)]


def expected(engine, prompts, samplings, max_tokens: int = MAX_TOKENS) -> list[str]:
    toks = reference_tokens(engine, prompts, max_tokens, list(samplings))
    return [engine.tokenizer.decode(t) for t in toks]


def until(what, timeout: float = 60.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(every)
    raise AssertionError("timed out")


def test_pair_is_announced_and_replicates_to_the_partner(pair):
    shown = nodes(pair)
    assert shown["n1"]["pair"] == "n2" and shown["n2"]["pair"] == "n1"
    assert shown["n1"]["pair_alive"] and shown["n1"]["role"] == "mixed"
    for name, partner in (("n1", "n2"), ("n2", "n1")):
        until(lambda: admin(pair.node_admin(name), "status")["replication"]["sender"].get("peer") == partner, 10)


def test_bad_role_switches_change_nothing(pair):
    before = nodes(pair)
    for args, why in (({"node": "n9", "role": "decode"}, "unknown node"),
                      ({"node": "n1", "role": "leader"}, "role must be one of"),
                      ({"node": "n1", "role": "decode"}, None),          # fine: n2 still takes prompts
                      ({"node": "n2", "role": "decode"}, "no node that takes prompts"),
                      ({"node": "n1", "role": "prefill"}, None),
                      ({"node": "n2", "role": "prefill"}, "no node that decodes")):
        reply = admin(pair.admin_socket, "set-role", **args)
        assert (why is None) == reply["ok"] and (why is None or why in reply["error"]), (args, reply)
    shown = nodes(pair)
    assert (shown["n1"]["role"], shown["n2"]["role"]) == ("prefill", "mixed")
    assert admin(pair.node_admin("n1"), "status")["role"] == "prefill"
    assert admin(pair.admin_socket, "set-role", node="n1", role="mixed")["ok"]
    assert nodes(pair)["n1"]["role_switches"] == before["n1"]["role_switches"] + 3
    reply = admin(pair.admin_socket, "handoff", request="no-such-request")
    assert not reply["ok"] and "not in flight" in reply["error"]


def test_a_routing_switch_keeps_prompts_going_to_pairs(pair):
    before = admin(pair.admin_socket, "routing")
    assert before["pairs"] == ["n1+n2"]
    try:
        for policy in ("session", "least-load"):
            reply = admin(pair.admin_socket, "routing", policy=policy)
            assert (reply["policy"], reply["pairs"]) == (policy, ["n1+n2"]), reply
    finally:
        assert admin(pair.admin_socket, "routing", policy=before["policy"])["pairs"] == ["n1+n2"]


@pytest.mark.parametrize("sampling", [None, SEEDED[0]], ids=["greedy", "seeded"])
def test_handoffs_every_few_tokens_keep_the_stream_exact(pair, reference_engine, sampling):
    ids = prompt(1 if sampling is None else 2)
    want = expected(reference_engine, [ids], [sampling or {"temperature": 0.0}], LONG)[0]
    before = sum(n["handoffs"] for n in nodes(pair).values())
    kept, exact = (sum(admin(pair.node_admin(n), "status")["replication"]["holder"][k] for n in NODES)
                   for k in ("kept", "resumed_exact"))
    made = sum(admin(pair.node_admin(n), "status")["generation_tokens"] for n in NODES)
    s = Stream(pair, ids, sampling, LONG)
    rid = until(lambda: next(iter(in_flight(pair)), None))
    moved, last, refused = 0, 0, []
    while s.is_alive():
        got = len(s.text)
        if got >= last + 2:                       # every few tokens, once its copy is complete
            reply = admin(pair.admin_socket, "handoff", request=rid)
            if reply["ok"]:
                moved, last = moved + 1, got
            else:
                assert any(w in reply["error"] for w in ("incomplete", "not in flight", "being moved", "still stopping", "not decoding")), reply
                refused.append(reply["error"])
        time.sleep(0.01)
    s.join()
    assert s.error is None and s.finish == "length", (s.error, s.finish)
    assert "".join(s.text) == want
    # how many moves a stream makes depends on the host: the engine runs ahead of the client, and
    # a source that already computed every token keeps nothing (its new owner's copy is then
    # rebuilt, and the request does not move back meanwhile); bench_handoff measures the moves
    holders = [admin(pair.node_admin(n), "status")["replication"]["holder"] for n in NODES]
    assert moved >= 1, (moved, len(s.text), refused)
    assert sum(n["handoffs"] for n in nodes(pair).values()) == before + moved
    assert 0 <= sum(h["kept"] for h in holders) - kept <= moved, holders
    assert 0 <= sum(h["resumed_exact"] for h in holders) - exact <= moved, holders
    # each move held the request at its source first: no token was computed there and again at its partner
    assert sum(admin(pair.node_admin(n), "status")["generation_tokens"] for n in NODES) - made == LONG
    wait_baseline(pair, NODES)        # every source freed its slot and blocks, every copy was dropped


def test_role_switch_mid_stream_hands_decodes_over(pair, reference_engine):
    prompts, samplings = [prompt(10 + i) for i in range(4)], [{"temperature": 0.0}, SEEDED[1]] * 2
    want = expected(reference_engine, prompts, samplings)
    made = sum(admin(pair.node_admin(n), "status")["generation_tokens"] for n in NODES)
    streams = [Stream(pair, p, s) for p, s in zip(prompts, samplings)]
    until(lambda: len(fl := in_flight(pair)) == 4 and all(r["tokens"] >= 2 for r in fl.values())
          and {r["node"] for r in fl.values()} == {"n1", "n2"})
    on_n1 = [rid for rid, r in in_flight(pair).items() if r["node"] == "n1"]
    full = len(prompts[0]) // 16 * 16
    until(lambda: all(admin(pair.node_admin("n2"), "replica held", source="n1", request=rid)["tokens"] >= full
                      for rid in on_n1))
    reply = admin(pair.admin_socket, "set-role", node="n1", role="prefill")
    # the switch took effect at n1's next step boundary: its reply came once n1 held every decode there
    # (tests/kvd/test_switch_hold.py: no step decodes them after it)
    assert reply["ok"] and reply["held"] == len(on_n1) >= 1, reply
    # n1's decodes move to n2 once their copies are complete; new requests go to n2 too
    until(lambda: all(r["node"] == "n2" for r in in_flight(pair).values()) or not any(s.is_alive() for s in streams))
    routed = nodes(pair)["n1"]["routed"]
    late = Stream(pair, prompt(20), None)
    for s in [*streams, late]:
        s.join(120)
    for s, w in zip(streams, want):
        assert s.error is None and s.finish == "length" and "".join(s.text) == w
    assert late.error is None and "".join(late.text) == expected(reference_engine, [prompt(20)], [{"temperature": 0.0}])[0]
    shown = nodes(pair)
    assert shown["n1"]["role"] == "prefill" and shown["n1"]["handoffs"] >= 1
    assert shown["n1"]["routed"] == routed            # the late request went to n2
    wait_baseline(pair, NODES)
    # every token computed once: a decode handed off was held at its source, then resumed after its last token
    assert sum(admin(pair.node_admin(n), "status")["generation_tokens"] for n in NODES) - made == 5 * MAX_TOKENS
    assert admin(pair.admin_socket, "set-role", node="n1", role="mixed")["ok"]
    metrics = pair.metrics()
    assert metrics['kvd_node_handoffs_total{node="n1"}'] >= 1
    assert metrics['kvd_node_role{node="n1",pair="n2",role="mixed"}'] == 1


def test_the_pair_scheduler_rebalances_decodes(pair, reference_engine):
    """Four decodes on n1 (n2 prefilling: it takes none), then n2 decodes
    again: the scheduler hands two of them over; every text stays exact."""
    prompts, samplings = [prompt(30 + i) for i in range(4)], [{"temperature": 0.0}, SEEDED[2]] * 2
    want = expected(reference_engine, prompts, samplings, LONG)
    assert admin(pair.admin_socket, "set-role", node="n2", role="prefill")["ok"]
    before = nodes(pair)["n1"]["handoffs"]
    streams = [Stream(pair, p, s, LONG) for p, s in zip(prompts, samplings)]
    until(lambda: sum(r["node"] == "n1" and r["tokens"] >= 2 for r in in_flight(pair).values()) == 4)
    assert admin(pair.admin_socket, "set-role", node="n2", role="mixed")["ok"]
    until(lambda: nodes(pair)["n1"]["handoffs"] >= before + 2 or not any(s.is_alive() for s in streams))
    for s in streams:
        s.join(120)
    for s, w in zip(streams, want):
        assert s.error is None and s.finish == "length" and "".join(s.text) == w
    assert nodes(pair)["n1"]["handoffs"] >= before + 2


def test_a_prompt_runs_alone_on_its_node_and_the_decodes_there_move(pair, reference_engine):
    """A stream decoding on each node, then a prompt: before its first
    chunk its node holds the stream there (its copy at the partner is
    complete) and the coordinator hands it over; no step ran a held decode
    with the prompt's chunks; every text is exact and every token was
    computed once."""
    prompts = [prompt(50), prompt(51), [(i * 7717) % 40000 + 1 for i in range(300)]]
    samplings, lengths = [{"temperature": 0.0}, SEEDED[1], SEEDED[2]], [LONG, LONG, 120]
    want = [expected(reference_engine, [p], [s], n)[0] for p, s, n in zip(prompts, samplings, lengths)]
    made = sum(admin(pair.node_admin(n), "status")["generation_tokens"] for n in NODES)

    def counts() -> tuple[int, int]:
        senders = [admin(pair.node_admin(n), "status")["replication"]["sender"] for n in NODES]
        return sum(s["prompt_holds"] for s in senders), sum(s["mixed_held"] for s in senders)
    before = counts()
    streams = []
    for p, s, n in zip(prompts, samplings, lengths):
        # the rule holds for a partner that computes no prompt, as its last replica ack says
        until(lambda: not any(admin(pair.node_admin(n), "status")["replication"]["sender"]["partner_prompting"]
                              for n in NODES), every=0.002)
        streams.append(Stream(pair, p, s, n))
        until(lambda: len(in_flight(pair)) == len(streams) and all(v["tokens"] >= 1 for v in in_flight(pair).values()),
              every=0.002)
    for s in streams:
        s.join(120)
    for s, w in zip(streams, want):
        assert s.error is None and s.finish == "length" and "".join(s.text) == w
    after = counts()
    # the third prompt's node held the decode it ran (the rule), and no step ran a held decode with a chunk
    assert after[0] >= before[0] + 1 and after[1] == before[1], (before, after)
    wait_baseline(pair, NODES)
    assert sum(admin(pair.node_admin(n), "status")["generation_tokens"] for n in NODES) - made == sum(lengths)


def test_a_copy_from_a_node_that_is_not_the_partner_is_refused_and_counted(pair):
    """A well-formed ReplicaData from n3's key (a node of the cluster, not n2's
    partner) passes the gate's identity check and is refused by the pair's."""
    before = admin(pair.node_admin("n2"), "status")["replication"]["holder"]

    async def forge():
        conn = await pair.connect("n2", as_name="n3")
        try:
            kv = __import__("torch").zeros((2, 2, 1, 16, 2, 8))
            forged = protocol.ReplicaData(id="x", source="n3", block_size=16, request_ids=("r",), starts=(0,),
                                          counts=(1,), token_ids=tuple(range(16)), tensors=(kv,),
                                          tickets={"r": "00" * 16})
            return await protocol.call(conn, forged, timeout=10)
        finally:
            await conn.close()
    reply = asyncio.run(forge())
    assert isinstance(reply, protocol.ReplicaAck) and "partner n1" in reply.refused["r"], reply
    after = admin(pair.node_admin("n2"), "status")["replication"]["holder"]
    assert after["not_partner"] == before["not_partner"] + 1


def test_a_member_killed_mid_stream_resumes_on_its_partner_exactly(pair, reference_engine):
    """Last here (it leaves n1 dead): kill -9 of a member mid-stream; its
    requests resume on the partner from their copies, token-exactly; the
    survivor may not switch to prefill while its partner is dead."""
    prompts, samplings = [prompt(40 + i) for i in range(2)], [{"temperature": 0.0}, SEEDED[0]]
    want = expected(reference_engine, prompts, samplings, LONG)
    before = admin(pair.admin_socket, "status")["recoveries"].get("replica/resumed", 0)
    # paced: an unthrottled stream of LONG tokens can end before a copy of 32 is seen on a fast host
    share = pace(tokens_per_second(pair), LONG, SPAN_S)
    survivor, victim = Throttle([pair.nodes["n2"]], share), Throttle([pair.nodes["n1"]], share)
    try:
        streams = []
        for p, s in zip(prompts, samplings):
            streams.append(Stream(pair, p, s, LONG))
            until(lambda: len(in_flight(pair)) == len(streams))
        until(lambda: {r["node"] for r in in_flight(pair).values() if r["replicated_tokens"] >= 32} == {"n1", "n2"})
        victim.stop()
        pair.nodes["n1"].kill9()
    finally:
        victim.stop()
        survivor.stop()
    for s in streams:
        s.join(120)
    for s, w in zip(streams, want):
        assert s.error is None and s.finish == "length" and "".join(s.text) == w
    assert admin(pair.admin_socket, "status")["recoveries"].get("replica/resumed", 0) >= before + 1
    pair.wait_gone("n1", 10)
    reply = admin(pair.admin_socket, "set-role", node="n2", role="prefill")
    assert not reply["ok"] and "no node that decodes" in reply["error"]
