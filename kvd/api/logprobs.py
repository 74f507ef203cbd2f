"""The OpenAI ``logprobs`` objects of a choice, from the engine's TokenLogprobs.

Completions (``logprobs: k``)::

    {"tokens": [str], "token_logprobs": [float | None],
     "top_logprobs": [{str: float} | None], "text_offset": [int]}

one entry per token; with ``echo`` the prompt's tokens come first, the first
of them with ``None`` (nothing predicts it). A ``top_logprobs`` dict holds
the k most likely tokens and the token itself (vLLM's: up to k + 1 keys).
``text_offset`` is vLLM's: each token's offset as the running sum of the
lengths of the token strings before it (from 0 at the choice's first token).

Chat (``logprobs: true``, ``top_logprobs: k``)::

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
     "refusal": None}

A token's string is its own decoded text (special tokens included; a
token that is part of a multi-byte character shows U+FFFD); its ``bytes``
are the bytes it stands for where the tokenizer is byte-level, else that
string's UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.model.tokenizer import Tokenizer
from engine.request import TokenLogprobs


class TokenText:
    """Token strings and bytes of one tokenizer, remembered per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._strings: dict[int, str] = {}
        table = tokenizer.token_bytes
        self._bytes = table[0] if table is not None else None

    def string(self, token_id: int) -> str:
        s = self._strings.get(token_id)
        if s is None:
            s = self._strings[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included (an echoed prompt)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        if self._bytes is not None and token_id < len(self._bytes):
            return list(self._bytes[token_id])
        return list(self.string(token_id).encode("utf-8"))


class CompletionLogprobs:
    """One completions choice's logprobs, chunk by chunk: ``text_offset`` runs on
    across calls (a stream's chunks continue the offsets of the ones before)."""

    def __init__(self, text: TokenText) -> None:
        self._text = text
        self._offset = 0

    def prompt(self, prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> dict:
        """The echoed prompt's object: ``entries`` are prompt tokens 1.. (token 0 gets None)."""
        first = self._object([self._text.string(prompt_ids[0])], [None], [None])
        rest = self.tokens(entries)
        return merge(first, rest)

    def tokens(self, entries: Sequence[TokenLogprobs]) -> dict:
        """The object of generated (or prompt) tokens ``entries``."""
        strings = [self._text.string(e.token_id) for e in entries]
        tops = [{self._text.string(t): lp for t, lp in (*e.top, (e.token_id, e.logprob))} for e in entries]
        return self._object(strings, [e.logprob for e in entries], tops)

    def _object(self, strings: list[str], logprobs: list, tops: list) -> dict:
        offsets = []
        for s in strings:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": strings, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def merge(a: dict | None, b: dict) -> dict:
    """Completions logprobs ``a`` followed by ``b`` (``a`` None: ``b``)."""
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


def chat_logprobs(text: TokenText, entries: Sequence[TokenLogprobs]) -> dict:
    """A chat choice's (or chunk's) ``logprobs`` object for ``entries``."""
    def item(token: int, logprob: float) -> dict:
        return {"token": text.string(token), "logprob": logprob, "bytes": text.bytes(token)}
    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}
