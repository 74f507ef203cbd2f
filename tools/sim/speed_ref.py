"""The host's speed at one moment: a short fixed measurement that ``kvd profile``
records in a profile (``reference``) and that tools/bench/sim/validate.py takes
again before each run it measures.

A shared host's speed drifts by 15-20% within the hour (a noisy neighbour,
the VM's share of the socket), so a profile describes the hour it was taken
in. The ratio of the same measurement now to the profile's says how much
slower or faster the engine is now, compute-bound (a prefill) and
bandwidth-bound (a one-row decode step) apart; ``kvd.sim.profile_file.at_speed``
brings a profile to it. A ratio rather than an absolute reading: on a host
whose speed did not move the ratio is 1 and the profile is unchanged.

What is timed, on an engine with nothing running or cached, after the
same warm-up in both places (a prefill and a batched decode, untimed):

- ``prefill_s``: the median of ``PREFILL_ROUNDS`` one-step prefills of
  ``PREFILL_TOKENS`` fresh tokens, back to back;
- ``decode_s``: the median one-row decode step, over ``DECODE_STEPS`` steps
  after the first ``DECODE_SKIP`` (those a prefill leaves with cold weights).

About two seconds beyond building the engine. The host's speed also
jitters by about 10% from one second to the next, so one reading is not a
reference: a profile records the median of ``PROFILE_READINGS`` spread over
its minutes, and validate the median of a configuration's readings (one
before each run).

    .venv/bin/python -m tools.sim.speed_ref --model smollm2 [-c CONFIG] [--repeat]

prints one reading as a JSON line; with ``--repeat``, one more for each line
read on stdin, on the same engine, until stdin ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PREFILL_TOKENS = 128
PREFILL_ROUNDS = 7
DECODE_SKIP = 12
DECODE_STEPS = 48
DECODE_PROMPT = 64
PROFILE_READINGS = 5          # readings kvd profile spreads over its phases


def reference_of_readings(readings: list[dict]) -> dict:
    """A reference from several readings: each measure's median, and the readings."""
    return {"prefill_s": statistics.median(r["prefill_s"] for r in readings),
            "decode_s": statistics.median(r["decode_s"] for r in readings),
            "readings": [[r["prefill_s"], r["decode_s"]] for r in readings]}


def measure_reference(engine, ids) -> dict:
    """Time the reference on ``engine`` (an LLMEngine with nothing running;
    ``ids(n)`` makes an n-token prompt of fresh tokens). Leaves nothing
    running and the prefix cache flushed. ``{"prefill_s", "decode_s"}``."""
    from engine.request import SamplingParams

    counter = iter(range(1 << 30))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(prompts: list[list[int]], params) -> None:
        for p in prompts:
            engine.add_request(f"ref-{next(counter)}", p, params)
        while engine.has_unfinished():
            engine.step()

    run([ids(PREFILL_TOKENS)], one)                                       # warm-up, untimed
    run([ids(32) for _ in range(3)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.pool.flush()
    prefill = []
    for _ in range(PREFILL_ROUNDS):
        engine.add_request(f"ref-{next(counter)}", ids(PREFILL_TOKENS), one)
        t0 = time.perf_counter()
        engine.step()
        prefill.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
        engine.pool.flush()
    engine.add_request(f"ref-{next(counter)}", ids(DECODE_PROMPT),
                       SamplingParams(max_tokens=DECODE_SKIP + DECODE_STEPS + 1, temperature=0.0, ignore_eos=True))
    engine.step()                                                         # its prefill
    decode = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - t0)
    engine.pool.flush()
    return {"prefill_s": statistics.median(prefill), "decode_s": statistics.median(decode[DECODE_SKIP:])}


def readings_of(config):
    """Build the engine ``config`` (an EngineConfig) describes; a generator that
    times one reading on it per ``next`` (with ``threads``: the engine's)."""
    from dataclasses import replace

    import numpy as np

    from engine.engine import LLMEngine

    engine = LLMEngine.from_config(replace(config, profile="", prefill_chunk_tokens=0, enable_prefix_caching=True))
    rng = np.random.default_rng(1)
    vocab = engine.model.config.vocab_size
    while True:
        yield {**measure_reference(engine, lambda n: rng.integers(10, vocab - 10, size=n).tolist()),
               "threads": engine.compute_threads}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", default=None, help="a kvd config whose [engine] table builds the engine")
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeat", action="store_true", help="one more reading per line on stdin")
    args = ap.parse_args(argv)
    from kvd.config import ConfigError, load_config

    try:
        config = load_config(args.config, {"engine": {"model": args.model}} if args.model else {})
    except (ConfigError, ValueError) as exc:
        print(f"speed_ref: error: {exc}", file=sys.stderr)
        return 2
    readings = readings_of(config.engine)
    print(json.dumps(next(readings)), flush=True)
    if args.repeat:
        for _ in sys.stdin:
            print(json.dumps(next(readings)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
