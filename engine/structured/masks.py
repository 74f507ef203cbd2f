"""Each step's allowed-token masks for the rows under a grammar, computed
while the model runs and applied to the logits before sampling.

A row's mask depends only on its request's grammar state, which is final once
the previous step's token was accepted. Where the host has a CPU the compute
team does not use (``overlap``), ``MaskComputer.start`` hands the step's states
to one worker thread before the step's model call, llguidance's ``LLExecutor``
fills one bitmask row per state (without the GIL) while the model computes,
and ``PendingMasks.apply`` waits for it (bounded by ``MASK_TIMEOUT_S``).
Where the team has every CPU, a thread beside it would take a core from a
team that waits on its slowest thread (the decode executor's barrier): the
masks are then computed in ``apply``, on the engine thread, one matcher after
the other (tens of microseconds each). Either way ``apply`` sets every
disallowed logit of those rows to -inf.

Bitmask layout (llguidance's): row ``r`` is ``ceil(V / 32)`` int32 words, bit
``i`` of word ``j`` (little-endian) allows token ``32 j + i``::

    word:  [ 0 ............ 31 ][ 32 ........... 63 ] ...
    bits:    b0 b1 ... b31        b0 b1 ... b31

The engine stays deterministic: a mask is a function of the grammar state
alone, and the step returns only after the masks were applied.
"""

from __future__ import annotations

import concurrent.futures
import os

import llguidance
import numpy as np
import torch

from engine.structured.grammar import GrammarState
from kernels.token_masks import MaskKernel

# the longest a step waits for its masks (llguidance bounds a mask's work by its lexer fuel
# and Earley item limits: this deadline is a guard, not a budget)
MASK_TIMEOUT_S = 30.0


class PendingMasks:
    """The masks of one step's guided rows, being computed (``MaskComputer.start``)."""

    def __init__(self, rows: list[int], bitmask: np.ndarray, done: concurrent.futures.Future | None,
                 matchers: list[llguidance.LLMatcher], kernel: MaskKernel | None = None) -> None:
        self.rows = rows                    # indices into the step's logits rows
        self._bitmask = bitmask             # [len(rows), ceil(V/32)] int32
        self._done = done                   # the worker's computation, or None: computed in apply
        self._matchers = matchers
        self._kernel = kernel               # applies the bitmask (else torch)

    def apply(self, logits: torch.Tensor) -> list[int]:
        """Wait for the masks, then mask ``logits`` ([B, V] fp32, the step's rows): each
        guided row's disallowed tokens become -inf. Mutates ``logits``. Returns the
        rows left without an allowed token (a grammar in an error state, or masks
        not computed within MASK_TIMEOUT_S): the caller fails their requests."""
        if self._done is None:
            row_bytes = self._bitmask.shape[1] * 4
            for k, matcher in enumerate(self._matchers):
                matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data + k * row_bytes, row_bytes)
        else:
            try:
                self._done.result(timeout=MASK_TIMEOUT_S)
            except concurrent.futures.TimeoutError:    # the worker may still write the bitmask: not read
                for row in self.rows:
                    logits[row].fill_(float("-inf"))
                return list(self.rows)
        if self._kernel is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            allowed = self._kernel.apply(logits, self.rows, self._bitmask)
            return [row for row, ok in zip(self.rows, allowed) if not ok]
        v = logits.shape[1]
        words = self._bitmask.view(np.uint8)
        allowed = np.unpackbits(words, axis=1, count=min(v, words.shape[1] * 8), bitorder="little")  # [n, V]
        if allowed.shape[1] < v:            # ids past the grammar's vocabulary: never allowed
            allowed = np.pad(allowed, ((0, 0), (0, v - allowed.shape[1])))
        refused = allowed == 0
        index = torch.tensor(self.rows, dtype=torch.int64)
        logits[index] = logits[index].masked_fill_(torch.from_numpy(refused), float("-inf"))
        return [self.rows[k] for k in np.flatnonzero(~allowed.any(axis=1))]


class MaskComputer:
    """Computes the masks of a step's guided rows (module docstring). ``vocab_size``:
    the grammar vocabulary's size (GrammarCompiler's). ``overlap``: on a worker thread
    while the model runs; default: where this process may run on more CPUs than
    torch's compute team uses. ``kernel``: applies the masks to the logits (else torch)."""

    def __init__(self, vocab_size: int, overlap: bool | None = None, kernel: MaskKernel | None = None) -> None:
        self.words = (vocab_size + 31) // 32
        self.kernel = kernel
        self.overlap = (len(os.sched_getaffinity(0)) > torch.get_num_threads()) if overlap is None else overlap
        self._executor: llguidance.LLExecutor | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, states: list[GrammarState | None]) -> PendingMasks | None:
        """Start computing the masks of the rows whose state is not None (row k of
        the step's logits is ``states[k]``'s); None when no row has a grammar. The
        states must not change until the returned masks are applied."""
        rows = [k for k, s in enumerate(states) if s is not None]
        if not rows:
            return None
        bitmask = np.zeros((len(rows), self.words), dtype=np.int32)
        if not self.overlap:
            return PendingMasks(rows, bitmask, None, [states[row].matcher for row in rows], self.kernel)
        if self._worker is None:            # the first guided step: nothing is paid before
            self._executor = llguidance.LLExecutor()
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvd-grammar-masks")
        matchers = [(states[row].matcher, k) for k, row in enumerate(rows)]
        done = self._worker.submit(self._executor.unsafe_compute_mask_ptr, matchers, bitmask.ctypes.data,
                                   self.words * 4, len(rows))
        return PendingMasks(rows, bitmask, done, [], self.kernel)

    def close(self) -> None:
        """Stop the worker thread (after the masks it is computing)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
