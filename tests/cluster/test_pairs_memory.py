"""A pair's redundant copies under memory pressure, over real daemons
(docs/cluster.md, "Pairs and roles"): a copy sits in the partner's device
tier while it has room, and is the first thing the partner gives up when
its own request needs the blocks (no preemption, no wait for the copy's
request to end); the copies given up are reported; the coordinator hands
the request whose copy was given up to nobody while it has none; every
text stays exact (greedy).

The streams are sized from the measured step rate and the nodes throttled
to a known share of it (tests/cluster/pair_pacing.py), so each stream
provably outlasts the state the test waits for; each wait reads the state
itself (kvctl), and the test says so if a stream ended first."""

from __future__ import annotations

import pytest

from .conftest import Cluster, admin, reference_tokens
from .pair_pacing import Throttle, long_reference, pace, paired_cluster, prompt_ids, tokens_per_second
from .test_pairs import Stream, in_flight, nodes, until

# n2: 128 device blocks; its own request (a 64-block prompt) and the copy of n1's (a 64-block
# prompt and its tokens) do not fit together, and its host tier is too small for the copy: once
# given up, the copy cannot come back while n2's request runs
N1 = ("--replication-interval", "0.05")
N2 = ("--replication-interval", "0.05", "--kv-blocks", "128", "--host-kv-blocks", "8")
PROMPT = 1024                     # 64 blocks of 16
FIRST = 1000                      # n1's stream: PROMPT + FIRST within the tiny model's context
SECOND = 250                      # n2's: its 64-block prompt and these tokens fit beside no copy
SPAN_S = 6.0                      # what FIRST must outlast: its copy, n2's request, the copy given up, the refusal
WINDOW_S = 2.0                    # what SECOND must outlast: the copy given up, the refused handoff


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with paired_cluster(tmp_path_factory.mktemp("pairmem"), N1, N2) as c:
        yield c


def ids(seed: int) -> list[int]:
    return prompt_ids(seed, PROMPT)


def holder(c: Cluster, node: str) -> dict:
    return admin(c.node_admin(node), "status")["replication"]["holder"]


def running_on(c: Cluster, node: str, rid: str) -> bool:
    """Whether ``node``'s engine still runs ``rid`` (its own ``requests``)."""
    return rid in admin(c.node_admin(node), "requests")["requests"]


def test_own_work_takes_the_copys_device_blocks_and_the_copy_is_not_handed_off(pair):
    ref = long_reference()
    rate = tokens_per_second(pair)
    share = min(pace(rate, FIRST, SPAN_S), pace(rate, SECOND, WINDOW_S))
    want = [ref.tokenizer.decode(reference_tokens(ref, [ids(s)], n)[0]) for s, n in ((1, FIRST), (2, SECOND))]
    refused = pair.metrics().get('kvd_handoffs_refused_total{reason="incomplete"}', 0)
    with Throttle([pair.nodes["n1"], pair.nodes["n2"]], share):
        first = Stream(pair, ids(1), None, FIRST)                  # both idle: n1 (by name)
        rid = until(lambda: next(iter(in_flight(pair)), None))
        assert in_flight(pair)[rid]["node"] == "n1"
        # its copy on n2's device, past the prompt (so it no longer fits beside n2's request)
        until(lambda: holder(pair, "n2")["device_blocks"] >= PROMPT // 16 + 2)
        second = Stream(pair, ids(2), None, SECOND)                 # n1 has a request in flight: n2
        rid2 = until(lambda: next((r for r in in_flight(pair) if r != rid), None))
        assert in_flight(pair)[rid2]["node"] == "n2"
        # n2 gives the copy up for its own request; the copy cannot come back while that one runs
        until(lambda: holder(pair, "n2")["reclaimed"] >= 1, 30)
        reply = admin(pair.admin_socket, "handoff", request=rid)
        assert running_on(pair, "n2", rid2), "n2's request ended before the handoff was tried: pace it slower"
        assert running_on(pair, "n1", rid), "n1's request ended before the handoff was tried: pace it slower"
    assert not reply["ok"] and "incomplete" in reply["error"], reply
    first.join(60)
    second.join(60)
    assert (first.error, second.error) == (None, None)
    assert first.finish == "length" and "".join(first.text) == want[0]
    assert second.finish == "length" and "".join(second.text) == want[1]
    st = holder(pair, "n2")
    assert st["reclaimed"] >= 1 and st["reclaimed_blocks"] >= PROMPT // 16 + 2, st
    shown = until(lambda: (c := nodes(pair)["n2"]["copies"])["reclaimed"] >= 1 and c, 10)     # its next heartbeat
    assert shown["reclaimed_blocks"] == st["reclaimed_blocks"], (shown, st)
    metrics = pair.metrics()
    preempted = [v for k, v in metrics.items() if k.startswith("kvd_preemptions_total")]
    assert preempted and not any(preempted), preempted    # n2's request took the copy's blocks, nobody's KV
    assert metrics['kvd_node_copies_reclaimed_total{node="n2"}'] >= 1
    assert metrics['kvd_handoffs_refused_total{reason="incomplete"}'] == refused + 1
