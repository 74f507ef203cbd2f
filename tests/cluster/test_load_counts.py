"""Every node's load count (``in_flight`` in ``kvctl nodes``, what routing
balances on) returns to zero once nothing is in flight, over real daemons:
after requests recovered from a killed node onto another one, and the
requests after them. (Disaggregated requests and
a client that leaves: test_peer_restart.py; requests a node gave up during a
coordinator stall: test_coordinator_stall.py.)"""

from __future__ import annotations

import concurrent.futures

from .conftest import MODEL, Cluster, admin
from .test_coordinator_stall import settled
from .test_recovery import check_texts, decoding, prompt, reference_engine, requests  # noqa: F401 -- a fixture

NODES = ["n1", "n2"]


def nodes(c: Cluster) -> dict[str, dict]:
    return {n["name"]: n for n in admin(c.admin_socket, "nodes")["nodes"]}


def test_recovered_requests_are_uncounted_where_they_ended(tmp_path, reference_engine):
    c = Cluster(tmp_path, "zmq+tcp", extra=("--recovery", "reprefill"))
    for name in NODES:
        c.start_node(name)
    try:
        c.wait_nodes(NODES)
        s = decoding(c, 4, seed0=0)
        on = requests(c)
        victim = max(NODES, key=lambda n: sum(r["node"] == n for r in on.values()))
        c.nodes[victim].kill9()
        s.join()
        check_texts(s, reference_engine)               # they carried on on the other node
        assert admin(c.admin_socket, "status")["failed_requests"] == 0
        settled(c)                                     # the node they moved to carries none of them now
        c.start_node(victim)                           # back, as a new process
        c.wait_nodes(NODES)
        settled(c)
        client = c.client(timeout=60)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda i: client.completions.create(
                model=MODEL, prompt=prompt(100 + i), max_tokens=64, temperature=0,
                extra_body={"ignore_eos": True}), range(4)))
        assert all(d.usage.completion_tokens == 64 for d in done)
        assert set(nodes(c)) == set(NODES)
        settled(c)
    finally:
        c.stop()
