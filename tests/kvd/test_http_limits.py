"""Availability of `kvd serve` against clients that ask too much (issue 9):
huge prompts and stop strings, bodies too big or too slow, unfinished request
heads, connection floods, random bodies. Real processes, real sockets."""

from __future__ import annotations

import concurrent.futures
import json
import random
import select
import socket
import threading
import time

import httpx
import openai
import pytest

from .conftest import TINY_ARGS, ServeProcess

MODEL = "tiny"
HEAD_TIMEOUT = 2.0
MAX_CONNECTIONS = 24


@pytest.fixture(scope="module")
def big():
    """Default limits; a 2048-token context, so prompts near the byte bound are long to tokenize."""
    s = ServeProcess(*TINY_ARGS, "--max-model-len", "2048").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tight():
    """Small HTTP limits, to reach each of them quickly."""
    s = ServeProcess(*TINY_ARGS, "--max-body-bytes", "65536", "--body-timeout", "1",
                     "--header-timeout", str(HEAD_TIMEOUT),
                     "--max-connections", str(MAX_CONNECTIONS)).wait_ready()
    yield s
    s.stop()


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


class HealthProbe:
    """Polls /health from a thread; ``worst`` is the slowest answer (a miss counts its timeout)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    self.statuses.append(c.get(self.base + "/health").status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                self.latencies.append(time.monotonic() - t0)
                time.sleep(0.05)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)

    @property
    def worst(self) -> float:
        return max(self.latencies)


# ----------------------------------------------------------------- prompts

def test_a_huge_prompt_is_refused_unread_while_health_and_a_stream_go_on(big):
    """A 4 MiB prompt took 5 s to tokenize on the event loop: /health stalled,
    the embedded node was declared dead and the stream in flight failed."""
    client = openai.OpenAI(base_url=big.base + "/v1", api_key="x", max_retries=0, timeout=60)
    result = {}
    stream_done = threading.Event()

    def stream():
        text, finish = [], None
        try:
            for chunk in client.completions.create(model=MODEL, prompt="tell a story", max_tokens=600,
                                                   stream=True, extra_body={"ignore_eos": True}):
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        except openai.APIError as exc:
            finish = f"error: {exc}"
        result.update(finish=finish)
        stream_done.set()
    streamer = threading.Thread(target=stream)
    with HealthProbe(big.base) as probe:
        streamer.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = httpx.post(big.base + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "a " * 2_097_152, "max_tokens": 4})
        refused_in = time.monotonic() - t0
        chat = httpx.post(big.base + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "b " * 2_000_000}]})
        streamer.join(60)
    err = openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "bytes" in err["message"]
    assert openai_error(chat, 400)["code"] == "context_length_exceeded"
    assert refused_in < 3.0, f"a 4 MiB prompt took {refused_in:.1f}s to refuse: was it tokenized?"
    assert result["finish"] == "length"
    assert set(probe.statuses) == {200}
    assert big.metrics().get("kvd_cluster_node_failures_total", 0) == 0


def test_big_prompts_are_tokenized_off_the_event_loop(big):
    """Prompts just under the byte bound (~80k tokens each, over the context)
    are tokenized before they are refused: 32 at once would stall an event
    loop tokenizing them for about 6 s. The coordinator's own measure of its
    loop's stalls (its failure detector's) stays near zero, and /health answers."""
    bound = 2048 * 81                         # max_model_len x the tiny tokenizer's longest token
    prompt = "a " * (bound // 2 - 100)
    stalled = "kvd_coordinator_loop_stalled_seconds_total"
    before = big.metrics()[stalled]
    with HealthProbe(big.base) as probe:
        time.sleep(0.2)
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(lambda _: httpx.post(
                big.base + "/v1/completions", timeout=120,
                json={"model": MODEL, "prompt": prompt, "max_tokens": 1}), range(32)))
        time.sleep(0.2)
    for r in replies:
        err = openai_error(r, 400)
        assert err["code"] == "context_length_exceeded" and "tokens" in err["message"]
    m = big.metrics()
    assert m[stalled] - before < 1.0, f"the event loop stalled {m[stalled] - before:.1f}s"
    assert set(probe.statuses) == {200}
    assert probe.worst < 1.5, f"/health took {probe.worst:.2f}s while prompts were tokenized"
    assert m.get("kvd_cluster_node_failures_total", 0) == 0


# -------------------------------------------------------------------- stop

@pytest.mark.parametrize("extra,param", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop": ["ok", "y" * 1025]}, "stop"),
    ({"stop": "x" * (1 << 20)}, "stop"),             # hung forever: the node refused it unseen
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
])
def test_stop_conditions_are_bounded(big, extra, param):
    r = httpx.post(big.base + "/v1/completions", timeout=20,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert openai_error(r, 400)["param"] == param


def test_stop_at_the_limits_is_served_and_nothing_is_left_in_flight(big):
    r = httpx.post(big.base + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 3, "stop": ["z" * 1024, "q" * 1024, "w", "v"],
        "stop_token_ids": list(range(100, 164))})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] >= 1
    m = big.metrics()
    assert m['kvd_num_requests_in_flight{model_name="tiny"}'] == 0


# ------------------------------------------------------------------ bodies

def test_a_body_over_the_limit_is_413_declared_or_chunked(tight):
    r = httpx.post(tight.base + "/v1/completions", timeout=10,
                   content=json.dumps({"model": MODEL, "prompt": "x" * 70_000}).encode(),
                   headers={"Content-Type": "application/json"})
    assert openai_error(r, 413)["code"] == "body_too_large"

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'"}'
    r = httpx.post(tight.base + "/v1/completions", timeout=10, content=chunks(),
                   headers={"Content-Type": "application/json"})
    assert openai_error(r, 413)["code"] == "body_too_large"


def raw_exchange(port: int, data: bytes, wait: float) -> tuple[bytes, float]:
    """Send ``data`` and read until the server closes; (what came back, seconds until closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        t0 = time.monotonic()
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except socket.timeout:
            pytest.fail(f"connection still open after {wait}s; got {got[:200]!r}")
        return got, time.monotonic() - t0


def test_a_body_that_never_ends_is_408_and_closed(tight):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    got, took = raw_exchange(tight.port, head + b'{"model": "tiny"', wait=10)
    assert got.startswith(b"HTTP/1.1 408")
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"


def test_an_unfinished_request_head_is_closed_after_the_header_timeout(tight):
    with socket.create_connection(("127.0.0.1", tight.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        closed = None
        while time.monotonic() - t0 < 8:           # trickle a header line now and then (slowloris)
            try:
                s.sendall(b"X-Slow: 1\r\n")
                s.settimeout(0.3)
                if s.recv(1024) == b"":
                    closed = time.monotonic() - t0
                    break
            except socket.timeout:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = time.monotonic() - t0
                break
    assert closed is not None, "a slowloris connection was still open after 8s"
    assert closed >= HEAD_TIMEOUT - 0.5


def test_connections_beyond_the_limit_are_refused_while_clients_are_served(tight):
    with httpx.Client(timeout=10) as normal:
        assert normal.get(tight.base + "/health").status_code == 200    # its connection is open
        flood = []
        try:
            for _ in range(MAX_CONNECTIONS + 10):
                s = socket.create_connection(("127.0.0.1", tight.port), timeout=5)
                s.sendall(b"GET /health HTTP/1.1\r\n")                   # and never finish
                flood.append(s)
            # the connection already open is still served; a new one is refused
            assert normal.get(tight.base + "/health").status_code == 200
            r = httpx.get(tight.base + "/health", timeout=5)
            assert openai_error(r, 503)["code"] == "too_many_connections"
            answers = []
            ready, _, _ = select.select(flood, [], [], 1.0)
            for s in ready:
                answers.append(s.recv(4096))
            refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
            assert len(refused) >= 10 and all(b'"code":"too_many_connections"' in a for a in refused)
            # served again once the header timeout closed the flood
            deadline = time.monotonic() + HEAD_TIMEOUT + 10
            while time.monotonic() < deadline:
                try:
                    if httpx.get(tight.base + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                pytest.fail("the server did not serve new clients after the flood timed out")
        finally:
            for s in flood:
                s.close()
    assert tight.metrics()["kvd_http_connections_refused_total"] >= len(refused) + 1


# ------------------------------------------------------------------- fuzz

def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "bigint", "float", "str", "bool", "null", "list", "dict", "longstr"]
    kind = rng.choice(kinds if depth < 2 else kinds[:6])
    if kind == "int":
        return rng.randint(-5, 3000)
    if kind == "bigint":
        return rng.choice([2 ** 63, -(2 ** 63) - 1, 10 ** 30, 2 ** 64])
    if kind == "float":
        return rng.choice([0.0, -1.5, 1e308, 0.5, 2.0, 1e-9])
    if kind == "str":
        return rng.choice(["", "x", "tiny", "\u0000", "é" * 3, "<|im_start|>", "\ud7ff"])
    if kind == "longstr":
        return "z" * rng.choice([1024, 1025, 70_000])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {rng.choice(["role", "content", "type", "text", "include_usage"]): _random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "stop_token_ids", "stream", "stream_options", "n", "min_tokens", "ignore_eos", "logprobs", "echo"]


def test_random_bodies_get_no_5xx_and_only_openai_shaped_errors(tight):
    rng = random.Random(9)
    valid = [("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2})]
    statuses = {}
    with httpx.Client(base_url=tight.base, timeout=60) as c:
        for i in range(400):
            path, body = valid[i % 2]
            body = dict(body)
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(FIELDS)] = _random_value(rng)
            if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
                body["max_tokens"] = min(body["max_tokens"], 8)     # keep generation short
            body.pop("stream", None)
            body.pop("stream_options", None)
            raw = json.dumps(body).encode() if rng.random() < 0.95 else json.dumps(body).encode()[:-3]
            r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text[:300])
            if r.status_code != 200:
                openai_error(r, r.status_code)
    assert statuses.get(200) and statuses.get(400), statuses
