"""Borrowed KV under load (docs/benchmarks.md, "Borrowed KV"; Infinite-LLM §5's
end-to-end throughput): a trace mixing a few long requests with many short chats on
two nodes, with borrowing on against off.

``kvd serve --nodes 2 --split-cpus cores`` (a core per node, one torch thread each),
float32 (attention over borrowed blocks runs on the float32 paged kernel), no host
tier, each node's device pool holding ``--node-tokens`` tokens. The trace is
kvd-loadgen's (tools/loadgen: its random dataset, its Poisson arrivals, its request
records and metrics): ``--long`` requests of ``--long-factor`` times one node's
tokens (prompt and answer), placed evenly among ``--short`` chats, the same prompts
and arrival times (``--seed``) in every run. Each round runs both, in alternating
order:

- **borrow**: every node lends (``--lend-kv-blocks``) and borrows: a long request
  keeps its first chunks on the node serving it and borrows the rest from the other
  (docs/cluster.md, "Requests on borrowed blocks");
- **off**: no lending or borrowing; a long request cannot fit one node and is refused.

With the prefix cache on (the default), finished chats' cached blocks fill both
pools, and a creditor lends them by evicting them (engine/memory/rmanager.py);
``--no-prefix-caching`` runs both without it (random prompts share no prefix).

Reported per run: output and request throughput, TTFT p50 / p99 (all requests, and
the short ones alone), completed and failed counts (long and short, with the
reasons), preemptions, and every request's timeline (its place in the trace, long or
not, start, TTFT, end-to-end latency, error), in seconds from the run's start. Every completed long request's text is checked against a
single node with blocks for the whole sequence (``kvd serve``, greedy, the same
flags otherwise), run once before the rounds.

    .venv/bin/python -m tools.bench.cluster.bench_borrow_throughput [--model smollm2] [--rounds 2]
        [--node-tokens 1024] [--long-factor 1.6] [--long 3] [--short 36] [--rate 0.5] [--no-prefix-caching]

Prints a table and writes JSON to results/bench_borrow_throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tools._twoproc import stop_processes, write_results  # noqa: E402
from tools.bench.serving.bench_n_copies import serve  # noqa: E402
from tools.loadgen import datasets, metrics, runner  # noqa: E402
from tools.loadgen.cli import load_tokenizer_for  # noqa: E402
from tools.loadgen.datasets import Conversation, DatasetOptions  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402

BS, CHUNK = 16, 128
MODES = ("borrow", "off")
PERCENTILES = (50, 99)


def long_prompt_len(args: argparse.Namespace) -> int:
    """Prompt tokens of a long request: its prompt and answer ``--long-factor`` x one node's."""
    return int(args.long_factor * args.node_tokens) - args.long_output


