"""Logprobs through the cluster, over real daemons: a disaggregated request's
token 0 (and the echoed prompt's logprobs) come from the prefill node that
computed them, the rest from the decode node; a request recovered on a
replica after its node was killed keeps one logprob per token. All equal the
single-node engine's, greedy and seeded."""

from __future__ import annotations

import threading
import time

import pytest

from engine.request import SamplingParams

from .conftest import MODEL, admin
from .test_disagg import ROLES, node_status, prompt, wait_idle
from .test_disagg import start as start_pd
from .test_recovery import MAX_TOKENS, busiest, reference_engine, requests, wait_replicated  # noqa: F401
from .test_recovery import start as start_ring

TOL = 1e-4


def reference(engine, ids: list[int], **kw):
    """The single-node engine's merged output."""
    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, ids, SamplingParams(ignore_eos=True, **kw))
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            got = out if got is None else got.merge(out)
    return got


def completion(client, ids: list[int], stream: bool, **kw) -> tuple[str, list, list[str]]:
    """(text, token_logprobs, tokens) of one choice, streamed or not."""
    r = client.completions.create(model=MODEL, prompt=ids, stream=stream, extra_body={"ignore_eos": True}, **kw)
    choices = [c.choices[0] for c in r if c.choices] if stream else r.choices
    return ("".join(c.text for c in choices), sum((c.logprobs.token_logprobs for c in choices), []),
            sum((c.logprobs.tokens for c in choices), []))


def close(got: list, want: list) -> bool:
    return len(got) == len(want) and all(g is w is None or abs(g - w) <= TOL for g, w in zip(got, want))


@pytest.mark.parametrize("stream", [False, True])
def test_a_disaggregated_request_has_the_logprobs_of_the_node_that_computed_each_token(tmp_path, reference_engine,
                                                                                     stream):
    c = start_pd(tmp_path, "zmq+tcp", ROLES)
    try:
        client = c.client(timeout=60)
        tok = reference_engine.tokenizer
        for i, sampling in enumerate([dict(temperature=0.0), dict(temperature=1.0, seed=9, top_p=0.9)]):
            ids = prompt(80 + i, 50)
            ref = reference(reference_engine, ids, max_tokens=10, logprobs=2, prompt_logprobs=2, **sampling)
            text, logprobs, tokens = completion(client, ids, stream, max_tokens=10, echo=True, logprobs=2,
                                                **sampling)
            assert text == tok.decode(ids, skip_special_tokens=False) + tok.decode(ref.new_token_ids)
            want = [None] + [e.logprob for e in ref.prompt_logprobs] + [e.logprob for e in ref.logprobs]
            assert close(logprobs, want), sampling
            assert len(tokens) == len(ids) + 10
        assert node_status(c, "d1")["disaggregation"]["decode"]["remote"] >= 2
        wait_idle(c, ROLES)
    finally:
        c.stop()


def test_a_recovered_request_keeps_one_logprob_per_token(tmp_path, reference_engine):
    c = start_ring(tmp_path, "zmq+tcp")
    try:
        client = c.client(timeout=120)
        # long enough to outlive the kill and the recovery: one stream alone decodes faster than
        # the streams of test_recovery, while its replica's progress still travels by heartbeat
        ids, n = prompt(5, 40), 3 * MAX_TOKENS
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["ok"] = completion(client, ids, True, max_tokens=n, temperature=0, logprobs=1)
            except Exception as exc:  # noqa: BLE001 -- reported by the assertion below
                result["error"] = exc
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not requests(c) and time.monotonic() < deadline:
            time.sleep(0.02)
        victim = busiest(c)
        try:
            wait_replicated(c, victim, 32)
        except AssertionError as exc:
            thread.join(30)
            raise AssertionError(f"{exc}; the request: {result}") from None
        before = admin(c.admin_socket, "status")["recoveries"].get("replica/resumed", 0)
        c.nodes[victim].kill9()
        thread.join(180)
        assert "ok" in result, result
        text, logprobs, tokens = result["ok"]
        ref = reference(reference_engine, ids, max_tokens=n, temperature=0.0, logprobs=1)
        assert text == reference_engine.tokenizer.decode(ref.new_token_ids)
        assert len(tokens) == n and close(logprobs, [e.logprob for e in ref.logprobs])
        assert admin(c.admin_socket, "status")["recoveries"].get("replica/resumed", 0) == before + 1
    finally:
        c.stop()
