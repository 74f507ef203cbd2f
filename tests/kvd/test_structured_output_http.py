"""Structured output over real HTTP (`kvd serve --model tiny`) with the
official openai client: response_format (json_object, json_schema) and vLLM's
guided_json / guided_regex / guided_choice, chat and completions, streaming
and not. The text parses and keeps to the spec, greedy and seeded answers are
reproducible and token-exact with the in-process engine, and a spec that is
malformed or does not compile is a 400 naming its field."""

from __future__ import annotations

import json
import re

import openai
import pytest

from engine.request import SamplingParams
from engine.structured.spec import StructuredOutput

from .test_sampling_http import client, engine, ids  # noqa: F401  (fixtures: the openai client, the reference engine)

MODEL = "tiny"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b", "c"]}}}}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["red", "green", "dark blue"]
SAMPLINGS = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}]


def keeps_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "tags"} and isinstance(value["name"], str) and len(value["name"]) <= 6
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b", "c"})


FORMATS = {
    "json_schema": ({"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
                    keeps_schema, StructuredOutput.json_schema(SCHEMA)),
    "guided_json": ({"extra_body": {"guided_json": SCHEMA}}, keeps_schema, StructuredOutput.json_schema(SCHEMA)),
    "guided_regex": ({"extra_body": {"guided_regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None,
                     StructuredOutput("regex", REGEX)),
    "guided_choice": ({"extra_body": {"guided_choice": CHOICES}}, lambda t: t in CHOICES,
                      StructuredOutput("choice", tuple(CHOICES))),
}


def complete(client, prompt, stream: bool, kwargs: dict, sampling: dict) -> tuple[str, str]:
    if "response_format" in kwargs:       # not in the client's completions signature: vLLM's extension there
        kwargs = {"extra_body": kwargs}
    args = dict(model=MODEL, prompt=prompt, max_tokens=60, stream=stream, **kwargs, **sampling)
    if not stream:
        choice = client.completions.create(**args).choices[0]
        return choice.text, choice.finish_reason
    text, finish = [], None
    for chunk in client.completions.create(**args):
        for c in chunk.choices:
            text.append(c.text)
            finish = c.finish_reason or finish
    return "".join(text), finish


def chat(client, stream: bool, kwargs: dict, sampling: dict) -> tuple[str, str]:
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=60,
                stream=stream, **kwargs, **sampling)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = [], None
    for chunk in client.chat.completions.create(**args):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_completions_keep_to_the_spec_and_equal_the_engine(client, engine, fmt, sampling):
    kwargs, keeps, spec = FORMATS[fmt]
    prompt = ids(hash(fmt) % 1000)
    want = engine.tokenizer.decode(engine.generate([prompt], SamplingParams(max_tokens=60, structured=spec,
                                                                            **sampling))[0])
    for stream in (False, True):
        text, finish = complete(client, prompt, stream, kwargs, sampling)
        assert finish == "stop" and keeps(text), text
        assert text == want


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_chat_keeps_to_the_spec_and_is_reproducible(client, fmt, sampling):
    kwargs, keeps, _ = FORMATS[fmt]
    first, finish = chat(client, False, kwargs, sampling)
    assert finish == "stop" and keeps(first), first
    assert chat(client, True, kwargs, sampling) == (first, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_is_a_json_object_or_its_prefix_when_cut_by_length(client, stream):
    text, finish = chat(client, stream, {"response_format": {"type": "json_object"}}, {"temperature": 0.0})
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format", "strin"),
    ({"guided_json": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json", "nowhere"),
    ({"guided_regex": "([a-z"}, "guided_regex", "regex"),
    ({"guided_regex": 5}, "guided_regex", "string"),
    ({"guided_choice": []}, "guided_choice", "choices"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"guided_grammar": "start: \"a\""}, "guided_grammar", "not supported"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "not supported"),
])
def test_a_bad_spec_is_a_400_naming_its_field(client, body, param, needle):
    for create in (lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=body),
                   lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=4, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as err:
            create()
        error = err.value.body
        assert error["param"] == param and needle in error["message"], error
