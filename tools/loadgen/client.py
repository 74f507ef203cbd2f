"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The request function is the generator's hot path: it runs once per request
and its inner loop once per SSE line, so it does the least work that keeps the
timestamps honest -- take the clock when a line arrives, parse it with orjson,
and keep only what the metrics need.

Timing rules (the same as vLLM's ``bench serve``):

- TTFT is the time from sending the request to the first chunk whose text is
  non-empty; a role-only chunk (``delta: {"role": "assistant"}``) is not a
  token arrival.
- ITL is every gap between consecutive non-empty chunks.
- E2EL is the time to the ``data: [DONE]`` line.
- Output tokens come from the final ``usage`` chunk when the server sends one
  (we ask with ``stream_options.include_usage``); otherwise we count non-empty
  chunks, which is exact when the server sends one token per chunk.

A request that ends in an HTTP error, an ``error`` object in the stream, a
connection error, a timeout, or a stream cut before ``[DONE]`` is a failure
with its error message; it is never dropped.  A request that completes with no
text at all is a success with ``ttft = e2el`` (the client learned the answer
only at the end) and is counted as empty by the metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class RequestRecord:
    """What one request did.  Times are seconds; ``start`` is relative to the
    start of the run, the others to ``start``."""

    index: int                   # position in the send order
    session: int = 0             # conversation id (the request's own index for single-turn datasets)
    turn: int = 0                # turn within the conversation
    prompt_len: int = 0          # prompt tokens as the dataset measured them (user text only)
    expected_output_len: int = 0  # max_tokens asked for
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float | None = None
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0              # chunks with non-empty text
    output_tokens: int = 0       # usage.completion_tokens, or ``chunks`` without usage
    prompt_tokens: int | None = None  # usage.prompt_tokens (includes any chat template)
    usage_reported: bool = False
    finish_reason: str | None = None
    text: str = ""               # generated text; saved only with --save-outputs

    def to_json(self, with_text: bool = False) -> dict:
        """The record as saved by ``--save-detailed`` (the generated text only
        ``with_text``: ``--save-outputs``)."""
        out = {
            "index": self.index, "session": self.session, "turn": self.turn,
            "success": self.success, "error": self.error,
            "start": self.start, "ttft": self.ttft, "e2el": self.e2el, "itl": self.itl,
            "prompt_len": self.prompt_len, "prompt_tokens": self.prompt_tokens,
            "expected_output_len": self.expected_output_len,
            "output_tokens": self.output_tokens, "chunks": self.chunks,
            "usage_reported": self.usage_reported, "finish_reason": self.finish_reason,
        }
        if with_text:
            out["text"] = self.text
        return out

    @classmethod
    def from_json(cls, data: dict) -> "RequestRecord":
        known = {k: v for k, v in data.items() if k in cls.__slots__}
        return cls(**known)


def build_body(*, model: str, chat: bool, prompt: str | list[dict], max_tokens: int,
               ignore_eos: bool, temperature: float, extra: dict | None = None) -> bytes:
    """The JSON body of one streamed request."""
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if extra:
        body.update(extra)
    return orjson.dumps(body)


def error_message(status: int, raw: bytes) -> str:
    """One line for an HTTP error: the OpenAI-shaped ``error.message`` when present."""
    message = ""
    try:
        data = orjson.loads(raw)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict):
            message = str(err.get("message") or "")
        elif isinstance(err, str):
            message = err
    except orjson.JSONDecodeError:
        message = raw.decode("utf-8", "replace")
    message = " ".join(message.split())[:300]
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def _stream_error(msg: dict) -> str:
    err = msg.get("error")
    if isinstance(err, dict):
        return "stream error: " + str(err.get("message") or err)
    return f"stream error: {err}"


async def send_request(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict,
                       chat: bool, record: RequestRecord) -> RequestRecord:
    """POST ``body`` to ``url``, read the SSE stream and fill ``record``.

    Never raises for anything the server or network does; cancellation passes
    through.  ``record.start`` is left for the caller to set.
    """
    parts: list[str] = []
    itl = record.itl
    ttft = None
    last = 0.0
    usage = None
    done = False
    start = time.perf_counter()
    try:
        async with http.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                record.error = error_message(resp.status, await resp.read())
                record.e2el = time.perf_counter() - start
                return record
            async for line in resp.content:
                now = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue        # blank separators, ": keep-alive" comments, "event:" lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                msg = orjson.loads(data)
                if "error" in msg:
                    record.error = _stream_error(msg)
                    break
                choices = msg.get("choices")
                if choices:
                    choice = choices[0]
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        if ttft is None:
                            ttft = now - start
                        else:
                            itl.append(now - last)
                        last = now
                        parts.append(piece)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                if msg.get("usage"):
                    usage = msg["usage"]
            end = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, OSError,
            AttributeError, TypeError, ValueError) as exc:
        # AttributeError/TypeError/ValueError: a chunk that is JSON but not the
        # OpenAI shape (e.g. "choices": null) -- the server's bug, our failure record.
        record.error = _exception_message(exc)
        record.e2el = time.perf_counter() - start
        return record

    record.e2el = end - start
    record.chunks = len(parts)
    record.text = "".join(parts)
    if usage is not None:
        record.usage_reported = True
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens") is not None:
            record.prompt_tokens = int(usage["prompt_tokens"])
    else:
        record.output_tokens = record.chunks
    if record.error:
        return record
    if not done:
        record.error = "stream ended before data: [DONE]"
        return record
    record.success = True
    record.ttft = ttft if ttft is not None else record.e2el
    return record


def _exception_message(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout: request exceeded --request-timeout"
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
