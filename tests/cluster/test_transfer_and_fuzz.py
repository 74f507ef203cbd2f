"""Two node processes (and a coordinator): KV transfer with insert across
processes, and malformed frames thrown at a node's and the coordinator's
listeners while a request is in flight."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import orjson
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import transports
from kvd import protocol
from transports.base import KIND_MSG, KIND_REQUEST, pack_envelope

from .conftest import MODEL, SEEDED, Cluster, admin, reference_tokens, running_cluster


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("pair"), "zmq+tcp", ["a", "b"]) as c:
        yield c


async def _generate(cluster: Cluster, node: str, ids: list[int], max_tokens: int,
                    sampling: dict | None = None) -> tuple[list[int], dict]:
    """Run one request directly on a node, as the coordinator (its key), greedy or with
    ``sampling`` (conftest.SEEDED's fields); (output ids, final usage)."""
    conn = await cluster.connect(node)
    try:
        await conn.send(*protocol.encode(protocol.GenerateRequest(
            request_id=f"t-{random.random()}", prompt_token_ids=tuple(ids),
            sampling={"max_tokens": max_tokens, "ignore_eos": True, **(sampling or {"temperature": 0.0})})))
        out: list[int] = []
        while True:
            inc = await asyncio.wait_for(conn.recv(), 30)
            msg = protocol.decode(inc.header, inc.frames)
            assert isinstance(msg, protocol.TokenChunk), msg
            assert msg.start_index == len(out)          # every token carries its index
            out += msg.token_ids
            if msg.finish_reason:
                return out, msg.usage
    finally:
        await conn.close()


def test_transfer_with_insert_between_two_node_processes(pair, reference_engine):
    rng = random.Random(7)
    ids = [rng.randrange(1, 40000) for _ in range(100)]            # 6 full blocks of 16
    ref = reference_tokens(reference_engine, [ids], 8)[0]
    out_a, usage_a = asyncio.run(_generate(pair, "a", ids, 8))
    assert out_a == ref and usage_a["cached_tokens"] == 0
    result = admin(pair.node_admin("a"), "transfer", to="b", address=pair.node_urls["b"], token_ids=ids)
    assert result["transferred"] is True, result
    assert result["blocks"] == 6 and result["inserted_tokens"] == 96
    # small: the allocation round trip, then ONE KVData with every layer, never one per block
    assert result["sends"] == 2 and result["chunks"] == 1 and result["new_blocks"] == 6
    assert admin(pair.node_admin("b"), "status")["transfers"]["received"] == 1
    out_b, usage_b = asyncio.run(_generate(pair, "b", ids, 8))
    assert usage_b["cached_tokens"] == 96                      # served from the transferred KV
    assert out_b == ref
    for sampling in SEEDED:                                   # seeded draws over the transferred KV too
        seeded, usage = asyncio.run(_generate(pair, "b", ids, 8, sampling))
        assert usage["cached_tokens"] == 96
        assert seeded == reference_tokens(reference_engine, [ids], 8, sampling)[0], sampling
    # a second transfer of the same prefix stores nothing new
    again = admin(pair.node_admin("a"), "transfer", to="b", address=pair.node_urls["b"], token_ids=ids)
    assert again["transferred"] is True and again["new_blocks"] == 0


@pytest.mark.parametrize("layout", ["staged", "pieces"])
def test_streamed_transfer_is_exact_and_skips_what_the_receiver_has(reference_engine, tmp_path,
                                                                    monkeypatch, layout):
    """The large-transfer path (allocation round trip, then layer chunks sent
    without waiting) over zmq between two engines: the receiver's KV is
    bit-identical, it serves the prefix from cache with the single-node
    engine's tokens, and blocks it already had are not sent. ``pieces``:
    frames are views of the sender's pool (the tiny model's slices are far
    under the zero-copy threshold, so the threshold is lowered); ``staged``:
    gathered into staging buffers. Then a small transfer with the default
    chunk size: the allocation round trip and ONE KVData, same checks."""
    import torch

    from kvd.node import transfer
    monkeypatch.setattr(transfer, "ZERO_COPY_MIN_BYTES", 0 if layout == "pieces" else 1 << 40)

    from engine.engine import EngineConfig, LLMEngine
    from engine.request import SamplingParams
    from kvd.node.engine_driver import EngineDriver
    from kvd.node.inbox import KVInbox
    from kvd.node.transfer import send_prefix

    def engine():
        return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=64,
                                                  host_kv_blocks=0, max_model_len=512, num_threads=1,
                                                  batch_invariant=True))

    rng = random.Random(11)
    ids = [rng.randrange(1, 40000) for _ in range(100)]                 # 6 full blocks
    ref = reference_tokens(reference_engine, [ids], 8)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run():
        a, b = EngineDriver(engine()), EngineDriver(engine())
        await a.start()
        await b.start()
        inbox = KVInbox(b)
        listener = await transports.listen(f"zmq+ipc://{tmp_path}/b.sock", options=transports.TransportOptions())

        async def reply(inc, msg):
            r = await inbox.answer(msg, inc)
            await listener.reply(inc, *protocol.encode(r))

        async def serve():
            tasks = set()
            while True:
                inc = await listener.recv()
                t = asyncio.create_task(reply(inc, protocol.decode(inc.header, inc.frames)))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

        server = asyncio.create_task(serve())
        conn = await transports.connect(listener.url, options=transports.TransportOptions())
        try:
            async def gen(d, rid):
                outs = [o async for o in d.generate(rid, ids, params)]
                return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens

            assert (await gen(a, "r-a"))[0] == ref
            # receiver already caches the first 2 blocks: only 4 travel
            await b.call(lambda e: e.generate([ids[:40]], SamplingParams(max_tokens=1)))
            kw = dict(src_node="a", dst_node="b", chunk_bytes=1)
            res = await send_prefix(a, conn, ids, **kw)
            L = a.engine.kv.num_layers
            assert res["transferred"] and res["inserted_tokens"] == 96, res
            assert res.get("zero_copy", False) == (layout == "pieces")
            assert res["new_blocks"] == res["sent_blocks"] == 4 and res["chunks"] == L
            assert res["sends"] == 1 + L                # allocation + one chunk per layer, never per block
            assert inbox.prefix_counts["received"] == 1 and not inbox.receivers

            def kv_of(toks):
                def run(engine):
                    m = engine.pool.tree.match(toks)
                    return torch.stack([engine.kv.tier(r.tier)[:, :, r.block_id] for r in m.blocks], 2).clone()
                return run
            assert torch.equal(await a.call(kv_of(ids)), await b.call(kv_of(ids)))
            assert await gen(b, "r-b") == (ref, 96)             # served from the transferred KV
            again = await send_prefix(a, conn, ids, **kw)
            assert again["transferred"] and again["sent_blocks"] == 0 and again["sends"] == 2
            # small, default chunk size: 4 new blocks after a shared first one, in ONE KVData
            ids2 = ids[:16] + [rng.randrange(1, 40000) for _ in range(70)]
            ref2 = reference_tokens(reference_engine, [ids2], 8)[0]
            outs = [o async for o in a.generate("r-a2", ids2, params)]
            assert [t for o in outs for t in o.new_token_ids] == ref2
            one = await send_prefix(a, conn, ids2, src_node="a", dst_node="b")
            assert one["transferred"] and one["new_blocks"] == 4 and one["inserted_tokens"] == 80, one
            assert one["sends"] == 2 and one["chunks"] == 1
            assert one.get("zero_copy", False) == (layout == "pieces")
            assert torch.equal(await a.call(kv_of(ids2)), await b.call(kv_of(ids2)))
            outs = [o async for o in b.generate("r-b2", ids2, params)]
            assert [t for o in outs for t in o.new_token_ids] == ref2 and outs[-1].num_cached_tokens == 80
            assert inbox.prefix_counts["received"] == 3 and not inbox.receivers
        finally:
            server.cancel()
            await conn.close()
            await listener.close()
            await a.stop()
            await b.stop()

    asyncio.run(run())


