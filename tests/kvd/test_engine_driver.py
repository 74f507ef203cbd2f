"""EngineDriver: ``call`` runs inline on an idle engine, queues behind earlier
commands and behind a running step, and the engine is never touched by two
threads at once."""

from __future__ import annotations

import asyncio
import threading

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from kvd.node.engine_driver import EngineDriver


def tiny_engine() -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=64,
                                              host_kv_blocks=0, max_model_len=512, num_threads=1))


async def test_idle_call_runs_inline_and_busy_call_queues():
    driver = EngineDriver(tiny_engine())
    await driver.start()
    try:
        assert await driver.call(lambda e: threading.current_thread()) is threading.current_thread()
        assert driver.inline_calls == 1
        # a long request keeps the engine stepping: calls now run on the engine thread
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = driver.generate("long", list(range(100, 140)), params)
        await anext(stream)                                  # the engine is busy
        threads = {await driver.call(lambda e: threading.current_thread().name) for _ in range(5)}
        assert threads == {"kvd-engine"}
        await stream.aclose()                                # aborts; the engine goes idle
        for _ in range(200):
            if not driver.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        before = driver.inline_calls
        await driver.call(lambda e: None)
        assert driver.inline_calls == before + 1
    finally:
        await driver.stop()


async def test_call_never_overtakes_an_earlier_command():
    """An ``add`` sent without waiting, then a call: the call must see the request."""
    driver = EngineDriver(tiny_engine())
    await driver.start()
    try:
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        for i in range(20):
            stream = driver.generate(f"r{i}", list(range(100, 130)), params)
            first = asyncio.ensure_future(anext(stream))     # puts the add command
            await asyncio.sleep(0)
            seen = await driver.call(lambda e, rid=f"r{i}": rid in e.requests)
            assert seen, "a call overtook the add sent before it"
            await first
            await stream.aclose()
    finally:
        await driver.stop()


async def test_inline_and_engine_thread_never_overlap():
    """Hammer calls while requests step: a fn never runs concurrently with a step."""
    driver = EngineDriver(tiny_engine())
    await driver.start()
    inside = threading.Lock()
    step = driver.engine.step

    def guarded_step():
        assert inside.acquire(blocking=False), "a call ran during a step"
        try:
            return step()
        finally:
            inside.release()
    driver.engine.step = guarded_step

    def probe(engine):
        assert inside.acquire(blocking=False), "a step ran during a call"
        inside.release()
        return engine.pool.stats()

    try:
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

        async def consume(i):
            async for _ in driver.generate(f"q{i}", list(range(200 + i, 240 + i)), params):
                await driver.call(probe)

        await asyncio.gather(*(consume(i) for i in range(4)),
                             *(driver.call(probe) for _ in range(50)))
        assert driver.inline_calls > 0
    finally:
        await driver.stop()
