"""What the one-call decode executors (fused_decode, plan_decode) are given and give back.

Both take one decode step for a batch as raw pointers into C++, so a wrong
dtype, shape or layout would be read as garbage rather than raise:
``check_decode_inputs`` is where it is refused, before anything is written.

``DecodeStaging`` is the engine's door to the same call, step after step: host
buffers for ids, positions and block tables in, logits and greedy tokens out,
allocated once and reused, so a step constructs no tensor and allocates nothing
on the Python side. A step streams the weights through the caches, so whatever
Python touches between steps is a cache miss: the less it touches, the shorter
the step (docs/benchmarks-history.md, "2026-11-27, later").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DecoderDims:
    """The shape of the decoder an executor runs, in the executors' own terms: what
    their C++ model descriptions hold besides weights (the engine fills it from its
    model's config)."""

    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float                      # the RMS norms' epsilon
    scale: float                    # attention's softmax scale

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The KV tensor's shape: [L, 2, num_blocks, block_size, kvh, hd]."""
        return (self.num_layers, 2, num_blocks, block_size, self.kv_heads, self.head_dim)


def check_decode_kv(kv: torch.Tensor, *, dims: DecoderDims, num_blocks: int, block_size: int,
                    dtype: torch.dtype, what: str) -> None:
    """Raises ValueError naming ``what`` unless ``kv`` is a contiguous
    [L, 2, num_blocks, block_size, kvh, hd] tensor of ``dtype``."""
    if kv.dtype != dtype or not kv.is_contiguous() or tuple(kv.shape) != dims.kv_shape(num_blocks, block_size):
        raise ValueError(f"kv {tuple(kv.shape)} {kv.dtype} does not match the {what}")


def check_decode_inputs(ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                        kv: torch.Tensor, *, dims: DecoderDims, num_blocks: int, block_size: int,
                        dtype: torch.dtype, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, block_tables), contiguous, for a step over ``kv``
    [L, 2, num_blocks, block_size, kvh, hd] of ``dtype``; ids and positions
    [B] int64, block_tables [B, M] int64. Raises ValueError naming ``what``
    (the executor) on anything else. Does not check ids or positions against
    their ranges (the C++ step does, before it writes)."""
    check_decode_kv(kv, dims=dims, num_blocks=num_blocks, block_size=block_size, dtype=dtype, what=what)
    if ids.dtype != torch.int64 or positions.dtype != torch.int64 or block_tables.dtype != torch.int64:
        raise ValueError("ids, positions and block_tables must be int64")
    B = ids.shape[0]
    ids, positions, tables = ids.contiguous(), positions.contiguous(), block_tables.contiguous()
    if ids.dim() != 1 or positions.shape != (B,) or tables.dim() != 2 or tables.shape[0] != B:
        raise ValueError("ids, positions and block_tables disagree on the batch size")
    return ids, positions, tables


# launch(B, ids, positions, tables, max_blocks, logits, argmax, threads) -> rc: the executor's
# step on addresses (argmax 0: not wanted; threads 0: torch's thread count); 0 on success, else
# the batch was refused (nothing written).
Launch = Callable[[int, int, int, int, int, int, int, int], int]


def decode_step(launch: Launch, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, *,
                vocab: int, refused: str) -> torch.Tensor:
    """fp32 logits [B, vocab] of one ``launch`` over checked inputs (``check_decode_inputs``'
    results), on torch's thread count, no greedy tokens. Raises ValueError(``refused``) when
    the executor refuses the batch (nothing written)."""
    B = ids.shape[0]
    logits = torch.empty(B, vocab, dtype=torch.float32)
    if launch(B, ids.data_ptr(), positions.data_ptr(), tables.data_ptr(), tables.shape[1], logits.data_ptr(),
              0, 0) != 0:
        raise ValueError(refused)
    return logits


class DecodeStaging:
    """Reusable host buffers of one executor's decode steps over one KV tensor.

    Use: ``reserve(B, M)`` (at least B rows of M block-table entries; growing
    reallocates, so it comes before filling), fill ``ids[:B]``, ``positions[:B]``
    and ``tables[:B, :M]`` (int64 numpy views the executor reads), then ``run(B)``
    (optionally on a team of its own size, ``run(B, threads)``).
    ``run`` returns ``(logits, greedy)``: fp32 logits [B, V], a view valid until
    the next ``run``, and each row's greedy token (the first index of its largest
    logit, a NaN counting as the largest: ``torch.argmax``'s indices). Where the
    executor computes the greedy tokens in the step (``native_argmax``) they come
    with it; else numpy's argmax over the logits gives the same indices.
    ``run`` raises ValueError, naming ``what``, when the executor refuses the
    batch (an id, position or block out of range: nothing written). The KV tensor
    was checked when the executor built this staging; the buffers' dtypes and
    layouts hold by construction."""

    def __init__(self, vocab: int, launch: Launch, *, native_argmax: bool, what: str) -> None:
        self.vocab = vocab
        self._launch = launch
        self._native_argmax = native_argmax
        self._what = what
        self._alloc(8, 16)

    def _alloc(self, rows: int, width: int) -> None:
        self.ids = np.zeros(rows, dtype=np.int64)
        self.positions = np.zeros(rows, dtype=np.int64)
        self.tables = np.zeros((rows, width), dtype=np.int64)
        self.argmax = np.zeros(rows, dtype=np.int64)
        self.logits = torch.empty(rows, self.vocab, dtype=torch.float32)
        self._logits_np = self.logits.numpy()
        self._ptrs = (self.ids.ctypes.data, self.positions.ctypes.data, self.tables.ctypes.data,
                      self.logits.data_ptr(), self.argmax.ctypes.data if self._native_argmax else 0)
        self._views: dict[int, tuple[torch.Tensor, np.ndarray]] = {}    # rows -> (logits, greedy source)

    def reserve(self, rows: int, width: int) -> None:
        """Room for ``rows`` sequences of ``width`` blocks (buffers' contents lost when they grow)."""
        have_rows, have_width = self.tables.shape
        if rows > have_rows or width > have_width:
            self._alloc(max(rows, 2 * have_rows if rows > have_rows else have_rows),
                        max(width, 2 * have_width if width > have_width else have_width))

    def run(self, rows: int, threads: int = 0) -> tuple[torch.Tensor, list[int]]:
        """The step over the first ``rows`` staged rows on ``threads`` threads (0: torch's
        thread count; any count gives the same bits)."""
        if not 0 < rows <= self.ids.shape[0]:
            raise ValueError(f"{self._what}: {rows} rows staged, room for {self.ids.shape[0]}")
        ids, positions, tables, logits, argmax = self._ptrs
        if self._launch(rows, ids, positions, tables, self.tables.shape[1], logits, argmax, threads) != 0:
            raise ValueError(f"{self._what}: a token id, position or block id out of range")
        views = self._views.get(rows)
        if views is None:                   # a view per batch size, made once: slicing a tensor is not free
            views = self._views[rows] = (self.logits[:rows], self.argmax[:rows] if self._native_argmax
                                         else self._logits_np[:rows])
        logits, greedy = views
        return logits, greedy.tolist() if self._native_argmax else greedy.argmax(axis=-1).tolist()


class DecodeExecutor:
    """A one-call decode executor's entry points over its ``_launcher``.

    A subclass sets ``dims``, ``num_blocks``, ``block_size`` and ``kv_dtype``,
    names itself in ``WHAT`` (error messages), says in ``REFUSED`` what its step
    refuses, whether its step computes the greedy tokens (``NATIVE_ARGMAX``), and
    implements ``_launcher(kv)``: the step over an already checked ``kv``."""

    WHAT: str = "decoder"
    REFUSED: str = "token id, position or block id out of range"
    NATIVE_ARGMAX: bool = False
    dims: DecoderDims
    num_blocks: int
    block_size: int
    kv_dtype: torch.dtype

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               kv: torch.Tensor) -> torch.Tensor:
        """ids, positions [B] int64; block_tables [B, M] int64 covering every
        position; kv [L, 2, N, bs, kvh, hd] of ``kv_dtype`` (mutated: the new K/V).
        Returns fp32 logits [B, V]. Raises ValueError on bad input (nothing written)."""
        ids, positions, tables = check_decode_inputs(ids, positions, block_tables, kv, dims=self.dims,
                                                     num_blocks=self.num_blocks, block_size=self.block_size,
                                                     dtype=self.kv_dtype, what=self.WHAT)
        return decode_step(self._launcher(kv), ids, positions, tables, vocab=self.dims.vocab, refused=self.REFUSED)

    def staging(self, kv: torch.Tensor) -> DecodeStaging:
        """Reusable buffers for steps over ``kv`` (checked here, once). Raises
        ValueError when ``kv`` does not match the executor."""
        check_decode_kv(kv, dims=self.dims, num_blocks=self.num_blocks, block_size=self.block_size,
                        dtype=self.kv_dtype, what=self.WHAT)
        return DecodeStaging(self.dims.vocab, self._launcher(kv), native_argmax=self.NATIVE_ARGMAX, what=self.WHAT)

    def _launcher(self, kv: torch.Tensor) -> Launch:
        raise NotImplementedError
