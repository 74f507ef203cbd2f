"""DistAttention in the engine (engine/dist_attention.py): a request whose KV sits in 2 or 3
parts -- its first chunks in the engine's MemPool, later ones in blocks lent by other
MemPools in this process (the lenders, on a thread of their own or called directly) --
gives the tokens AND the logits bits of the engine with every block local, in chunked
prefill and decode, greedy and seeded, on the tiny model, a tiny model at 3,000 tokens, and
SmolLM2 on its exact (fp32, batch_invariant) and native (quantized) paths.

The debtor's own blocks are NaN before the run: a read of a position it does not hold
would show in the logits."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from engine.dist_attention import FuturePartials, InProcessLender, LentKV, RemoteKV, RemoteKVError, RemotePart
from engine.engine import EngineConfig, LLMEngine, build_model
from engine.memory.kv_cache import KVCache
from engine.memory.mempool import MemPool
from engine.memory.region import Purpose
from engine.model.config import tiny_config
from engine.model.weights import random_weights
from engine.request import SamplingParams

BS = 16


def lender_pool(engine: LLMEngine, blocks: int) -> MemPool:
    """Another instance's MemPool: the engine's KV layout, ``blocks`` device blocks."""
    m = engine.model
    kv = KVCache(num_layers=m.num_local_layers, num_kv_heads=m.config.num_kv_heads, head_dim=m.config.head_dim,
                 block_size=BS, device_blocks=blocks, dtype=engine.kv.dtype)
    return MemPool(device_blocks=blocks, host_blocks=0, block_size=BS, storage=kv)


def borrow(engine: LLMEngine, rid: str, cuts: list[int], total: int, executor) -> list[MemPool]:
    """Give request ``rid`` remote parts at chunks cuts[0]..cuts[1], ..., the last open (room
    for ``total`` keys), each in a LENT region of a MemPool of its own (its blocks after a
    few others, so they are not the debtor's ids)."""
    if engine.runner.remote_kv is None:
        engine.runner.remote_kv = RemoteKV()
    m = engine.model
    windows = [m.config.layer_window(i) for i in range(m.num_local_layers)]
    parts, pools = [], []
    for i, lo in enumerate(cuts):
        hi = cuts[i + 1] if i + 1 < len(cuts) else None
        keys = (hi * 128 if hi is not None else total) - lo * 128
        pool = lender_pool(engine, -(-keys // BS) + 9)
        assert pool.reserve_region((), num_blocks=5, purpose=Purpose.LENT) is not None       # others' loans
        region = pool.reserve_region((), num_blocks=-(-keys // BS), purpose=Purpose.LENT)
        lent = LentKV(pool, region.block_ids, lo, m.attention_kernel, m.scale, windows)
        parts.append(RemotePart(lo, hi, InProcessLender(lent, executor)))
        pools.append(pool)
    engine.runner.remote_kv.add(rid, parts)
    return pools


def record_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Every logits row the engine samples from, by request, in order (a copy of each)."""
    seen: dict[str, list[torch.Tensor]] = {}
    pick = engine.runner._pick

    def recording(requests, sampled, logits, *args, **kwargs):
        for row, i in enumerate(sampled):
            seen.setdefault(requests[i].request_id, []).append(logits[row].clone())
        return pick(requests, sampled, logits, *args, **kwargs)

    engine.runner._pick = recording
    return seen


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return got
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    raise AssertionError("the engine stopped making progress")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def seeded(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.9, top_k=40, seed=11, ignore_eos=True)


def compare(make, prompts: dict[str, tuple[list[int], SamplingParams]], split: dict[str, list[int]],
            threaded: bool) -> None:
    """The requests on an engine with every block local, then on one whose ``split``
    requests have remote parts (the others beside them in the same steps): the same tokens
    and the same logits bits."""
    ref_engine = make(enable_prefix_caching=True)
    ref_logits = record_logits(ref_engine)
    want = run(ref_engine, prompts)
    engine = make(enable_prefix_caching=False)
    engine.kv.tier("device").fill_(float("nan"))
    logits = record_logits(engine)
    lenders = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for rid, cuts in split.items():
            ids, params = prompts[rid]
            lenders += borrow(engine, rid, cuts, len(ids) + params.max_tokens, pool if threaded else None)
        got = run(engine, prompts)
    for lender in lenders:                      # each part's K/V went to its lender
        assert lender.layer_caches(0)[0].abs().sum() > 0
    assert got == want
    assert logits.keys() == ref_logits.keys()
    for rid, rows in logits.items():
        assert len(rows) == len(ref_logits[rid]) == len(want[rid])
        assert all(torch.equal(a, b) for a, b in zip(rows, ref_logits[rid])), rid


@pytest.fixture(scope="module")
def tiny_model(tiny_weights):
    cfg = EngineConfig(model="tiny", dtype="float32", batch_invariant=True)
    return build_model(cfg, tiny_weights)


def tiny_engines(model, tokenizer, **kw):
    def make(**more) -> LLMEngine:
        cfg = EngineConfig(**{"model": "tiny", "dtype": "float32", "batch_invariant": True, "kv_blocks": 256,
                              "host_kv_blocks": 0, "max_num_seqs": 8, **kw, **more})
        return LLMEngine(cfg, model, tokenizer, "tiny")
    return make


def prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("cuts", [[2], [1, 3]], ids=["2 parts", "3 parts"])
@pytest.mark.parametrize("sampling", [greedy, seeded])
@pytest.mark.parametrize("threaded", [True, False], ids=["lender thread", "direct"])
def test_tiny_in_parts(tiny_model, tokenizer, cuts, sampling, threaded):
    """Chunked prefill (chunks of 100 rows straddle the parts) and decode across a part's
    boundary (370 + 40 tokens passes key 384), a request with every block local beside it."""
    make = tiny_engines(tiny_model, tokenizer, prefill_chunk_tokens=100)
    prompts = {"split": (prompt(370, 1), sampling(40)), "local": (prompt(150, 2), sampling(30))}
    compare(make, prompts, {"split": cuts}, threaded)


def test_tiny_several_thousand_tokens():
    """A tiny model with room for 4,096 positions: 3,000 prompt tokens in 3 parts, decoding
    past a part boundary."""
    config = tiny_config(max_position_embeddings=4096)
    cfg = EngineConfig(model="tiny", dtype="float32", batch_invariant=True)
    model = build_model(cfg, random_weights(config, seed=5))
    from engine.model.registry import resolve_model
    tokenizer = resolve_model("tiny:7").load_tokenizer()
    make = tiny_engines(model, tokenizer, prefill_chunk_tokens=512, max_num_batched_tokens=4096)
    compare(make, {"long": (prompt(3000, 3), greedy(12))}, {"long": [8, 16]}, threaded=True)


@pytest.fixture(scope="module")
def smollm2_exact(smollm2_weights):
    return build_model(EngineConfig(model="smollm2", dtype="float32", weights="dequantize", batch_invariant=True),
                       smollm2_weights)


@pytest.fixture(scope="module")
def smollm2_native(smollm2_source):
    return build_model(EngineConfig(model="smollm2", dtype="float32"), smollm2_source.load_weights(quantized=True))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["exact", "native"])
def test_smollm2_in_parts(request, smollm2_source, prompts, path):
    model = request.getfixturevalue(f"smollm2_{path}")
    tokenizer = smollm2_source.load_tokenizer()

    def make(**more) -> LLMEngine:
        cfg = EngineConfig(**{"model": "smollm2", "dtype": "float32", "kv_blocks": 128, "host_kv_blocks": 0,
                              "prefill_chunk_tokens": 128, **({"batch_invariant": True} if path == "exact" else {}),
                              **more})
        return LLMEngine(cfg, model, tokenizer, "smollm2")

    long = ([t for p in prompts for t in p] * 8)[:300]  # the fidelity prompts, one after another
    reqs = {"two": (long, greedy(12)), "three": (long[:260], seeded(12)), "plain": (prompts[0], greedy(8))}
    compare(make, reqs, {"two": [2], "three": [1, 2]}, threaded=True)


def test_a_part_refuses_what_it_does_not_hold(tiny_model, tokenizer):
    """Writes outside the part, a part the sequence passes inside a chunk, a layer out of
    range: refused, nothing written; a lender that does not answer in time fails the step."""
    engine = tiny_engines(tiny_model, tokenizer)()
    pool = lender_pool(engine, 20)
    region = pool.reserve_region((), num_blocks=12, purpose=Purpose.LENT)
    m = engine.model
    lent = LentKV(pool, region.block_ids, 1, m.attention_kernel, m.scale, [None] * m.num_local_layers)
    H, kvh, hd = m.config.num_heads, m.config.num_kv_heads, m.config.head_dim
    q, k, v = torch.randn(1, H, hd), torch.randn(1, kvh, hd), torch.randn(1, kvh, hd)
    before = pool.layer_caches(0)[0].clone()
    with pytest.raises(ValueError):             # position 100 is the debtor's own
        lent.step(0, q, 200, torch.tensor([100]), k, v)
    with pytest.raises(ValueError):             # 12 blocks end at key 320, inside chunk 2
        lent.step(0, q, 400, torch.tensor([399]), k, v)
    with pytest.raises(ValueError):
        lent.step(m.num_local_layers, q, 200, torch.tensor([199]), k, v)
    assert torch.equal(pool.layer_caches(0)[0], before)
    assert lent.step(0, q, 200, torch.tensor([199]), k, v).m.shape == (1, 1, H)
    with pytest.raises(ValueError):
        RemoteKV().add("r", [RemotePart(0, None, InProcessLender(lent))])       # chunk 0 stays local
    with pytest.raises(ValueError):
        RemoteKV().add("r", [RemotePart(1, None, InProcessLender(lent)), RemotePart(2, None, InProcessLender(lent))])

    class Silent:                               # a lender that never answers
        def start(self, *args):
            return FuturePartials(concurrent.futures.Future())

    engine.runner.remote_kv = RemoteKV(deadline_s=0.2)
    engine.runner.remote_kv.add("r", [RemotePart(1, None, Silent())])
    engine.add_request("r", prompt(200, 4), greedy(2))
    with pytest.raises(RemoteKVError):
        engine.step()
