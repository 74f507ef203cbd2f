"""What a handoff costs a stream (docs/benchmarks.md; docs/cluster.md, "Pairs and roles").

One pair (n1 on core 0, n2 on core 1, ``[cluster].pairs``, the pair
scheduler off), a real coordinator and node processes
(``bench_recovery.cluster``). Each round streams the same greedy
completion twice, in alternating order: once undisturbed, once with a
handoff (admin ``handoff``) forced every ``--every`` tokens the client has
read, retried while the partner's copy is incomplete. Measured per round:

- the gap at each handoff: the longest inter-token gap among the
  ``--window`` tokens after the handoff was asked for, over the stream's
  median ITL (the target: at most 2x, AcceLLM's "at most one extra step");
- TPOT with handoffs over TPOT without (the same prompt, the same cluster);
- whether the text with handoffs is the undisturbed text (it must be).

    .venv/bin/python -m tools.bench.cluster.bench_handoff [--model smollm2] [--rounds 3] [--max-tokens 256]

Prints a table and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kvd.ctl import AdminUnavailable  # noqa: E402
from kvd.ctl import request as admin_request  # noqa: E402
from tools._twoproc import write_results  # noqa: E402
from tools.bench.cluster.bench_recovery import cluster, stream  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402


class Forcer:
    """Asks for a handoff of the one request in flight every ``every`` tokens read."""

    def __init__(self, sock: str, every: int) -> None:
        self.sock, self.every = sock, every
        self.read = 0                       # tokens the client has read (set by the stream's callback)
        self.at: list[int] = []             # tokens read when each handoff was done
        self.refused = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        rid, last = None, 0
        while not self.done.is_set():
            time.sleep(0.002)
            if rid is None:
                try:
                    rid = next(iter(admin_request(self.sock, {"cmd": "requests"})["requests"]), None)
                except (AdminUnavailable, OSError, ValueError, KeyError):
                    pass
                continue
            read = self.read
            if read < last + self.every:
                continue
            reply = admin_request(self.sock, {"cmd": "handoff", "request": rid})
            if reply.get("ok"):
                self.at.append(read)
                last = read
            else:
                self.refused += 1


@contextlib.contextmanager
def pair_cluster(args: argparse.Namespace, tmp: str, rng: random.Random):
    """One pair, its scheduler off (only what the benchmark asks for moves), warmed
    by one short stream; yields (base URL, admin socket)."""
    config = os.path.join(tmp, "pairs.toml")
    Path(config).write_text("[cluster]\npairs = true\npair_scheduler = false\n[nodes.n1]\n[nodes.n2]\n")
    with cluster("pair", args, tmp, ["-c", config]) as (base, sock):
        stream(base, [rng.randrange(1, 40000) for _ in range(32)], 4)
        yield base, sock


def one(base: str, sock: str, ids: list[int], args: argparse.Namespace, force: bool) -> dict:
    forcer = Forcer(sock, args.every) if force else None
    on_token = (lambda n: setattr(forcer, "read", n)) if forcer else None
    times, text, error = stream(base, ids, args.max_tokens, on_token)
    if forcer:
        forcer.done.set()
        forcer.thread.join(5)
    itl = [b - a for a, b in zip(times, times[1:])]
    median = statistics.median(itl)
    gaps = [max(itl[h - 1:h - 1 + args.window]) / median for h in (forcer.at if forcer else ()) if h - 1 < len(itl)]
    return {"text": text, "error": error, "tpot_s": (times[-1] - times[0]) / (len(times) - 1),
            "itl_median_s": median, "handoffs": len(forcer.at) if forcer else 0,
            "refused": forcer.refused if forcer else 0, "gap_ratios": gaps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--every", type=int, default=8, help="tokens between two forced handoffs")
    ap.add_argument("--window", type=int, default=3, help="tokens after a handoff whose gaps count")
    ap.add_argument("--deadline", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.lengths = [args.prompt_len]              # bench_recovery.cluster sizes the nodes by them
    rng = random.Random(3)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        with pair_cluster(args, tmp, rng) as (base, sock):
            for rnd in range(args.rounds):
                ids = [rng.randrange(1, 40000) for _ in range(args.prompt_len)]
                res = {}
                for force in ((True, False) if rnd % 2 == 0 else (False, True)):     # alternate the order
                    res[force] = one(base, sock, ids, args, force)
                on, off = res[True], res[False]
                row = {"round": rnd, "handoffs": on["handoffs"], "refused": on["refused"],
                       "exact": on["text"] == off["text"] and on["error"] is None and off["error"] is None,
                       "gap_ratio_median": statistics.median(on["gap_ratios"]) if on["gap_ratios"] else None,
                       "gap_ratio_max": max(on["gap_ratios"], default=None), "gap_ratios": on["gap_ratios"],
                       "itl_median_s": off["itl_median_s"], "tpot_ratio": on["tpot_s"] / off["tpot_s"],
                       "loadavg": os.getloadavg()[0]}
                rows.append(row)
                print(f"round {rnd}: {row['handoffs']} handoffs ({row['refused']} refused tries), exact "
                      f"{row['exact']}, gap at a handoff / median ITL {row['gap_ratio_median']:.2f}x median, "
                      f"{row['gap_ratio_max']:.2f}x max (ITL {row['itl_median_s'] * 1e3:.1f} ms), TPOT "
                      f"with/without {row['tpot_ratio']:.3f}x", flush=True)
    ratios = [g for r in rows for g in r["gap_ratios"]]
    summary = {"summary": True, "handoffs": len(ratios), "exact_rounds": sum(r["exact"] for r in rows),
               "gap_ratio_median": statistics.median(ratios), "gap_ratio_p99": sorted(ratios)[int(0.99 * (len(ratios) - 1))],
               "gap_ratio_max": max(ratios), "within_2x": sum(g <= 2 for g in ratios) / len(ratios),
               "tpot_ratio_median": statistics.median(r["tpot_ratio"] for r in rows)}
    print(f"\n{summary['handoffs']} handoffs: gap / median ITL {summary['gap_ratio_median']:.2f}x median, "
          f"{summary['gap_ratio_p99']:.2f}x p99, {summary['within_2x']:.0%} within 2x; TPOT with/without "
          f"{summary['tpot_ratio_median']:.3f}x; exact {summary['exact_rounds']}/{len(rows)} rounds")
    print(f"CPU: {machine_info().get('cpu_model', '?')}, model {args.model}, one core per node, shared host")
    write_results(args.out or str(REPO / "results" / "bench_handoff.json"), rows + [summary])


if __name__ == "__main__":
    main()
