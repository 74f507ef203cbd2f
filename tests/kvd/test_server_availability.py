"""The embedded `kvd serve` in this process -- coordinator and node on one
event loop, the real inproc transport and the tiny model -- when that loop
stalls, and when the node refuses a request the coordinator routed to it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engine.config import EngineConfig
from kvd.cluster_config import ClusterConfig
from kvd.config import KvdConfig, ServerConfig
from kvd.server import Server

DEADLINE = 3.0


@pytest.fixture
async def embedded():
    config = KvdConfig(engine=EngineConfig(model="tiny", dtype="float32", kv_blocks=256, host_kv_blocks=64,
                                           max_model_len=512, num_threads=1),
                       server=ServerConfig(port=0))
    server = Server(config, ClusterConfig(heartbeat_interval=0.5, heartbeat_deadline=DEADLINE))
    task = asyncio.create_task(server.run())
    async with asyncio.timeout(120):
        while server.coordinator is None:
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        await server.coordinator.wait_ready()
    try:
        yield server
    finally:
        server.request_stop()
        server.request_stop()
        await asyncio.wait_for(task, 60)


def http(server: Server, timeout: float = 60) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=timeout)


async def test_a_stalled_event_loop_declares_no_live_node_dead(embedded):
    """Tokenizing a 4 MiB prompt on the loop stalled it 5 s: the node in the
    same process was declared dead (no heartbeat for 3 s) and the stream in
    flight failed. A stall is the coordinator's, not the node's: here the
    whole loop blocks for 1.5 deadlines with a stream in flight."""
    async with http(embedded) as client:
        body = {"model": "tiny", "prompt": "stall", "max_tokens": 300, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            time.sleep(DEADLINE * 1.5)          # blocks this loop: HTTP, coordinator, node alike
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2], rest[-2]
        membership = embedded.coordinator.membership
        assert membership.failures == 0 and "n0" in membership.nodes
        assert membership.stalls >= 1 and membership.stalled_s >= DEADLINE
        # and it keeps serving
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 2})
        assert r.status_code == 200 and (await client.get("/health")).status_code == 200


async def test_a_node_that_refuses_a_request_ends_it_at_once(embedded):
    """The node started draining before its heartbeat said so (heartbeats
    paused: the coordinator still routes to it). Its refusal used to be
    dropped unanswered, and the request waited forever."""
    node = embedded.node
    node.heartbeat.paused = True
    node.draining = True
    try:
        async with http(embedded, timeout=8) as client:
            t0 = time.monotonic()
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            took = time.monotonic() - t0
            err = r.json()["error"]
            assert r.status_code == 503 and err["code"] == "engine_dead" and "no node" in err["message"]
            assert took < 5.0
            assert embedded.coordinator.client._streams == {}
            assert (await embedded.coordinator.commands.cmd_requests({})) == {"requests": {}}
            m = (await client.get("/metrics")).text
            assert 'kvd_num_requests_in_flight{model_name="tiny"} 0.0' in m
    finally:
        node.draining = False
        node.heartbeat.paused = False
