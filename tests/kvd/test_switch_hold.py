"""A paired node switched to prefill stops decoding, at its next step
boundary, every request whose copy at its partner is complete
(``Replicator.hold_all``), and only those; a node whose replica peer is not
its partner holds nothing. A real engine thread over the tiny model."""

from __future__ import annotations

import asyncio

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from kvd.node.engine_driver import EngineDriver
from kvd.node.replication import Replicator

BS = 16
PROMPT = list(range(1, 41))               # 40 tokens: two full blocks


async def _nothing(*_):
    return None


async def _drain(outputs) -> None:
    async for _ in outputs:
        pass


async def made(driver, rid: str) -> int:
    """``rid``'s tokens so far (-1: not running)."""
    return await driver.call(lambda engine: len(engine.requests[rid].output_ids) if rid in engine.requests else -1,
                             timeout=5)


async def test_a_switch_holds_the_decodes_whose_copy_is_complete_and_no_other():
    # torch's decode steps (milliseconds each for the tiny model) and 2,000 tokens keep both
    # requests running for seconds; the test ends them
    driver = EngineDriver(LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=BS,
                                                             kv_blocks=320, host_kv_blocks=0, max_model_len=2048,
                                                             num_threads=1, decode_kernel="torch")))
    await driver.start()
    rep = Replicator("n1", driver, _nothing, _nothing, interval=10, timeout=5)
    rep.partner = "n2"
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    streams = [asyncio.create_task(_drain(driver.generate(rid, PROMPT, params))) for rid in "ab"]
    try:
        for _ in range(500):
            if min([await made(driver, rid) for rid in "ab"]) >= 2:
                break
            await asyncio.sleep(0.01)
        assert await rep.hold_all() == {}                  # no peer yet: nothing to hand off to
        rep.set_peer("n3", "inproc://n3")
        rep.sent = {"a": 32, "b": 32}
        assert await rep.hold_all() == {}                  # the peer is not the partner: no pair copies
        rep.set_peer("n2", "inproc://n2")
        rep.sent = {"a": 32, "b": 16}                       # b's copy lacks a block of its prompt
        held = await rep.hold_all()
        assert list(held) == ["a"] and held["a"] == await made(driver, "a")
        b0 = await made(driver, "b")
        await asyncio.sleep(0.3)                            # many steps
        assert await made(driver, "a") == held["a"]         # no step decoded it since the switch
        assert await made(driver, "b") > b0                 # the other decodes on here
    finally:
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await driver.stop()