def test_transfer_of_an_uncached_prefix_is_refused(pair):
    r = admin(pair.node_admin("a"), "transfer", to="b", address=pair.node_urls["b"], token_ids=[5] * 40)
    assert r["transferred"] is False and r["blocks"] == 0 and r["reason"]


# ─── malformed frames ───────────────────────────────────────────────────────

_good = [protocol.encode(m) for m in (
    protocol.GenerateRequest(request_id="x", prompt_token_ids=(1, 2, 3)),
    protocol.Heartbeat(node="ghost", seq=1, load=0.0, running=0, waiting=0, free_blocks={}),
    protocol.KVData(transfer_id="t", tensors=(protocol.RawTensor("uint8", (4,), memoryview(b"abcd")),)),
)]


@st.composite
def bad_message(draw) -> list[bytes]:
    """Multipart frames (after the identity) that no daemon may accept."""
    kind = draw(st.sampled_from(["garbage", "bad_header", "truncated_header", "truncated_frames",
                                 "bad_field", "no_header"]))
    env = pack_envelope(draw(st.sampled_from([KIND_MSG, KIND_REQUEST])), draw(st.integers(1, 2**32)))
    header, frames = draw(st.sampled_from(_good))
    frames = [bytes(f) for f in frames]
    if kind == "garbage":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
    if kind == "no_header":
        return [env]
    if kind == "bad_header":
        return [env, draw(st.binary(max_size=200)).replace(b"{", b"["), *frames]
    if kind == "truncated_header":
        return [env, header[:draw(st.integers(0, len(header) - 1))], *frames]
    if kind == "truncated_frames":
        if frames:
            return [env, header, frames[0][:draw(st.integers(0, len(frames[0]) - 1))]]
        return [env, header, b"unexpected frame"]
    body = orjson.loads(header)
    key = draw(st.sampled_from(sorted(set(body) - {"frames"})))
    # a value of the wrong type for that field: a list where a dict belongs
    # ({"k": 1} is a valid Heartbeat.stats), a dict anywhere else
    body[key] = [[1]] if isinstance(body[key], dict) else {"k": 1}
    if key == "type":
        body[key] = "NoSuchMessage"
    return [env, orjson.dumps(body), *frames]


