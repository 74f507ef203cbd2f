"""EngineDriver: ``call`` runs inline on an idle engine, queues behind earlier
commands and behind a running step, and the engine is never touched by two
threads at once."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from kernels import native
from kvd import cli
from kvd.cluster_config import HOST_NODES_ENV
from kvd.node.engine_driver import EngineDriver, load_engine


def tiny_engine() -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=64,
                                              host_kv_blocks=0, max_model_len=512, num_threads=1))


@pytest.fixture
async def driver():
    d = EngineDriver(tiny_engine())
    await d.start()
    yield d
    await d.stop()


def hold_steps(driver) -> tuple[threading.Event, threading.Event]:
    """Make each engine step wait inside the step until ``release`` is set;
    ``in_step`` is set once a step has begun."""
    in_step, release = threading.Event(), threading.Event()
    step = driver.engine.step

    def slow_step():
        in_step.set()
        release.wait(10)
        return step()
    driver.engine.step = slow_step
    return in_step, release


def start_request(driver):
    """A 4-token greedy request: (its stream, the future of its first output)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    stream = driver.generate("r", list(range(100, 140)), params)
    return stream, asyncio.ensure_future(anext(stream))


async def test_idle_call_runs_inline_and_a_call_during_a_step_waits_for_it(driver):
    assert await driver.call(lambda e: threading.current_thread()) is threading.current_thread()
    assert driver.inline_calls == 1
    # hold the engine inside a step: a call must wait for the step to end
    in_step, release = hold_steps(driver)
    stream, first = start_request(driver)
    assert await asyncio.to_thread(in_step.wait, 10)
    call = asyncio.ensure_future(driver.call(lambda e: len(e.requests)))
    await asyncio.sleep(0.2)
    assert not call.done()                               # queued behind the step
    release.set()
    assert await call == 1                               # ran between two steps
    await first
    await stream.aclose()


async def test_try_call_runs_only_when_it_could_run_now(driver):
    """``try_call``: the result at once on an idle engine; ``(False, None)``
    with nothing run while a step holds the engine or a command is queued."""
    assert driver.try_call(lambda e: threading.current_thread()) == (True, threading.current_thread())
    with pytest.raises(ZeroDivisionError):
        driver.try_call(lambda e: 1 / 0)                 # what fn raises comes back
    ran = []
    in_step, release = hold_steps(driver)
    stream, first = start_request(driver)
    await asyncio.sleep(0)                               # the add is sent: queued or being applied
    assert driver.try_call(ran.append) == (False, None)
    assert await asyncio.to_thread(in_step.wait, 10)
    assert driver.try_call(ran.append) == (False, None)  # a step holds the engine
    assert ran == []
    release.set()
    await first
    await stream.aclose()


async def test_call_never_overtakes_an_earlier_command(driver):
    """An ``add`` sent without waiting, then a call: the call must see the request."""
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(20):
        stream = driver.generate(f"r{i}", list(range(100, 130)), params)
        first = asyncio.ensure_future(anext(stream))     # puts the add command
        await asyncio.sleep(0)
        seen = await driver.call(lambda e, rid=f"r{i}": rid in e.requests)
        assert seen, "a call overtook the add sent before it"
        await first
        await stream.aclose()


async def test_inline_and_engine_thread_never_overlap(driver):
    """Hammer calls while requests step (a prober retries without pause, so
    some calls land between two steps and run inline while the engine is
    busy): a fn never runs concurrently with a step."""
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

    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    done = asyncio.Event()

    async def consume(i):
        await asyncio.sleep(0.02 * i)                    # staggered: idle, busy, idle
        async for _ in driver.generate(f"q{i}", list(range(200 + i, 240 + i)), params):
            await driver.call(probe)

    async def prober():
        while not done.is_set():
            await driver.call(probe)
            await asyncio.sleep(0)

    probing = asyncio.ensure_future(prober())
    await asyncio.gather(*(consume(i) for i in range(4)), *(driver.call(probe) for _ in range(50)))
    done.set()
    await probing
    assert not driver.engine.has_unfinished()
    assert driver.inline_calls > 0