def trace(args: argparse.Namespace, tokenizer) -> list[Conversation]:
    """The long requests evenly among the short chats (the first long one after a few
    shorts, so that both nodes are busy when it comes); the same for every run."""
    longs = datasets.build(DatasetOptions(name="random", num_prompts=args.long, seed=args.seed,
                                          random_input_len=long_prompt_len(args),
                                          random_output_len=args.long_output), tokenizer)
    shorts = datasets.build(DatasetOptions(name="random", num_prompts=args.short, seed=args.seed + 1,
                                           random_input_len=args.short_input, random_output_len=args.short_output,
                                           random_range_ratio=0.5), tokenizer)
    out, every = list(shorts), max(1, len(shorts) // len(longs))
    for i, conv in enumerate(longs):
        out.insert(min(len(out), every // 2 + i * (every + 1)), conv)
    return out


def flags(args: argparse.Namespace, mode: str, tokens: int) -> list[str]:
    """``kvd serve`` flags: the reference (``one``) node holds ``tokens``; a cluster's
    nodes ``--node-tokens`` each, lending and borrowing or not."""
    common = ["--model", args.model, "--dtype", "float32", "--num-threads", "1", "--host-kv-blocks", "0",
              "--max-model-len", str(args.max_model_len), "--kv-blocks", str(-(-tokens // BS)),
              *(["--no-prefix-caching"] if args.no_prefix_caching else [])]
    if mode == "one":
        return common
    blocks = args.node_tokens // BS
    caps = (args.lend, blocks) if mode == "borrow" else (0, 0)
    return [*common, "--nodes", "2", "--split-cpus", "cores", "--lend-kv-blocks", str(caps[0]),
            "--borrow-kv-blocks", str(caps[1])]


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """The server's /metrics samples, keyed by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def wait_ready(url: str, mode: str, lend: int, timeout: float = 300.0) -> None:
    """Until both nodes are routable and, borrowing, both caps are in the ledger."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = scrape(url)
        routable = s.get(("kvd_cluster_nodes", frozenset({("state", "routable")})), 0)
        lendable = [v for (n, labels), v in s.items() if n == "kvd_ledger_blocks" and ("kind", "lendable") in labels]
        if routable == 2 and (mode != "borrow" or (len(lendable) == 2 and min(lendable) >= lend)):
            return
        time.sleep(0.5)
    raise SystemExit(f"bench_borrow_throughput: the {mode} cluster was not ready within {timeout:.0f} s")


def send(url: str, convs: list[Conversation], rate: float, seed: int, concurrency: int | None = None
         ) -> runner.RunResult:
    """kvd-loadgen's run of ``convs`` against ``url``: greedy, ``ignore_eos``, Poisson at ``rate``."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    cfg = runner.RunConfig(url=url + "/v1/completions", model=model, chat=False, request_rate=rate, seed=seed,
                           ignore_eos=True, temperature=0.0, request_timeout_s=900.0, progress=False,
                           max_concurrency=concurrency)
    return asyncio.run(runner.run(convs, cfg))


def reference_texts(args: argparse.Namespace, longs: list[Conversation]) -> list[str]:
    """Each long prompt's greedy text on one node with blocks for the whole sequence."""
    proc, url = serve(flags(args, "one", args.max_model_len))
    try:
        result = send(url, longs, float("inf"), args.seed, concurrency=1)
    finally:
        stop_processes([proc])
    bad = [r.error for r in result.records if not r.success]
    if bad:
        raise SystemExit(f"bench_borrow_throughput: the single node failed a long request: {bad[0]}")
    return [r.text for r in result.records]


def one_run(args: argparse.Namespace, mode: str, convs: list[Conversation], want: dict[int, str],
            warm: list[Conversation]) -> dict:
    """One run of the trace ``convs`` on a fresh cluster (``mode``), after ``warm``; ``want``:
    the long requests' texts by their place in the trace."""
    proc, url = serve(flags(args, mode, args.node_tokens))
    try:
        wait_ready(url, mode, args.lend)
        send(url, warm, float("inf"), args.seed)           # a fresh server's first steps pay one-off costs
        before = scrape(url)
        result = send(url, convs, args.rate, args.seed)
        time.sleep(2.0)                                    # the nodes' last counts reach the coordinator by heartbeat
        after = scrape(url)
    finally:
        stop_processes([proc])
    records = result.records                               # in trace order (the runner's index)
    assert [r.prompt_len for r in records] == [c.turns[0].prompt_len for c in convs]
    is_long = [i in want for i in range(len(records))]
    longs = [r for r, lg in zip(records, is_long) if lg]
    shorts = [r for r, lg in zip(records, is_long) if not lg]
    m = metrics.compute_metrics(records, result.duration_s, PERCENTILES)
    short_m = metrics.compute_metrics(shorts, result.duration_s, PERCENTILES)
    wrong = [r.index for r in longs if r.success and r.text != want[r.index]]
    return {
        "mode": mode, "duration_s": result.duration_s,
        "output_throughput": m["output_throughput"], "request_throughput": m["request_throughput"],
        "total_token_throughput": m["total_token_throughput"],
        "p50_ttft_ms": m["p50_ttft_ms"], "p99_ttft_ms": m["p99_ttft_ms"],
        "short_p50_ttft_ms": short_m["p50_ttft_ms"], "short_p99_ttft_ms": short_m["p99_ttft_ms"],
        "short_median_tpot_ms": short_m["median_tpot_ms"],
        "completed": m["completed"], "failed": m["failed"],
        "long_completed": sum(r.success for r in longs), "long_failed": sum(not r.success for r in longs),
        "short_failed": sum(not r.success for r in shorts),
        "long_ttft_s": [r.ttft for r in longs if r.success],
        "timeline": [{"index": r.index, "long": lg, "start": round(r.start, 3),
                      "ttft": None if r.ttft is None else round(r.ttft, 3), "e2el": round(r.e2el, 3),
                      "error": r.error} for r, lg in zip(records, is_long)],
        "errors": metrics.error_counts(records),
        "long_text_checked": sum(r.success for r in longs), "long_text_wrong": wrong,
        "preemptions": total(after, "kvd_preemptions_total") - total(before, "kvd_preemptions_total"),
        "ledger_queries": total(after, "kvd_ledger_queries_total") - total(before, "kvd_ledger_queries_total"),
        "metrics": m,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--node-tokens", type=int, default=1024, help="tokens one node's device pool holds")
    p.add_argument("--long-factor", type=float, default=1.6, help="a long request's tokens over one node's")
    p.add_argument("--long", type=int, default=3, help="long requests in the trace")
    p.add_argument("--long-output", type=int, default=32)
    p.add_argument("--short", type=int, default=36, help="short chats in the trace")
    p.add_argument("--short-input", type=int, default=96)
    p.add_argument("--short-output", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.5, help="requests a second (Poisson)")
    p.add_argument("--lend", type=int, default=0, help="blocks each node lends (default: all but one chunk's)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="nodes without a prefix cache")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON path (default results/bench_borrow_throughput.json)")
    args = p.parse_args(argv)
    blocks = args.node_tokens // BS
    if args.node_tokens % CHUNK or args.node_tokens < 2 * CHUNK:
        p.error(f"--node-tokens must be a multiple of {CHUNK}, at least {2 * CHUNK}")
    if not 1.0 < args.long_factor < 2.0:
        p.error("--long-factor must be in (1, 2): past one node, within two")
    if min(args.long, args.short, args.long_output, args.short_input, args.short_output, args.rounds) < 1:
        p.error("--long, --short, --long-output, --short-input, --short-output and --rounds must be >= 1")
    if not args.rate > 0:
        p.error("--rate must be > 0")
    args.lend = args.lend or blocks - CHUNK // BS
    if not 0 < args.lend <= blocks:
        p.error(f"--lend must be in [1, {blocks}]")
    args.max_model_len = int(args.long_factor * args.node_tokens) + CHUNK
    if args.short_input * 1.5 + args.short_output * 1.5 >= args.node_tokens:
        p.error("a short chat must fit one node")

    tokenizer, _ = load_tokenizer_for(None, args.model)
    convs = trace(args, tokenizer)
    long_at = [i for i, c in enumerate(convs) if c.turns[0].prompt_len > args.node_tokens // 2]
    print(f"trace: {len(long_at)} long requests of {long_prompt_len(args)} + {args.long_output} tokens "
          f"({args.long_factor:g}x one node's {args.node_tokens}) at {long_at} among {args.short} short chats, "
          f"{args.rate:g} req/s", flush=True)
    texts = reference_texts(args, [convs[i] for i in long_at])
    want = dict(zip(long_at, texts))
    warm = datasets.build(DatasetOptions(name="random", num_prompts=2, seed=args.seed + 2, random_input_len=32,
                                         random_output_len=4), tokenizer)       # prompts of their own: no cache hit
    rows = []
    for rnd in range(args.rounds):
        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):      # alternate which runs first
            row = one_run(args, mode, convs, want, warm) | {"round": rnd}
            rows.append(row)
            print(f"round {rnd} {mode:6s}: {row['output_throughput']:6.1f} out tok/s "
                  f"({row['total_token_throughput']:6.1f} with prompts), "
                  f"{row['request_throughput']:.3f} req/s, TTFT p50 {row['p50_ttft_ms']:.0f} / p99 "
                  f"{row['p99_ttft_ms']:.0f} ms, long {row['long_completed']} done / {row['long_failed']} failed, "
                  f"short failed {row['short_failed']}, preemptions {row['preemptions']:.0f}, "
                  f"wrong long texts {row['long_text_wrong']}; errors {row['errors']}", flush=True)
    keys = ("output_throughput", "request_throughput", "total_token_throughput", "p50_ttft_ms", "p99_ttft_ms", "short_p50_ttft_ms",
            "short_p99_ttft_ms", "long_completed", "long_failed", "short_failed", "preemptions")
    summary = {mode: {k + "_median": statistics.median(got) if (got := [r[k] for r in rows
                                                                     if r["mode"] == mode and r[k] is not None]) else None
                      for k in keys} for mode in MODES}
    summary["output_throughput_ratio"] = (summary["borrow"]["output_throughput_median"]
                                          / summary["off"]["output_throughput_median"])
    summary["long_text_same"] = all(not r["long_text_wrong"] for r in rows)
    print(summary)
    write_results(args.out or str(REPO / "results" / "bench_borrow_throughput.json"), rows, summary=summary,
                  args=vars(args), host=machine_info())
    return 0 if summary["long_text_same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
