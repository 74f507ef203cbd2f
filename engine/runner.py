"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples.

Input layout of one call (T tokens over B requests)::

    prefill: ids  [t0 t1 t2 | u0 u1 | ...]   each request's next ``num_new`` tokens (a chunk
                                             of its prompt, or all it has left), concatenated
    decode:  ids  [a b c ...]                one token per request
    slots:   (block_table[pos // bs], pos % bs) for every token

Only the last row of each request that reaches its last token goes to the LM
head: the head is the largest matmul of a small model and prefill would
otherwise pay it per prompt token; a request whose chunk stops short of the
end samples nothing.

A decode step goes to a one-call C++ decoder when the runner has one: the
fused bf16 kernel (kernels/fused_decode.py, bf16 on an AVX512-BF16 CPU) or the
plan executor of an fp32 model (kernels/plan_decode.py), made from the
model by engine/model/decode_kernels.py; prefill always runs the torch model.
A sequence whose KV is partly in blocks other engines lend (``remote_kv``,
engine/dist_attention.py) prefills on the torch model and decodes on the plan
executor where the runner has one (the torch model otherwise), every layer's
attention split over its parts and merged: the paged kernel's bits, so the
same tokens and logits as the one-call decoder gives unsplit.
The one-call decoder is fed through reused host buffers
(kernels/decode_inputs.DecodeStaging) and hands back each row's greedy token
with the logits, so a greedy decode step builds no tensor in Python.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from engine.dist_attention import DistStep, RemoteKV
from engine.model.llama import LlamaModel
from engine.logprobs import prompt_logprobs, summarize
from engine.request import Request, TokenLogprobs
from engine.sampling import UNSAMPLED, apply_min_tokens, greedy, sample
from engine.structured.masks import MaskComputer, PendingMasks
from engine.team import TeamSizer
from kernels.attention import AttentionBatch, PrefillSeq, decode_key_mask, store_kv
from kernels.decode_inputs import DecodeStaging
from kernels.dist_attention import Partials
from kernels.fused_decode import FusedDecoder
from kernels.plan_decode import PlanDecoder, SplitStep
from kernels.logprob_rows import LogprobKernel
from kernels.sampler import RowSampler
from kernels.token_masks import MaskKernel


# A decode batch of at most this many rows runs on ModelRunner.small_batch_threads: it reads
# every weight once for little arithmetic, so fixed costs per phase, not compute, set its pace.
SMALL_BATCH = 4


class ModelRunner:
    """Executes steps of a full model (all layers) against one device KV tensor.

    ``fused``: a one-call decoder over the same model and ``kv`` (the fused
    bf16 kernel or the plan executor, same ``decode`` contract), or None
    (every step runs the torch model). ``sampler``: the C++ sampler of a step's
    random rows, or None (engine.sampling draws them in torch)."""

    def __init__(self, model: LlamaModel, kv: torch.Tensor, block_size: int,
                 fused: FusedDecoder | PlanDecoder | None = None, sampler: RowSampler | None = None,
                 logprob_kernel: LogprobKernel | None = None) -> None:
        if not (model.is_first and model.is_last):
            raise ValueError("ModelRunner drives a whole model, not a pipeline stage (layer_range)")
        self.model = model
        self.kv = kv                    # [L, 2, N, bs, kvh, hd]
        self.block_size = block_size
        self.fused = fused
        self.sampler = sampler
        self.logprob_kernel = logprob_kernel
        # the one-call decoder's reused buffers (checks kv once)
        self._staging: DecodeStaging | None = fused.staging(kv) if fused is not None else None
        # threads of a one-call decode step of at most SMALL_BATCH rows (0: torch's count);
        # the engine sets it (EngineConfig.decode_threads)
        self.small_batch_threads = 0
        # or, where set, each one-call decode step's threads chosen from measured step
        # times (the engine sets it: EngineConfig.decode_threads = 0 on a decoder that
        # runs a step on fewer threads than the team, SMALL_TEAMS)
        self.team: TeamSizer | None = None
        # sequences with KV in remote parts (DistAttention); the engine's, None where none borrow
        self.remote_kv: RemoteKV | None = None
        # structured output: the grammar masks of a step's rows, computed while its model runs
        self.masks = MaskComputer(model.config.vocab_size, kernel=MaskKernel.create())

    def build_batch(self, requests: list[Request], is_prefill: bool, num_new: list[int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[int]]:
        """ids [T], positions [T], attention metadata, and each request's last row.
        ``num_new[i]``: tokens request i computes (prefill; default: all it has left)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        prefill: list[PrefillSeq] = []
        for i, req in enumerate(requests):
            tokens = req.all_ids
            start = req.num_computed
            end = start + num_new[i] if num_new is not None else len(tokens)
            table = req.block_ids
            if is_prefill:
                n = -(-end // bs)               # padded past a local part (DistAttention's kernel never reads it)
                prefill.append(PrefillSeq(q_start=len(ids), q_len=end - start, ctx_len=end,
                                          block_table=torch.tensor(table[:n] + [0] * (n - len(table[:n])),
                                                                   dtype=torch.int64)))
            ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            # a position past the table is in a remote part (DistAttention): no local slot
            slots.extend(table[p // bs] * bs + p % bs if p // bs < len(table) else -1 for p in range(start, end))
            last_rows.append(len(ids) - 1)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        batch = AttentionBatch(
            slots=torch.tensor(slots, dtype=torch.int64),
            is_prefill=is_prefill,
        )
        if is_prefill:
            batch.prefill = prefill
        else:
            lens = [p + 1 for p in positions]
            max_blocks = max(-(-n // bs) for n in lens)
            tables = [r.block_ids[:max_blocks] + [0] * (max_blocks - len(r.block_ids[:max_blocks]))
                      for r in requests]
            batch.block_tables = torch.tensor(tables, dtype=torch.int64)
            batch.key_mask = decode_key_mask(lens, max_blocks, bs)
        return torch.tensor(ids, dtype=torch.int64), pos_t, batch, last_rows

    def execute(self, requests: list[Request], is_prefill: bool, generators: list,
                banned: list[tuple[int, list[int]]],
                on_layer: Callable[[int], None] | None = None,
                num_new: list[int] | None = None) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """Run one call; writes KV for every computed token and returns, per
        request, its sampled id (``engine.sampling.UNSAMPLED`` when its row could
        not be drawn), or None for a prefill chunk that stops short of the
        request's last token (nothing sampled); and per request the sampled
        token's logprobs when it asks for them (``params.logprobs``), else None.
        A prefill appends to ``req.prompt_logprobs`` the prompt logprobs its rows
        give (``Request.needs_prompt_logprobs``).

        ``banned``: (request index, token ids) masked for requests below their min_tokens.
        ``on_layer``: the prefill's layer hook (engine.stream.LayerStreamer).
        ``num_new``: prefill only, tokens each request computes (default: all it has left).
        """
        if not is_prefill and self.fused is not None:
            split = self._has_remote_kv(requests)
            if not split or self._splits_in_executor():
                pending = self.masks.start([r.grammar for r in requests])
                logits, greedy_ids = self._decode_split(requests) if split else self._decode_fused(requests)
                return self._pick(requests, list(range(len(requests))), logits, greedy_ids, generators, banned,
                                  pending)
        with torch.inference_mode():
            sampled = [i for i, r in enumerate(requests)
                       if num_new is None or r.num_computed + num_new[i] == r.num_tokens]
            pending = self.masks.start([requests[i].grammar for i in sampled])
            logits = self._forward(requests, is_prefill, sampled, on_layer, num_new)
            if logits is None:
                return [None] * len(requests), [None] * len(requests)
            return self._pick(requests, sampled, logits, None, generators, banned, pending)

    def _has_remote_kv(self, requests: list[Request]) -> bool:
        """Whether a request of the step has KV in remote parts."""
        return bool(self.remote_kv) and any(self.remote_kv.parts(r.request_id) for r in requests)

    def _splits_in_executor(self) -> bool:
        """Whether a decode step with KV in remote parts runs on the one-call decoder (the
        plan executor, beside the paged kernel the lenders compute with), not the torch model."""
        return isinstance(self.fused, PlanDecoder) and self.model.attention_kernel is not None

    def _decode_split(self, requests: list[Request]) -> tuple[torch.Tensor, list[int]]:
        """A decode step on the plan executor of requests some of whose KV is in remote
        parts: at every layer the executor's hooks start the parts' micro-attentions
        (``DistStep.start_remote``) before it computes the local chunks, and gather their
        partials after (logits [B, V] and greedy ids). Raises RemoteKVError as the torch
        path does."""
        ids, positions, batch, _ = self.build_batch(requests, False)
        dist = DistStep(*batch.paged_rows(positions), batch.slots,
                        [self.remote_kv.parts(r.request_id) for r in requests], self.model.attention_kernel,
                        self.remote_kv.deadline_s)
        cfg, B, kv_dtype = self.model.config, len(requests), self.kv.dtype
        q = torch.empty(B, cfg.num_heads, cfg.head_dim)
        k, v = torch.empty(B, cfg.num_kv_heads, cfg.head_dim), torch.empty(B, cfg.num_kv_heads, cfg.head_dim)
        gather = Partials.empty(B, dist.slots_total, cfg.num_heads, cfg.head_dim)

        stored = kv_dtype == k.dtype                        # the caches hold k and v as they are

        def hook(layer: int, phase: int) -> None:
            if phase == 0:
                dist.start_remote(layer, q, *((k, v) if stored else (store_kv(k, kv_dtype), store_kv(v, kv_dtype))))
            else:
                dist.gather_remote(gather)

        return self.fused.decode_split(ids, positions, batch.block_tables, self.kv,
                                       SplitStep(dist.split, q, k, v, gather, hook),
                                       self.small_batch_threads if B <= SMALL_BATCH else 0)

    def _pick(self, requests: list[Request], sampled: list[int], logits: torch.Tensor, greedy_ids: list[int] | None,
              generators: list, banned: list[tuple[int, list[int]]], pending: PendingMasks | None = None
              ) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """Sample row k of ``logits`` for request ``sampled[k]``; None for the others;
        ``engine.sampling.UNSAMPLED`` for a row that could not be drawn. With each
        token, its logprobs where its request asks (engine/logprobs.py)."""
        asking = [k for k, i in enumerate(sampled) if requests[i].params.logprobs is not None]
        # the model's raw logits: before the min_tokens mask and the sampler's adjustments change rows
        pending_logprobs = summarize(
            logits, asking, [requests[sampled[k]].params.logprobs for k in asking], self.logprob_kernel,
            [k for k in asking if requests[sampled[k]].params.adjusts_logits]) if asking else None
        row_of = {i: row for row, i in enumerate(sampled)}
        if banned := [(row_of[i], ids) for i, ids in banned if i in row_of]:
            apply_min_tokens(logits, banned)
            greedy_ids = None                       # the masked rows' argmax may have moved
        # structured output: a guided row keeps only the tokens its grammar allows (its argmax moves)
        unallowed = pending.apply(logits) if pending is not None else []
        if pending is not None and greedy_ids is not None:
            greedy_ids = list(greedy_ids)
            guided = logits if len(pending.rows) == logits.shape[0] else logits[pending.rows]
            for row, tok in zip(pending.rows, greedy(guided)):
                greedy_ids[row] = tok
        picked = sample(logits, [requests[i].params for i in sampled], [generators[i] for i in sampled],
                        [len(requests[i].output_ids) for i in sampled], greedy_ids, self.sampler,
                        [(requests[i].prompt_ids, requests[i].output_ids) for i in sampled])
        for row in unallowed:                       # its grammar allows no token: nothing to draw
            picked[row] = UNSAMPLED
        tokens: list[int | None] = [None] * len(requests)
        for i, tok in zip(sampled, picked):
            tokens[i] = tok
        answers: list[TokenLogprobs | None] = [None] * len(requests)
        if pending_logprobs is not None:
            entries = pending_logprobs.answer(logits, [max(picked[k], 0) for k in asking])   # UNSAMPLED fails anyway
            for k, entry in zip(asking, entries):
                answers[sampled[k]] = entry
        return tokens, answers

    def _forward(self, requests: list[Request], is_prefill: bool, sampled: list[int],
                 on_layer: Callable[[int], None] | None, num_new: list[int] | None) -> torch.Tensor | None:
        """The torch model's call (in inference mode): logits [len(sampled), V], or None
        when no request samples."""
        ids, positions, batch, last_rows = self.build_batch(requests, is_prefill, num_new)
        dist = None
        if self._has_remote_kv(requests):
            if self.model.attention_kernel is None:
                raise ValueError("KV in remote parts needs the paged attention kernel")
            dist = DistStep(*batch.paged_rows(positions), batch.slots,
                            [self.remote_kv.parts(r.request_id) for r in requests], self.model.attention_kernel,
                            self.remote_kv.deadline_s)
        hidden = self.model.forward(ids, positions, batch, self.kv, on_layer, dist)   # [T, D]
        if is_prefill:
            self._prompt_logprobs(requests, hidden, batch)
        if not sampled:
            return None
        rows = [last_rows[i] for i in sampled]
        if len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, dtype=torch.int64)]       # [B', D]
        return self.model.compute_logits(hidden)                         # [B', V]

    def _prompt_logprobs(self, requests: list[Request], hidden: torch.Tensor, batch: AttentionBatch) -> None:
        """Append to each prefilling request that needs them the prompt logprobs of
        this step's rows: the row of position p answers prompt token p + 1. The
        scheduler gave such a request no cached prefix, so its rows start where its
        logprobs stopped (or, recomputed after a preemption, before)."""
        for req, seq in zip(requests, batch.prefill):
            if not req.needs_prompt_logprobs:
                continue
            start, first = req.num_computed, len(req.prompt_logprobs)
            stop = min(start + seq.q_len, len(req.prompt_ids) - 1)      # positions [first, stop) answer
            if first < start or first >= stop:
                continue
            rows = hidden[seq.q_start + first - start:seq.q_start + stop - start]
            req.prompt_logprobs += prompt_logprobs(rows, self.model.compute_logits,
                                                   req.prompt_ids[first + 1:stop + 1], req.params.prompt_logprobs,
                                                   self.logprob_kernel)

    def _decode_fused(self, requests: list[Request]) -> tuple[torch.Tensor, list[int]]:
        """A decode step on the one-call decoder, its inputs written into the reused
        staging buffers: logits [B, V] (valid until the next step) and greedy ids."""
        st = self._staging
        bs = self.block_size
        st.reserve(len(requests), max(r.num_tokens - 1 for r in requests) // bs + 1)
        ids, positions, tables = st.ids, st.positions, st.tables
        for i, r in enumerate(requests):
            pos = r.num_tokens - 1                  # its one new token: the last sampled (or prompt) id
            ids[i] = r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]
            positions[i] = pos
            n = pos // bs + 1
            tables[i, :n] = r.block_ids[:n]
        rows = len(requests)
        if self.team is None:
            return st.run(rows, self.small_batch_threads if rows <= SMALL_BATCH else 0)
        size = self.team.pick(rows)
        t = time.perf_counter()
        out = st.run(rows, size)
        self.team.record(rows, size, time.perf_counter() - t)
        return out

    def time_decode_teams(self, block: int, teams: list[int], budget_s: float,
                          rounds: tuple[int, int] = (5, 40)) -> dict[int, float]:
        """Median seconds of a one-row decode step on each team size in ``teams``: one
        unmeasured step of each, then the teams' steps alternated for as many rounds as
        fit in ``budget_s`` (by the first steps' times), within ``rounds`` (least, most).
        The steps run at the last position of device block ``block``, which the caller
        holds: they write its K/V, nothing else."""
        st = self.fused.staging(self.kv)                # its own buffers: the engine's stay as they are
        st.reserve(1, 1)
        st.ids[0], st.positions[0], st.tables[0, 0] = 0, self.block_size - 1, block
        t = time.perf_counter()
        for n in teams:
            st.run(1, n)
        n_rounds = int(budget_s / max(time.perf_counter() - t, 1e-6))
        times: dict[int, list[float]] = {n: [] for n in teams}
        for _ in range(min(max(n_rounds, rounds[0]), rounds[1])):
            for n in teams:
                t = time.perf_counter()
                st.run(1, n)
                times[n].append(time.perf_counter() - t)
        return {n: statistics.median(ts) for n, ts in times.items()}
