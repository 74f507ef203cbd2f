"""A coordinator and 3 node processes over zmq+tcp, driven by the openai client.

One cluster per module (startup costs seconds per process); tests run in file
order and the destructive ones (heartbeats stopped, kill -9) come last.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import openai
import pytest

from .conftest import MODEL, Cluster, admin, reference_tokens, running_cluster

NODES = ["n1", "n2", "n3"]
DEADLINE = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("zmq"), "zmq+tcp", NODES,
                         extra=("--recovery", "fail")) as c:
        yield c


def prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(n)]


def stream_text(client: openai.OpenAI, ids: list[int], max_tokens: int) -> tuple[str, str, str]:
    """(request id, text, finish_reason) of one greedy streamed completion."""
    rid, text, finish = "", [], None
    for chunk in client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        rid = chunk.id
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return rid, "".join(text), finish


def routed(c: Cluster) -> dict[str, int]:
    return {n["name"]: n["routed"] for n in admin(c.admin_socket, "nodes")["nodes"]}


def test_concurrent_streams_match_the_single_node_engine(cluster, reference_engine):
    prompts = [prompt(i) for i in range(9)]
    ref = reference_tokens(reference_engine, prompts, 24)
    client = cluster.client(timeout=60)
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        results = list(pool.map(lambda p: stream_text(client, p, 24), prompts))
    tok = reference_engine.tokenizer
    for (rid, text, finish), r in zip(results, ref):
        assert finish == "length"
        assert text == tok.decode(r), rid
    spread = routed(cluster)
    assert sum(v > 0 for v in spread.values()) >= 2, spread   # least-load spreads them
    # the coordinator's /metrics sums the nodes' engine steps from their heartbeats
    deadline = time.monotonic() + 15
    while True:
        m = {k.split("{")[0]: v for k, v in cluster.metrics().items()}
        if m.get("kvd_engine_steps_total", 0) >= 24 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m["kvd_engine_steps_total"] >= 24 and m["kvd_engine_step_seconds_total"] > 0, m


def test_session_affinity_sends_a_conversation_back(cluster):
    client = cluster.client(timeout=60)
    base = prompt(1000, 80)
    before = routed(cluster)
    client.completions.create(model=MODEL, prompt=base, max_tokens=2, temperature=0)
    mid = routed(cluster)
    first = next(n for n in mid if mid[n] > before.get(n, 0))
    r = client.completions.create(model=MODEL, prompt=base + prompt(1001, 20), max_tokens=2, temperature=0)
    after = routed(cluster)
    assert after[first] == mid[first] + 1
    assert r.usage.prompt_tokens_details.cached_tokens >= 64      # that node's prefix cache


def test_drain_node_finishes_its_requests_and_gets_nothing_new(cluster):
    client = cluster.client(timeout=60)
    admin(cluster.admin_socket, "drain", node="n3")
    try:
        before = routed(cluster)["n3"]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda i: stream_text(client, prompt(200 + i), 8), range(6)))
        assert all(f == "length" for _, _, f in outs)
        assert routed(cluster)["n3"] == before
        assert admin(cluster.node_admin("n3"), "status")["draining"] is True
    finally:
        admin(cluster.admin_socket, "undrain", node="n3")
    assert admin(cluster.node_admin("n3"), "status")["draining"] is False


def test_drain_lets_a_running_request_finish(cluster):
    client = cluster.client(timeout=60)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=stream_text(client, prompt(300), 300)))
    t.start()
    deadline = time.monotonic() + 10
    node = None
    while node is None and time.monotonic() < deadline:
        reqs = admin(cluster.admin_socket, "requests")["requests"]
        node = next((r["node"] for r in reqs.values()), None)
        time.sleep(0.01)
    assert node is not None
    admin(cluster.admin_socket, "drain", node=node)
    try:
        t.join(60)
        assert result["out"][2] == "length"
    finally:
        admin(cluster.admin_socket, "undrain", node=node)


def test_stopped_heartbeats_fail_the_nodes_requests_within_the_deadline(cluster):
    victim = "n2"
    try:
        # the node keeps decoding with its beats stopped: a stream that ends before the node is
        # declared gone ends well, every other one ends with an error by the deadline
        victim = _fail_one_node(cluster, lambda name: admin(cluster.admin_socket, "fail", node=name, mode="stop"),
                                may_finish=True)
    finally:
        # it beats again and rejoins
        admin(cluster.node_admin(victim), "fail", mode="resume")
    cluster.wait_nodes(NODES, timeout=20)


def test_a_hung_node_fails_its_requests_within_the_deadline_and_rejoins(cluster):
    victim = "n2"
    try:
        victim = _fail_one_node(cluster, lambda name: cluster.nodes[name].pause())
    finally:
        cluster.nodes[victim].resume()
    cluster.wait_nodes(NODES, timeout=30)


def test_kill9_fails_the_nodes_requests_others_unaffected_and_it_rejoins(cluster):
    victim = "n2"
    try:
        victim = _fail_one_node(cluster, lambda name: cluster.nodes[name].kill9())
    finally:
        if not cluster.nodes[victim].alive():
            cluster.start_node(victim)
    cluster.wait_nodes(NODES, timeout=120)
    client = cluster.client(timeout=60)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda i: stream_text(client, prompt(500 + i), 6), range(6)))
    assert all(f == "length" for _, _, f in outs)


def _fail_one_node(cluster: Cluster, fail, may_finish: bool = False) -> str:
    """Start long streams, fail a node that serves some of them, check the
    outcome of each; returns the failed node's name.

    Every stream on the failed node ends with an error naming it within the
    heartbeat deadline; with ``may_finish`` (a node that still decodes) one
    may instead end well before the node is declared gone. Streams on the
    other nodes end well."""
    client = cluster.client(timeout=60)
    outcomes: dict[int, tuple] = {}
    started = threading.Barrier(7)

    def run(i: int) -> None:
        rid, n, t_err = "", 0, None
        try:
            for chunk in client.completions.create(model=MODEL, prompt=prompt(400 + i), max_tokens=1500,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                rid = chunk.id
                n += 1
                if n == 3:
                    started.wait(30)
            outcomes[i] = ("ok", rid, n, (time.monotonic(), ""))
        except openai.APIError as exc:
            outcomes[i] = ("error", rid, n, (time.monotonic(), str(exc)))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(60)
    on_node = {rid: r["node"] for rid, r in admin(cluster.admin_socket, "requests")["requests"].items()}
    serving = sorted(set(on_node.values()))
    assert len(serving) >= 2, on_node          # least-load routing spreads the streams
    victim = "n2" if "n2" in serving else serving[0]
    t_fail = time.monotonic()
    fail(victim)
    gone_after = cluster.wait_gone(victim, DEADLINE + 2)
    for t in threads:
        t.join(90)
    assert len(outcomes) == 6
    for kind, rid, n, err in outcomes.values():
        if on_node.get(rid) == victim:
            if may_finish and kind == "ok":
                assert err[0] - t_fail <= gone_after + 0.5, (rid, n, err[0] - t_fail, gone_after)
                continue
            assert kind == "error", (rid, n)
            assert err[0] - t_fail <= DEADLINE + 2, err
            assert victim in err[1]
        else:
            assert kind == "ok", (rid, on_node.get(rid), err)
    assert gone_after <= DEADLINE + 2
    # new requests go to the survivors at once
    r = client.completions.create(model=MODEL, prompt=prompt(600), max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    m = cluster.metrics()
    assert m["kvd_cluster_node_failures_total"] >= 1
    return victim
