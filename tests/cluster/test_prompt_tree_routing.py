"""Global prompt trees and cache-aware routing with real daemons: a
coordinator and 3 nodes over zmq+tcp, driven by the openai client.

The coordinator's tree is checked against the nodes' own trees (``kvctl
tree --verify``: each node's cached blocks, fetched from it) after random
workloads, a flush, a kill -9 and a restart; requests sharing a prefix land
where it is cached; an overloaded node stops getting cache-affine work; the
policy switches at run time. Greedy tokens equal the single-node engine's.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest

from .conftest import MODEL, Cluster, admin, reference_tokens, running_cluster

NODES = ["n1", "n2", "n3"]
BS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("tree"), "zmq+tcp", NODES) as c:
        yield c


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(n)]


def routed(c: Cluster) -> dict[str, int]:
    return {n["name"]: n["routed"] for n in admin(c.admin_socket, "nodes")["nodes"]}


def complete(c: Cluster, prompt: list[int], max_tokens: int = 8):
    return c.client(timeout=60).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, extra_body={"ignore_eos": True})


def held_blocks(c: Cluster, reply: dict) -> dict[str, tuple[int, int, int]]:
    """Per node: (blocks in the coordinator's tree, blocks its verification
    counted on the node, the node's cached-block counters)."""
    stats = admin(c.admin_socket, "cache stats")["nodes"]
    per_node = reply["roles"].get("mixed", {}).get("nodes", {})
    return {name: (per_node.get(name, {}).get("blocks", 0), reply["verify"][name]["blocks"],
                   stats[name]["kv"]["device"]["cached"] + stats[name]["kv"]["host"]["cached"])
            for name in NODES}


def wait_exact(c: Cluster, timeout: float = 20.0, counters: bool = False) -> dict:
    """Until the coordinator's tree equals every node's own cache (events
    travel every 50 ms) and, with ``counters``, the nodes' cached-block
    counters agree too (a finished request's blocks reach its node's cache
    just after its last chunk reaches the client); returns the last ``tree`` reply."""
    deadline = time.monotonic() + timeout
    while True:
        reply = admin(c.admin_socket, "tree", verify=True)
        checks, held = reply["verify"], {}
        if set(checks) == set(c.nodes_up()) and all(v.get("equal") for v in checks.values()):
            held = held_blocks(c, reply) if counters else {}
            if all(len(set(v)) == 1 for v in held.values()):
                return reply
        if time.monotonic() > deadline:
            raise AssertionError(f"the global tree never matched the nodes' trees: {checks} "
                                 f"(tree, verified, counters per node: {held})")
        time.sleep(0.1)


def node_of(c: Cluster, before: dict[str, int]) -> str:
    after = routed(c)
    (name,) = [n for n in after if after[n] > before.get(n, 0)]
    return name


def test_requests_sharing_a_prefix_land_where_it_is_cached(cluster, reference_engine):
    system = tokens(1, 20 * BS)                  # a 20-block shared "system prompt"
    prompts = [system + tokens(100 + i, 24) for i in range(4)]   # the 21st block differs
    ref = reference_tokens(reference_engine, prompts, 8)
    before = routed(cluster)
    first = complete(cluster, prompts[0])
    home = node_of(cluster, before)
    wait_exact(cluster)
    hits_before = cluster.metrics().get(f'kvd_node_prefix_cache_hit_tokens_total{{node="{home}"}}', 0)
    outs = []
    for p in prompts[1:]:
        before = routed(cluster)
        outs.append(complete(cluster, p))
        assert node_of(cluster, before) == home
    for out, r in zip([first, *outs], ref):
        assert out.choices[0].text == reference_engine.tokenizer.decode(r)
    assert all(o.usage.prompt_tokens_details.cached_tokens >= 20 * BS for o in outs)
    time.sleep(1.2)                              # the next heartbeat carries the node's hit counter
    hits = cluster.metrics()[f'kvd_node_prefix_cache_hit_tokens_total{{node="{home}"}}']
    assert hits >= hits_before + 3 * 20 * BS
    tree = admin(cluster.admin_socket, "tree")["roles"]["mixed"]["nodes"][home]
    assert tree["blocks"] >= 20 and tree["tokens"] == tree["blocks"] * BS
    assert tree["shared_prefixes"][0]["blocks"] >= 20     # the system prompt, branching


def test_global_tree_equals_the_nodes_trees_after_a_random_workload(cluster, reference_engine):
    heads = [tokens(200 + h, 6 * BS) for h in range(3)]
    rng = random.Random(7)
    prompts = [rng.choice(heads) + tokens(300 + i, rng.randrange(1, 4 * BS)) for i in range(18)]
    ref = reference_tokens(reference_engine, prompts, 4)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda p: complete(cluster, p, 4), prompts))
    assert [o.choices[0].text for o in outs] == [reference_engine.tokenizer.decode(r) for r in ref]
    wait_exact(cluster)
    admin(cluster.admin_socket, "cache flush", node="n1")
    for p in prompts[:3]:
        complete(cluster, p, 2)
    wait_exact(cluster, counters=True)


