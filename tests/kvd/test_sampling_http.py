"""Sampling over real HTTP (`kvd serve --model tiny`): no request can stop the
engine for the others (a temperature too small to divide by is greedy; every
parameter at its extremes runs beside greedy requests, which keep their
reference text); logit_bias, repetition_penalty and min_p do what they say,
token-exact with the in-process engine; and fields that would change the
answer but are not implemented are refused with a 400 naming them."""

from __future__ import annotations

import concurrent.futures
import random

import httpx
import openai
import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams

MODEL = "tiny"
N = 8


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine():
    """The plain single-node engine, in this process: the reference tokens."""
    return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", kv_blocks=256,
                                              host_kv_blocks=0, max_model_len=512))


def ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(rng.randint(6, 30))]


def ref_text(engine, prompt: list[int], **kw) -> str:
    params = SamplingParams(max_tokens=N, ignore_eos=True, **{"temperature": 0.0, **kw})
    return engine.tokenizer.decode(engine.generate([prompt], params)[0])


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.base + path, json={"model": MODEL, **body}, timeout=60)


def complete(server, prompt: list[int], **kw) -> str:
    r = post(server, {"prompt": prompt, "max_tokens": N, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# ------------------------------------------------------------ nothing stops the engine
@pytest.mark.parametrize("temperature", [1e-300, 1e-46, 5e-324, -0.0, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy_and_the_server_serves_on(server, engine, temperature):
    p, q = ids(1), ids(2)
    assert complete(server, p, temperature=temperature) == ref_text(engine, p)
    assert complete(server, q, temperature=0) == ref_text(engine, q)          # the engine serves on
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}


EXTREMES = [dict(temperature=2), dict(temperature=1e-300, seed=0), dict(top_p=1e-300), dict(top_p=1),
            dict(top_k=1), dict(top_k=10**9), dict(top_k=2**31 - 1), dict(seed=0), dict(seed=2**63 - 1),
            dict(min_p=1e-300), dict(min_p=1), dict(repetition_penalty=1e-300), dict(repetition_penalty=2),
            dict(logit_bias={"0": -100, "1": 100}, temperature=2), dict(min_tokens=N, temperature=2)]
AS_GREEDY = [dict(temperature=1e-300, seed=0), dict(top_p=1e-300), dict(top_k=1), dict(min_p=1)]


def test_every_parameter_at_its_extremes_beside_greedy_requests(server, engine):
    prompts = [ids(10 + i) for i in range(4)]
    bodies = [(p, {"temperature": 0}) for p in prompts]
    bodies += [(prompts[i % 4], {"temperature": 1.0, **kw}) for i, kw in enumerate(EXTREMES)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        texts = list(pool.map(lambda b: complete(server, b[0], **b[1]), bodies))
    refs = [ref_text(engine, p) for p in prompts]
    assert texts[:4] == refs
    for i, kw in enumerate(EXTREMES):
        if kw in AS_GREEDY:
            assert texts[4 + i] == refs[i % 4], kw
    assert complete(server, prompts[0], temperature=0) == refs[0]


@pytest.mark.parametrize("body,param", [
    ({"top_k": 2**63}, "top_k"), ({"top_k": 2**31}, "top_k"), ({"seed": 2**63}, "seed"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 2}, "min_p"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),                      # outside the vocabulary
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": "x"}, "logit_bias"),
    ({"logit_bias": [5, 1]}, "logit_bias"), ({"logit_bias": {"five": 1}}, "logit_bias"),
])
def test_values_the_engine_cannot_represent_are_refused(server, body, param):
    r = post(server, {"prompt": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


# ------------------------------------------------------- fields that change the answer
REFUSED = [
    ("/v1/completions", {"suffix": "the end"}, "suffix"),
    ("/v1/completions", {"suffix": ""}, "suffix"),
    ("/v1/completions", {"guided_grammar": "start: /a+/"}, "guided_grammar"),
    ("/v1/chat/completions", {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": "json_object"}, "response_format"),
    ("/v1/chat/completions", {"tools": "x"}, "tools"),
    ("/v1/chat/completions", {"tools": ["x"]}, "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": 5}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}], "function_call": {"name": "f"}}, "function_call"),
]


@pytest.mark.parametrize("path,body,param", REFUSED)
def test_a_field_that_would_change_the_answer_is_refused_by_name(server, path, body, param):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = post(server, {**base, "max_tokens": 2, **body}, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["code"] in ("invalid_value", "invalid_type") and param in err["message"]


def test_the_openai_client_gets_a_bad_request_for_each_refused_field(client):
    msgs = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    calls = [
        ("suffix", lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="!")),
        ("guided_grammar", lambda: client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, extra_body={"guided_grammar": "start: /a+/"})),
        ("tool_choice", lambda: client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, tools=[tool], tool_choice="required")),
        ("tool_choice", lambda: client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, tools=[tool],
            tool_choice={"type": "function", "function": {"name": "f"}})),
        ("response_format.type", lambda: client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, response_format={"type": "yaml"})),
        ("logit_bias", lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                         logit_bias={"5": 200})),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.body["param"] == param


