"""Structured output's cost per decode step: a JSON-schema request's TPOT
against an unconstrained one's, side by side, at batch 1 and 32.

Each round runs the same B requests twice through one ``LLMEngine`` (the
bundled SmolLM2, the serving defaults): unconstrained (greedy, ``ignore_eos``)
and under a JSON schema (greedy; an array of at least ``--min-items`` records,
so the grammar goes on past ``--tokens`` and every step masks), alternated
``--rounds`` times. TPOT is a run's median decode step (every request
decoding), in ms; the ratio is structured / plain, per round, and its median.
The structured run's masks are computed while the step's model runs where a
CPU is left beside the compute team, else on the engine thread
(engine/structured/masks.py). ``mask CPU`` is the engine thread's CPU time
(``time.thread_time``: a busy host's preemptions left out) of one step's
structured-output work alone, over B rows in the schema's grammar: computing
the masks, masking the logits, the guided rows' argmax and accepting the
tokens, the median of ``--tokens`` steps.

    .venv/bin/python -m tools.bench.engine.bench_structured [--batches 1,32] [--threads N]
        [--tokens 48] [--prompt-len 64] [--rounds 3]

Prints the table and appends JSON to results/bench_structured.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from engine.sampling import greedy
from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.structured.spec import StructuredOutput
from tools.bench.engine.bench_engine import append_result, machine

RESULTS = Path("results/bench_structured.json")


def schema(min_items: int) -> dict:
    person = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 24},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150},
                             "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,4}$"},
                             "tags": {"type": "array", "maxItems": 4,
                                      "items": {"enum": ["admin", "user", "guest", "owner"]}}}}
    return {"type": "object", "required": ["people"], "additionalProperties": False,
            "properties": {"people": {"type": "array", "minItems": min_items, "items": person}}}


def decode_steps(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds of each step in which every request decodes (after their prefill)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    times, produced = [], 0
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        produced += len(outs)
        if produced > len(prompts) and len(outs) == len(prompts):     # a decode step of the whole batch
            times.append(dt)
    return times


def mask_cpu_ms(engine: LLMEngine, spec: StructuredOutput, batch: int, steps: int) -> float:
    """The median thread CPU ms of one step's structured-output work over ``batch`` rows
    (random logits: each row's state follows its own argmax through the grammar)."""
    v = engine.model.config.vocab_size
    states = [engine.grammars.start(spec) for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, v, generator=gen)
        t = time.thread_time()
        pending = engine.runner.masks.start(states)
        pending.apply(logits)
        for state, tok in zip(states, greedy(logits)):
            state.accept(tok)
        times.append(time.thread_time() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-items", type=int, default=100)
    args = ap.parse_args()
    engine = LLMEngine.from_config(EngineConfig(model="smollm2", num_threads=args.threads))
    spec = StructuredOutput.json_schema(schema(args.min_items))
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, structured=spec)
    rng = random.Random(0)
    info = machine()
    print(f"# {info['cpu']}, {torch.get_num_threads()} threads, decode {engine.kernels()['decode']}")
    rows = []
    for b in map(int, args.batches.split(",")):
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(b)]
        decode_steps(engine, prompts, guided)                    # warm-up (compiles the grammar once)
        decode_steps(engine, prompts, plain)
        tpot = {"plain": [], "json_schema": []}
        for _ in range(args.rounds):
            for name, params in (("plain", plain), ("json_schema", guided)):
                tpot[name].append(statistics.median(decode_steps(engine, prompts, params)) * 1e3)
        ratios = [s / p for s, p in zip(tpot["json_schema"], tpot["plain"])]
        row = {"batch": b, "tpot_plain_ms": tpot["plain"], "tpot_json_schema_ms": tpot["json_schema"],
               "ratio_median": statistics.median(ratios), "mask_cpu_ms": mask_cpu_ms(engine, spec, b, args.tokens),
               "mask_overlap": engine.runner.masks.overlap}
        rows.append(row)
        print(f"batch {b:3d}: TPOT plain {statistics.median(tpot['plain']):8.2f} ms, json_schema "
              f"{statistics.median(tpot['json_schema']):8.2f} ms, ratio {row['ratio_median']:.3f} "
              f"(rounds {', '.join(f'{r:.3f}' for r in ratios)}); mask CPU {row['mask_cpu_ms']:.3f} ms/step "
              f"({'overlapped' if row['mask_overlap'] else 'on the engine thread'})")
    append_result(RESULTS, {"bench": "structured", "machine": info, "args": vars(args),
                            "decode": engine.kernels()["decode"], "rows": rows,
                            "time": time.strftime("%Y-%m-%d %H:%M:%S")})


if __name__ == "__main__":
    main()
