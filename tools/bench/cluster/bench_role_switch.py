"""What a run-time role switch costs (docs/benchmarks.md; docs/cluster.md, "Pairs and roles").

One pair (n1 on core 0, n2 on core 1, ``[cluster].pairs``, the pair
scheduler off so that only the switch moves anything), a real coordinator
and node processes (``bench_recovery.cluster``). Each round streams
``--streams`` greedy completions at once twice, in alternating order: once
undisturbed, once with ``kvctl role n1 prefill`` (admin ``set-role``) sent
when every stream has read ``--switch-after`` tokens, and ``n1`` switched
back to ``mixed`` once the streams end. Measured per switch:

- the effect: from sending ``set-role`` to its answer. The node answers
  once the step boundary it held its decodes at has passed (its next step
  decodes none of those it can hand off: ``held``), so this is the switch
  taking effect on the node; routing follows the new role from then on.
  Against the target (within one step, 50 ms here) it is read over the
  median ITL of the undisturbed streams;
- the move: from sending it until no stream is on ``n1`` any more (the
  coordinator's ``requests``, polled every 2 ms): every decode resumed on
  the partner and the coordinator told;
- each moved stream's gap: its longest inter-token gap among the
  ``--window`` tokens after the switch, over its median ITL;
- nothing drained, failed or duplicated: every stream ends without an error
  and its text is the undisturbed one, token for token.

    .venv/bin/python -m tools.bench.cluster.bench_role_switch [--rounds 10] [--streams 4]

Prints a table and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

from kvd.ctl import request as admin_request  # noqa: E402
from tools._twoproc import write_results  # noqa: E402
from tools.bench.cluster.bench_handoff import pair_cluster  # noqa: E402
from tools.bench.cluster.bench_recovery import stream  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402


class Switcher:
    """Sends ``set-role n1 prefill`` once every stream has read ``after`` tokens,
    then polls until no request is on n1."""

    def __init__(self, sock: str, streams: int, after: int) -> None:
        self.sock, self.after = sock, after
        self.read = [0] * streams
        self.on_n1 = 0                  # streams on n1 when the switch was sent
        self.held = 0                   # of them, those n1 held at its switch
        self.sent = self.replied = self.moved = None    # perf_counter times
        self.error = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        while min(self.read) < self.after:
            if time.monotonic() > deadline:
                self.error = "the streams never reached the switch"
                return
            time.sleep(0.001)
        self.on_n1 = sum(r["node"] == "n1" for r in admin_request(self.sock, {"cmd": "requests"})["requests"].values())
        self.sent = time.perf_counter()
        reply = admin_request(self.sock, {"cmd": "set-role", "node": "n1", "role": "prefill"})
        self.replied = time.perf_counter()
        if not reply.get("ok"):
            self.error = f"set-role refused: {reply.get('error')}"
            return
        self.held = reply.get("held", 0)
        while time.monotonic() < deadline:
            on = admin_request(self.sock, {"cmd": "requests"})["requests"].values()
            if not any(r["node"] == "n1" for r in on):
                self.moved = time.perf_counter()
                return
            time.sleep(0.002)
        self.error = "streams stayed on n1"


def run(base: str, sock: str, prompts: list[list[int]], args: argparse.Namespace, switch: bool) -> dict:
    switcher = Switcher(sock, len(prompts), args.switch_after) if switch else None

    def one(i: int):
        on_token = (lambda n: switcher.read.__setitem__(i, n)) if switcher else None
        return stream(base, prompts[i], args.max_tokens, on_token)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts))))
    if switcher:
        switcher.thread.join(10)
        admin_request(sock, {"cmd": "set-role", "node": "n1", "role": "mixed"})
    out = {"texts": [r[1] for r in results], "errors": [r[2] for r in results]}
    itls = [[b - a for a, b in zip(t, t[1:])] for t, _, _ in results]
    out["itl_median_s"] = statistics.median(x for itl in itls for x in itl)
    if switcher:
        gaps = []
        for (times, _, _), itl in zip(results, itls):
            after = [j for j, t in enumerate(times) if t > switcher.sent]
            if after and after[0] >= 1:
                j = after[0] - 1                      # the gap that spans the switch, then the window
                gaps.append(max(itl[j:j + args.window]) / statistics.median(itl))
        out.update(on_n1=switcher.on_n1, held=switcher.held, error=switcher.error, gap_ratios=gaps,
                   effect_s=(switcher.replied - switcher.sent) if switcher.replied else None,
                   moved_s=(switcher.moved - switcher.sent) if switcher.moved else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--switch-after", type=int, default=32, help="tokens every stream has read at the switch")
    ap.add_argument("--window", type=int, default=3, help="tokens after the switch whose gaps count")
    ap.add_argument("--deadline", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.lengths = [args.prompt_len]              # bench_recovery.cluster sizes the nodes by them
    rng = random.Random(5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        with pair_cluster(args, tmp, rng) as (base, sock):
            for rnd in range(args.rounds):
                prompts = [[rng.randrange(1, 40000) for _ in range(args.prompt_len)] for _ in range(args.streams)]
                res = {}
                for switch in ((True, False) if rnd % 2 == 0 else (False, True)):     # alternate the order
                    res[switch] = run(base, sock, prompts, args, switch)
                on, off = res[True], res[False]
                row = {"round": rnd, "on_n1": on["on_n1"], "held": on["held"], "error": on["error"],
                       "failed": sum(e is not None for e in on["errors"] + off["errors"]),
                       "exact": on["texts"] == off["texts"], "effect_s": on["effect_s"], "moved_s": on["moved_s"],
                       "itl_median_s": off["itl_median_s"],
                       "effect_steps": on["effect_s"] / off["itl_median_s"] if on["effect_s"] else None,
                       "gap_ratios": on["gap_ratios"], "loadavg": os.getloadavg()[0]}
                rows.append(row)
                eff = f"{row['effect_s'] * 1e3:.1f} ms ({row['effect_steps']:.2f} steps)" if row["effect_s"] else "n/a"
                print(f"round {rnd}: {row['on_n1']} of {args.streams} streams on n1, {row['held']} held, in effect "
                      f"after {eff}, all moved after {(row['moved_s'] or 0) * 1e3:.1f} ms, ITL "
                      f"{row['itl_median_s'] * 1e3:.1f} ms, gaps {[round(g, 2) for g in row['gap_ratios']]}, "
                      f"exact {row['exact']}, failed {row['failed']} {row['error']}", flush=True)
    effects = [r["effect_s"] for r in rows if r["effect_s"] is not None and r["on_n1"]]
    steps = [r["effect_steps"] for r in rows if r["effect_steps"] is not None and r["on_n1"]]
    moves = [r["moved_s"] for r in rows if r["moved_s"] is not None and r["on_n1"]]
    gaps = [g for r in rows for g in r["gap_ratios"]]
    summary = {"summary": True, "rounds": len(rows), "switches_moving_streams": len(effects),
               "exact_rounds": sum(r["exact"] for r in rows), "failed": sum(r["failed"] for r in rows),
               "errors": [r["error"] for r in rows if r["error"]],
               "held": sum(r["held"] for r in rows), "on_n1": sum(r["on_n1"] for r in rows),
               "effect_ms_median": 1e3 * statistics.median(effects) if effects else None,
               "effect_ms_max": 1e3 * max(effects) if effects else None,
               "effect_steps_median": statistics.median(steps) if steps else None,
               "effect_steps_max": max(steps) if steps else None,
               "moved_ms_median": 1e3 * statistics.median(moves) if moves else None,
               "gap_ratio_median": statistics.median(gaps) if gaps else None,
               "gap_ratio_max": max(gaps) if gaps else None}
    print(f"\n{summary['switches_moving_streams']} switches moving streams ({summary['held']} of "
          f"{summary['on_n1']} streams on n1 held at the switch): in effect after {summary['effect_ms_median']:.1f} "
          f"ms median ({summary['effect_steps_median']:.2f} steps), {summary['effect_ms_max']:.1f} ms max "
          f"({summary['effect_steps_max']:.2f} steps); every stream off n1 after {summary['moved_ms_median']:.1f} "
          f"ms median; gap / median ITL "
          f"{summary['gap_ratio_median']:.2f}x median, {summary['gap_ratio_max']:.2f}x max; exact "
          f"{summary['exact_rounds']}/{len(rows)} rounds, {summary['failed']} streams failed")
    print(f"CPU: {machine_info().get('cpu_model', '?')}, model {args.model}, one core per node")
    write_results(args.out or str(REPO / "results" / "bench_role_switch.json"), rows + [summary])


if __name__ == "__main__":
    main()
