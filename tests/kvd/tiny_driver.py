"""A real engine thread for the node's in-process tests: an EngineDriver
over the tiny float32 model, started on entry and stopped on exit."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from engine.engine import EngineConfig, LLMEngine
from kvd.node.engine_driver import EngineDriver


@contextlib.asynccontextmanager
async def running_driver(*, block_size: int, kv_blocks: int, host_kv_blocks: int) -> AsyncIterator[EngineDriver]:
    """A started driver over a fresh tiny engine with these pools (max_model_len
    512, one thread); stopped on exit, whatever the body raised."""
    engine = LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=block_size,
                                                kv_blocks=kv_blocks, host_kv_blocks=host_kv_blocks,
                                                max_model_len=512, num_threads=1))
    driver = EngineDriver(engine)
    await driver.start()
    try:
        yield driver
    finally:
        await driver.stop()
