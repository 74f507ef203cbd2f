"""A coordinator and 3 node processes over UCX, driven by the openai client;
every UCX link authenticated by the handshake of transports/ucx_auth.py."""

from __future__ import annotations

import concurrent.futures
import importlib.util

import pytest

from .conftest import admin, reference_tokens, running_cluster
from .test_cluster_zmq import prompt, stream_text

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")
NODES = ["u1", "u2", "u3"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("ucx"), "ucx", NODES) as c:
        yield c


def test_concurrent_streams_over_ucx_match_the_single_node_engine(cluster, reference_engine):
    prompts = [prompt(50 + i) for i in range(9)]
    ref = reference_tokens(reference_engine, prompts, 20)
    client = cluster.client(timeout=60)
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        results = list(pool.map(lambda p: stream_text(client, p, 20), prompts))
    for (_, text, finish), r in zip(results, ref):
        assert finish == "length" and text == reference_engine.tokenizer.decode(r)
    routed = {n["name"]: n["routed"] for n in admin(cluster.admin_socket, "nodes")["nodes"]}
    assert sum(v > 0 for v in routed.values()) >= 2, routed


def test_kv_transfer_over_ucx(cluster, reference_engine):
    ids = prompt(77, 64)
    client = cluster.client(timeout=60)
    routed = lambda: {n["name"]: n["routed"] for n in admin(cluster.admin_socket, "nodes")["nodes"]}  # noqa: E731
    before = routed()
    client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    after = routed()
    src = next(n for n in after if after[n] > before.get(n, 0))     # the node that cached it
    dst = next(n for n in NODES if n != src)
    r = admin(cluster.node_admin(src), "transfer", to=dst, address=cluster.node_urls[dst], token_ids=ids)
    # the allocation round trip, then ONE KVData with every layer (a small transfer)
    assert r["transferred"] and r["sends"] == 2 and r["inserted_tokens"] == 64, r