async def test_multithreaded_torch_never_runs_calls_inline():
    """A torch op on the loop thread would start a second OpenMP team: with
    more than one torch thread every call goes to the engine thread."""
    import torch
    engine = tiny_engine()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        driver = EngineDriver(engine)
        await driver.start()
        try:
            assert await driver.call(lambda e: threading.current_thread().name) == "kvd-engine"
            assert driver.inline_calls == 0
        finally:
            await driver.stop()
    finally:
        torch.set_num_threads(before)


async def test_stats_reflect_an_inline_call_at_once(driver):
    """The snapshot (admin ``cache stats``) is refreshed after an inline call,
    as the engine thread refreshes it after its commands."""
    before = driver.stats()["kv"]
    ids = await driver.call(lambda e: e.pool.alloc_mem(3))
    assert driver.inline_calls == 1 and driver.stats()["kv"] != before
    await driver.call(lambda e: e.pool.free_mem(ids))
    assert driver.stats()["kv"] == before


# ------------------------------------------------------------------ OpenMP workers
def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def new_threads_settle_at(before: set[str], count: int, timeout: float = 5.0) -> int:
    """How many of the process's threads are not in ``before``, once that is ``count``
    (released workers exit on their own time), or whatever it is at the timeout. Threads
    of earlier tests that exit meanwhile do not count."""
    deadline = time.monotonic() + timeout
    while (n := len(threads() - before)) != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def on_a_thread_kept_alive(fn, workers: int = 0) -> dict:
    """Run ``fn(box)`` on a new thread and, while that thread is still alive, count the
    threads started since into ``box["new"]`` once they are the thread and ``workers``
    more (or at a timeout: a finished thread's OpenMP pool goes with it)."""
    before = threads()
    box: dict = {"before": before}

    def run():
        fn(box)
        box["new"] = new_threads_settle_at(before, 1 + workers)
    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    return box


@pytest.fixture
def two_torch_threads():
    """torch on 2 threads for the test (a team with one OpenMP worker), then as it was."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_release_frees_the_calling_threads_openmp_workers(two_torch_threads):
    """A thread that ran a torch op on 2 threads holds an OpenMP worker; released, it exits."""
    def work(box):
        torch.ones(1 << 22).add_(1)                     # a parallel region: this thread's team
        box["with_pool"] = len(threads() - box["before"])
        box["released"] = native.release_openmp_pool()
    box = on_a_thread_kept_alive(work)
    assert box["released"]
    assert box["with_pool"] >= 2                        # the thread and its worker
    assert box["new"] == 1                              # the thread alone


TINY = EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=64, host_kv_blocks=0, max_model_len=512,
                    num_threads=2)


def test_load_engine_leaves_its_loader_thread_without_openmp_workers(two_torch_threads):
    """The daemon loads the engine on a loader thread that lives on (asyncio.to_thread's
    pool): load_engine lets go of that thread's OpenMP workers, so the engine thread's
    team is the only one and libgomp does not throttle it."""
    def load(box):
        torch.ones(1 << 22).add_(1)                     # whatever team loading left on this thread
        box["engine"] = load_engine(TINY)
    box = on_a_thread_kept_alive(load)
    assert isinstance(box["engine"], LLMEngine)
    assert box["new"] == 1


def test_load_engine_keeps_the_pool_where_the_hosts_nodes_would_outnumber_its_cpus(two_torch_threads):
    """Nodes that share a host (kvd serve --nodes N) and together have more compute
    threads than CPUs keep the loader's pool: libgomp then throttles each node's team, whose
    workers sleep between steps instead of spinning against the other nodes' teams."""
    def load(box):
        torch.ones(1 << 22).add_(1)
        load_engine(TINY, host_nodes=len(os.sched_getaffinity(0)))
    box = on_a_thread_kept_alive(load, workers=1)
    assert box["new"] >= 2                          # the thread and its worker


def test_the_host_nodes_come_from_the_environment_kvd_serve_sets(monkeypatch):
    monkeypatch.setenv(HOST_NODES_ENV, "3")
    assert cli._host_nodes() == 3 and HOST_NODES_ENV not in os.environ    # taken, not passed on
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(HOST_NODES_ENV, bad)
        assert cli._host_nodes() == 1
    monkeypatch.delenv(HOST_NODES_ENV, raising=False)
    assert cli._host_nodes() == 1


