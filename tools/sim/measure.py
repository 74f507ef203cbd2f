"""A measured run beside a simulated one, and the serving overhead a profile records.

- ``measured``: ``kvd-loadgen`` (its own CLI, a subprocess) against a running
  kvd, with the given workload flags; its result's metrics.
- ``simulated``: the same flags through ``kvd simulate``'s code on a profile.
- ``serving_overhead``: what an unloaded request's time to first token
  through a real ``kvd serve`` (HTTP parsing, chat template and tokenizer,
  the event loop's hops, the first SSE chunk) takes beyond what the
  simulator charges the same request on the same profile (engine steps and
  transport hops), and what each further token takes beyond the engine's
  step (the output's dispatch and SSE chunk, on the node's CPUs).
  ``kvd profile`` records both; the simulator adds the first to every
  request before routing (kvd/sim/cluster.py) and the second to every step
  with a decode part (kvd/sim/node.py), so an unloaded simulated TTFT and
  TPOT are the measured ones.
- ``disagg_overhead``: the same through a real one-prefill-one-decode
  cluster on this host (a node per CPU where there are two), with prompts
  long enough to be disaggregated: what such a request's path (the
  decode node's reservation, the grant and the prefill leg, the layer
  stream's messages on both nodes' event loops) takes beyond what the
  simulator charges it, recorded as ``serving.disagg_s`` and charged
  between the grant and the prefill leg.

Each overhead is the median over several fresh servers (``served_medians``):
one server instance's latencies may sit apart from the next one's.

The tools that check the simulator and the planner against real runs
(tools/bench/sim/) use the same two functions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OVERHEAD_INPUT_LEN = 64        # prompt tokens of the overhead's requests (random text)
OVERHEAD_OUTPUT_LEN = 16          # tokens out: a TPOT over 15 steps
OVERHEAD_RATE = 2.0           # req/s: arrivals with idle gaps, as a trace's at its rate
OVERHEAD_WARMUP = 4           # requests first, not counted: a fresh server's first ones pay one-off costs
DISAGG_INPUT_LEN = 128        # prompt tokens of the disaggregated run: past [cluster].prefill_threshold's default
OVERHEAD_INSTANCES = 3        # fresh servers each overhead is measured on (the median of theirs)


def measured(url: str, flags: list[str], out: Path, timeout: float = 600.0) -> dict:
    """Run kvd-loadgen with ``flags`` against ``url``, its result at ``out``; the metrics."""
    subprocess.run([sys.executable, "-m", "tools.loadgen.cli", "--base-url", url, *flags, "--save-result",
                    "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=timeout)  # noqa: S603
    return json.loads(out.read_text())["metrics"]


def served_medians(serve_args: list[str], flags: list[str], warmup: list[str], instances: int) -> dict:
    """Run ``flags`` (after ``warmup``) against ``instances`` fresh ``kvd serve
    serve_args`` one after another; the median over the instances of each one's
    median TTFT and TPOT, and each instance's (a server instance's speed varies
    on a shared machine: one slow instance must not set the overhead)."""
    import statistics

    from tools._twoproc import stop_processes
    from tools.bench.serving.bench_n_copies import serve

    ttfts, tpots = [], []
    for _ in range(instances):
        proc, url = serve(serve_args)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                measured(url, warmup, Path(tmp) / "warmup.json")
                real = measured(url, flags, Path(tmp) / "run.json")
        finally:
            stop_processes([proc])
        ttfts.append(real["median_ttft_ms"])
        tpots.append(real["median_tpot_ms"])
    return {"median_ttft_ms": statistics.median(ttfts), "median_tpot_ms": statistics.median(tpots),
            "instances_ttft_ms": [round(t, 3) for t in ttfts], "instances_tpot_ms": [round(t, 3) for t in tpots]}


def simulated(profile: str, nodes: int, prefill: int, routing: str | None, cfg: str | Path | None,
              flags: list[str], colocated: bool = False) -> dict:
    """``kvd simulate`` of ``flags`` on ``profile`` for that shape (``nodes`` 0: one node;
    ``colocated``: every node on this one host); the metrics."""
    from tools.loadgen import metrics

    from tools.sim.run import load_shape, parse, simulate, workload_of

    _, args = parse(["--profile", str(profile), *flags])
    shape = load_shape(str(cfg) if cfg else None, str(profile), max(nodes, 1), prefill, routing, colocated)
    conversations, opts, encode, _ = workload_of(args)
    records, duration, _ = simulate(shape, conversations, opts, encode)
    return metrics.compute_metrics(records, duration, args.percentiles, args.slo)


def disagg_overhead(profile: str | Path, model: str, config: str | None, requests: int,
                    instances: int = OVERHEAD_INSTANCES) -> dict:
    """``kvd serve --nodes 2 --prefill 1`` (``-c config``; ``--split-cpus cores``
    when this process may use two CPUs or more), ``requests`` prompts of
    ``DISAGG_INPUT_LEN`` tokens one at a time on each of ``instances`` fresh
    servers (``served_medians``), against the simulator's TTFT for the same
    flags and shape (colocated) on ``profile``, which holds the one-node
    serving overhead already and no ``disagg_s``. Returns the ``serving`` keys to add."""
    import os

    flags = overhead_flags(model, requests, input_len=DISAGG_INPUT_LEN)
    split = "cores" if len(os.sched_getaffinity(0)) >= 2 else "off"
    real = served_medians(["--model", model, *(["-c", config] if config else []), "--nodes", "2", "--prefill", "1",
                           "--split-cpus", split], flags,
                          overhead_flags(model, OVERHEAD_WARMUP, "inf", seed=1, input_len=DISAGG_INPUT_LEN), instances)
    sim = simulated(profile, 2, 1, None, config, flags, colocated=True)
    real_ms, sim_ms = real["median_ttft_ms"], sim["median_ttft_ms"]
    return {"disagg_s": round(max(0.0, real_ms - sim_ms) / 1e3, 6), "disagg_input_len": DISAGG_INPUT_LEN,
            "disagg_split_cpus": split, "disagg_measured_median_ttft_ms": round(real_ms, 3),
            "disagg_instances_ttft_ms": real["instances_ttft_ms"],
            "disagg_simulated_median_ttft_ms": round(sim_ms, 3)}


def overhead_flags(model: str, requests: int, rate: float | str = OVERHEAD_RATE, seed: int = 0,
                   input_len: int = 0) -> list[str]:
    """kvd-loadgen flags of the overhead's run: ``requests`` random prompts, one at a
    time, arriving at ``rate`` (Poisson: the engine idles between most of them).
    A warm-up takes another ``seed``: its prompts must not be cached for the run."""
    return ["--dataset-name", "random", "--random-input-len", str(input_len or OVERHEAD_INPUT_LEN),
            "--random-output-len", str(OVERHEAD_OUTPUT_LEN), "--num-prompts", str(requests),
            "--max-concurrency", "1", "--request-rate", str(rate), "--seed", str(seed), "--tokenizer", model]


def serving_overhead(profile: str | Path, model: str, config: str | None, requests: int,
                     instances: int = OVERHEAD_INSTANCES) -> dict:
    """``kvd serve`` (``--model model``, ``-c config``), warmed with
    ``OVERHEAD_WARMUP`` requests, ``requests`` random prompts one at a time at
    ``OVERHEAD_RATE`` on each of ``instances`` fresh servers (``served_medians``),
    against the simulator's median TTFT and TPOT for the same flags on
    ``profile`` (which must not hold a serving overhead yet). Returns the
    profile's ``serving`` object."""
    flags = overhead_flags(model, requests)
    real = served_medians(["--model", model, *(["-c", config] if config else [])], flags,
                          overhead_flags(model, OVERHEAD_WARMUP, "inf", seed=1), instances)
    sim = simulated(profile, 0, 0, None, config, flags)
    real_ms, sim_ms = real["median_ttft_ms"], sim["median_ttft_ms"]
    real_tpot, sim_tpot = real["median_tpot_ms"], sim["median_tpot_ms"]
    return {"first_token_s": round(max(0.0, real_ms - sim_ms) / 1e3, 6),
            "token_s": round(max(0.0, real_tpot - sim_tpot) / 1e3, 6), "requests": requests,
            "instances": instances, "input_len": OVERHEAD_INPUT_LEN, "output_len": OVERHEAD_OUTPUT_LEN,
            "measured_median_ttft_ms": round(real_ms, 3), "simulated_median_ttft_ms": round(sim_ms, 3),
            "measured_median_tpot_ms": round(real_tpot, 3), "simulated_median_tpot_ms": round(sim_tpot, 3),
            "instances_ttft_ms": real["instances_ttft_ms"], "instances_tpot_ms": real["instances_tpot_ms"]}