def _bad_total(status: dict) -> int:
    return sum(status["bad_messages"].values()) + status["malformed_frames"]


def _tcp(url: str) -> str:
    return url.replace("zmq+tcp://", "tcp://")


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example drives processes
@given(batch=st.lists(bad_message(), min_size=1, max_size=25))
def test_malformed_frames_are_counted_and_nothing_breaks(pair, reference_engine, batch):
    rng = random.Random(len(batch))
    ids = [rng.randrange(1, 40000) for _ in range(20)]
    result = {}
    t = threading.Thread(target=lambda: result.update(
        out=pair.client(timeout=60).completions.create(model=MODEL, prompt=ids, max_tokens=32,
                                                       temperature=0, extra_body={"ignore_eos": True})))
    t.start()
    targets = {"a": (_tcp(pair.node_urls["a"]), pair.node_admin("a")),
               "coordinator": (_tcp(pair.coordinator_url), pair.admin_socket)}
    pair.make_key("fuzzer")         # an authorized key: the fuzz must get past CURVE to test decoding
    ctx = zmq.Context()
    try:
        for name, (endpoint, sock_path) in targets.items():
            before = _bad_total(admin(sock_path, "status"))
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 1000)
            keys = pair.client_keys(name, as_name="fuzzer")
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = (keys.public_key, keys.secret_key,
                                                                       keys.server_key)
            s.connect(endpoint)
            for parts in batch:
                s.send_multipart(parts)
            # every bad message is counted exactly once (replies, if any, are ignored)
            deadline = time.monotonic() + 5
            while _bad_total(admin(sock_path, "status")) < before + len(batch) and time.monotonic() < deadline:
                time.sleep(0.05)
            counted = admin(sock_path, "status")
            assert _bad_total(counted) == before + len(batch), (name, before, len(batch), counted)
            s.close()
    finally:
        ctx.destroy(linger=0)       # closes a socket a failed assert left open (term() would wait forever)
    t.join(60)
    out = result["out"]
    assert out.usage.completion_tokens == 32
    assert out.choices[0].text == reference_engine.tokenizer.decode(reference_tokens(reference_engine, [ids], 32)[0])
    assert pair.nodes_up() == ["a", "b"]
    m = pair.metrics()
    assert sum(v for k, v in m.items() if k.startswith(("kvd_protocol_rejected_total",
                                                         "kvd_transport_malformed_frames_total"))) > 0


