"""`kvd serve` with a KV pool far smaller than its load: every stream completes.

Sixteen concurrent streams over a 6-block device tier (swap preemption, the
default), each needing nearly the whole tier by its end, plus a short request
sent while they run: all complete, each with the text it gets alone, and the
preempted work comes back (nothing left swapped or owned).
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from .conftest import running_serve

MODEL = "tiny"
STREAMS = 16
MAX_TOKENS = 72
ARGS = ("--model", "tiny", "--dtype", "float32", "--kv-blocks", "6", "--host-kv-blocks", "256",
        "--max-model-len", "96", "--num-threads", "1")


@pytest.fixture(scope="module")
def small_server():
    with running_serve(*ARGS) as s:
        yield s


def prompt(i: int) -> str:
    """A distinct prompt of over one block (16 tokens): its block is cached while it runs."""
    return f"Stream {i}: the quick brown fox jumps over the lazy dog and runs far away"


def stream_text(client: openai.OpenAI, i: int) -> tuple[str, str]:
    kw = dict(model=MODEL, prompt=prompt(i), max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True})
    kw.update(temperature=0) if i % 2 == 0 else kw.update(temperature=0.8, seed=i)
    text, finish = [], None
    for chunk in client.completions.create(**kw):
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def test_sixteen_streams_over_a_six_block_pool_all_complete(small_server):
    client = openai.OpenAI(base_url=small_server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    usage = client.completions.create(model=MODEL, prompt=prompt(0), max_tokens=1).usage
    assert 16 < usage.prompt_tokens and usage.prompt_tokens + MAX_TOKENS <= 96   # 1 full block; <= 6 at the end
    pool = concurrent.futures.ThreadPoolExecutor(STREAMS + 1)
    try:
        streams = [pool.submit(stream_text, client, i) for i in range(STREAMS)]
        short = pool.submit(lambda: client.completions.create(model=MODEL, prompt="Hi there", max_tokens=4,
                                                              temperature=0, extra_body={"ignore_eos": True}))
        _, late = concurrent.futures.wait(streams + [short], timeout=90)
        if late:
            state = {k: v for k, v in small_server.metrics().items()
                     if "preemptions" in k or "requests_swapped" in k or "generation_tokens" in k}
            pytest.fail(f"{len(late)} requests still running after 90 s: {state}")
        results = [f.result() for f in streams]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)    # a hung stream ends when the server stops
    assert short.result().usage.completion_tokens == 4
    assert all(finish == "length" for _, finish in results)
    m = small_server.metrics()
    assert m['kvd_preemptions_total{model_name="tiny"}'] > 0, "the pool never ran short: the test tests nothing"
    assert m['kvd_num_requests_swapped{model_name="tiny"}'] == 0
    assert m['kvd_kv_blocks_request_owned{model_name="tiny",tier="host"}'] == 0
    # each stream's text is the one it gets alone (greedy and seeded)
    assert [text for text, _ in results] == [stream_text(client, i)[0] for i in range(STREAMS)]
