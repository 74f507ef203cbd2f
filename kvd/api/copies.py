"""``n`` choices of one request: copies that share the prompt's KV through the prefix cache.

Copy 0 runs first. Once its first output is in, its prompt has been computed
and indexed in the prefix cache of the node that ran it (the engine caches a
prompt's full blocks in the step that samples its first token), and copies
1..n-1 start: each matches the prompt's cached blocks and computes only what
they do not cover (the last, partial block): one prefill for the prompt.

Each copy samples on its own stream: copy ``i`` of a seeded request is the
request seeded ``(seed + i) mod 2**63`` (copy 0 is the request itself), so
seeded copies are reproducible and each differs from the others; greedy
copies are n times the tokens of one greedy request. Copies after the first
do not ask for prompt logprobs: copy 0's are the prompt's, and come with
each copy's first output here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from engine.request import RequestOutput, SamplingParams
from kvd.engine_client import EngineClient

SEED_MODULUS = 2**63         # SamplingParams.seed's bound


def copy_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of copy ``index`` (the module docstring's rule)."""
    if index == 0:
        return params
    seed = None if params.seed is None else (params.seed + index) % SEED_MODULUS
    return replace(params, seed=seed, prompt_logprobs=None)


def copy_id(request_id: str, index: int) -> str:
    """The engine request id of copy ``index``: copy 0 is the request's own id."""
    return request_id if index == 0 else f"{request_id}-{index}"


async def generate_copies(client: EngineClient, request_id: str, prompt_ids: list[int], params: SamplingParams,
                          n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(copy index, output) for each engine output of the ``n`` copies, in the order
    they arrive, until every copy has finished. An exception of any copy's stream
    (EngineDead) is raised here; closing this iterator (or its cancellation) aborts
    every copy still running."""
    if n == 1:
        async for out in client.generate(request_id, prompt_ids, params):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        outputs = client.generate(copy_id(request_id, index), prompt_ids, copy_params(params, index))
        try:
            async for out in outputs:
                queue.put_nowait((index, out))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            await outputs.aclose()           # a cancelled copy aborts its engine request

    tasks = [asyncio.create_task(pump(0))]
    running = 1
    prompt_logprobs = None                   # copy 0's, for the others' first outputs
    first_seen: set[int] = set()
    try:
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if len(tasks) == 1:              # copy 0's prompt is cached now: the others hit it
                prompt_logprobs = item.prompt_logprobs
                tasks += [asyncio.create_task(pump(i)) for i in range(1, n)]
                running += n - 1
            elif index not in first_seen and prompt_logprobs is not None:
                item = replace(item, prompt_logprobs=prompt_logprobs)
            first_seen.add(index)
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
