"""The plan executor's split step (``PlanDecoder.decode_split``; DistAttention): a decode
batch whose sequences have key chunks in remote parts gives the unsplit step's bits when
its hooks hand back the paged kernel's partials of those chunks (here computed over a
lender's copy of the KV, as a creditor computes them); the debtor's blocks of the remote
chunks are NaN, so a read of one would show. A hook that raises fails the step with its
exception and no hook runs after it; bad inputs are refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from engine.dist_attention import RemoteKVError
from engine.model.llama import LlamaModel
from kernels.attention import store_kv
from kernels.dist_attention import KEY_CHUNK, Partials, chunks_of
from kernels.plan_decode import PlanDecoder, SplitStep

from .test_plan_decode import BS, decoder, kernel, prefilled, tiny_model  # noqa: F401 -- kernel: a fixture


class Lender:
    """The remote chunks of each sequence, on a copy of the KV cache: K/V of a remote
    position written there at phase 0, the paged kernel's partials gathered at phase 1."""

    def __init__(self, model: LlamaModel, kv: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                 split: list[int], fail_at: tuple[int, int] | None = None) -> None:
        self.model, self.kv, self.positions, self.tables, self.split = model, kv, positions, tables, split
        c = model.config
        B = len(split)
        self.slots = max(chunks_of(int(p) + 1) for p in positions)
        self.step = SplitStep(torch.tensor(split, dtype=torch.int64), torch.empty(B, c.num_heads, c.head_dim),
                              torch.empty(B, c.num_kv_heads, c.head_dim), torch.empty(B, c.num_kv_heads, c.head_dim),
                              Partials.empty(B, self.slots, c.num_heads, c.head_dim), self.hook)
        self.fail_at, self.calls = fail_at, []

    def hook(self, layer: int, phase: int) -> None:
        self.calls.append((layer, phase))
        if (layer, phase) == self.fail_at:
            raise RemoteKVError("a remote part refused: test")
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]
        for b, lo in enumerate(self.split):
            pos = int(self.positions[b])
            ctx = pos + 1
            if lo >= chunks_of(ctx):
                continue                                    # every chunk local
            if phase == 0:
                if pos >= lo * KEY_CHUNK:                   # the new token's K/V is the part's
                    blk, off = int(self.tables[b, pos // BS]), pos % BS
                    k_cache[blk, off] = store_kv(self.step.k[b], k_cache.dtype)
                    v_cache[blk, off] = store_kv(self.step.v[b], v_cache.dtype)
                continue
            part = self.model.attention_kernel.partials(
                self.step.q[b:b + 1], k_cache, v_cache, torch.tensor([[0, 1, ctx]]), self.tables[b:b + 1],
                torch.tensor([[lo, chunks_of(ctx)]]), self.model.scale, chunks_of(ctx) - lo,
                window=self.model.config.layer_window(layer))
            self.step.gather.place(part, slice(b, b + 1), lo)


def debtor_kv(kv: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, split: list[int]) -> torch.Tensor:
    """``kv`` with every block of a remote chunk NaN (the debtor does not hold them)."""
    out = kv.clone()
    for b, lo in enumerate(split):
        for j in range(lo * KEY_CHUNK // BS, int(positions[b]) // BS + 1):
            out[:, :, int(tables[b, j])] = float("nan")
    return out


def split_logits(model, kv, ids, pos, tables, split, threads=0):
    dec: PlanDecoder = decoder(model, kv)
    lender = Lender(model, kv.clone(), pos, tables, split)
    mine = debtor_kv(kv, pos, tables, split)
    logits, greedy = dec.decode_split(ids, pos, tables, mine, lender.step, threads)
    return logits, greedy, mine, lender


@pytest.fixture(scope="module")
def tiny_q8(kernel) -> LlamaModel:
    return tiny_model("Q8_0", kernel)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_split_step_gives_the_unsplit_steps_bits(tiny_q8, kv_dtype, threads):
    """Sequences with 1, 2 and 5 local chunks of contexts up to 700 keys (the new token's key
    in a remote part or a local one), beside one with no remote part: the unsplit step's
    logits and greedy tokens bit for bit, its K/V written where each position lives."""
    lengths, split = [300, 700, 255, 40, 600], [1, 2, 2, 1, 5]
    kv, ids, pos, tables = prefilled(tiny_q8, lengths, seed=3, kv_dtype=kv_dtype)
    want_kv = kv.clone()
    want = decoder(tiny_q8, kv).decode(ids, pos, tables, want_kv)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got, greedy, mine, lender = split_logits(tiny_q8, kv, ids, pos, tables, split)
    finally:
        torch.set_num_threads(saved)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert greedy == want.argmax(-1).tolist()
    layers = tiny_q8.config.num_layers
    assert lender.calls == [(layer, phase) for layer in range(layers) for phase in (0, 1)]
    for b, (p, lo) in enumerate(zip(pos.tolist(), split)):
        blk, off = int(tables[b, p // BS]), p % BS
        holder = lender.kv if p >= lo * KEY_CHUNK else mine       # the new K/V where its chunk lives
        assert torch.equal(holder[:, :, blk, off], want_kv[:, :, blk, off]), b


def test_sliding_windows_split(kernel):
    """A window of 150 keys: a remote part's chunks outside a row's window are not read,
    and the row's bits are the unsplit step's."""
    model = tiny_model("Q8_0", kernel, "gemma3", sliding_window=150)
    lengths, split = [257, 700, 400], [1, 3, 2]
    kv, ids, pos, tables = prefilled(model, lengths, seed=6)
    want = decoder(model, kv).decode(ids, pos, tables, kv.clone())
    got, _, _, _ = split_logits(model, kv, ids, pos, tables, split)
    assert torch.equal(got, want)


def test_a_failing_hook_fails_the_step_and_no_hook_runs_after_it(tiny_q8):
    kv, ids, pos, tables = prefilled(tiny_q8, [300, 40], seed=4)
    lender = Lender(tiny_q8, kv.clone(), pos, tables, [1, 1], fail_at=(1, 1))
    with pytest.raises(RemoteKVError, match="test"):
        decoder(tiny_q8, kv).decode_split(ids, pos, tables, debtor_kv(kv, pos, tables, [1, 1]), lender.step)
    assert lender.calls == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_bad_splits_and_buffers_are_refused_before_writing(tiny_q8):
    kv, ids, pos, tables = prefilled(tiny_q8, [300, 40], seed=5)
    dec = decoder(tiny_q8, kv)
    before = kv.clone()

    def attempt(cuts, **change):
        lender = Lender(tiny_q8, kv.clone(), pos, tables, cuts)
        step = SplitStep(**{**vars(lender.step), **change})
        with pytest.raises(ValueError):
            dec.decode_split(ids, pos, tables, kv, step)
        assert lender.calls == []

    attempt([0, 9])                                             # chunk 0 is always local
    c = tiny_q8.config
    attempt([1, 9], gather=Partials.empty(2, 2, c.num_heads, c.head_dim))   # the gather does not reach chunk 2
    attempt([1, 9], split=torch.tensor([1, 9], dtype=torch.int32))
    attempt([1, 9], q=torch.empty(2, 1, c.head_dim))
    attempt([1, 9], k=torch.empty(3, c.num_kv_heads, c.head_dim))
    short = tables.clone()
    short[0, 2] = 10_000                                        # a local block id out of range
    lender = Lender(tiny_q8, kv.clone(), pos, short, [1, 9])
    with pytest.raises(ValueError):
        dec.decode_split(ids, pos, short, kv, lender.step)
    assert torch.equal(kv, before)
