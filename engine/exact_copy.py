"""A running request's KV to the token, for a pair's redundant copy
(docs/cluster.md, "Pairs and roles"; AcceLLM §4).

A replica (``LLMEngine.replicable``) holds whole blocks, and a request
resumed from one recomputes what they lack. A pair's copy is kept current
to the step: ``copyable`` also gives each request's last, partial block,
and ``resume_from_copy`` admits a resumed request whose KV of every token
but the last is already in a PROMPT region, so it decodes at once with
nothing recomputed (``LLMEngine.resume_request`` with the prefill already
done, as ``add_prefilled`` is for a disaggregated prompt).

Both run on the engine thread, between two steps. No I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.request import InvalidParam, RequestOutput


def copyable(engine: Any) -> list[tuple[str, int, list[int], list[int]]]:
    """``LLMEngine.replicable`` to the token: (request id, tokens computed,
    those tokens, the device block ids holding them, the last one partial
    when the count is not a whole number of blocks), oldest first. A query:
    nothing changes; the ids stay the request's until its next step."""
    bs = engine.config.block_size
    out = []
    for req in engine.scheduler.running:
        if req.kv_out is not None or engine.scheduler._borrows(req):     # its KV is not all here
            continue
        n = min(req.num_computed, len(req.block_ids) * bs)
        out.append((req.request_id, req.num_computed, req.all_ids[:n], req.block_ids[:-(-n // bs)]))
    return out


def resume_from_copy(engine: Any, request_id: str, prompt_ids: list[int], output_ids: list[int], params: Any,
                     reservation: Any) -> RequestOutput | None:
    """``LLMEngine.resume_request`` for a request whose KV of
    ``prompt_ids + output_ids[:-1]`` is in ``reservation`` (a PROMPT
    region of exactly those tokens, every layer written): the client's
    tokens are replayed into the stop conditions and text state, and the
    request decodes from ``output_ids[-1]`` on with nothing recomputed.
    Returns the replayed output when the tokens already end the request
    (nothing runs), else None. The reservation belongs to the request from
    now on; on an exception (InvalidParam, ValueError: nothing queued) or
    an ended request it is cancelled."""
    try:
        vocab = engine.model.config.vocab_size
        if not output_ids or any(not 0 <= t < vocab for t in output_ids):
            raise InvalidParam("output_token_ids", f"a resumed request needs its tokens, in [0, {vocab})")
        if len(output_ids) >= params.max_tokens:
            raise InvalidParam("output_token_ids", "the request already has max_tokens tokens")
        if tuple(prompt_ids) + tuple(output_ids[:-1]) != reservation.tokens:
            raise ValueError("resume_from_copy: the reservation is for other tokens")
        # the prompt logprobs went out with token 0, which the client has: not computed again
        params = dataclasses.replace(params, prompt_logprobs=None)
        req = engine._new_request(request_id, prompt_ids, params, replayed=output_ids)
    except Exception:
        reservation.cancel()
        raise
    for tok in output_ids:
        out = engine.outputs.append(req, tok)
        if out.finished:
            reservation.cancel()
            engine._retire(req, cache=False)
            return out
    req.prefix = reservation.commit()
    req.block_ids = reservation.all_ids
    req.num_computed = req.num_tokens - 1
    engine.scheduler.add_prefilled(req)
    return None
