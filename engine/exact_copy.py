"""A running request's KV to the token, for a pair's redundant copy
(docs/cluster.md, "Pairs and roles"; AcceLLM §4).

A replica (``LLMEngine.replicable``) holds whole blocks, and a request
resumed from one recomputes what they lack. A pair's copy is kept current
to the step: each round sends the tokens computed since the last one as
token rows (``copy_sources``, ``token_span``; the rows themselves:
engine/memory/token_rows.py), ``copyable`` gives a request's whole KV to
the token (its last block partial), and ``resume_from_copy`` admits a
resumed request whose KV of every token but the last is already in a
PROMPT region, so it decodes at once with nothing recomputed
(``LLMEngine.resume_request`` with the prefill already done, as
``add_prefilled`` is for a disaggregated prompt).

All run on the engine thread, between two steps. No I/O.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from engine.request import InvalidParam, Request, RequestOutput


def copy_sources(engine: Any) -> list[tuple[Request, int]]:
    """The running requests whose KV is all on this node, oldest first,
    each with its tokens computed whose KV is in its blocks. A query:
    nothing changes; the block ids stay the request's until its next step."""
    bs = engine.config.block_size
    return [(req, min(req.num_computed, len(req.block_ids) * bs)) for req in engine.scheduler.running
            if req.kv_out is None and not engine.scheduler._borrows(req)]     # else its KV is not all here


def token_span(req: Request, start: int, end: int) -> list[int]:
    """``req.all_ids[start:end]`` without building the whole sequence."""
    n = len(req.prompt_ids)
    if end <= n:
        return req.prompt_ids[start:end]
    if start >= n:
        return req.output_ids[start - n:end - n]
    return req.prompt_ids[start:] + req.output_ids[:end - n]


def copyable(engine: Any) -> list[tuple[str, int, list[int], list[int]]]:
    """``LLMEngine.replicable`` to the token: (request id, tokens computed,
    those tokens, the device block ids holding them, the last one partial
    when the count is not a whole number of blocks), oldest first. A query:
    nothing changes; the ids stay the request's until its next step."""
    bs = engine.config.block_size
    return [(req.request_id, req.num_computed, token_span(req, 0, n), req.block_ids[:-(-n // bs)])
            for req, n in copy_sources(engine)]


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
    an ended request it is cancelled. ``reservation`` may also be what
    builds it (kvd/node/replica_store.py ``ReplicaStore.reservation``), run
    here first, so that the copy becomes the request's between the same two
    steps as its admission; when that finds the device tier short
    (None), the request is resumed as ``LLMEngine.resume_request`` resumes
    it, its KV computed again."""
    if callable(reservation):
        reservation = reservation(engine)
        if reservation is None:
            return engine.resume_request(request_id, prompt_ids, output_ids, params)
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


def hold(engine: Any, request_id: str, seconds: float) -> int | None:
    """Leave ``request_id`` out of this engine's decode steps for
    ``seconds`` (``Scheduler.hold``): a pair hands it off from here, and no
    token is computed past the ones it made. Returns how many tokens it
    made (its client's, once delivered), or None when it is not decoding
    here (unknown, or still computing its prompt): nothing changes then."""
    req = engine.requests.get(request_id)
    if req is None or req not in engine.scheduler.running or req.prefilling or not req.output_ids:
        return None
    engine.scheduler.hold(request_id, time.monotonic() + seconds)
    return len(req.output_ids)
