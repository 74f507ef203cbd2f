"""The input check shared by the one-call decode executors (fused_decode, plan_decode).

Both take one decode step for a batch as raw pointers into C++, so a wrong
dtype, shape or layout would be read as garbage rather than raise: this is
where it is refused, before anything is written.
"""

from __future__ import annotations

import torch

from engine.model.config import LlamaConfig


def check_decode_inputs(ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                        kv: torch.Tensor, *, config: LlamaConfig, num_blocks: int, block_size: int,
                        dtype: torch.dtype, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, block_tables), contiguous, for a step over ``kv``
    [L, 2, num_blocks, block_size, kvh, hd] of ``dtype``; ids and positions
    [B] int64, block_tables [B, M] int64. Raises ValueError naming ``what``
    (the executor) on anything else. Does not check ids or positions against
    their ranges (the C++ step does, before it writes)."""
    if (kv.dtype != dtype or not kv.is_contiguous()
            or tuple(kv.shape) != (config.num_layers, 2, num_blocks, block_size,
                                   config.num_kv_heads, config.head_dim)):
        raise ValueError(f"kv {tuple(kv.shape)} {kv.dtype} does not match the {what}")
    if ids.dtype != torch.int64 or positions.dtype != torch.int64 or block_tables.dtype != torch.int64:
        raise ValueError("ids, positions and block_tables must be int64")
    B = ids.shape[0]
    ids, positions, tables = ids.contiguous(), positions.contiguous(), block_tables.contiguous()
    if ids.dim() != 1 or positions.shape != (B,) or tables.dim() != 2 or tables.shape[0] != B:
        raise ValueError("ids, positions and block_tables disagree on the batch size")
    return ids, positions, tables
