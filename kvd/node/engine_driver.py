"""EngineDriver: an LLMEngine in one dedicated thread, reached from asyncio.

Threading contract: the engine is touched only by its thread. The event loop
sends commands through a ``queue.SimpleQueue``; the engine thread hands each
step's outputs back in ONE ``loop.call_soon_threadsafe`` call. ``call(fn)``
runs ``fn(engine)`` on the engine thread between two steps (MemPool verbs for
KV transfers, cache flushes) and returns its result to the caller.

Used by the node daemon (one per node process, and the embedded node of
``kvd serve``); it satisfies :class:`~kvd.engine_client.EngineClient`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.engine import LLMEngine
from engine.request import InvalidParam, RequestOutput, SamplingParams
from kvd.engine_client import EngineDead

log = logging.getLogger("kvd.engine")
T = TypeVar("T")


class EngineDriver:

    """An LLMEngine in a thread of this process; implements EngineClient."""

    IDLE_WAIT_S = 0.5

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._snapshot: dict = self._take_snapshot()
        self._dead: BaseException | None = None

    # ----------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvd-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread; open streams end with an abort."""
        self._stopping.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ------------------------------------------------------------- requests
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        self.engine.check_request(num_prompt_tokens, params)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDead(f"engine stopped: {self._dead}")
        if request_id in self._streams:
            raise InvalidParam("request_id", f"request id {request_id} is already in flight")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt_ids, params))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], T], timeout: float = 30.0) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or
        exception comes back here. Raises TimeoutError past ``timeout`` (``fn``
        may still run later: it must be safe to run late) and EngineDead."""
        if self._dead is not None or self._thread is None or not self._thread.is_alive():
            raise EngineDead("engine is not running")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, fut))
        async with asyncio.timeout(timeout):
            return await fut

    def stats(self) -> dict:
        """The engine's last published snapshot (consistent, possibly one step old)."""
        return dict(self._snapshot, in_flight=len(self._streams))

    def num_in_flight(self) -> int:
        return len(self._streams)

    # --------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine.has_unfinished())
                if self._stopping.is_set():
                    break
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                self._snapshot = self._take_snapshot()
                if outputs:
                    self._deliver(outputs)
            for rid in list(self.engine.requests):
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._deliver([out])
        except BaseException as exc:  # the engine hit a bug: fail every stream, loudly
            log.exception("engine thread died")
            self._dead = exc
            self._deliver_error(EngineDead(f"engine failed: {exc!r}"))

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, params = cmd
            try:
                self.engine.add_request(rid, ids, params)
            except (InvalidParam, ValueError) as exc:
                self._deliver([RequestOutput(rid, [], "", True, "error", error=str(exc))])
        elif cmd[0] == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:
                self._deliver([out])
        elif cmd[0] == "call":
            _, fn, fut = cmd
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # noqa: BLE001 -- handed to the caller
                result, error = None, exc
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(_resolve, fut, result, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _deliver_error(self, exc: BaseException) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)

    def _take_snapshot(self) -> dict:
        eng = self.engine
        s = eng.stats
        return {
            "time": time.time(),
            "running": len(eng.scheduler.running),
            "waiting": len(eng.scheduler.waiting),
            "swapped": len(eng.scheduler.swapped),
            "kv": eng.kv_usage(),
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "prefix_hit_tokens": s.prefix_hit_tokens,
            "preemptions": s.preemptions,
            "finished": dict(s.finished),
        }


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return  # the caller timed out
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)

