"""Validation of OpenAI request bodies into typed requests.

Every rule raises :class:`ApiError` carrying OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) and an HTTP status, so a
bad body never reaches the engine. Unknown fields are ignored, as vLLM does;
known fields with the wrong type or range are rejected, and so is a known
field that would change the answer but is not implemented (``UNSUPPORTED``,
``_refuse_unsupported``): a client is never answered as if it had been.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.request import MAX_LOGPROBS, InvalidParam, SamplingParams
from engine.structured.spec import StructuredOutputError
from kvd.api.structured import parse_structured, structured_field


class ApiError(Exception):
    """An error for the client, in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ApiRequest:
    """A validated completion or chat request. Exactly one of prompt/messages is set."""

    model: str
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    structured_field: str | None = None     # the body field params.structured came from (kvd/api/structured.py)
    n: int = 1                   # choices to generate (kvd/api/copies.py)
    echo: bool = False           # completions: the prompt comes first in each choice's text (and logprobs)
    echo_only: bool = False      # echo with max_tokens 0: the one token params ask is not shown


def _get(body: dict, name: str, types: type | tuple, default: Any = None, nullable: bool = True) -> Any:
    if name not in body or (body[name] is None and nullable):
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(name, f"'{name}' must be of type {_tname(types)}, got a boolean", "invalid_type")
    if not isinstance(value, types):
        raise bad(name, f"'{name}' must be of type {_tname(types)}, got {type(value).__name__}",
                  "invalid_type")
    return value


def _tname(types: type | tuple) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in ts))


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
# SamplingParams fields a body spells OpenAI's way (_logprob_fields), never passed through
OPENAI_SPELLED = frozenset({"logprobs", "prompt_logprobs"})
MAX_N = 64                   # choices one request may ask (n)

# Fields that change what the answer must be and are not implemented: refused
# whenever they are given (not null). Structured output, fill-in-the-middle.
UNSUPPORTED = {
    "suffix": "'suffix' (fill-in-the-middle) is not supported",
    "guided_grammar": "'guided_grammar' (a context-free grammar) is not supported; structured output takes "
                      "response_format, guided_json, guided_regex or guided_choice",
    "guided_whitespace_pattern": "'guided_whitespace_pattern' is not supported: JSON output has no free whitespace",
}
# tool_choice / function_call values under which the model may answer in text:
# the tools are then accepted and not shown to the model (no tool calls).
TEXT_TOOL_CHOICES = (None, "none", "auto")


def _refuse_unsupported(body: dict) -> None:
    """Refuse what would change the answer's contract and is not implemented:
    a context-free grammar (``guided_grammar``), a forced tool call (``tool_choice`` "required" or a named
    function, the legacy ``function_call`` alike), fill-in-the-middle. Malformed
    ``tools``/``functions`` are refused by type."""
    for name, message in UNSUPPORTED.items():
        if body.get(name) is not None:
            raise bad(name, message)
    for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        given = _get(body, tools, list, None)
        if given is not None and not all(isinstance(t, dict) for t in given):
            raise bad(tools, f"'{tools}' must be an array of objects", "invalid_type")
        value = body.get(choice)
        if value not in TEXT_TOOL_CHOICES:
            what = "a named function" if isinstance(value, dict) else repr(value)
            raise bad(choice, f"'{choice}' {what[:60]} is not supported: this server never calls a tool; "
                      "only \"none\" or \"auto\" (the model answers in text)")


def _copies(body: dict) -> int:
    """``n``, in [1, MAX_N]; ``best_of``, where given, must equal it (as vLLM's V1
    engine takes it: no hidden candidates ranked away)."""
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise bad("n", f"n must be an integer in [1, {MAX_N}], got {n}")
    best_of = _get(body, "best_of", int, None)
    if best_of is not None and best_of != n:
        raise bad("best_of", f"best_of must equal n ({n}) or be left out: candidates ranked away "
                  f"(best_of > n) are not supported, got {best_of}")
    return n


def _echo(body: dict, chat: bool) -> tuple[bool, bool]:
    """(echo, echo with max_tokens 0). Chat has no echo."""
    echo = _get(body, "echo", bool, False)
    if echo and chat:
        raise bad("echo", "echo is not supported for chat completions")
    return echo, echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0


