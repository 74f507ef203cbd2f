"""``StructuredOutput``: what a request's output must match, as it travels.

One definition end to end: the HTTP schema builds one from ``response_format``
or vLLM's ``guided_*`` fields (kvd/api/structured.py), ``SamplingParams`` holds
it (field ``structured``), the wire carries it as a JSON object
(``to_dict``/``from_dict``, validated on arrival) and the engine compiles it
(engine/structured/grammar.py). Pure Python: no grammar library here, so the
coordinator and the wire can validate a spec's shape without one.

Kinds and values:

===============  ======================================================
``json_object``  any JSON object; ``value`` is None
``json_schema``  ``value``: the schema, a JSON object as canonical JSON text
                 (compact, keys sorted but a ``properties`` object's: their
                 order is the order the output's keys are written in), so
                 equal schemas are equal specs
``regex``        ``value``: the pattern (Rust regex syntax, as llguidance reads it)
``choice``       ``value``: a tuple of the strings allowed, one of which is the output
===============  ======================================================

Construction validates and raises ``engine.request.InvalidParam``-compatible
``StructuredOutputError`` (a ``ValueError`` with ``param``), naming the bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice")
# Bounds on a spec (it travels in one wire header, kvd.wire's max_header_bytes, and is
# compiled per distinct value): the schema's or the pattern's characters, the choices.
MAX_SPEC_CHARS = 65536
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096


class StructuredOutputError(ValueError):
    """A spec is refused: ``param`` names the request field (``structured``
    unless the caller knows better), ``code`` is OpenAI's ``invalid_type`` or
    ``invalid_value``. ``engine.request.InvalidParam`` re-raises it as its own."""

    def __init__(self, message: str, code: str = "invalid_value", param: str = "structured") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class StructuredOutput:
    """A request's output grammar (module docstring). Immutable and hashable:
    it keys the compiled-grammar cache."""

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind must be one of {', '.join(KINDS)}, "
                                        f"got {str(self.kind)[:40]!r}")
        v = self.value
        if self.kind == "json_object":
            if v is not None:
                raise StructuredOutputError("a json_object spec has no value")
        elif self.kind == "choice":
            if not (isinstance(v, tuple) and all(isinstance(c, str) for c in v)):
                raise StructuredOutputError("choices must be a list of strings", "invalid_type")
            if not 0 < len(v) <= MAX_CHOICES or not all(0 < len(c) <= MAX_CHOICE_CHARS for c in v):
                raise StructuredOutputError(f"choices must be 1 to {MAX_CHOICES} non-empty strings of at most "
                                            f"{MAX_CHOICE_CHARS} characters")
        else:
            what = "a JSON schema" if self.kind == "json_schema" else "a regex"
            if not isinstance(v, str):
                raise StructuredOutputError(f"{what} must be given as a string", "invalid_type")
            if not 0 < len(v) <= MAX_SPEC_CHARS:
                raise StructuredOutputError(f"{what} must have 1 to {MAX_SPEC_CHARS} characters, got {len(v)}")
            if self.kind == "json_schema":
                try:
                    schema = json.loads(v)
                except ValueError:
                    raise StructuredOutputError("a JSON schema must be JSON text") from None
                if not isinstance(schema, (dict, bool)):
                    raise StructuredOutputError("a JSON schema must be an object", "invalid_type")
                object.__setattr__(self, "value", canonical_json(schema))

    @classmethod
    def json_schema(cls, schema: object) -> "StructuredOutput":
        """The spec of a schema given as a parsed JSON value (an HTTP body's)."""
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("a JSON schema must be an object", "invalid_type")
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def from_dict(cls, values: object) -> "StructuredOutput":
        """From the wire's JSON object ``{"kind", "value"}`` (a list for a tuple).
        Raises StructuredOutputError on any other shape or a bad value."""
        if not isinstance(values, dict) or set(values) - {"kind", "value"}:
            raise StructuredOutputError('structured must be an object {"kind", "value"}', "invalid_type")
        value = values.get("value")
        return cls(values.get("kind"), tuple(value) if isinstance(value, list) else value)

    def to_dict(self) -> dict:
        """The JSON object ``from_dict`` reads back to an equal spec."""
        return {"kind": self.kind, "value": list(self.value) if isinstance(self.value, tuple) else self.value}


def _ordered(value: object, keep_order: bool = False) -> object:
    """``value`` with every object's keys sorted but a ``properties`` object's."""
    if isinstance(value, dict):
        items = value.items() if keep_order else sorted(value.items(), key=lambda kv: str(kv[0]))
        return {k: _ordered(v, k == "properties" and isinstance(v, dict)) for k, v in items}
    if isinstance(value, list):
        return [_ordered(v) for v in value]
    return value


def canonical_json(value: object) -> str:
    """``value`` as JSON text with no spaces and its keys sorted, but those of a
    ``properties`` object, which keep their order: that order is the order the
    output's keys are written in (one text per schema).
    Raises StructuredOutputError when it is deeper or larger than a spec may be."""
    try:
        text = json.dumps(_ordered(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as exc:
        raise StructuredOutputError(f"a JSON schema must be plain JSON: {exc}"[:200]) from None
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"a JSON schema must have at most {MAX_SPEC_CHARS} characters, got {len(text)}")
    return text
