"""One request's stream at the coordinator: its legs and its chunks in token order.

A ``Stream`` turns the ``TokenChunk``s of a request's legs into
``RequestOutput`` deltas: tokens are deduplicated by index
(``TokenChunk.start_index``), so a chunk that repeats tokens already
delivered is trimmed (a replay or recovery may resend safely), and a chunk
past a gap (the decode leg's token 1 overtaking the prefill leg's token 0)
waits until the gap fills.

Imports no torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from engine.request import INVALID_REQUEST, FinishReason, RequestOutput
from kvd import protocol
from kvd.coordinator.load import LoadBook


def error_output(request_id: str, prompt_ids: Sequence[int], message: str, code: str = INVALID_REQUEST) -> RequestOutput:
    """The one output of a request that ends with an error (``code``: whose fault, as
    ``RequestOutput.error_code``; a node's ``Error.code``)."""
    return RequestOutput(request_id, [], "", True, FinishReason.ERROR.value, num_prompt_tokens=len(prompt_ids),
                         error=message, error_code=code)


class Stream:
    """One request's chunks: ``node`` owns it (its death recovers or ends the
    request), ``prefill`` names its prefill leg's node, if any (chunks from
    it count too). ``tokens``: every token delivered, what a recovery resumes
    after."""

    __slots__ = ("node", "incarnation", "prefill", "prefilled_by", "queue", "next_index", "prompt_len", "early",
                 "request", "tokens", "recoveries", "failed", "recovering")

    def __init__(self, node: str, request: protocol.GenerateRequest, incarnation: str = "") -> None:
        self.node = node
        self.incarnation = incarnation                      # of the node process serving it now
        self.prefill: str | None = None
        self.prefilled_by: str | None = None                # the prefill leg's node, kept after it ends
        self.queue: asyncio.Queue = asyncio.Queue()
        self.next_index = 0
        self.prompt_len = len(request.prompt_token_ids)
        self.early: dict[int, protocol.TokenChunk] = {}   # chunks past a gap, by start_index
        self.request = request
        self.tokens: list[int] = []
        self.recoveries = 0
        self.failed: set[tuple[str, str]] = set()          # (node, incarnation) that lost this request
        self.recovering = False                            # a recovery task owns it

    def legs(self) -> tuple[str, ...]:
        return (self.node, self.prefill) if self.prefill else (self.node,)

    def in_order(self, chunk: protocol.TokenChunk) -> list[RequestOutput]:
        """The outputs ``chunk`` makes deliverable, in token order: a chunk
        past a gap waits in ``early`` until the gap fills."""
        if chunk.start_index > self.next_index:
            self.early[chunk.start_index] = chunk
            return []
        outs = []
        while chunk is not None:
            out = self._to_output(chunk)
            if out is not None:
                outs.append(out)
            chunk = self.early.pop(self.next_index, None)
        return outs

    def _to_output(self, chunk: protocol.TokenChunk) -> RequestOutput | None:
        skip = self.next_index - chunk.start_index   # tokens already delivered (dedup)
        tokens = list(chunk.token_ids[skip:])
        if not tokens and chunk.finish_reason is None and skip > 0:
            return None
        self.next_index = chunk.start_index + len(chunk.token_ids)
        self.tokens.extend(tokens)
        usage = chunk.usage or {}
        repeated = min(skip, len(chunk.token_ids))
        kept = chunk.text_ends[repeated - 1] if repeated > 0 else 0   # their text was delivered too
        return RequestOutput(chunk.request_id, tokens, chunk.text[kept:],
                             chunk.finish_reason is not None, chunk.finish_reason, chunk.stop_reason,
                             num_prompt_tokens=usage.get("prompt_tokens", self.prompt_len),
                             num_output_tokens=usage.get("completion_tokens", self.next_index),
                             num_cached_tokens=usage.get("cached_tokens", 0),
                             text_ends=[e - kept for e in chunk.text_ends[repeated:]],
                             logprobs=list(chunk.logprobs[repeated:]) if chunk.logprobs is not None else None,
                             prompt_logprobs=(list(chunk.prompt_logprobs)
                                              if chunk.prompt_logprobs is not None and skip == 0 else None))


def forget(streams: dict[str, Stream], load: LoadBook, request_id: str) -> None:
    """``request_id`` ended: no stream, counted on no node."""
    streams.pop(request_id, None)
    load.release(request_id)