def _logprob_fields(body: dict, chat: bool, echo: bool) -> dict:
    """SamplingParams' ``logprobs`` (and, with echo, ``prompt_logprobs``) from
    OpenAI's spelling: completions' ``logprobs`` is the top count (an integer,
    SamplingParams bounds it); chat's is a boolean with the count in
    ``top_logprobs``. vLLM's own ``prompt_logprobs`` field is refused (echo asks
    for the prompt's logprobs here)."""
    if body.get("prompt_logprobs") is not None:
        raise bad("prompt_logprobs", "'prompt_logprobs' is not supported; use echo with logprobs "
                  "(completions) for the prompt's logprobs")
    if chat:
        top = _get(body, "top_logprobs", int, None)
        if not _get(body, "logprobs", bool, False):
            if top is not None:
                raise bad("top_logprobs", "top_logprobs needs logprobs: true")
            return {}
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}")
        return {"logprobs": top or 0}
    k = _get(body, "logprobs", (bool, int), None)
    if k is None or k is False:
        return {}
    if k is True:
        raise bad("logprobs", "'logprobs' must be of type integer (how many top logprobs), got a boolean",
                  "invalid_type")
    return {"logprobs": k, "prompt_logprobs": k} if echo else {"logprobs": k}


def _sampling(body: dict, default_max_tokens: int | None, chat: bool = False) -> tuple[SamplingParams, bool]:
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, (int, float), 0) != 0:
            raise bad(name, f"'{name}' is not supported; leave it at 0")
    echo, echo_only = _echo(body, chat)
    _refuse_unsupported(body)
    # Every SamplingParams field is read by SamplingParams itself (from_dict):
    # one definition of names, types and ranges for HTTP, the wire and the
    # engine. Here only OpenAI's spelling: null means absent, stop may be one
    # string, max_completion_tokens is max_tokens.
    values = {name: body[name] for name in SAMPLING_FIELDS
              if body.get(name) is not None and name not in OPENAI_SPELLED}
    values |= _logprob_fields(body, chat, echo)
    try:
        values["structured"] = parse_structured(body)   # never the body's own "structured"
    except StructuredOutputError as exc:
        raise bad(exc.param, str(exc), exc.code) from None
    if echo_only:
        values["max_tokens"] = 1         # the engine samples one token (not shown): the prompt's logprobs
    if "max_tokens" not in values and body.get("max_completion_tokens") is not None:
        values["max_tokens"] = body["max_completion_tokens"]
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    given = "max_tokens" in values
    if not given:
        # chat's real default (the rest of the context) is set after tokenizing;
        # until then a placeholder that admits any min_tokens
        min_tokens = values.get("min_tokens")
        values["max_tokens"] = default_max_tokens or max(16, min_tokens if type(min_tokens) is int else 0)
    try:
        params = SamplingParams.from_dict(values)
    except InvalidParam as exc:
        raise bad(exc.param, str(exc), exc.code) from None
    return params, given


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, None)
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed when stream is true")
        include_usage = _get(opts, "include_usage", bool, False)
    return stream, include_usage


def _model(body: dict) -> str:
    model = _get(body, "model", str, None)
    if not model:
        raise bad("model", "'model' is required", "missing_required_parameter")
    return model


def parse_completion(body: Any) -> ApiRequest:
    """POST /v1/completions body -> ApiRequest."""
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    model = _model(body)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "'prompt' is required", "missing_required_parameter")
    prompt = body["prompt"]
    text, ids = None, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                 # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt must not be empty")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = tuple(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise bad("prompt", "prompt must not be empty")
    elif isinstance(prompt, list):
        raise bad("prompt", "prompt must be a string, a list of token ids, or a list holding one "
                  "of those; batched prompts are not supported", "invalid_type")
    else:
        raise bad("prompt", "prompt must be a string or a list of token ids", "invalid_type")
    params, given = _sampling(body, default_max_tokens=16)
    stream, include_usage = _stream(body)
    echo, echo_only = _echo(body, chat=False)
    return ApiRequest(model=model, params=params, max_tokens_given=given, stream=stream,
                           include_usage=include_usage, prompt_text=text, prompt_ids=ids,
                           n=_copies(body), echo=echo, echo_only=echo_only,
                           structured_field=structured_field(body))


ROLES = ("system", "user", "assistant", "developer", "tool")


def parse_chat(body: Any) -> ApiRequest:
    """POST /v1/chat/completions body -> ApiRequest (max_tokens defaults to the rest of the context)."""
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    model = _model(body)
    raw = _get(body, "messages", list, None)
    if raw is None:
        raise bad("messages", "'messages' is required", "missing_required_parameter")
    if not raw:
        raise bad("messages", "messages must contain at least one message")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}")
        messages.append(ChatMessage(role="system" if role == "developer" else role,
                                    content=_content(m.get("content"), f"{where}.content")))
    params, given = _sampling(body, default_max_tokens=None, chat=True)
    stream, include_usage = _stream(body)
    return ApiRequest(model=model, params=params, max_tokens_given=given, stream=stream,
                           include_usage=include_usage, messages=tuple(messages), n=_copies(body),
                           structured_field=structured_field(body))


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(where, f"{where}: only text content parts are supported", "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, f"{where} must be a string or a list of text parts", "invalid_type")
