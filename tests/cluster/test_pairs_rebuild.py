"""A pair member killed and replaced, over real daemons (docs/cluster.md,
"Pairs and roles"): kill -9 of n2 mid-stream; its requests resume on n1
from their copies and every stream goes on token-exactly (greedy and
seeded); a new n2 process joins the pair in its place, and n1 rebuilds
there the copies of every request it runs at ``[cluster].replication_rate``:
the rebuild takes many rounds, each sending its whole share.

The new n2 is started before the streams, at another address (a new
registration is refused while the old one lives, and taken within a beat
of its death), so no stream has to outlast a process start. The streams
are sized from the step rate measured on the cluster and the nodes
throttled to a known share of it (tests/cluster/pair_pacing.py), so every
stream provably runs until its copy is back; each wait reads the state
itself (kvctl), and the test says so if a stream ended first."""

from __future__ import annotations

import pytest

from kvd.node.replication import BURST_S

from .conftest import SEEDED, admin, reference_tokens
from .pair_pacing import CONTEXT, Throttle, long_reference, pace, paired_cluster, prompt_ids, tokens_per_second
from .test_pairs import Stream, in_flight, nodes, until

RATE = 200                        # blocks/s a node sends of what its partner lacks: at most 20 a round
FLAGS = ("--replication-interval", "0.05", "--replication-rate", str(RATE))
PROMPT = 512                      # 32 blocks: four copies are many rounds' share
TOKENS = CONTEXT - PROMPT - 64
SAMPLINGS = [None, SEEDED[0], None, SEEDED[1]]     # two on each node (the router alternates by load)
DEADLINE_S = 3.0                  # conftest HEARTBEAT: n2 is declared dead this long after its kill
# what every stream must outlast: the copies, the kill's detection and the new n2's registration
# (a beat), the rebuild of every copy whole at RATE, and a margin for the checks
SPAN_S = 2.0 + DEADLINE_S + 1.0 + len(SAMPLINGS) * CONTEXT / 16 / RATE + 3.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with paired_cluster(tmp_path_factory.mktemp("pairrebuild"), FLAGS, FLAGS) as c:
        yield c


def ids(seed: int) -> list[int]:
    return prompt_ids(seed, PROMPT)


def test_a_killed_member_is_replaced_and_gets_its_partners_copies_back_at_a_bounded_rate(pair):
    c = pair
    ref = long_reference()
    share = pace(tokens_per_second(c), TOKENS, SPAN_S)
    prompts = [ids(40 + i) for i in range(len(SAMPLINGS))]
    want = [ref.tokenizer.decode(t) for t in
            reference_tokens(ref, prompts, TOKENS, [s or {"temperature": 0.0} for s in SAMPLINGS])]
    old = c.nodes["n2"]
    new_admin = c.tmp / "n2-new.sock"
    c.start_node("n2", *FLAGS, "--pair", "n1", "--admin-socket", str(new_admin), url=c.url("n2"))
    until(lambda: new_admin.exists() and not admin(new_admin, "status")["registered"], 120)   # up, refused
    resumed = admin(c.admin_socket, "status")["recoveries"].get("replica/resumed", 0)
    survivor, victim = Throttle([c.nodes["n1"]], share), Throttle([old], share)
    try:
        streams = []
        for p, s in zip(prompts, SAMPLINGS):
            streams.append(Stream(c, p, s, TOKENS))
            until(lambda: len(in_flight(c)) == len(streams))
        # mid-stream on both nodes, every prompt's copy complete at the partner
        until(lambda: sorted(r["node"] for r in in_flight(c).values()) == ["n1", "n1", "n2", "n2"]
              and all(r["replicated_tokens"] >= PROMPT for r in in_flight(c).values()), 30)
        rids = sorted(in_flight(c))
        victim.stop()
        old.kill9()
        # n2's two requests resume on n1 from their copies; the new n2 takes the old one's place
        until(lambda: admin(c.admin_socket, "status")["recoveries"].get("replica/resumed", 0) >= resumed + 2, 30)
        sender = admin(c.node_admin("n1"), "status")["replication"]["sender"]
        assert sorted(in_flight(c)) == rids, "a stream ended before n2 was declared dead: pace it slower"
        until(lambda: admin(new_admin, "status")["registered"], 30)
        held = lambda rid: admin(new_admin, "replica held", source="n1", request=rid)["tokens"]  # noqa: E731
        until(lambda: all(held(rid) >= PROMPT for rid in rids), 60)
        running = admin(c.node_admin("n1"), "requests")["requests"]
        assert set(rids) <= set(running), "a stream ended before its copy was back: pace it slower"
        after = admin(c.node_admin("n1"), "status")["replication"]["sender"]
    finally:
        victim.stop()
        survivor.stop()
    assert admin(c.admin_socket, "status")["recoveries"].get("replica/resumed", 0) == resumed + 2
    assert all(r["node"] == "n1" for r in in_flight(c).values()), in_flight(c)
    # the rebuild: at least the four prompts' tokens (as rows), over many rounds that each sent their whole share
    share_blocks = int(RATE * BURST_S)
    assert after["rows"] - sender["rows"] >= len(rids) * PROMPT, (sender, after)
    assert after["rate_limited"] - sender["rate_limited"] >= len(rids) * PROMPT // 16 // share_blocks // 2, \
        (sender, after)
    shown = until(lambda: (n := nodes(c)["n2"])["pair_alive"] and n["redundant_blocks"] >= PROMPT // 16 and n, 10)
    assert shown["pair"] == "n1", shown
    for s in streams:
        s.join(120)
    for s, w in zip(streams, want):
        assert s.error is None and s.finish == "length" and "".join(s.text) == w
