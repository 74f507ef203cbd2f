"""The run: arrival process, concurrency limit, sessions, faults, progress.

Conversations start at times drawn from a gamma process (vLLM's): the gap
before each start is ``Gamma(shape=burstiness, scale=1/(rate*burstiness))``,
which is Poisson for burstiness 1 and keeps the mean rate for any shape;
``rate = inf`` starts everything at once.  The schedule is computed up front
from the seed and followed against the clock, so a slow start never shifts
later ones.

Within a conversation, turn k+1 is sent only after turn k's answer arrived
(MemServe §8.2) and carries the whole history: chat messages on the chat
endpoint; on the completions endpoint the previous prompt, its answer
appended as the continuation it is, a newline and the next message -- so
every turn's prompt starts with the previous turn's prompt and answer.
``max_concurrency`` bounds requests in flight (a turn waiting for its
predecessor holds no slot); ``think_time_s`` is the pause between an
answer and the next turn (a user reading and typing; 0: at once).  A failed turn ends its conversation; the turns
not sent are recorded as failures with that reason, so counts always add up.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import aiohttp
import numpy as np

from tools.loadgen import faults
from tools.loadgen.client import RequestRecord, build_body, send_request
from tools.loadgen.datasets import Conversation


@dataclass(frozen=True)
class RunConfig:
    url: str                       # base URL + endpoint
    model: str
    chat: bool
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)   # sent with every request (--header)
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout_s: float = 3600.0
    keepalive: bool = True         # False: a new connection per request (servers that drop idle ones)
    seed: int = 0
    progress: bool = True
    admin_socket: str | None = None
    faults: tuple[faults.FaultSpec, ...] = ()
    extra_body: dict = field(default_factory=dict)
    think_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.think_time_s >= 0 and math.isfinite(self.think_time_s)):
            raise ValueError("think time must be a finite number of seconds >= 0")
        if not self.request_rate > 0:
            raise ValueError("request rate must be > 0 (inf for all at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError("burstiness must be a positive number")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max concurrency must be at least 1")
        if self.faults and not self.admin_socket:
            raise ValueError("--fail needs --admin-socket PATH")


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    started_at: float              # wall clock (time.time()) of the run start
    fault_events: list[dict]


def start_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds after the run start at which each of ``n`` conversations starts."""
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0                  # the first request goes out at once, as in vLLM
    return np.cumsum(gaps)


class Progress:
    """A one-line progress bar on a terminal; a line per 10% elsewhere."""

    def __init__(self, total: int, enabled: bool, out: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.enabled = enabled
        self.out = out if out is not None else sys.stderr
        self.tty = enabled and self.out.isatty()
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, success: bool) -> None:
        self.done += 1
        self.failed += not success
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._last_draw = now
                self.out.write("\r" + self.line(now))
                self.out.flush()
        else:
            decile = self.done * 10 // max(1, self.total)
            if decile != self._last_decile:
                self._last_decile = decile
                self.out.write(self.line(now) + "\n")
                self.out.flush()

    def line(self, now: float) -> str:
        elapsed = now - self.start
        frac = self.done / max(1, self.total)
        bar = "#" * int(frac * 30)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_s = f"{eta:5.0f}s" if math.isfinite(eta) else "    ?"
        fail = f" failed={self.failed}" if self.failed else ""
        return (f"{self.done:>6}/{self.total} [{bar:<30}] {frac:4.0%} "
                f"{elapsed:6.1f}s elapsed, eta {eta_s}, {rate:7.1f} req/s{fail}")

    def note(self, text: str) -> None:
        """A message that does not tear the bar."""
        if self.tty:
            self.out.write("\r\x1b[K" + text + "\n" + self.line(time.perf_counter()))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def fault_summary(event: dict) -> str:
    status = "ok" if event["ok"] else f"FAILED: {event['error']}"
    return f"fault {event['node']}@{event['at_s']:g}s ({event['mode']}): {status}"


def _headers(cfg: RunConfig) -> dict:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    headers.update(cfg.headers)
    return headers


async def run(conversations: list[Conversation], cfg: RunConfig) -> RunResult:
    """Send every turn of every conversation and return one record per turn."""
    total = sum(len(c.turns) for c in conversations)
    records: list[RequestRecord] = []
    offsets = start_offsets(len(conversations), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    progress = Progress(total, cfg.progress)
    headers = _headers(cfg)
    fault_log: list[dict] = []
    # No connection cap unless asked: a cap would queue requests inside the
    # client and charge that wait to the server's TTFT.
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0, ttl_dns_cache=300,
                                     force_close=not cfg.keepalive)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    counter = iter(range(total))

    async def one_turn(session_id: int, turn_no: int, prompt, turn, http, t0) -> RequestRecord:
        record = RequestRecord(index=next(counter), session=session_id, turn=turn_no,
                               prompt_len=turn.prompt_len, expected_output_len=turn.output_len)
        records.append(record)
        body = build_body(model=cfg.model, chat=cfg.chat, prompt=prompt, max_tokens=turn.output_len,
                          ignore_eos=cfg.ignore_eos, temperature=cfg.temperature,
                          extra=cfg.extra_body)
        if limit is not None:
            await limit.acquire()
        try:
            record.start = time.perf_counter() - t0
            await send_request(http, cfg.url, body, headers, cfg.chat, record)
        finally:
            if limit is not None:
                limit.release()
        progress.update(record.success)
        return record

    async def converse(session_id: int, conv: Conversation, http, t0) -> None:
        messages: list[dict] = []
        history = ""
        for k, turn in enumerate(conv.turns):
            if cfg.chat:
                messages.append({"role": "user", "content": turn.text})
                prompt = list(messages)
            else:
                history = f"{history}\n{turn.text}" if history else turn.text
                prompt = history
            record = await one_turn(session_id, k, prompt, turn, http, t0)
            if not record.success:
                for j in range(k + 1, len(conv.turns)):
                    skipped = conv.turns[j]
                    records.append(RequestRecord(
                        index=next(counter), session=session_id, turn=j, prompt_len=skipped.prompt_len,
                        expected_output_len=skipped.output_len, start=record.start + record.e2el,
                        error=f"not sent: turn {k} of the session failed"))
                    progress.update(False)
                return
            if cfg.chat:
                messages.append({"role": "assistant", "content": record.text})
            else:
                history += record.text
            if cfg.think_time_s and k + 1 < len(conv.turns):
                await asyncio.sleep(cfg.think_time_s)

    async def inject_fault(spec: faults.FaultSpec, t0: float) -> None:
        event = await faults.inject(cfg.admin_socket, spec, t0, fault_log)
        progress.note(fault_summary(event))

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        started_at = time.time()
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as conversations_group:
            fault_tasks = [conversations_group.create_task(inject_fault(spec, t0))
                           for spec in cfg.faults]
            convo_tasks = []
            for i, (conv, offset) in enumerate(zip(conversations, offsets.tolist())):
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                convo_tasks.append(conversations_group.create_task(converse(i, conv, http, t0)))
            await asyncio.gather(*convo_tasks)
            duration = time.perf_counter() - t0
            # Faults scheduled after the last answer are not sent.
            for task in fault_tasks:
                task.cancel()
        progress.close()

    for event in fault_log:
        if event["sent_s"] is None:
            event["error"] = "not sent: the run ended first"
            progress.note(fault_summary(event))
    records.sort(key=lambda r: r.index)
    return RunResult(records, duration, started_at, fault_log)
