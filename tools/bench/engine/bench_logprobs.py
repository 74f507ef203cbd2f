"""What log probabilities cost the engine, side by side in one run.

``decode``: TPOT (the median decode step in which every request decodes) of
B greedy requests asking ``logprobs = --top`` against the same requests
asking none, alternated ``--rounds`` times; the ratio is with / without.
Beside it, measured inside the same steps (so that a busy host slows both
alike), the share of a step the logprob computation takes (engine/logprobs.py's
``summarize`` and ``PendingLogprobs.answer``, timed around their calls).

``prompt``: a ``--prompt-len``-token prompt's prefill when it asks for
prompt logprobs (echo): the whole prompt is computed and every position
goes through the LM head and a logprob summary (engine/logprobs.py), cached
prefix or not; beside it the same prompt served from the prefix cache
without them (what a plain repeat costs) and computed without a cache (a
plain prefill). Each is the time of one request with max_tokens 1.

    .venv/bin/python -m tools.bench.engine.bench_logprobs [--parts decode,prompt] [--batch 32]
        [--top 5] [--tokens 48] [--prompt-len 1000] [--rounds 3] [--threads N]

Prints the tables and appends JSON to results/bench_logprobs.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

import engine.logprobs
import engine.runner
from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from tools.bench.engine.bench_engine import append_result, machine

RESULTS = Path("results/bench_logprobs.json")


def batch_decode_steps(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                       timed: "Timed | None" = None) -> tuple[list[float], float]:
    """(seconds of each step in which every request of ``prompts`` decodes, the
    seconds ``timed`` counted within those steps)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    times, produced, inside = [], 0, 0.0
    while engine.has_unfinished():
        before = timed.seconds if timed is not None else 0.0
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        produced += len(outs)
        if produced > len(prompts) and len(outs) == len(prompts):
            times.append(dt)
            inside += (timed.seconds if timed is not None else 0.0) - before
    return times, inside


def one_request_seconds(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> float:
    t = time.perf_counter()
    engine.generate([prompt], params)
    return time.perf_counter() - t


class Timed:
    """Wraps the step's logprob work (engine.runner's ``summarize`` and
    ``PendingLogprobs.answer``), adding up the seconds spent in it."""

    TARGETS = ((engine.runner, "summarize"), (engine.logprobs.PendingLogprobs, "answer"))

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals = [(owner, name, getattr(owner, name)) for owner, name in self.TARGETS]

    def __enter__(self) -> "Timed":
        for owner, name, fn in self._originals:
            setattr(owner, name, self._timed(fn))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._originals:
            setattr(owner, name, fn)

    def _timed(self, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return call


def decode_part(engine: LLMEngine, args, rng: random.Random) -> dict:
    prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(args.batch)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    asking = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=args.top)
    batch_decode_steps(engine, prompts, plain)                          # warm-up
    tpot: dict[str, list[float]] = {"plain": [], "logprobs": []}
    shares = []
    for _ in range(args.rounds):
        tpot["plain"].append(statistics.median(batch_decode_steps(engine, prompts, plain)[0]) * 1e3)
        with Timed() as timed:
            steps, inside = batch_decode_steps(engine, prompts, asking, timed)
        tpot["logprobs"].append(statistics.median(steps) * 1e3)
        shares.append(inside / (sum(steps) - inside))
    ratios = [a / p for a, p in zip(tpot["logprobs"], tpot["plain"])]
    row = {"batch": args.batch, "top": args.top, "tpot_plain_ms": tpot["plain"], "tpot_logprobs_ms": tpot["logprobs"],
           "ratio_median": statistics.median(ratios), "in_step_share": shares,
           "in_step_share_median": statistics.median(shares)}
    print(f"decode, batch {args.batch}: TPOT plain {statistics.median(tpot['plain']):.2f} ms, logprobs "
          f"top {args.top} {statistics.median(tpot['logprobs']):.2f} ms, ratio {row['ratio_median']:.3f} "
          f"(rounds {', '.join(f'{r:.3f}' for r in ratios)}); logprobs' own time / the rest of the step "
          f"{row['in_step_share_median']:.3f} (rounds {', '.join(f'{r:.3f}' for r in shares)})")
    return row


def prompt_part(engine: LLMEngine, uncached: LLMEngine, args, rng: random.Random) -> dict:
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    echo = SamplingParams(max_tokens=1, temperature=0.0, logprobs=args.top, prompt_logprobs=args.top)
    engine.generate([prompt], plain)                                    # cached from now on
    one_request_seconds(uncached, prompt, plain)                        # warm-up
    times: dict[str, list[float]] = {"cached_plain": [], "prompt_logprobs": [], "uncached_plain": []}
    for _ in range(args.rounds):
        times["cached_plain"].append(one_request_seconds(engine, prompt, plain))
        times["prompt_logprobs"].append(one_request_seconds(engine, prompt, echo))
        times["uncached_plain"].append(one_request_seconds(uncached, prompt, plain))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    row = {"prompt_len": args.prompt_len, "top": args.top, **{f"{k}_ms": v for k, v in times.items()},
           "vs_uncached": med["prompt_logprobs"] / med["uncached_plain"],
           "vs_cached": med["prompt_logprobs"] / med["cached_plain"]}
    print(f"prompt of {args.prompt_len}: cached, no logprobs {med['cached_plain']:.1f} ms; prompt logprobs top "
          f"{args.top} {med['prompt_logprobs']:.1f} ms; uncached prefill {med['uncached_plain']:.1f} ms "
          f"(prompt logprobs / uncached prefill {row['vs_uncached']:.3f}, / cached {row['vs_cached']:.2f})")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="decode,prompt")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    engine = LLMEngine.from_config(EngineConfig(model="smollm2", num_threads=args.threads))
    info = machine()
    print(f"# {info['cpu']}, {torch.get_num_threads()} threads, decode {engine.kernels()['decode']}")
    rng = random.Random(0)
    record = {"bench": "logprobs", "machine": info, "args": vars(args), "decode": engine.kernels()["decode"],
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if "decode" in parts:
        record["decode_row"] = decode_part(engine, args, rng)
    if "prompt" in parts:
        uncached = LLMEngine.from_config(EngineConfig(model="smollm2", num_threads=args.threads,
                                                      enable_prefix_caching=False))
        record["prompt_row"] = prompt_part(engine, uncached, args, rng)
    append_result(RESULTS, record)


if __name__ == "__main__":
    main()
