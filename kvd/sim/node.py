"""A simulated node: kvd's Scheduler over a bookkeeping MemPool, in simulated time.

The node runs the engine's loop (``LLMEngine.step``: schedule -> execute ->
update) with the execute part replaced by time: ``Scheduler.schedule`` picks
the step's batch exactly as on a real node (admission, chunking, prefix hits,
preemption), the step lasts what the profile's ``StepCosts`` say, and at its
end the batch's requests advance as ``LLMEngine._execute`` advances them: a
prefill chunk short of the prompt's end computes its tokens, every other
request gets one token, a request at ``max_tokens`` (or a prefill leg that
streamed its KV out) retires, its blocks cached. Token ids are made up
(stable per request and position): only the prefix cache reads them.

Work that arrives during a step waits for the next ``schedule``, as on a node
whose engine thread is busy. A step's duration::

    prefill(parts) + decode(batch, context) + swap(blocks moved)
    + replication (replicas=1: one token's KV per decoding request, copied out)
    + KV streamed out (a prefill leg's chunk) and KV received since the last
      step (a prefilled prompt's): the node's own CPU time, as replication's,
      ``transfer_byte_s`` per byte and half the small-message round trip
      (``transfer_latency_s / 2``) per message, ``kv_messages`` a prompt
      (one per layer with ``kv_stream = "layers"``, else one)
    + a paired node's copies to its ``partner`` (kvd/sim/pairs.py): each
      step's new tokens of KV, one message, and each prompt chunk's KV as
      it is computed, the CPU time of KV messages as above on this node; the
      partner's next step pays the same to receive them
    + token_s per step with a decode part (the serving path's work after a
      step: the outputs' hand-off to the event loop, whose wake-up and GIL
      the next step waits on; the profile's ``serving.token_s``, measured on
      one stream, where a step emits one token; a batched step's extra
      streams add next to nothing on top)
    + the decode part's cold-cache cost (kvd/sim/warmth.py: how much of the
      weights the last-level cache holds after this node's prefills, the
      steps of ``neighbours`` (the nodes that share its host) and the time
      its engine waited for work)
    + on the first step after the engine waited for work, the wake cost of
      that wait (kvd/sim/wake.py)

On a shared ``host`` (kvd/sim/host.py) that is the step's work at full
speed: the host's cores are shared with the other nodes' running steps.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.memory.mempool import MemPool
from engine.memory.region import Purpose, Region
from engine.request import Request, RequestStatus
from engine.prefill_alone import PrefillAlone
from engine.scheduler import ScheduledBatch, Scheduler
from kvd.sim.costs import StepCosts
from kvd.sim.events import EventQueue
from kvd.sim.host import SimHost
from kvd.sim.wake import WakeCosts
from kvd.sim.warmth import CacheCosts, Warmth

# a prefill leg's kv_out (the engine's KVSink): the request hands off after its first token
HAND_OFF = object()


def token_of(request_id: str, index: int, vocab: int = 30000) -> int:
    """The made-up token ``index`` of ``request_id``'s output (stable across runs)."""
    return 100 + zlib.crc32(f"{request_id}:{index}".encode()) % vocab


