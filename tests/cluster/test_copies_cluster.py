"""``n`` choices through a cluster: a coordinator and 2 nodes over zmq+tcp, the
openai client. The copies follow copy 0 to the node that computed the prompt
(the router records its blocks as pending there), so the prompt is computed
once, and each copy's text equals the single-node engine's: greedy copies the
one greedy answer, seeded copy i the request seeded seed + i."""

from __future__ import annotations

import random
import time

import pytest

from engine.request import SamplingParams

from .conftest import MODEL, admin, kvd_metrics, running_cluster

NODES = ["n1", "n2"]
BS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("copies"), "zmq+tcp", NODES) as c:
        yield c


def routed(c) -> dict[str, int]:
    return {n["name"]: n["routed"] for n in admin(c.admin_socket, "nodes")["nodes"]}


def hits(c) -> float:
    m = kvd_metrics(c.base)
    return sum(m.get(f'kvd_node_prefix_cache_hit_tokens_total{{node="{n}"}}', 0) for n in NODES)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, top_k=40, seed=11)],
                         ids=["greedy", "seeded"])
def test_copies_share_one_prefill_on_one_node_and_equal_the_engine(cluster, reference_engine, sampling):
    rng = random.Random(str(sampling))
    prompt = [rng.randrange(1, 40000) for _ in range(20 * BS + 5)]
    n, tokens = 4, 12
    before, hits_before = routed(cluster), hits(cluster)
    openai_args = {k: v for k, v in sampling.items() if k != "top_k"}
    out = cluster.client(timeout=120).completions.create(
        model=MODEL, prompt=prompt, max_tokens=tokens, n=n, **openai_args,
        extra_body={"ignore_eos": True, **({"top_k": sampling["top_k"]} if "top_k" in sampling else {})})
    after = routed(cluster)
    assert sorted(after[k] - before.get(k, 0) for k in after) == [0, n]      # every copy on one node
    seed = sampling.get("seed")
    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, **{**sampling, **(
        {"seed": seed + i} if seed is not None else {})}) for i in range(n)]
    want = [reference_engine.generate([prompt], p)[0] for p in params]
    got = sorted(out.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [reference_engine.tokenizer.decode(w) for w in want]
    if seed is None:
        assert len({c.text for c in got}) == 1
    # copies 1..n-1 matched the prompt's 20 full blocks that copy 0 computed (the next heartbeat
    # carries the counter)
    deadline = time.monotonic() + 10
    while hits(cluster) < hits_before + (n - 1) * 20 * BS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hits(cluster) >= hits_before + (n - 1) * 20 * BS


def test_the_cluster_names_its_nodes_build_in_every_response(cluster):
    """Nodes of one build: the coordinator's fingerprint is theirs, and every response carries it."""
    prints = {n: admin(cluster.node_admin(n), "status")["fingerprint"] for n in NODES}
    (build,) = set(prints.values())
    assert admin(cluster.admin_socket, "status")["fingerprint"] == build
    out = cluster.client(timeout=60).completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=2, temperature=0)
    assert out.system_fingerprint == build
