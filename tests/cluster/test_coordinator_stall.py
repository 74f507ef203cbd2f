"""A coordinator that stalls (its event loop blocked: `kvctl fail --mode
stall`) while a decode node streams to it, over real daemons: a prefill node
and a decode node (whose listener then has two peers, as in production).

- A stall shorter than the node's send timeout (``request_timeout``) is
  tolerated: the node's sends wait for the coordinator to read again, and
  every stream completes with the text it has without a stall.
- A longer one: the node gives its streams up and says so in its next
  heartbeat; each client gets the text, or an error event at once (not
  silence until it disconnects). Nothing stays in flight or counted."""

from __future__ import annotations

import random
import threading
import time

import openai
import pytest

from .conftest import MODEL, Cluster, admin, reference_tokens

SEND_TIMEOUT = 4.0                 # [cluster].request_timeout: the node's send timeout
STREAMS = 24
MAX_TOKENS = 400                   # outlasts a stall: the streams are decoding when it ends


def prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stall")
    config = tmp / "kvd.toml"
    config.write_text(f"[cluster]\nrequest_timeout = {SEND_TIMEOUT}\n")
    # zmq+ipc: Unix socket buffers are small, so a stalled reader's queues fill within the stall
    c = Cluster(tmp, "zmq+ipc", extra=("-c", str(config), "--prefill-queue-factor", "0"))
    c.start_node("p1", "--role", "prefill", "--prefill-threshold", "0")
    c.start_node("d1", "--role", "decode", "--prefill-threshold", "0")
    c.wait_nodes(["d1", "p1"])
    yield c
    c.stop()


class Streams:
    """``n`` greedy streams in threads: each one's outcome and when it ended."""

    def __init__(self, c: Cluster, seed0: int) -> None:
        self.client = c.client(timeout=90)
        self.prompts = [prompt(seed0 + i) for i in range(STREAMS)]
        self.counts = [0] * STREAMS
        self.results: dict[int, tuple] = {}
        self.ended: dict[int, float] = {}
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        text = []
        try:
            for chunk in self.client.completions.create(model=MODEL, prompt=self.prompts[i], max_tokens=MAX_TOKENS,
                                                        temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}):
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                    self.counts[i] += 1
            self.results[i] = ("ok", "".join(text))
        except openai.APIError as exc:
            self.results[i] = ("error", str(exc))
        self.ended[i] = time.monotonic()

    def decoding(self, tokens: int = 3, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while sum(k >= tokens for k in self.counts) < STREAMS:
            assert time.monotonic() < deadline, self.counts
            time.sleep(0.02)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert len(self.results) == STREAMS, f"{STREAMS - len(self.results)} stream(s) still open"


def stall(c: Cluster, seconds: float) -> float:
    """Block the coordinator's loop for ``seconds``; when it runs again."""
    assert admin(c.admin_socket, "fail", mode="stall", seconds=seconds, timeout=seconds + 15)["ok"]
    return time.monotonic()


def settled(c: Cluster, timeout: float = 30) -> None:
    """Nothing in flight at the coordinator, and every node's load count zero."""
    deadline = time.monotonic() + timeout
    while True:
        requests = admin(c.admin_socket, "requests")["requests"]
        counts = {n["name"]: n["in_flight"] for n in admin(c.admin_socket, "nodes")["nodes"]}
        if not requests and not any(counts.values()):
            return
        assert time.monotonic() < deadline, (requests, counts)
        time.sleep(0.1)


def texts(reference_engine, prompts) -> list[str]:
    return [reference_engine.tokenizer.decode(t) for t in reference_tokens(reference_engine, prompts, MAX_TOKENS)]


def test_a_stall_within_the_send_timeout_loses_no_stream(pd, reference_engine):
    s = Streams(pd, seed0=0)
    s.decoding()
    stall(pd, SEND_TIMEOUT / 2)
    s.join(120)
    want = texts(reference_engine, s.prompts)
    assert [s.results[i] for i in range(STREAMS)] == [("ok", w) for w in want]
    assert "coordinator unreachable" not in pd.nodes["d1"].log_text()
    settled(pd)


def test_a_longer_stall_ends_each_stream_with_its_text_or_an_error_at_once(pd, reference_engine):
    failed = admin(pd.admin_socket, "status")["failed_requests"]
    s = Streams(pd, seed0=100)
    s.decoding()
    resumed = stall(pd, 2 * SEND_TIMEOUT + 1)
    s.join(60)
    want = texts(reference_engine, s.prompts)
    errors = [i for i in range(STREAMS) if s.results[i][0] == "error"]
    assert errors, "the stall outlasted the send timeout: the node gave streams up"
    for i in range(STREAMS):
        if i in errors:
            assert "could not reach the coordinator" in s.results[i][1]
            assert s.ended[i] - resumed < 15, "an error event at once, not at the client's timeout"
        else:
            assert s.results[i] == ("ok", want[i])
    assert admin(pd.admin_socket, "status")["failed_requests"] - failed == len(errors)
    settled(pd)
    # the cluster serves on
    again = pd.client(timeout=60).completions.create(model=MODEL, prompt=prompt(999), max_tokens=8, temperature=0,
                                                     extra_body={"ignore_eos": True})
    assert again.choices[0].text == reference_engine.tokenizer.decode(
        reference_tokens(reference_engine, [prompt(999)], 8)[0])
