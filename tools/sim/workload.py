"""The simulated client: kvd-loadgen's workload, sent in simulated time.

The conversations are kvd-loadgen's own (``tools.loadgen.datasets.build``,
from its parsed flags) and so are the start times
(``tools.loadgen.runner.start_offsets``: the same gamma process and seed), so
a simulated run sends what a measured run with the same flags sends. As in
the loadgen's runner, turn k+1 of a conversation is sent when turn k's answer
has arrived (plus the think time) and carries the history: the previous
prompt, its answer and the next message (the completions endpoint's shape;
the answer's tokens are the simulator's made-up ones). ``max_concurrency``
bounds requests in flight. Each request ends as a loadgen ``RequestRecord``.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from tools.loadgen.client import RequestRecord
from tools.loadgen.datasets import Conversation
from tools.loadgen.runner import start_offsets

from kvd.sim.cluster import SimCluster, SimStream
from kvd.sim.events import EventQueue
from kvd.sim.node import token_of


@dataclass(frozen=True)
class WorkloadOptions:
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None
    think_time_s: float = 0.0


class SimClient:
    """Sends ``conversations`` into ``cluster``; ``records`` fill in as requests end."""

    def __init__(self, conversations: list[Conversation], opts: WorkloadOptions, encode, cluster: SimCluster,
                 events: EventQueue) -> None:
        self.conversations, self.opts, self.encode = conversations, opts, encode
        self.cluster, self.events = cluster, events
        self.records: list[RequestRecord] = []
        self.total = sum(len(c.turns) for c in conversations)
        self._index = 0
        self._in_flight = 0
        self._queue: collections.deque = collections.deque()       # turns waiting for a concurrency slot
        self.last_end = 0.0

    def start(self) -> None:
        offsets = start_offsets(len(self.conversations), self.opts.request_rate, self.opts.burstiness,
                                self.opts.seed)
        for i, offset in enumerate(offsets.tolist()):
            self.events.at(self.events.now + offset, self._turn, i, 0, [])

    def _turn(self, conv_no: int, turn_no: int, history: list[int]) -> None:
        turn = self.conversations[conv_no].turns[turn_no]
        text = f"\n{turn.text}" if history else turn.text
        prompt = history + self.encode(text)
        if self.opts.max_concurrency is not None and self._in_flight >= self.opts.max_concurrency:
            self._queue.append((conv_no, turn_no, prompt))
            return
        self._send(conv_no, turn_no, prompt)

    def _send(self, conv_no: int, turn_no: int, prompt: list[int]) -> None:
        turn = self.conversations[conv_no].turns[turn_no]
        record = RequestRecord(index=self._index, session=conv_no, turn=turn_no, prompt_len=turn.prompt_len,
                               expected_output_len=turn.output_len, start=self.events.now)
        self._index += 1
        self._in_flight += 1
        self.records.append(record)

        def done(stream: SimStream) -> None:
            self._finish(record, stream, conv_no, turn_no, prompt)

        self.cluster.submit(f"sim-{record.index}", prompt, turn.output_len, done)

    def _finish(self, record: RequestRecord, stream: SimStream, conv_no: int, turn_no: int,
                prompt: list[int]) -> None:
        now = self.events.now
        self._in_flight -= 1
        self.last_end = max(self.last_end, now)
        arrivals = stream.arrivals
        record.e2el = now - record.start
        record.prompt_tokens = len(prompt)
        record.usage_reported = True
        if stream.error or not arrivals:
            record.error = stream.error or "no token"
        else:
            record.success = True
            record.ttft = arrivals[0] - record.start
            record.itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
            record.chunks = record.output_tokens = len(arrivals)
            record.finish_reason = "length"
        conv = self.conversations[conv_no]
        if record.success and turn_no + 1 < len(conv.turns):
            answer = [token_of(stream.request_id, i) for i in range(len(arrivals))]
            self.events.after(self.opts.think_time_s, self._turn, conv_no, turn_no + 1, prompt + answer)
        elif not record.success:
            for j in range(turn_no + 1, len(conv.turns)):
                skipped = conv.turns[j]
                self.records.append(RequestRecord(index=self._index, session=conv_no, turn=j,
                                                  prompt_len=skipped.prompt_len,
                                                  expected_output_len=skipped.output_len, start=now,
                                                  error=f"not sent: turn {turn_no} of the session failed"))
                self._index += 1
        if self._queue:
            self._send(*self._queue.popleft())
