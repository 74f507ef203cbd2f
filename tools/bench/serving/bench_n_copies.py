"""``n`` choices against ``n`` separate requests, over HTTP, side by side.

Two ``kvd serve`` processes with the bundled model: one with the prefix
cache (the default), one with ``--no-prefix-caching``. Each round sends, to
the first, one completion with ``n = --n`` over a fresh ``--prompt-len``-token
prompt, and to the second ``--n`` concurrent requests (n = 1) over another
fresh prompt of that length (seeded sampling, ``--tokens`` tokens each,
``ignore_eos``); the servers take turns, so only one computes at a time. A
round's time is its wall time, from the first byte sent to the last answer;
the ratio is n-copies / separate, per round, and its median. The prompt
tokens each side computed come from ``/metrics`` (``kvd_prompt_tokens_total``
minus ``kvd_prefix_hit_tokens_total``): n copies compute the prompt once.

    .venv/bin/python -m tools.bench.serving.bench_n_copies [--n 8] [--prompt-len 1000] [--tokens 32]
        [--rounds 3] [--serve ARGS]

Prints the table and appends JSON to results/bench_n_copies.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tools._twoproc import free_port, stop_processes, wait_healthy
from tools.bench.engine.bench_engine import append_result, machine

RESULTS = Path("results/bench_n_copies.json")


def serve(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    why = wait_healthy(url, proc, 300.0)
    if why:
        stop_processes([proc])
        raise SystemExit(f"bench_n_copies: kvd serve {why}")
    return proc, url


def computed_prompt_tokens(url: str) -> float:
    """Prompt tokens the server's engine computed so far (admitted minus cache hits)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvd_prompt_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvd_prefix_hit_tokens_total"):
            total -= float(line.rsplit(" ", 1)[1])
    return total


def complete(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, timeout=1800)
    r.raise_for_status()
    return r.json()


def timed_round(url: str, bodies: list[dict]) -> tuple[float, float]:
    """(wall seconds to answer ``bodies``, sent at once; prompt tokens computed for them)."""
    before = computed_prompt_tokens(url)
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: complete(url, b), bodies))
    seconds = time.perf_counter() - t
    assert all(len(a["choices"]) == b.get("n", 1) for a, b in zip(answers, bodies))
    return seconds, computed_prompt_tokens(url) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", default="", help="more kvd serve arguments, one string")
    args = ap.parse_args()
    extra = shlex.split(args.serve)
    rng = random.Random(0)
    info = machine()
    procs = []
    try:
        cached_proc, cached = serve(extra)
        procs.append(cached_proc)
        plain_proc, plain = serve([*extra, "--no-prefix-caching"])
        procs.append(plain_proc)

        def body(n: int, seed: int) -> dict:
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
            return {"model": "x", "prompt": prompt, "max_tokens": args.tokens, "temperature": 1.0, "seed": seed,
                    "ignore_eos": True, "n": n}
        model = httpx.get(cached + "/v1/models").json()["data"][0]["id"]
        timed_round(cached, [body(args.n, 0) | {"model": model}])                          # warm-up
        timed_round(plain, [body(1, 0) | {"model": model}])
        rows = []
        for r in range(args.rounds):
            copies, copies_tokens = timed_round(cached, [body(args.n, r) | {"model": model}])
            separate, separate_tokens = timed_round(plain, [body(1, r + i) | {"model": model} for i in range(args.n)])
            rows.append({"copies_s": copies, "separate_s": separate, "ratio": copies / separate,
                         "copies_prompt_tokens_computed": copies_tokens,
                         "separate_prompt_tokens_computed": separate_tokens})
            print(f"round {r}: n={args.n} {copies:.2f} s ({copies_tokens:.0f} prompt tokens computed), "
                  f"{args.n} requests without the cache {separate:.2f} s ({separate_tokens:.0f}), "
                  f"ratio {copies / separate:.3f}")
        ratio = statistics.median(row["ratio"] for row in rows)
        print(f"# {info['cpu']}: n={args.n} over {args.prompt_len} tokens, {args.tokens} out: "
              f"median ratio {ratio:.3f}")
        append_result(RESULTS, {"bench": "n_copies", "machine": info, "args": vars(args), "rows": rows,
                                "ratio_median": ratio, "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    finally:
        stop_processes(procs)


if __name__ == "__main__":
    main()
