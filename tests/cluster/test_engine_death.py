"""A node whose engine thread died (``kvctl fail NODE --mode engine``, an
operator's fault injection) leaves the cluster at once instead of being
routed to with a dead engine: its Goodbye names the cause and its requests
(recovered or ended with 503 ``engine_dead``), and the process exits with
status 3, which ``kvd serve --nodes``'s supervisor (and systemd's
``Restart=on-failure``) answers with a new process."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from engine.request import SamplingParams
from kvd.supervisor import ENGINE_DEAD_EXIT

from .conftest import Cluster, admin
from .test_local_cluster import LocalServe, wait_until

LONG = 1800          # tokens: the stream still runs when the fault is injected (max_model_len 2048)
FAULT = "InjectedFault: fault injection (admin fail --mode engine)"


@pytest.fixture(scope="module")
def long_reference():
    """The plain single-node engine, with the cluster's context length."""
    from engine.engine import EngineConfig, LLMEngine

    return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=256,
                                              host_kv_blocks=0, max_model_len=2048, num_threads=1,
                                              batch_invariant=True))


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(40)]


def test_a_node_whose_engine_died_leaves_at_once_and_its_supervisor_restarts_it(tmp_path, long_reference):
    """``kvd serve --nodes 2`` with ``recovery = reprefill``: the stream on the
    node whose engine dies goes on on the other node with exactly the
    uninterrupted run's text; the fault's reply, the coordinator's log and the
    supervisor's name the cause; the node process is restarted as after a
    crash, rejoins as a new incarnation and serves again."""
    s = LocalServe(tmp_path, "--recovery", "reprefill")
    try:
        s.wait_healthy()
        before, pids = s.nodes(), s.node_pids()
        ids = prompt(1)
        want = long_reference.tokenizer.decode(long_reference.generate(
            [ids], SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True))[0])
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=120)
        chunks = iter(client.completions.create(model="tiny", prompt=ids, max_tokens=LONG, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        text = [next(chunks).choices[0].text]
        (info,) = admin(s.admin_socket, "requests")["requests"].values()
        victim = info["node"]
        reply = admin(s.admin_socket, "fail", node=victim, mode="engine")
        assert reply["ok"] and reply["engine"] == {"state": "dead", "error": FAULT}, reply
        finish = None
        for chunk in chunks:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and "".join(text) == want
        log = s.log_text()
        assert f"node {victim} left (engine dead: {FAULT})" in log, log[-3000:]
        assert f"node {victim} failed (left: engine dead: {FAULT}); resumed on" in log
        assert admin(s.admin_socket, "status")["recoveries"] == {"reprefill/resumed": 1}
        wait_until(lambda: f"node {victim} (pid {pids[victim]}) exited with code {ENGINE_DEAD_EXIT} (its engine "
                           f"died); restarting it" in s.log_text(), 30, s.log_text)
        wait_until(lambda: victim in s.nodes() and s.nodes()[victim]["incarnation"] != before[victim]["incarnation"],
                   60, s.log_text)
        assert s.node_pids()[victim] != pids[victim]
        assert all(s.complete(f"after the restart {i}").usage.completion_tokens == 4 for i in range(4))
    finally:
        s.close()


def test_a_kvd_node_whose_engine_died_ends_its_stream_with_503_and_exits_3(tmp_path):
    """A standalone ``kvd node`` (systemd's ``kvd-node@``), the default
    ``recovery = fail``: the stream it ran ends with an ``engine_dead`` error
    event at once (it used to get 400 ``invalid_request_error`` and every
    later request on that node too, while it kept beating); the process exits
    with status 3 naming the cause; the same command started again (what
    ``Restart=on-failure`` does) rejoins and serves."""
    c = Cluster(tmp_path)
    node = c.start_node("n1")
    try:
        c.wait_nodes(["n1"])
        body = {"model": "tiny", "prompt": prompt(2), "max_tokens": LONG, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", c.base + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
            reply = admin(c.admin_socket, "fail", node="n1", mode="engine")
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert reply["ok"] and reply["engine"] == {"state": "dead", "error": FAULT}, reply
        assert events[-1] == "[DONE]" and len(events) - 2 < LONG
        error = json.loads(events[-2])["error"]
        assert (error["code"], error["type"]) == ("engine_dead", "service_unavailable"), error
        assert FAULT in error["message"]
        assert node.proc.wait(30) == ENGINE_DEAD_EXIT, node.log_text()[-3000:]
        assert f"kvd: error: node n1: the engine died: {FAULT}" in node.log_text()
        new = httpx.post(c.base + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                         timeout=30)
        assert new.status_code == 503 and new.json()["error"]["code"] == "engine_dead", new.text
        node.start()
        c.wait_nodes(["n1"])
        assert c.client().completions.create(model="tiny", prompt="back", max_tokens=4).usage.completion_tokens == 4
    finally:
        c.stop()
