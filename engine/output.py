"""Stop conditions and incremental detokenization, per request.

Checked after every sampled token, in this order (vLLM's): EOS (unless
``ignore_eos``), ``stop_token_ids``, stop strings, ``max_tokens``, context
length. ``min_tokens`` suppresses the first three until reached.

A stop string is never shown to the client: while a request streams, the last
``len(longest stop) - 1`` characters are held back, because they could be the
start of a stop string that the next token completes.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.request import FinishReason, Request, RequestOutput


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    text: str = ""          # all stable text so far (stop strings found here)
    emitted: int = 0        # chars of `text` already sent


class OutputProcessor:
    """Owns the per-request text state. Called by the engine thread only."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        self._state: dict[str, _TextState] = {}
        tokenizer.token_bytes           # built now (~0.1 s for a 49K vocabulary), not in the first request's step

    def add(self, req: Request) -> None:
        self._state[req.request_id] = _TextState(IncrementalDetokenizer(self.tokenizer))

    def discard(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def banned_ids(self, req: Request) -> list[int]:
        """Token ids that must not be sampled yet (min_tokens not reached)."""
        p = req.params
        if len(req.output_ids) >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids |= self.eos_ids
        return sorted(ids)

    def append(self, req: Request, token: int) -> RequestOutput:
        """Record a sampled token; decide whether ``req`` is finished. Mutates ``req``."""
        p = req.params
        st = self._state[req.request_id]
        req.output_ids.append(token)
        n_out = len(req.output_ids)
        can_stop = n_out >= p.min_tokens
        finish: FinishReason | None = None
        if can_stop and token in self.eos_ids and not p.ignore_eos:
            finish = FinishReason.STOP
        elif can_stop and token in p.stop_token_ids:
            finish, req.stop_reason = FinishReason.STOP, token
        if finish is None:
            before = len(st.text)
            st.text += st.detok.push(token)
            if p.stop and can_stop:
                hit = _find_stop(st.text, before, p.stop)
                if hit is not None:
                    st.text = st.text[:hit[0]]
                    finish, req.stop_reason = FinishReason.STOP, hit[1]
        if finish is None and (n_out >= p.max_tokens or req.num_tokens >= self.max_model_len):
            finish = FinishReason.LENGTH
            st.text += st.detok.flush()
        if finish is not None:
            req.finish_reason = finish
            end = len(st.text)
        else:
            hold = max((len(s) for s in p.stop), default=1) - 1
            end = max(st.emitted, len(st.text) - hold)
        delta, st.emitted = st.text[st.emitted:end], end
        return RequestOutput(
            request_id=req.request_id, new_token_ids=[token], text=delta,
            finished=finish is not None, finish_reason=finish.value if finish else None,
            stop_reason=req.stop_reason, num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=n_out, num_cached_tokens=req.num_cached_tokens, text_ends=[len(delta)])


def _find_stop(text: str, new_from: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string that ends in the newly added text: (index, stop)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
