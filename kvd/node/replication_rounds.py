"""What one replication round carries (kvd/node/replication.py): the
ReplicaData fields of a round and the staging buffer holding its KV,
gathered on the engine thread between two steps. Full blocks for a
replica (``collect``), token rows for a pair's copy (``collect_rows``).
No I/O.
"""

from __future__ import annotations

from typing import Any

from engine.exact_copy import copy_sources, token_span
from engine.memory.token_rows import gather_rows
from engine.stream import STAGING


def collect(engine: Any, sent: dict[str, int], skip: set[str], adopt: dict[str, str],
            tickets: dict[str, str], exact: bool = False, kept: dict[str, int] | None = None,
            budget: int | None = None) -> tuple[dict | None, Any, int, int]:
    """Engine thread: the ReplicaData fields of one round (None: nothing to
    send), the staging buffer holding its KV, and the lag in tokens.
    ``sent``: tokens the peer holds; ``skip``: requests not to send now;
    ``adopt``: requests not to send but to claim (request id -> writer)
    while they are still here; ``tickets``: the coordinator's tickets at
    the peer (a request without one is not sent: the holder would refuse
    it); ``exact``: every computed token, as token rows from where the
    peer's copy ends (a pair's copy), else full blocks only; ``kept``:
    tokens the peer holds of requests not in ``sent`` (a handoff's kept
    copy); ``budget``: blocks the peer does not hold that the round may
    send at most (None: no bound; a request past it sends its first
    blocks' worth). Also returns how many of those it sends."""
    if exact:
        return collect_rows(engine, sent, skip, adopt, tickets, kept or {}, budget)
    bs = engine.config.block_size
    ids, rids, starts, counts, tokens = [], [], [], [], []
    lag = spent = 0
    live = set()
    for rid, computed, toks, blocks in engine.replicable():
        live.add(rid)
        have = sent.get(rid, (kept or {}).get(rid, 0))
        lag += max(0, computed - have)
        if len(toks) <= have or rid in skip or rid in adopt or rid not in tickets:
            continue
        first = have // bs                        # a partial block held is written again, fuller
        again, n = int(have % bs > 0), len(blocks) - first
        if budget is not None and n - again > budget - spent:
            n = budget - spent + again            # full blocks only: the last block, maybe partial, is past them
            if n <= 0:
                continue
            toks, blocks = toks[:(first + n) * bs], blocks[:first + n]
        spent += n - again
        rids.append(rid)
        starts.append(first * bs)
        counts.append(n)
        tokens.extend(toks[first * bs:])
        ids.extend(blocks[first:])
    frees, claims = ended_and_claimed(engine, sent, adopt, live)
    if not rids and not frees and not claims:
        return None, None, lag, 0
    buf, tensors = None, ()
    if ids:
        layout = engine.pool.kv_layout()
        buf, view = STAGING.acquire((layout.num_layers, 2, len(ids), *layout.block_shape[2:]), layout.dtype)
        engine.pool.gather_blocks(ids, view, (0, layout.num_layers))
        tensors = (view,)
    return {"block_size": bs, "request_ids": tuple(rids), "starts": tuple(starts), "counts": tuple(counts),
            "token_ids": tuple(tokens), "frees": frees, "adopt": claims, "tensors": tensors,
            "tickets": {rid: tickets[rid] for rid in rids}}, buf, lag, spent


def collect_rows(engine: Any, sent: dict[str, int], skip: set[str], adopt: dict[str, str],
                 tickets: dict[str, str], kept: dict[str, int], budget: int | None
                 ) -> tuple[dict | None, Any, int, int]:
    """``collect`` for a pair's copy: each request's tokens from where the
    peer's copy ends to the last one computed, as token rows (ReplicaData
    ``rows``): a step's round carries one row per request, not the blocks
    around it. ``budget`` counts the blocks the peer's copies grow by."""
    bs = engine.config.block_size
    rids, starts, counts, tokens, spans = [], [], [], [], []
    lag = spent = 0
    live = set()
    for req, computed in copy_sources(engine):
        rid = req.request_id
        live.add(rid)
        have = sent.get(rid, kept.get(rid, 0))
        lag += max(0, computed - have)
        if computed <= have or rid in skip or rid in adopt or rid not in tickets:
            continue
        end, held_blocks = computed, -(-have // bs)
        if budget is not None:
            end = min(end, (held_blocks + budget - spent) * bs)
            if end <= have:
                continue
            spent += -(-end // bs) - held_blocks
        rids.append(rid)
        starts.append(have)
        counts.append(end - have)
        tokens.extend(token_span(req, have, end))
        spans.append((req.block_ids, have, end))
    frees, claims = ended_and_claimed(engine, sent, adopt, live)
    if not rids and not frees and not claims:
        return None, None, lag, spent
    buf, tensors = None, ()
    if rids:
        layout = engine.pool.kv_layout()
        num_layers, _, _, kvh, hd = layout.block_shape
        buf, view = STAGING.acquire((num_layers, 2, len(tokens), kvh, hd), layout.dtype)
        at = 0
        for block_ids, start, end in spans:
            gather_rows(engine.pool, "device", block_ids, start, end, view, at)
            at += end - start
        tensors = (view,)
    return {"block_size": bs, "request_ids": tuple(rids), "starts": tuple(starts), "counts": tuple(counts),
            "token_ids": tuple(tokens), "frees": frees, "adopt": claims, "tensors": tensors,
            "tickets": {rid: tickets[rid] for rid in rids}, "rows": True}, buf, lag, spent


def ended_and_claimed(engine: Any, sent: dict[str, int], adopt: dict[str, str],
                       live: set[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """A round's ``frees`` (requests the peer holds that ended here) and its
    claims (``adopt``'s requests now running here)."""
    # a claim waits for its request to start here (a resume may wait for its copy first): never freed by it
    frees = tuple(rid for rid in sent if rid not in live and rid not in adopt and not engine.has_request(rid))
    claims = {rid: writer for rid, writer in adopt.items() if rid not in sent and engine.has_request(rid)}
    return frees, claims