@dataclass
class StepLog:
    """One step as scheduled (for tests and traces): request ids and token counts."""

    start: float
    seconds: float
    prefill: list[tuple[str, int]] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class SimNode:
    """``on_token(node, req, done, handed_off, new=True)`` is called at the end of
    the step that gave ``req`` a token (``new`` False: ``add_prefilled`` found it
    done with the prefill node's token); ``on_events(node, events)`` with the MemPool's
    cache events after each step. Not thread-safe (one event queue drives it)."""

    def __init__(self, name: str, role: str, config: EngineConfig, costs: StepCosts, events: EventQueue,
                 on_token: Callable, on_events: Callable | None = None, *, kv_bytes_per_token: int = 0,
                 replicas: int = 0, token_s: float = 0.0, cache: CacheCosts | None = None,
                 wake: WakeCosts | None = None, threads: int = 1, kv_messages: int = 1, keep_log: bool = False) -> None:
        self.name, self.role, self.config, self.costs, self.events = name, role, config, costs, events
        self.pool = MemPool(device_blocks=config.kv_blocks, host_blocks=config.host_kv_blocks,
                            block_size=config.block_size)
        self.scheduler = Scheduler(config.scheduler_config(config.prefill_chunk_tokens), self.pool)
        self.on_token, self.on_events = on_token, on_events
        self.kv_bytes_per_token = kv_bytes_per_token
        self.replicas = replicas
        self.kv_messages = kv_messages
        self.token_s = token_s
        self.warmth = Warmth(cache)
        self.wake_costs = wake
        self.neighbours: list[SimNode] = []    # the nodes on this node's host (their steps evict its weights)
        self.threads = threads
        self.host: SimHost | None = None       # the cores it shares (kvd/sim/host.py); None: its own
        self.work_left: float | None = None    # on a host: the running step's work left (full-speed seconds)
        self.since, self.rate, self.generation = 0.0, 1.0, 0
        self.idle_since: float | None = events.now     # the engine waits for work since (None: busy)
        self._running: ScheduledBatch | None = None
        self.busy = False
        self.dead = False                  # killed (kvd/sim/faults.py): computes nothing more
        self.busy_seconds = 0.0
        self.received_s = 0.0                  # KV received since the last step's start: its CPU time
        self.steps = 0
        self.log: list[StepLog] | None = [] if keep_log else None
        self.requests: dict[str, Request] = {}     # every unfinished request here, by id (as LLMEngine's)
        self.pair_rule: PrefillAlone | None = None  # a paired node's (kvd/sim/pairs.py): no decode in a prompt's steps
        self.partner: SimNode | None = None        # a paired node's partner: it receives the copies
        self._batch: ScheduledBatch | None = None  # the running step's
        self._leaving: dict[str, Callable[[Request], None]] = {}   # handed off at the running step's end

    # ------------------------------------------------------------------ intake
    def add(self, req: Request) -> None:
        """Queue ``req`` (Scheduler.add: raises ValueError when it could never fit) and wake the loop."""
        if self.dead:
            return
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        self.wake()

    def reserve_prompt(self, prompt: list[int], min_uncached: int) -> tuple[Region | None, str]:
        """As the node's ``reserve_prompt`` (kvd/node/engine_driver.py): a PROMPT region
        when at least ``min_uncached`` tokens are not cached here, else (None, why)."""
        if len(prompt) - self.pool.cached_tokens(prompt[:-1]) < min_uncached:
            return None, "below_threshold"
        region = self.pool.reserve_region(prompt, purpose=Purpose.PROMPT)
        return region, "" if region is not None else "no_blocks"

    def add_prefilled(self, req: Request, region: Region, first_token: int) -> None:
        """As ``LLMEngine.add_prefilled``: ``req`` decodes from a prompt whose KV
        arrived in ``region``; its first token is the prefill node's."""
        if self.dead:
            return
        self.received_s += self._kv_cpu_seconds(len(req.prompt_ids))
        req.prefix = region.commit()
        req.block_ids = region.all_ids
        req.num_computed = len(req.prompt_ids)
        req.output_ids.append(first_token)
        if len(req.output_ids) >= req.params.max_tokens:
            self._retire(req)
            self.on_token(self, req, True, False, False)
            return
        self.scheduler.add_prefilled(req)
        self.requests[req.request_id] = req
        self.wake()

    def take_over(self, req: Request) -> None:
        """Resume ``req`` (its prompt and tokens so far; a pair partner's
        handoff) from this node's copy of its KV: every token but the last
        is computed here already, so its next step decodes it. Without room
        for the copy's blocks in the device tier it queues to be computed
        again, as a resume (``add``: ValueError when it could never fit)."""
        if self.dead:
            return
        fresh = Request(request_id=req.request_id, prompt_ids=list(req.prompt_ids), params=req.params,
                        arrival=self.events.now)
        fresh.output_ids = list(req.output_ids)
        tokens = req.prompt_ids + req.output_ids[:-1]
        region = self.pool.reserve_region(tokens, purpose=Purpose.PROMPT)
        if region is None:
            self.add(fresh)
            return
        fresh.prefix = region.commit()
        fresh.block_ids = region.all_ids
        fresh.num_computed = len(tokens)
        self.scheduler.add_prefilled(fresh)
        self.requests[fresh.request_id] = fresh
        self.wake()

    def leave(self, request_id: str, then: Callable[[Request], None]) -> None:
        """Hand ``request_id`` off from here (a pair's handoff): at once when
        the running step does not decode it, else at that step's end, with
        the token it makes; then its blocks are freed and ``then(req)`` is
        called. Nothing happens to a request that finished or is not here."""
        req = self.requests.get(request_id)
        if req is None or self.dead:
            return
        if self._batch is not None and any(r is req for r in (*self._batch.decode, *self._batch.prefill)):
            self._leaving[request_id] = then
            return
        self._hand_off(req, then)

    def _hand_off(self, req: Request, then: Callable[[Request], None]) -> None:
        self.scheduler.remove(req)
        self.scheduler.release_memory(req)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        then(req)
        self.wake()                                      # what the step held for it may run now

    def kill(self) -> None:
        """The node dies: the step it runs is lost, and nothing more runs here."""
        self.dead = True
        if self.host is not None and self.work_left is not None:
            self._running, self.work_left = None, None
            self.host.reschedule()

    def abort(self, req: Request) -> None:
        """Drop ``req`` (a prefill leg whose decode node died), its blocks freed."""
        if req.status is RequestStatus.FINISHED:
            return
        self.scheduler.remove(req)
        self.scheduler.release_memory(req)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)

    def hold_replica(self, tokens: list[int], tier: str = "host") -> bool:
        """Commit a replica's KV of ``tokens`` into the prefix cache, in ``tier``
        (the host tier, where a ring peer's replicas are held: a resumed
        request's prefix hit then swaps it in; the device tier, where a pair
        partner's copies are: a hit costs nothing). False when the tier has
        no room (it recomputes)."""
        n = len(tokens) // self.config.block_size
        ids = self.pool.alloc_mem(n, tier=tier) if n else None
        if ids is None:
            return False
        self.pool.insert(tokens[:n * self.config.block_size], ids, tier=tier)
        return True

    # -------------------------------------------------------------------- loop
    def wake(self) -> None:
        if not self.busy and not self.dead:
            self._start_step()

    def _start_step(self) -> None:
        if self.pair_rule is not None:
            self.pair_rule.before(self)
        batch = self.scheduler.schedule()
        if batch is None:
            if self.busy or self.idle_since is None:
                self.idle_since = self.events.now
            self.busy = False
            return
        waited = 0.0
        if self.idle_since is not None:
            waited = self.events.now - self.idle_since
            self.warmth.idle(waited)
            self.idle_since = None
        self.busy = True
        self._batch = batch
        seconds = self.step_seconds(batch, waited)
        if self.log is not None:
            self.log.append(StepLog(self.events.now, seconds,
                                    [(r.request_id, n) for r, n in zip(batch.prefill, batch.prefill_lens)],
                                    [r.request_id for r in batch.decode],
                                    [r.request_id for r in batch.preempted]))
        self.busy_seconds += seconds
        self.steps += 1
        if self.host is None:
            self.events.after(seconds, self._finish_step, batch)
            return
        self._running, self.work_left, self.since = batch, seconds, self.events.now
        self.host.reschedule()

    def end_shared_step(self, generation: int) -> None:
        """The end event of a step on a shared host (ignored when rescheduled since)."""
        if generation != self.generation or self.work_left is None:
            return
        batch, self._running, self.work_left = self._running, None, None
        self._finish_step(batch)
        if self.work_left is None:                     # no next step: the others speed up
            self.host.reschedule()

    def step_seconds(self, batch: ScheduledBatch, waited: float = 0.0) -> float:
        """What ``batch`` takes on the profiled machine (see the module docstring), its
        engine having ``waited`` seconds for work before it. Called once per step, at its
        start: it moves this node's warmth and its neighbours'."""
        c = self.costs
        t = c.prefill_seconds((n, r.num_computed) for r, n in zip(batch.prefill, batch.prefill_lens)) \
            if batch.prefill else 0.0
        t += c.decode_seconds(len(batch.decode), sum(r.num_computed + 1 for r in batch.decode))
        swapped = sum(len(r.host_block_ids) for r in batch.preempted if r.status is RequestStatus.SWAPPED)
        t += c.swap_seconds(2 * swapped + batch.host_blocks_swapped_in)     # out now, back in later
        if self.replicas:
            t += c.transfer_byte_s * self.kv_bytes_per_token * len(batch.decode)
        if self.partner is not None:
            copied = c.transfer_byte_s * self.kv_bytes_per_token * len(batch.decode) \
                + c.transfer_latency_s / 2 if batch.decode else 0.0          # one message a step
            copied += sum(self._kv_cpu_seconds(n) for n in batch.prefill_lens)
            t += copied
            self.partner.received_s += copied
        t += sum(self._kv_cpu_seconds(n) for r, n in zip(batch.prefill, batch.prefill_lens) if r.kv_out is not None)
        t += self.received_s
        self.received_s = 0.0
        batched = c.decode_batch_seconds(len(batch.decode)) - c.decode_batch_seconds(1) if batch.decode else 0.0
        t += self.warmth.step_extra(bool(batch.prefill), bool(batch.decode), max(0.0, batched))
        if self.wake_costs is not None:
            t += self.wake_costs.extra(waited)
        for n in self.neighbours:
            n.warmth.neighbour_step(bool(batch.prefill), bool(batch.decode))
        return t + (self.token_s if batch.decode else 0.0)

    def _kv_cpu_seconds(self, tokens: int) -> float:
        """This node's CPU time to send or receive ``tokens`` tokens' KV of a prompt."""
        c = self.costs
        return c.transfer_byte_s * self.kv_bytes_per_token * tokens + self.kv_messages * c.transfer_latency_s / 2

    def _finish_step(self, batch: ScheduledBatch) -> None:
        if self.dead:
            return                                         # the step died with the node
        self._batch = None
        self._advance(batch.prefill, batch.prefill_lens)
        self._advance(batch.decode, None)
        if self._leaving:
            leaving, self._leaving = self._leaving, {}
            for rid, then in leaving.items():
                req = self.requests.get(rid)
                if req is not None:
                    self._hand_off(req, then)
        if self.on_events is not None:
            events = self.pool.take_events()
            if events:
                self.on_events(self, events)
        self._start_step()

    def _advance(self, reqs: list[Request], num_new: list[int] | None) -> None:
        """The update half of ``LLMEngine._execute`` for one call over ``reqs``."""
        for i, req in enumerate(reqs):
            if req.status is not RequestStatus.RUNNING:
                continue                                   # aborted meanwhile
            if num_new is not None and req.num_computed + num_new[i] < req.num_tokens:
                req.num_computed += num_new[i]             # a chunk short of the prompt's end
                self.scheduler.cache_computed(req)
                continue
            req.num_computed = req.num_tokens                # every token so far; the new one is next
            req.prefilling = False
            req.output_ids.append(token_of(req.request_id, len(req.output_ids)))
            done = len(req.output_ids) >= req.params.max_tokens
            handed = req.kv_out is not None and not done
            if done or handed:
                self.scheduler.remove(req)
                self._retire(req)
            elif num_new is not None:
                self.scheduler.cache_computed(req)
            self.on_token(self, req, done or handed, handed)

    def _retire(self, req: Request) -> None:
        self.scheduler.release_memory(req, cache=True)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
