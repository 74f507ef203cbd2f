"""``kvd serve``: one process owning the engine thread and the HTTP front door.

Lifecycle (aiohttp's runner pattern): load the model, start the engine
thread, bind, serve; on SIGTERM/SIGINT drain — /health turns 503, new
generation requests get 503, in-flight ones finish — until none are left or
``drain_timeout`` passes, then close. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from engine.engine import LLMEngine
from kvd.api.http import FrontDoor
from kvd.config import KvdConfig
from kvd.engine_client import LocalEngineClient

log = logging.getLogger("kvd.serve")


class Server:
    """Setup and cleanup mirror each other; ``run`` returns when drained."""

    def __init__(self, config: KvdConfig) -> None:
        self.config = config
        self.client: LocalEngineClient | None = None
        self.front: FrontDoor | None = None
        self.runner: web.AppRunner | None = None
        self.port: int | None = None
        self._stop = asyncio.Event()
        self._force = asyncio.Event()

    async def setup(self) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        engine = await asyncio.to_thread(LLMEngine.from_config, cfg.engine)
        log.info("loaded %s (%s, %d layers) in %.1fs; KV: %d device + %d host blocks of %d tokens",
                 engine.model_name, str(engine.model.dtype).removeprefix("torch."),
                 engine.model.config.num_layers,
                 time.perf_counter() - t0, cfg.engine.kv_blocks, cfg.engine.host_kv_blocks,
                 cfg.engine.block_size)
        self.client = LocalEngineClient(engine)
        await self.client.start()
        self.front = FrontDoor(self.client, api_key=cfg.server.resolved_api_key(),
                               served_model_name=cfg.server.served_model_name)
        self.runner = web.AppRunner(self.front.make_app(), handler_cancellation=True,
                                    access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, cfg.server.host, cfg.server.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        log.info("serving %s on http://%s:%d/v1", self.front.model_name, cfg.server.host, self.port)

    def request_stop(self) -> None:
        """First call: drain. Second call: stop without waiting."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.setup()
            await self._stop.wait()
            await self.drain()
        finally:
            await self.cleanup()

    async def drain(self) -> None:
        front = self.front
        front.draining = True
        deadline = time.monotonic() + self.config.server.drain_timeout
        log.info("draining: %d request(s) in flight", front.in_flight)
        while front.in_flight and time.monotonic() < deadline and not self._force.is_set():
            await asyncio.sleep(0.05)
        if front.in_flight:
            log.warning("drain ended with %d request(s) still in flight", front.in_flight)

    async def cleanup(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.client is not None:
            await self.client.stop()
