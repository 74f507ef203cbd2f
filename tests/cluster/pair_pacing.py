"""Pacing for daemon tests that need a stream still running when an event
happens (a partner's copy given up, a member killed and replaced).

The tiny model makes a token in about a millisecond on a fast host, and a
node's engine does not wait for its client, so a stream sized by a guess
can end before the event it is meant to span. Here a test sizes its streams
from the step rate measured on its own cluster (``tokens_per_second``), and
``Throttle`` holds the nodes to a known share of that rate by pausing them
(SIGSTOP) for most of every ``PERIOD_S``, as a slow or overloaded host
would; a pause is far shorter than the heartbeat deadline, so no node is
declared dead for it. ``pace`` picks the share: a stream of ``tokens`` then
lasts at least ``seconds``. ``paired_cluster`` starts the pair these tests
pace.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

PERIOD_S = 0.1            # one pause and one run of a throttled node
SAFETY = 2.0              # the measured rate may be a loaded moment's: assume a node up to this much faster
CONTEXT = 2048            # the tiny model's context (tiny_config().max_position_embeddings)
MIN_SHARE = 0.1           # a throttled node runs at least this share: its heartbeats and answers keep going


@functools.lru_cache(maxsize=1)
def long_reference():
    """The plain single-node engine with the tiny model's whole context (the
    conftest's ``reference_engine`` stops at 512 tokens)."""
    from engine.engine import EngineConfig, LLMEngine

    return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=1024,
                                              host_kv_blocks=0, max_model_len=CONTEXT, num_threads=1,
                                              batch_invariant=True))


def tokens_per_second(c, tokens: int = 256) -> float:
    """Tokens a second of one greedy stream on cluster ``c``'s idle nodes
    now (measured: the faster of two requests, the first one warming up)."""
    from .conftest import MODEL

    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        c.client(timeout=120).completions.create(model=MODEL, prompt=[11, 12, 13, 14], max_tokens=tokens,
                                                 temperature=0.0, extra_body={"ignore_eos": True})
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def pace(rate: float, tokens: int, seconds: float) -> float:
    """The share of ``PERIOD_S`` a throttled node may run (``MIN_SHARE`` to 1)
    so that a stream of ``tokens`` lasts at least ``seconds`` on a node up
    to ``SAFETY`` times faster than ``rate`` tokens/s."""
    return max(MIN_SHARE, min(1.0, tokens / (seconds * rate * SAFETY)))


class Throttle:
    """Pauses ``procs`` (conftest ``Proc``) for ``1 - share`` of every
    ``PERIOD_S`` until ``stop`` (a context manager; ``share`` 1: no pause).
    Every process is running again when ``stop`` returns."""

    def __init__(self, procs: list, share: float) -> None:
        self.procs, self.share = list(procs), share
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if share < 1.0:
            self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                for p in self.procs:
                    p.pause()
                self._done.wait(PERIOD_S * (1.0 - self.share))
                for p in self.procs:
                    p.resume()
                self._done.wait(PERIOD_S * self.share)
        finally:
            for p in self.procs:
                p.resume()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def __enter__(self) -> Throttle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def paired_cluster(tmp, n1: tuple[str, ...], n2: tuple[str, ...]):
    """A coordinator and the pair n1-n2 (each started with its flags), a
    dead member's requests recovered from their copies and no pair
    scheduler (these tests place every request themselves); stopped on exit."""
    from .conftest import Cluster

    c = Cluster(tmp, "zmq+tcp", extra=("--recovery", "replica", "--no-pair-scheduler"))
    c.start_node("n1", *n1, "--pair", "n2")
    c.start_node("n2", *n2, "--pair", "n1")
    try:
        c.wait_nodes(["n1", "n2"])
        yield c
    finally:
        c.stop()


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` prompt token ids, the same for the same seed."""
    return [(seed * 7919 + i * 104729) % 40000 + 1 for i in range(n)]
