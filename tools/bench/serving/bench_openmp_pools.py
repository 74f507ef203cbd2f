"""Decode steps on an engine thread, the loader thread's OpenMP workers kept or released.

The node daemon loads its engine on a loader thread and steps it on another
(kvd/node/engine_driver.py). libgomp keeps a pool of workers per thread that has
run a parallel region; when the pools' threads outnumber the CPUs it throttles
them all: a worker spins ~100 times after a region, then sleeps on a futex, and
every region (a decode step is one) wakes the team again. ``load_engine``
releases the loader's pool. This measures what that is worth, side by side in
one process, rounds alternated:

- ``kept``: the loader thread holds a team of the compute threads (a torch op
  on it, as loading leaves one), so the process has two;
- ``released``: ``kernels.native.release_openmp_pool()`` on the loader thread.

Each round decodes one sequence of ``--context`` prompt tokens for ``--steps``
greedy steps through ``LLMEngine.step`` on the engine thread: the median step,
and the voluntary context switches of all the process's threads per step
(/proc/self/task: a worker that sleeps after a step and is woken for the next
counts one).

    .venv/bin/python -m tools.bench.serving.bench_openmp_pools [--model M] [--threads N] [--steps 200] [--rounds 3]

``--threads`` defaults to the engine's own choice (EngineConfig.compute_threads).
Prints a markdown row and writes results/bench_openmp_pools.json.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from kernels import native  # noqa: E402
from kernels.quant_linear import host_variant  # noqa: E402
from tools._twoproc import write_results  # noqa: E402
from tools.bench.serving.bench_serve_checkouts import switches  # noqa: E402
from tools.loadgen.report import cpu_model  # noqa: E402


class Worker:
    """A thread that runs the functions it is given, in order, and lives until closed."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            try:
                done.put((fn(), None))
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                done.put((None, exc))

    def do(self, fn: Callable[[], Any]) -> Any:
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, done))
        result, exc = done.get(timeout=600)
        if exc is not None:
            raise exc
        return result

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(60)


def voluntary_switches() -> int:
    """Voluntary context switches of every thread of this process so far."""
    return sum(v for v, _ in switches(os.getpid()).values())


def decode_round(eng: LLMEngine, context: int, steps: int, seed: int) -> dict:
    """One sequence prefilled, then ``steps`` timed greedy steps (on the calling thread)."""
    rng = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, eng.model.config.vocab_size, (context,), generator=rng).tolist()
    eng.add_request("r", prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    while eng.requests["r"].num_computed < context:
        eng.step()
    for _ in range(3):
        eng.step()
    walls = []
    before = voluntary_switches()
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        walls.append((time.perf_counter() - t) * 1e3)
    switches = voluntary_switches() - before
    eng.abort_request("r")
    return {"median_ms": statistics.median(walls), "switches_per_step": switches / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=EngineConfig().model, help="model spec or GGUF path (default: the bundled model)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_openmp_pools.json"))
    args = ap.parse_args()

    # this thread runs no torch op: the loader's and the engine thread's are the only teams
    loader, stepper = Worker("loader"), Worker("engine")
    eng = loader.do(lambda: LLMEngine.from_config(EngineConfig(model=args.model, num_threads=args.threads)))
    threads = torch.get_num_threads()

    def keep_team() -> None:                    # the team loading leaves on the loader thread
        torch.ones(1 << 22).add_(1)

    rows = []
    for rnd in range(args.rounds):
        for mode in (("kept", "released") if rnd % 2 == 0 else ("released", "kept")):
            loader.do(keep_team if mode == "kept" else native.release_openmp_pool)
            r = stepper.do(lambda: decode_round(eng, args.context, args.steps, seed=rnd))
            rows.append({"mode": mode, "round": rnd, **r})
            print(f"round {rnd} {mode:8s}: step {r['median_ms']:.3f} ms, "
                  f"{r['switches_per_step']:.1f} voluntary context switches a step", flush=True)
    loader.close()
    stepper.close()

    med = {m: {k: statistics.median(r[k] for r in rows if r["mode"] == m) for k in ("median_ms", "switches_per_step")}
           for m in ("kept", "released")}
    cpu = cpu_model() or "unknown CPU"
    print("\n| CPU | threads | loader's team kept: step, switches a step | released: step, switches a step |")
    print("|---|---|---|---|")
    print(f"| {cpu}, {host_variant()} | {threads} | {med['kept']['median_ms']:.3f} ms, "
          f"{med['kept']['switches_per_step']:.1f} | **{med['released']['median_ms']:.3f} ms**, "
          f"{med['released']['switches_per_step']:.1f} |")
    write_results(args.out, rows, cpu=cpu, threads=threads, context=args.context, steps=args.steps, medians=med)


if __name__ == "__main__":
    main()
