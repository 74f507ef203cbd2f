"""EngineDriver: an LLMEngine in one dedicated thread, reached from asyncio.

Threading contract: the engine is touched by one thread at a time, under
``_lock``. The engine thread holds it while it applies commands and runs a
step. The event loop sends commands through a ``queue.SimpleQueue``; the
engine thread hands each step's outputs back in ONE
``loop.call_soon_threadsafe`` call.

A request's outputs wait for its consumer in an ``OutputCollector``: when
the event loop falls behind the steps (a fast engine, many streams), the
outputs that queued become one (``RequestOutput.merge``), so the loop's work
per step stays one output per request, not one per token.

``call(fn)`` runs ``fn(engine)`` between two steps (MemPool verbs for KV
transfers, cache flushes) and returns its result to the caller. When the
engine is idle (the lock is free and every command sent before has been
applied) and torch runs single-threaded, ``fn`` runs right there on the
event loop thread: two thread hand-offs would
otherwise be a large part of a small KV transfer. With more torch threads
it always goes to the engine thread (see ``_inline_ok``). When the engine
is busy, ``fn`` queues behind the commands sent before it and runs on the
engine thread after the current step, so a call never overtakes an ``add``
or ``abort`` sent earlier. ``try_call(fn)`` is the inline half alone: it
runs ``fn`` only if it could run right now. Either way ``fn`` must be
short: it blocks the loop or the step.

If the engine thread dies (a step raised: a bug, or ``fail`` injecting one),
the driver is dead for good: ``on_dead`` is called on the event loop first,
then every open stream ends with EngineDead, every ``call`` waiting in the
queue fails with it, and so does every later request; ``state()`` names the
exception. Nothing restarts the engine in this process: its owner leaves
(kvd/node/daemon.py) and its supervisor starts a new one.

Used by the node daemon (one per node process, and the embedded node of
``kvd serve``); it satisfies :class:`~kvd.engine_client.EngineClient`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import torch

from engine.engine import EngineConfig, LLMEngine
from engine.exact_copy import resume_from_copy
from engine.memory.region import Purpose
from engine.request import INVALID_REQUEST, FinishReason, InvalidParam, RequestOutput, SamplingParams
from engine.structured.spec import StructuredOutputError
from kernels import native
from kvd.engine_client import EngineDead

log = logging.getLogger("kvd.engine")
# the longest a request waits for its grammar to compile before the engine is asked to
# (past it, the engine compiles it in its step, or finds it cached by then)
GRAMMAR_COMPILE_TIMEOUT_S = 30.0
T = TypeVar("T")


def load_engine(config: EngineConfig, host_nodes: int = 1) -> LLMEngine:
    """``LLMEngine.from_config(config)`` on the calling thread (a loader: run it with
    ``asyncio.to_thread``), which then lets go of the OpenMP workers that loading
    started (``kernels.native.release_openmp_pool``): the engine thread's team is
    then the process's only one, and libgomp lets its workers spin between steps
    instead of sleeping on a futex after each (docs/architecture.md).

    ``host_nodes``: the kvd nodes on this host (``kvd serve --nodes N`` starts N).
    Where their teams together outnumber the CPUs, the pool is kept: libgomp then
    throttles this process's team, whose workers sleep between steps and leave the
    CPUs to the other nodes' (spinning, two teams on the same CPUs halved `kvd serve
    --nodes 2`'s output on 2 CPUs)."""
    engine = LLMEngine.from_config(config)
    threads, usable = torch.get_num_threads(), len(os.sched_getaffinity(0))
    if threads * host_nodes <= usable:
        native.release_openmp_pool()
    else:
        log.info("%d nodes of %d threads on %d CPUs: this node's OpenMP team sleeps between steps",
                 host_nodes, threads, usable)
    return engine


class OutputCollector:
    """One request's outputs between the engine thread's ``_dispatch`` and its
    consumer (both on the event loop): ``put`` merges into an output not yet
    taken, as vLLM's RequestOutputCollector does; an exception replaces it
    (the stream ends there)."""

    __slots__ = ("_item", "_ready")

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        held = self._item
        if isinstance(item, RequestOutput) and isinstance(held, RequestOutput):
            self._item = held.merge(item)
        elif not isinstance(held, BaseException):
            self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """What was put since the last ``get``, waiting for it if nothing was."""
        while self._item is None:
            await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        return item


class InjectedFault(RuntimeError):
    """An operator's fault injection (admin ``fail --mode engine``): the engine
    thread raises it at its next turn, as a step that raised would."""


class EngineDriver:

    """An LLMEngine in a thread of this process; implements EngineClient."""

    IDLE_WAIT_S = 0.5
    # A step that scheduled nothing while requests wait (their blocks are held outside the
    # scheduler: a transfer grant, a reservation) waits this long for a command before it
    # tries again, instead of spinning a core until the blocks come back.
    STALLED_WAIT_S = 0.005

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.fingerprint = engine.fingerprint
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()      # held by whoever touches the engine
        self._submitted = 0                # commands put (event loop thread only)
        self._applied = 0                  # commands applied (under _lock)
        self.inline_calls = 0              # calls that ran on the loop thread (idle engine)
        # Inline only with single-threaded torch: a torch op on this thread
        # would start a second OpenMP team next to the engine thread's, and
        # the two teams' spinning workers starve the transport threads (KV
        # transfers: docs/benchmarks.md, design measurements).
        self._inline_ok = torch.get_num_threads() == 1
        self._streams: dict[str, OutputCollector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._snapshot: dict = self._take_snapshot()
        self._snapshot_stale = False       # an inline call changed the engine since
        self._running = False              # the engine thread is up (cheaper than is_alive())
        # the engine thread waits for a command, computing nothing: read by other threads
        # that would otherwise take the node's cores from a step (a ring's spin,
        # kvd/node/attention_ring.py); a bool, set only by the engine thread
        self.idle = True
        self._dead: BaseException | None = None
        self._died = asyncio.Event()       # set on the event loop once the thread died
        # called on the event loop when the engine thread died, before the open
        # streams end (its owner may still see them): on_dead(the exception)
        self.on_dead: Callable[[BaseException], None] | None = None

    # ----------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvd-engine", daemon=True)
        self._running = True
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread; open streams end with an abort."""
        self._stopping.set()
        self._submit(("wake",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ------------------------------------------------------------- requests
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        self.engine.check_request(num_prompt_tokens, params)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       kv_out: Any = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs, as the engine produces them. ``kv_out``: a
        prefill leg (``LLMEngine.add_request``'s KV sink)."""
        await self._compile_grammar(params)
        async for out in self._run_stream(request_id, ("add", request_id, prompt_ids, params, kv_out)):
            yield out

    async def generate_prefilled(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                                 reservation: Any, first_token: int, cached_tokens: int
                                 ) -> AsyncIterator[RequestOutput]:
        """A decode leg: ``LLMEngine.add_prefilled``, then its outputs (from
        token 1; token 0's output only when it already ends the request).
        The reservation is the engine's from here on."""
        await self._compile_grammar(params)
        cmd = ("add_prefilled", request_id, prompt_ids, params, reservation, first_token, cached_tokens)
        async for out in self._run_stream(request_id, cmd):
            yield out

    async def generate_resumed(self, request_id: str, prompt_ids: list[int], output_ids: list[int],
                               params: SamplingParams, reservation: Any = None) -> AsyncIterator[RequestOutput]:
        """A recovered request: ``LLMEngine.resume_request``, then its outputs
        (from token ``len(output_ids)``; the replayed output only when the
        tokens already end the request). ``reservation``: a PROMPT region
        holding the KV of every token but the last (a pair's copy,
        engine/exact_copy.py ``resume_from_copy``): nothing is recomputed; it
        is the engine's from here on."""
        await self._compile_grammar(params)
        cmd = (("resume", request_id, prompt_ids, output_ids, params) if reservation is None
               else ("resume_from_copy", request_id, prompt_ids, output_ids, params, reservation))
        async for out in self._run_stream(request_id, cmd):
            yield out

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's structured-output grammar on a worker thread, off the
        event loop and off the engine's step, into the engine's cache (where its add
        finds it), waiting at most GRAMMAR_COMPILE_TIMEOUT_S. A spec that does not
        compile is the engine's to refuse (the cache holds the refusal)."""
        if params.structured is None:
            return
        try:
            async with asyncio.timeout(GRAMMAR_COMPILE_TIMEOUT_S):
                await asyncio.to_thread(self.engine.grammars.check, params.structured)
        except (StructuredOutputError, TimeoutError):
            pass

    async def _run_stream(self, request_id: str, cmd: tuple) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDead(f"engine died: {describe_failure(self._dead)}")
        if request_id in self._streams:
            raise InvalidParam("request_id", f"request id {request_id} is already in flight")
        stream = OutputCollector()
        self._streams[request_id] = stream
        self._submit(cmd)
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
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def unavailable(self) -> str | None:
        if self._dead is not None:
            return f"engine died: {describe_failure(self._dead)}"
        return None if self._running else "engine is not running"

    def state(self) -> dict[str, str | None]:
        """``{"state": "running" | "stopped" | "dead", "error": the exception
        that killed the engine thread ("RuntimeError: ...") or None}``."""
        if self._dead is not None:
            return {"state": "dead", "error": describe_failure(self._dead)}
        return {"state": "running" if self._running else "stopped", "error": None}

    async def inject_failure(self, message: str, timeout: float) -> dict[str, str | None]:
        """Fault injection: the engine thread raises ``InjectedFault(message)``
        at its next turn (after the step under way) and dies, as if a step
        had raised. Returns ``state()`` once it died; TimeoutError past
        ``timeout``, EngineDead if it was not running."""
        if self._dead is not None or not self._running:
            raise EngineDead(self.unavailable() or "engine is not running")
        self._submit(("fail", message))
        async with asyncio.timeout(timeout):
            await self._died.wait()
        return self.state()

    # ------------------------------------------------- KV memory (MemPool verbs)
    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (block size, pool sizes, batch size): fixed once loaded."""
        return self.engine.config

    def kernels(self) -> dict[str, str]:
        """The kernel implementation chosen per op (``LLMEngine.kernels``)."""
        return self.engine.kernels()

    def kv_layout(self):
        """The KV pool's layout (``MemPool.kv_layout``): fixed once loaded, read on any thread."""
        return self.engine.pool.kv_layout()

    async def reserve_prompt(self, prompt: list[int], params: SamplingParams, min_uncached: int,
                             timeout: float) -> tuple[Any, str]:
        """Check the request as the engine would (raises InvalidParam), then
        reserve blocks for the prompt's KV (``MemPool.reserve``) when at least
        ``min_uncached`` of its tokens are not cached here: ``(the
        reservation, "")``, or ``(None, "below_threshold" | "no_blocks")``."""
        def reserve(engine: LLMEngine) -> tuple[Any, str]:
            engine.check_request(len(prompt), params)
            if len(prompt) - engine.pool.cached_tokens(prompt[:-1]) < min_uncached:
                return None, "below_threshold"
            res = engine.pool.reserve_region(prompt, purpose=Purpose.PROMPT)
            return res, "" if res is not None else "no_blocks"
        return await self.call(reserve, timeout=timeout)

    async def flush_cache(self, timeout: float) -> Any:
        """Drop every unlocked cached block (``MemPool.flush``), between steps; what was freed."""
        return await self.call(lambda engine: engine.pool.flush(), timeout=timeout)

    async def cache_snapshot(self, timeout: float) -> list:
        """This node's cached blocks (``MemPool.cache_snapshot``), between steps."""
        return await self.call(lambda engine: engine.pool.cache_snapshot(), timeout=timeout)

    def _submit(self, cmd: tuple) -> None:
        """Queue a command for the engine thread (event loop thread only)."""
        self._submitted += 1
        self._commands.put(cmd)

    async def call(self, fn: Callable[[LLMEngine], T], timeout: float = 30.0) -> T:
        """Run ``fn(engine)`` between two steps; its result or exception comes
        back here. Inline on this thread when the engine is idle, else on the
        engine thread after the commands sent before (module docstring).
        Raises TimeoutError past ``timeout`` (a queued ``fn`` may still run
        later: it must be safe to run late) and EngineDead."""
        done, result = self.try_call(fn)
        if done:
            return result
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._submit(("call", fn, fut))
        async with asyncio.timeout(timeout):
            return await fut

    def try_call(self, fn: Callable[[LLMEngine], T]) -> tuple[bool, T | None]:
        """``call`` without waiting: ``(True, fn(engine))`` when ``fn`` could
        run right now on this thread (the engine idle, as ``call`` inlines),
        else ``(False, None)`` and nothing ran: use ``call``. Lets a message
        handler answer at once, without a task. Raises EngineDead, and what
        ``fn`` raises."""
        if self._dead is not None or not self._running:
            raise EngineDead("engine is not running")
        if self._inline_ok and self._lock.acquire(blocking=False):
            try:
                if self._applied == self._submitted:
                    self.inline_calls += 1
                    self._snapshot_stale = True    # refreshed by the next stats()
                    return True, fn(self.engine)
            finally:
                self._lock.release()
        return False, None

    def stats(self) -> dict:
        """The engine's last published snapshot (consistent, possibly one step
        old; an inline call's changes are in it: it is retaken here, under the
        lock, when the engine thread is not about to publish its own)."""
        if self._snapshot_stale and self._lock.acquire(blocking=False):
            try:
                self._snapshot_stale = False
                self._snapshot = self._take_snapshot()
            finally:
                self._lock.release()
        return dict(self._snapshot, in_flight=len(self._streams), engine=self.state())

    def num_in_flight(self) -> int:
        return len(self._streams)

    # --------------------------------------------------------- engine thread
    def _run(self) -> None:
        busy = stalled = False
        try:
            while not self._stopping.is_set():
                cmd = None
                if not busy or stalled:        # idle or stalled: sleep until a command comes
                    self.idle = True
                    try:
                        cmd = self._commands.get(timeout=self.STALLED_WAIT_S if busy else self.IDLE_WAIT_S)
                    except queue.Empty:
                        pass
                    self.idle = False
                with self._lock:
                    if cmd is not None:
                        self._apply(cmd)
                    self._apply_queued()
                    if self._stopping.is_set():
                        break
                    steps = self.engine.stats.steps
                    outputs = self.engine.step() if self.engine.has_unfinished() else []
                    busy = self.engine.has_unfinished()
                    stalled = self.engine.stats.steps == steps
                    self._snapshot = self._take_snapshot()
                if outputs:
                    self._deliver(outputs)
            with self._lock:
                for rid in list(self.engine.requests):
                    out = self.engine.abort_request(rid)
                    if out is not None:
                        self._deliver([out])
        except BaseException as exc:  # the engine hit a bug: fail every stream, loudly
            log.critical("engine thread died: %s", describe_failure(exc), exc_info=exc)
            self._dead = exc
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._on_thread_death, exc)
        finally:
            self._running = False

    def _apply_queued(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            self._apply(cmd)

    def _apply(self, cmd: tuple) -> None:
        self._applied += 1
        if cmd[0] == "add":
            _, rid, ids, params, kv_out = cmd
            try:
                self.engine.add_request(rid, ids, params, kv_out=kv_out)
            except (InvalidParam, ValueError) as exc:
                self._deliver([RequestOutput(rid, [], "", True, FinishReason.ERROR.value, error=str(exc),
                                             error_code=INVALID_REQUEST)])
        elif cmd[0] in ("add_prefilled", "resume", "resume_from_copy"):
            rid = cmd[1]
            add = {"add_prefilled": self.engine.add_prefilled, "resume": self.engine.resume_request,
                   "resume_from_copy": lambda *a: resume_from_copy(self.engine, *a)}[cmd[0]]
            try:
                out = add(*cmd[1:])
            except (InvalidParam, ValueError) as exc:       # the reservation was cancelled
                out = RequestOutput(rid, [], "", True, FinishReason.ERROR.value, error=str(exc),
                                    error_code=INVALID_REQUEST)
            if out is not None:
                self._deliver([out])
        elif cmd[0] == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:
                self._deliver([out])
        elif cmd[0] == "fail":
            raise InjectedFault(cmd[1])
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

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _on_thread_death(self, exc: BaseException) -> None:
        """On the event loop, once the engine thread died: ``on_dead`` first,
        then every open stream and every queued ``call`` ends with EngineDead
        (later ones are refused: ``_dead`` is set)."""
        self._died.set()
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:  # noqa: BLE001 -- the streams must still end
                log.exception("on_dead failed")
        error = EngineDead(f"engine died: {describe_failure(exc)}")
        for stream in self._streams.values():
            stream.put(error)
        while True:                        # nothing will apply these any more
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "call":
                _resolve(cmd[2], None, error)

    def _take_snapshot(self) -> dict:
        eng = self.engine
        return {
            "time": time.time(),
            "running": len(eng.scheduler.running),
            "waiting": len(eng.scheduler.waiting),
            "swapped": len(eng.scheduler.swapped),
            "kv": eng.kv_usage(),
            **eng.stats.snapshot(),
        }


def describe_failure(exc: BaseException) -> str:
    """"RuntimeError: cannot sample row 0 ...": what killed an engine thread."""
    return f"{type(exc).__name__}: {exc}"


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return  # the caller timed out
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)