def token_texts(outputs) -> list[str]:
    """Each token's own text, cut where its output's text_ends say."""
    texts = []
    for o in outputs:
        cuts = [0, *o.text_ends]
        texts += [o.text[a:b] for a, b in zip(cuts, cuts[1:])]
    return texts


async def test_outputs_that_queue_while_the_loop_is_stalled_arrive_merged_and_exact(driver):
    """The event loop stalls while the engine steps on: the outputs that queued
    come as one, with every token and its text, in order, once; each token's
    text is where text_ends cut it (what a receiver that holds the first
    tokens keeps)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = list(range(100, 140))
    reference = [out async for out in driver.generate("a", prompt, params)]
    ref_tokens = [t for o in reference for t in o.new_token_ids]
    assert len(ref_tokens) == 12 and len(token_texts(reference)) == 12
    stream = driver.generate("b", prompt, params)
    outputs = [await anext(stream)]
    time.sleep(1.0)                                   # the loop is stalled; the engine thread is not
    outputs += [out async for out in stream]
    last = outputs[-1]
    assert len(outputs) < len(ref_tokens) and len(last.new_token_ids) > 1      # what queued came as one
    assert [t for o in outputs for t in o.new_token_ids] == ref_tokens
    assert "".join(o.text for o in outputs) == "".join(o.text for o in reference)
    assert token_texts(outputs) == token_texts(reference)
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 12
    # what a TokenChunk's start_index says
    assert last.num_output_tokens - len(last.new_token_ids) == sum(len(o.new_token_ids) for o in outputs[:-1])


async def test_an_output_collector_keeps_an_error_over_what_it_holds():
    from engine.request import RequestOutput
    from kvd.node.engine_driver import OutputCollector

    c = OutputCollector()
    c.put(RequestOutput("r", [1], "a", False, num_output_tokens=1))
    c.put(RequestOutput("r", [2], "b", False, num_output_tokens=2))
    merged = await c.get()
    assert (merged.new_token_ids, merged.text, merged.num_output_tokens) == ([1, 2], "ab", 2)
    waiter = asyncio.ensure_future(c.get())
    await asyncio.sleep(0.01)
    assert not waiter.done()                          # nothing put since the last get
    c.put(RequestOutput("r", [3], "c", False))
    boom = RuntimeError("engine failed")
    c.put(boom)
    c.put(RequestOutput("r", [4], "d", False))
    assert await waiter is boom


async def test_a_step_that_cannot_schedule_waits_instead_of_spinning(driver):
    """Blocks held outside the scheduler (as a transfer grant holds them) leave a
    waiting request unschedulable: the engine thread waits between tries (about
    STALLED_WAIT_S) instead of spinning a core, and runs the request once the
    blocks come back."""
    held = await driver.call(lambda e: e.pool.alloc_mem(60))
    assert held is not None
    calls = 0
    step = driver.engine.step

    def counting_step():
        nonlocal calls
        calls += 1
        return step()
    driver.engine.step = counting_step
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    stream = driver.generate("r", list(range(100, 200)), params)      # 7 blocks: only 4 are free
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.5)
    assert not first.done()
    # spinning would be tens of thousands of tries in 0.5 s; waiting, about 100
    assert 0 < calls < 0.5 / driver.STALLED_WAIT_S * 3, calls
    await driver.call(lambda e: e.pool.free_mem(held))
    out = await asyncio.wait_for(first, 30)
    tokens = list(out.new_token_ids)
    async for o in stream:
        tokens += o.new_token_ids
    assert len(tokens) == 4


async def test_idle_says_whether_the_engine_thread_waits_for_work(driver):
    """``idle`` (read by a creditor's ring thread before it spins): False while a step runs,
    True once the engine has nothing to do."""
    in_step, release = hold_steps(driver)
    stream, first = start_request(driver)
    assert await asyncio.to_thread(in_step.wait, 10)
    assert not driver.idle
    release.set()
    await first
    async for _ in stream:
        pass
    for _ in range(200):
        if driver.idle:
            break
        await asyncio.sleep(0.01)
    assert driver.idle
