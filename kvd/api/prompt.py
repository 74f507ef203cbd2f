"""From a request body to a validated request and its prompt token ids, with
the heavy work bounded and off the event loop.

Parsing JSON, rendering a chat template and tokenizing cost time in
proportion to the body: a 4 MiB prompt took 5 s to tokenize, and on the event
loop that stalled every stream, /health and the heartbeats with it. So:

- a prompt text is refused by its size in bytes before it is tokenized: a text
  of more than ``max_model_len * tokenizer.max_token_bytes`` bytes has more
  tokens than the context holds (an upper bound on the bytes per token, so no
  prompt that fits is refused); a list of token ids by its length, before its
  ids are checked;
- a body over ``INLINE_BODY_BYTES`` is parsed, templated and tokenized in a
  worker thread; ``Tokenizer.encode`` releases the GIL while the Rust BPE
  runs, so the loop goes on meanwhile. The workers are one fewer than the
  CPUs (at least one): a flood of big prompts waits its turn and leaves the
  loop a core. Smaller bodies stay on the loop, where a thread hop (~0.1 ms)
  would cost more than the work.

The body itself is bounded before this (``[server] max_body_bytes``, 413).
Every refusal is an :class:`ApiError` in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from engine.request import InvalidParam
from kvd.api.schema import ApiError, ApiRequest, bad, parse_chat, parse_completion

INLINE_BODY_BYTES = 2048       # at most ~1k tokens: about 2 ms of tokenizing on the loop


class PromptBuilder:
    """Turns request bodies into (ApiRequest, prompt token ids).

    Holds only immutable state (the tokenizer is safe to share across
    threads), so ``parse`` may run in any thread. ``max_model_len`` is passed
    in by the caller, read on the event loop: it comes from the cluster's
    membership, which only the loop may read. Owns its worker threads:
    ``close`` stops them.
    """

    def __init__(self, tokenizer: Any, model_name: str, workers: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_token_bytes = tokenizer.max_token_bytes   # ~0.1 s once, at start-up
        self.workers = workers or max(1, (os.cpu_count() or 2) - 1)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvd-prompt")

    def close(self) -> None:
        """Stop the workers; prompts waiting for one are dropped (their handlers are gone)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def max_prompt_bytes(self, max_model_len: int) -> int:
        """Bytes of prompt text beyond which it cannot fit ``max_model_len`` tokens."""
        return max_model_len * self.max_token_bytes

    async def build(self, raw: bytes, chat: bool, max_model_len: int) -> tuple[ApiRequest, list[int]]:
        """``parse``, in a worker thread when the body is big. Raises ApiError."""
        if len(raw) <= INLINE_BODY_BYTES:
            return self.parse(raw, chat, max_model_len)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.parse, raw, chat, max_model_len)

    def parse(self, raw: bytes, chat: bool, max_model_len: int) -> tuple[ApiRequest, list[int]]:
        """The validated request and its prompt token ids; the model name is
        checked, the prompt bounded by ``max_model_len``. Raises ApiError."""
        if not raw:
            raise bad(None, "request body is empty; expected a JSON object")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise bad(None, f"request body is not valid JSON: {exc}", code="invalid_json") from None
        req = (parse_chat if chat else parse_completion)(body)
        if req.model != self.model_name:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves "
                           f"'{self.model_name}'", param="model", type="not_found_error",
                           code="model_not_found")
        tok = self.tokenizer
        try:
            req.params.check_vocab(tok.vocab_size)          # logit_bias's token ids
        except InvalidParam as exc:
            raise bad(exc.param, str(exc), exc.code) from None
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            if len(ids) >= max_model_len:      # before the per-id check, which is O(n) in Python
                raise _too_long("prompt", f"prompt has {len(ids)} tokens; this model's context is "
                                f"{max_model_len} tokens")
            if any(not 0 <= t < tok.vocab_size for t in ids):
                raise bad("prompt", f"token ids must be in [0, {tok.vocab_size})")
            return req, ids
        if chat:
            if not tok.has_chat_template:
                raise bad("messages", "this model has no chat template; use /v1/completions")
            try:
                text = tok.apply_chat_template([{"role": m.role, "content": m.content}
                                                for m in req.messages], add_generation_prompt=True)
            except Exception as exc:  # the template's own raise_exception, e.g. bad role order
                raise bad("messages", f"chat template rejected the messages: {exc}") from None
        else:
            text = req.prompt_text
        self._check_size("messages" if chat else "prompt",
                         len(text.encode("utf-8", "surrogatepass")), max_model_len)
        return req, tok.encode(text, add_special_tokens=not chat)

    def _check_size(self, param: str, size: int, max_model_len: int) -> None:
        """Refuse ``size`` bytes of prompt text that cannot fit the context (for
        chat, the rendered template: it may add text, or trim some)."""
        limit = self.max_prompt_bytes(max_model_len)
        if size > limit:
            raise _too_long(param, f"the prompt is {size} bytes: more than this model's context of "
                            f"{max_model_len} tokens can hold (at most {limit} bytes)")


def _too_long(param: str, message: str) -> ApiError:
    return bad(param, message, code="context_length_exceeded")
