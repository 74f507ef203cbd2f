"""One choice of a completion or chat response, built from its copy's engine outputs.

A ``Choice`` is fed its copy's ``RequestOutput`` deltas in order (``add``)
and answers each one's delta for a stream chunk, while keeping the whole
for a response that does not stream:

- ``echo`` (completions): the prompt's text comes first, with the first
  delta, and with ``logprobs`` the prompt tokens' logprobs before the
  generated ones (kvd/api/logprobs.py); ``echo`` with ``max_tokens: 0``
  (``ApiRequest.echo_only``) shows the prompt alone: the one token the engine
  sampled is neither shown nor counted;
- ``logprobs``: each delta carries its tokens' logprobs object (None when
  the request did not ask).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.request import RequestOutput
from kvd.api.logprobs import CompletionLogprobs, TokenText, chat_logprobs, merge
from kvd.api.schema import ApiRequest


class Choice:
    def __init__(self, index: int, req: ApiRequest, prompt_ids: Sequence[int], chat: bool, text: TokenText,
                 prompt_text: str | None) -> None:
        """``prompt_text``: the prompt as the client sent it (None: decoded from its ids
        when echoed)."""
        self.index = index
        self.chat = chat
        self.echo_only = req.echo_only
        self.wants_logprobs = req.params.logprobs is not None
        self._text = text
        self._completion = CompletionLogprobs(text) if self.wants_logprobs and not chat else None
        self._prompt_ids = prompt_ids
        self._echo: str | None = None
        if req.echo:
            self._echo = prompt_text if prompt_text is not None else text.decode(prompt_ids)
        self.parts: list[str] = []
        self.logprobs: dict | None = None         # the whole choice's, for a response that does not stream
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> tuple[str, dict | None]:
        """``out``'s delta: (its text, its logprobs object or None). Kept for ``body``."""
        self.last = out
        text, entries = out.text, out.logprobs or []
        if self.echo_only:
            text, entries = "", []
        lp = None
        if self._echo is not None:                # the first delta: the prompt first
            text = self._echo + text
            if self._completion is not None and out.prompt_logprobs is not None:
                lp = self._completion.prompt(self._prompt_ids, out.prompt_logprobs)
            self._echo = None
        if self.wants_logprobs:
            if self.chat:
                lp = chat_logprobs(self._text, entries)
                whole = self.logprobs["content"] if self.logprobs is not None else []
                self.logprobs = lp | {"content": whole + lp["content"]}
            else:
                lp = merge(lp, self._completion.tokens(entries))
                self.logprobs = merge(self.logprobs, lp)
        self.parts.append(text)
        return text, lp

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens the client is answered (none for echo_only)."""
        return 0 if self.echo_only or self.last is None else self.last.num_output_tokens

    def body(self) -> dict:
        """The whole choice of a response that does not stream."""
        text = "".join(self.parts)
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": self.index, **content, "logprobs": self.logprobs,
                "finish_reason": self.last.finish_reason, "stop_reason": self.last.stop_reason}


def usage_output(choices: Sequence[Choice]) -> RequestOutput:
    """The counts of the whole response as one output (for ``http.usage``): the
    prompt once (as copy 0 ran it), the generated tokens of every choice."""
    return dataclasses.replace(choices[0].last, num_output_tokens=sum(c.num_output_tokens for c in choices))