def test_an_overloaded_node_stops_receiving_cache_affine_work(cluster, reference_engine):
    # a fresh router (no recent work from the tests before) and a prefix long
    # enough (30 blocks) that affinity outweighs 4 requests in flight and the
    # recent work of computing it once: only the in-flight guard stops it
    assert admin(cluster.admin_socket, "routing", policy="prompt-tree")["ok"]
    system = tokens(2, 30 * BS)
    before = routed(cluster)
    complete(cluster, system + [5])
    home = node_of(cluster, before)
    wait_exact(cluster)
    started = threading.Barrier(6)
    stop = threading.Event()
    client = cluster.client(timeout=120)

    def long_stream(i: int) -> None:
        stream = client.completions.create(model=MODEL, prompt=system + tokens(500 + i, 4), max_tokens=1300,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        with stream:
            for n, _ in enumerate(stream):
                if n == 1:
                    started.wait(60)
                if stop.is_set():
                    return

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    try:
        started.wait(60)
        on_node = {rid: r["node"] for rid, r in admin(cluster.admin_socket, "requests")["requests"].items()}
        assert sorted(on_node.values()) == [home] * 5        # affinity: within the slack (4)
        probe = system + tokens(600, 8)
        before = routed(cluster)
        out = complete(cluster, probe)
        assert node_of(cluster, before) != home               # 5 above the idle nodes: guarded
        ref = reference_tokens(reference_engine, [probe], 8)[0]
        assert out.choices[0].text == reference_engine.tokenizer.decode(ref)
        assert admin(cluster.admin_socket, "routing")["guarded"] >= 1
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def test_routing_policy_switches_at_run_time(cluster):
    assert admin(cluster.admin_socket, "routing")["policy"] == "prompt-tree"
    bad = admin(cluster.admin_socket, "routing", policy="random")
    assert not bad["ok"] and "routing policy" in bad["error"]
    # weights: overridden for this router only, validated, and gone with the next switch
    tuned = admin(cluster.admin_socket, "routing", recent_weight=0, load_weight=2.5)
    assert tuned["ok"] and (tuned["recent_weight"], tuned["load_weight"]) == (0, 2.5)
    for bad_args in ({"recent_weight": -1}, {"recent_weight": "x"}, {"bogus_weight": 1.0},
                     {"policy": "least-load", "load_weight": 1.0}):
        bad = admin(cluster.admin_socket, "routing", **bad_args)
        assert not bad["ok"] and bad["error"]
        assert admin(cluster.admin_socket, "routing")["recent_weight"] == 0   # the refusal changed nothing
    default = admin(cluster.admin_socket, "routing", policy="prompt-tree")
    assert (default["recent_weight"], default["load_weight"]) == (0.25, 4.0)
    prefix = tokens(5, 8 * BS)                   # cached on one node only

    def route(prompt: list[int]) -> str:
        before = routed(cluster)
        complete(cluster, prompt, 2)
        return node_of(cluster, before)

    try:
        assert admin(cluster.admin_socket, "routing", policy="least-load")["policy"] == "least-load"
        idle_pick = route(tokens(4, 8))
        admin(cluster.admin_socket, "drain", node=idle_pick)
        try:
            home = route(prefix + [1])               # the prefix lands elsewhere
        finally:
            admin(cluster.admin_socket, "undrain", node=idle_pick)
        assert home != idle_pick
        wait_exact(cluster)
        assert "cache_routed" not in admin(cluster.admin_socket, "routing")
        routed_by_cache = admin(cluster.admin_socket, "routing", policy="prompt-tree")["cache_routed"]
        assert route(prefix + [3]) == home           # prompt-tree follows the prefix
        assert admin(cluster.admin_socket, "routing")["cache_routed"] == routed_by_cache + 1
    finally:
        admin(cluster.admin_socket, "routing", policy="prompt-tree")


def test_a_killed_node_leaves_the_tree_and_resyncs_when_it_restarts(cluster):
    wait_exact(cluster)
    victim = "n3"
    cluster.nodes[victim].kill9()
    cluster.wait_gone(victim, 10)
    assert victim not in admin(cluster.admin_socket, "tree")["roles"].get("mixed", {}).get("nodes", {})
    cluster.start_node(victim)
    cluster.wait_nodes(NODES, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: complete(cluster, tokens(700 + i, 3 * BS), 2), range(6)))
    wait_exact(cluster)