def test_staging_pool_reuses_buffers_of_any_size():
    import torch

    from engine.stream import StagingPool

    pool = StagingPool(keep_bytes=1 << 20)
    big, v = pool.acquire((4, 1024), torch.float32)          # 16 KiB
    small, w = pool.acquire((2, 8), torch.float32)
    pool.release(big)
    pool.release(small)
    again, x = pool.acquire((2, 8), torch.float32)           # smallest buffer that fits
    assert again is small and x.shape == (2, 8) and pool.allocated == 2
    again2, _ = pool.acquire((3, 1024), torch.float32)
    assert again2 is big and pool.allocated == 2
    pool.release(torch.empty(2 << 20, dtype=torch.uint8))   # over keep_bytes: dropped
    assert all(b.numel() <= 1 << 20 for b in pool._free)


def test_pieces_frames_are_capped_per_message_not_per_transfer(monkeypatch):
    """A prefix in many runs (a fragmented pool) still goes as pool pieces
    when it is streamed in narrow layer chunks: the frame cap holds for each
    KVData message. One message of every layer would exceed it: staged."""
    from engine.memory.kv_cache import KVCache
    from engine.memory.mempool import MemPool
    from engine.memory.radix import make_refs
    from kvd.node import transfer

    kv = KVCache(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, device_blocks=64)
    layout = MemPool(64, 0, 16, storage=kv).kv_layout()
    ids = [b for start in range(0, 48, 8) for b in (start, start + 1)]      # 6 runs of 2 blocks
    refs = make_refs("device", ids, "n")
    assert transfer.MAX_PIECE_FRAMES == 128
    assert transfer._zero_copy_tier(layout, refs, layers_per_message=16) is None   # 2*16*6 > 128
    assert transfer._zero_copy_tier(layout, refs, layers_per_message=4) == "device"
    assert transfer._zero_copy_tier(layout, refs[:1], layers_per_message=1) is None  # 32 KiB slices
    for L, max_layers in ((16, 1), (16, 3), (16, 16), (5, 2)):
        chunks = transfer._layer_chunks(L, 1, 1 << 30, max_layers=max_layers)
        assert chunks[0][0] == 0 and chunks[-1][1] == L and len(chunks) <= L
        assert all(b == c for (_, b), (c, _) in zip(chunks, chunks[1:]))
        assert max(l1 - l0 for l0, l1 in chunks) <= max_layers
    assert transfer._layer_chunks(16, 256 << 20, 8 << 20) == [(i, i + 1) for i in range(16)]


def test_failed_zero_copy_transfer_keeps_its_blocks_until_the_deadline(tmp_path, monkeypatch):
    """Frames that alias the sender's pool may still sit in the transport's
    queue after a failure: the prefix stays locked (not evictable, not
    reused) until the messages' deadline has passed, then it is released."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.request import SamplingParams
    from kvd.node import transfer
    from kvd.node.engine_driver import EngineDriver

    monkeypatch.setattr(transfer, "ZERO_COPY_MIN_BYTES", 0)
    ids = [random.Random(5).randrange(1, 40000) for _ in range(70)]    # 4 full blocks

    async def run():
        a = EngineDriver(LLMEngine.from_config(EngineConfig(
            model="tiny", dtype="float32", block_size=16, kv_blocks=64, host_kv_blocks=0,
            max_model_len=512, num_threads=1, batch_invariant=True)))
        await a.start()
        silent = await transports.listen(f"zmq+ipc://{tmp_path}/silent.sock",
                                         options=transports.TransportOptions())   # never answers
        conn = await transports.connect(silent.url, options=transports.TransportOptions())
        try:
            await a.call(lambda e: e.generate([ids], SamplingParams(max_tokens=1)))

            def locked(engine):
                m = engine.pool.tree.match(ids)
                return len(m.blocks) == 4 and all(engine.pool.tree.is_locked(r) for r in m.blocks)
            assert not await a.call(locked)
            t0 = time.time()
            with pytest.raises(TimeoutError):   # the request times out at the deadline
                await transfer.send_prefix(a, conn, ids, src_node="a", dst_node="b", timeout=0.5)
            assert await a.call(locked)        # deadline just passed: still held (+1 s margin)
            while await a.call(locked):
                assert time.time() - t0 < 5, "the prefix was never unlocked"
                await asyncio.sleep(0.05)
            assert time.time() - t0 >= 1.4     # released only after deadline + 1 s
        finally:
            await conn.close()
            await silent.close()
            await a.stop()

    asyncio.run(run())
