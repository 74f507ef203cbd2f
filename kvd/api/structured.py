"""Structured output as clients ask for it: OpenAI's ``response_format`` and
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` and
``structured_outputs``, read into one ``engine.structured.spec.StructuredOutput``.

=======================================================  ===============
body                                                     spec kind
=======================================================  ===============
``response_format: {"type": "text"}`` (or absent)        none
``response_format: {"type": "json_object"}``             ``json_object``
``response_format: {"type": "json_schema",``
``"json_schema": {"name", "schema", "strict"}}``         ``json_schema``
``guided_json``: a schema (object, or its JSON text)     ``json_schema``
``guided_regex``: a pattern                              ``regex``
``guided_choice``: a list of strings                     ``choice``
``structured_outputs: {"json" | "regex" | "choice" |``
``"json_object": true}``                                 as above
=======================================================  ===============

At most one of them may be given. A bad shape raises ``StructuredOutputError``
whose ``param`` names the field (kvd/api/schema.py makes it a 400); whether the spec compiles is the grammar compiler's to say
(``check`` at the front door, on a worker thread).
"""

from __future__ import annotations

import json
from typing import Any

from engine.structured.spec import StructuredOutput, StructuredOutputError

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "json_object")


def structured_field(body: dict) -> str | None:
    """The body field that asks for structured output (``response_format`` of type
    text does not), or None. Assumes ``parse_structured(body)`` accepted it."""
    for name in FIELDS:
        value = body.get(name)
        if value is not None and not (name == "response_format" and value.get("type") == "text"):
            return name
    return None


def parse_structured(body: dict) -> StructuredOutput | None:
    """The spec a request body asks for (module docstring), None for plain text.
    Raises StructuredOutputError naming the field for a bad shape or more than one field."""
    given = [name for name in FIELDS if body.get(name) is not None]
    specs = [(name, _parse(name, body[name])) for name in given]
    specs = [(name, spec) for name, spec in specs if spec is not None]
    if len(specs) > 1:
        raise bad(specs[1][0], f"only one kind of structured output may be given; got {specs[0][0]} and "
                  f"{specs[1][0]}")
    return specs[0][1] if specs else None


def _parse(name: str, value: Any) -> StructuredOutput | None:
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        return _guided(name, value)
    except StructuredOutputError as exc:
        if exc.param != "structured":                   # named already
            raise
        raise bad(name, f"{name}: {exc}", exc.code) from None


def _response_format(fmt: Any) -> StructuredOutput | None:
    if not isinstance(fmt, dict):
        raise bad("response_format", "'response_format' must be an object", "invalid_type")
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise bad("response_format.type", f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, "
                  f"got {str(kind)[:40]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "response_format of type json_schema needs 'json_schema', "
                  "an object with the schema under 'schema'", "invalid_type")
    if not isinstance(spec.get("schema"), dict):
        raise bad("response_format.json_schema.schema", "response_format.json_schema.schema must be a JSON "
                  "schema object", "invalid_type" if "schema" in spec else "missing_required_parameter")
    return StructuredOutput.json_schema(spec["schema"])


def _guided(name: str, value: Any) -> StructuredOutput:
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad(name, "'guided_json' must be a JSON schema: an object, or its JSON text") from None
        if not isinstance(value, dict):
            raise bad(name, "'guided_json' must be a JSON schema object", "invalid_type")
        return StructuredOutput.json_schema(value)
    if name == "guided_regex":
        if not isinstance(value, str):
            raise bad(name, "'guided_regex' must be a string", "invalid_type")
        return StructuredOutput("regex", value)
    if not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
        raise bad(name, "'guided_choice' must be a list of strings", "invalid_type")
    return StructuredOutput("choice", tuple(value))


def _structured_outputs(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise bad("structured_outputs", "'structured_outputs' must be an object", "invalid_type")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise bad(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]} is not supported; "
                  f"only one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    if len(given) != 1:
        raise bad("structured_outputs", f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    (key, v), = given.items()
    if key == "json_object":
        if v is not True:
            raise bad("structured_outputs.json_object", "structured_outputs.json_object must be true", "invalid_type")
        return StructuredOutput("json_object")
    return _guided({"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice"}[key], v)


def bad(param: str, message: str, code: str = "invalid_value") -> StructuredOutputError:
    return StructuredOutputError(message, code, param)
