"""One vocabulary for sampling parameters: engine.request.SamplingParams is the
definition, and the HTTP schema and the wire (GenerateRequest.sampling) read
it through SamplingParams.from_dict, so each refuses exactly what the engine
refuses, with the engine's message, and every field arrives as it was sent."""

from __future__ import annotations

from dataclasses import fields

import orjson
import pytest

from engine.request import InvalidParam, SamplingParams
from engine.structured.spec import StructuredOutput
from kvd import protocol as P
from kvd.api.schema import ApiError, parse_completion

# a value the engine refuses -> the param and the code (OpenAI's) named in the error
REFUSED = [
    ({"temperature": 2.5}, "temperature", "invalid_value"),          # the old wire took any temperature >= 0
    ({"temperature": -0.5}, "temperature", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"top_k": -2}, "top_k", "invalid_value"),
    ({"top_k": 1.5}, "top_k", "invalid_type"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": "3"}, "max_tokens", "invalid_type"),
    ({"max_tokens": True}, "max_tokens", "invalid_type"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "invalid_value"),
    ({"seed": -1}, "seed", "invalid_value"),
    ({"seed": 2**63}, "seed", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"stop": ["x" * 1025]}, "stop", "invalid_value"),
    ({"stop": [1]}, "stop", "invalid_type"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "invalid_value"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
    ({"stop_token_ids": "12"}, "stop_token_ids", "invalid_type"),
    ({"ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
    # bounds the engine can represent: top_k is an int32, 2**63 was accepted and wrapped in the kernel
    ({"top_k": 2**63}, "top_k", "invalid_value"),
    ({"top_k": 2**31}, "top_k", "invalid_value"),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"repetition_penalty": 2.5}, "repetition_penalty", "invalid_value"),
    ({"repetition_penalty": "x"}, "repetition_penalty", "invalid_type"),
    ({"min_p": -0.1}, "min_p", "invalid_value"),
    ({"min_p": 1.01}, "min_p", "invalid_value"),
    ({"min_p": True}, "min_p", "invalid_type"),
    ({"logit_bias": "x"}, "logit_bias", "invalid_type"),
    ({"logit_bias": [[1, 2]]}, "logit_bias", "invalid_type"),
    ({"logit_bias": {"1": "5"}}, "logit_bias", "invalid_type"),
    ({"logit_bias": {"1": None}}, "logit_bias", "invalid_type"),
    ({"logit_bias": {"1": 100.5}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1": -101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1" * 11: 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1": 1, "01": 2}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
]


@pytest.mark.parametrize("values,param,code", REFUSED)
def test_a_value_the_engine_refuses_is_refused_at_every_edge_with_its_message(values, param, code):
    with pytest.raises(InvalidParam) as engine:
        SamplingParams.from_dict(values)
    assert engine.value.param == param and engine.value.code == code

    with pytest.raises(ApiError) as http:
        parse_completion({"model": "m", "prompt": "x", **values})
    assert http.value.status == 400 and http.value.param == param
    assert http.value.message == str(engine.value) and http.value.code == engine.value.code

    header = orjson.dumps({"type": "GenerateRequest", "v": P.PROTOCOL_VERSION, "id": "g", "request_id": "r",
                           "prompt_token_ids": [1], "sampling": values})
    err = P.decode(header, [])
    assert isinstance(err, P.ProtocolError) and err.reason == "invalid_field"
    assert err.detail == str(engine.value)
    with pytest.raises(ValueError, match=param):
        P.GenerateRequest(request_id="r", prompt_token_ids=(1,), sampling=values)


@pytest.mark.parametrize("key", ["best_of", "presence_penalty", "frequency_penalty"])
def test_the_wire_refuses_parameters_the_engine_does_not_have(key):
    # the old wire took these and the node refused them after the fact
    header = orjson.dumps({"type": "GenerateRequest", "v": P.PROTOCOL_VERSION, "id": "g", "request_id": "r",
                           "prompt_token_ids": [1], "sampling": {key: 0.5}})
    err = P.decode(header, [])
    assert isinstance(err, P.ProtocolError) and err.reason == "invalid_field"
    assert err.detail == f"unknown sampling parameter {key!r}"


# a non-default value for every field, as an OpenAI body spells it
BODY = {"max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 1234,
        "stop": ["foo", "bar"], "stop_token_ids": [3, 4], "ignore_eos": True, "min_tokens": 2,
        "logit_bias": {"7": -100.0, "50": 2.5}, "repetition_penalty": 1.3, "min_p": 0.05,
        "logprobs": 3, "prompt_logprobs": 3, "structured": {"kind": "regex", "value": "[a-z]+"}}
# OpenAI's spelling of the fields it names otherwise: echo asks for the prompt's logprobs,
# guided_regex (one of the structured-output fields) for a grammar
HTTP_BODY = ({k: v for k, v in BODY.items() if k not in ("prompt_logprobs", "structured")}
             | {"echo": True, "guided_regex": "[a-z]+"})
EXPECTED = dict(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=1234, stop=("foo", "bar"),
                stop_token_ids=(3, 4), ignore_eos=True, min_tokens=2, logit_bias=((7, -100.0), (50, 2.5)),
                repetition_penalty=1.3, min_p=0.05, logprobs=3, prompt_logprobs=3,
                structured=StructuredOutput("regex", "[a-z]+"))


def test_every_field_round_trips_http_wire_engine():
    names = {f.name for f in fields(SamplingParams)}
    assert set(BODY) == names, "a SamplingParams field this test does not carry"
    defaults = SamplingParams()
    assert all(getattr(defaults, k) != v for k, v in EXPECTED.items()), "each value must differ from its default"

    params = parse_completion({"model": "m", "prompt": "x", **HTTP_BODY}).params   # HTTP
    assert params == SamplingParams(**EXPECTED)
    header, frames = P.encode(P.GenerateRequest(id="g", request_id="r", prompt_token_ids=(1, 2),
                                                sampling=params))                  # the coordinator
    assert orjson.loads(header)["sampling"] == BODY                                # the wire's JSON
    msg = P.decode(header, frames)                                                 # the node
    assert isinstance(msg, P.GenerateRequest) and msg.sampling == params
    for name, value in EXPECTED.items():                                           # what the engine gets
        assert getattr(msg.sampling, name) == value and type(getattr(msg.sampling, name)) is type(value)


def test_integers_where_numbers_are_due_and_absent_keys():
    assert SamplingParams.from_dict({"temperature": 0, "top_p": 1}) == SamplingParams(temperature=0.0)
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict(SamplingParams(seed=5).to_dict()) == SamplingParams(seed=5)
    with pytest.raises(InvalidParam, match="must be an object"):
        SamplingParams.from_dict([1, 2])


def test_a_structured_output_spec_is_validated_on_the_wire():
    def decode(spec):
        header = orjson.dumps({"type": "GenerateRequest", "v": P.PROTOCOL_VERSION, "id": "g", "request_id": "r",
                               "prompt_token_ids": [1], "sampling": {"structured": spec}})
        return P.decode(header, [])

    ok = decode({"kind": "json_schema", "value": '{"type": "object"}'})
    assert ok.sampling.structured == StructuredOutput.json_schema({"type": "object"})
    for bad in ({"kind": "grammar", "value": "x"}, {"kind": "regex"}, {"kind": "choice", "value": []},
                {"kind": "json_schema", "value": "[1"}, "regex", {"kind": "regex", "value": "a", "x": 1}):
        err = decode(bad)
        assert isinstance(err, P.ProtocolError) and err.reason == "invalid_field", bad
    # the body's own "structured" is not a way in: only the OpenAI and vLLM fields are
    assert parse_completion({"model": "m", "prompt": "x", "structured": {"kind": "regex", "value": "a"}}
                            ).params.structured is None