def test_tools_the_model_may_leave_uncalled_are_accepted(server, engine):
    """tools with tool_choice absent, "none" or "auto": the answer may be text, and is
    (the tools are not shown to the model): the same text as without them."""
    tool = {"type": "function", "function": {"name": "f"}}
    base = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
    plain = post(server, base, "/v1/chat/completions").json()["choices"][0]["message"]["content"]
    for extra in ({"tools": [tool]}, {"tools": [tool], "tool_choice": "none"},
                  {"tools": [tool], "tool_choice": "auto"}, {"response_format": {"type": "text"}}):
        r = post(server, {**base, **extra}, "/v1/chat/completions")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain, extra


# ---------------------------------------------------------- the adjustments, implemented
def test_logit_bias_forces_its_token_greedy_and_seeded(server, client, engine):
    tok = engine.tokenizer
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        out = client.completions.create(model=MODEL, prompt=ids(20), max_tokens=N, logit_bias={"1234": 100},
                                        extra_body={"ignore_eos": True}, **kw)
        assert out.choices[0].text == tok.decode([1234] * N) and out.usage.completion_tokens == N
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=N, temperature=0, logit_bias={"1234": 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tok.decode([1234] * N)
    # -100 on the greedy first token: another one comes first
    p = ids(21)
    first = engine.generate([p], SamplingParams(max_tokens=1, temperature=0.0))[0][0]
    got = complete(server, p, temperature=0, logit_bias={str(first): -100})
    assert got == ref_text(engine, p, logit_bias=((first, -100.0),)) != ref_text(engine, p)


@pytest.mark.parametrize("kw,changes", [
    (dict(repetition_penalty=2.0), True),
    (dict(repetition_penalty=0.5), False),            # greedy repeats itself here already
    (dict(repetition_penalty=1.5, logit_bias={"321": 5}), True),
    (dict(temperature=0.1, seed=7, min_p=0.3), True),
    (dict(temperature=0.1, seed=8, repetition_penalty=1.3, top_k=40), True),
    (dict(temperature=1.0, seed=9, min_p=0.05, top_p=0.9, logit_bias={"50": 2}), True),
])
def test_repetition_penalty_and_min_p_are_token_exact_with_the_engine(server, engine, kw, changes):
    p = ids(30)
    engine_kw = {k: (tuple((int(t), float(b)) for t, b in v.items()) if k == "logit_bias" else v)
                 for k, v in kw.items()}
    want = ref_text(engine, p, **engine_kw)
    got = complete(server, p, **{"temperature": 0, **kw})
    assert got == want and complete(server, p, **{"temperature": 0, **kw}) == got     # and it repeats
    off = {k: v for k, v in kw.items() if k not in ("repetition_penalty", "min_p", "logit_bias")}
    assert (got != complete(server, p, **{"temperature": 0, **off})) == changes
