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
plan executor of a quantized fp32 model (kernels/plan_decode.py); prefill
always runs the torch model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model.llama import LlamaModel
from engine.request import Request
from engine.sampling import apply_min_tokens, sample
from kernels.attention import AttentionBatch, PrefillSeq, decode_key_mask
from kernels.fused_decode import FusedDecoder
from kernels.plan_decode import PlanDecoder


class ModelRunner:
    """Executes steps of a full model (all layers) against one device KV tensor.

    ``fused``: a one-call decoder over the same model and ``kv`` (the fused
    bf16 kernel or the plan executor, same ``decode`` contract), or None
    (every step runs the torch model)."""

    def __init__(self, model: LlamaModel, kv: torch.Tensor, block_size: int,
                 fused: FusedDecoder | PlanDecoder | None = None) -> None:
        if not (model.is_first and model.is_last):
            raise ValueError("ModelRunner drives a whole model; pipeline stages use the stage runner")
        self.model = model
        self.kv = kv                    # [L, 2, N, bs, kvh, hd]
        self.block_size = block_size
        self.fused = fused

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
                prefill.append(PrefillSeq(q_start=len(ids), q_len=end - start, ctx_len=end,
                                          block_table=torch.tensor(table[:-(-end // bs)], dtype=torch.int64)))
            ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
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
            if self.fused is None:      # the fused kernel reads lengths from positions
                batch.key_mask = decode_key_mask(lens, max_blocks, bs)
        return torch.tensor(ids, dtype=torch.int64), pos_t, batch, last_rows

    @torch.inference_mode()
    def execute(self, requests: list[Request], is_prefill: bool, generators: list,
                banned: list[tuple[int, list[int]]],
                on_layer: Callable[[int], None] | None = None,
                num_new: list[int] | None = None) -> list[int | None]:
        """Run one call; writes KV for every computed token and returns, per
        request, its sampled id, or None for a prefill chunk that stops short of
        the request's last token (nothing sampled).

        ``banned``: (request index, token ids) masked for requests below their min_tokens.
        ``on_layer``: the prefill's layer hook (engine.stream.LayerStreamer).
        ``num_new``: prefill only, tokens each request computes (default: all it has left).
        """
        ids, positions, batch, last_rows = self.build_batch(requests, is_prefill, num_new)
        sampled = [i for i, r in enumerate(requests)
                   if num_new is None or r.num_computed + num_new[i] == r.num_tokens]
        if not is_prefill and self.fused is not None:
            logits = self.fused.decode(ids, positions, batch.block_tables, self.kv)  # [B, V]
        else:
            hidden = self.model.forward(ids, positions, batch, self.kv, on_layer)   # [T, D]
            if not sampled:
                return [None] * len(requests)
            rows = [last_rows[i] for i in sampled]
            if len(rows) != hidden.shape[0]:
                hidden = hidden[torch.tensor(rows, dtype=torch.int64)]       # [B', D]
            logits = self.model.compute_logits(hidden)                       # [B', V]
        row_of = {i: row for row, i in enumerate(sampled)}
        if banned := [(row_of[i], ids) for i, ids in banned if i in row_of]:
            apply_min_tokens(logits, banned)
        picked = sample(logits, [requests[i].params for i in sampled], [generators[i] for i in sampled],
                        [len(requests[i].output_ids) for i in sampled])
        tokens: list[int | None] = [None] * len(requests)
        for i, tok in zip(sampled, picked):
            tokens[i] = tok
        return tokens
