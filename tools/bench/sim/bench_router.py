"""The coordinator's prompt-tree routing decision at 10, 100 and 1,000 nodes:
this tree's code beside another commit's (``--base``), alternated rounds.

Each round replays one seeded workload through a ``PromptTreeRouter`` over
``N`` registered nodes: prompts share ``--prefixes`` system prompts, every
pick's node caches the prompt's blocks (its cache events, through the global
prompt tree), about ``--in-flight`` requests stay in flight per node (the
oldest end as new ones are routed) and the router's clock advances by
``--gap`` seconds per request. Only ``pick`` is timed. Both sides must make
the same decisions (a digest of the chosen names is compared): the
rewrite's contract is speed, not new choices.

    .venv/bin/python -m tools.bench.sim.bench_router [--base COMMIT] [--nodes 10,100,1000] \\
        [--requests 2000] [--rounds 3]

The base commit's ``kvd/`` and ``engine/`` are extracted with ``git archive``
into a temporary directory and run in a subprocess with that code first on
the path. Writes results/sim/bench_router.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def replay(nodes: int, requests: int, prefixes: int, in_flight: int, gap: float, seed: int) -> dict:
    """One workload through the router of the code first on ``sys.path``: µs per pick, and a digest."""
    from engine.memory.radix import ROOT_HASH, block_hash
    from kvd import protocol
    from kvd.coordinator.cache_router import PromptTreeRouter
    from kvd.coordinator.membership import Membership
    from kvd.coordinator.prompt_tree import STORED, Op, PromptTrees

    bs = 16
    m = Membership(deadline=5.0)
    for i in range(nodes):
        m.register(protocol.Hello(id="h", node=f"n{i}", address=f"inproc://n{i}", incarnation="x",
                                  block_size=bs, blocks_per_tier={"device": 4096}), now=0.0)
    trees = PromptTrees(bs)
    router = PromptTreeRouter(trees)
    clock = [0.0]
    router.clock = lambda: clock[0]
    rng = random.Random(seed)
    heads = [[rng.randrange(100, 30000) for _ in range(4 * bs)] for _ in range(prefixes)]
    flying: deque = deque()
    infos = list(m.nodes.values())
    digest = hashlib.blake2b(digest_size=8)
    seconds = 0.0
    for r in range(requests):
        prompt = heads[rng.randrange(prefixes)] + [rng.randrange(100, 30000) for _ in range(2 * bs + 3)]
        rid = f"r{r}"
        t0 = time.perf_counter()
        node = router.pick(infos, prompt, rid)
        seconds += time.perf_counter() - t0
        digest.update(node.name.encode())
        node.in_flight.add(rid)
        flying.append((node, rid))
        while len(flying) > in_flight * nodes:
            done, drid = flying.popleft()
            done.in_flight.discard(drid)
        tree, held, ops, parent = trees.for_node(node.name), None, [], ROOT_HASH
        held = tree.held(node.name) if tree.num_blocks(node.name) < 64 else {}
        for p in range(0, len(prompt) - bs, bs):
            blk = tuple(prompt[p:p + bs])
            h = block_hash(parent, blk)
            if h not in held and tree.num_blocks(node.name) < 64:
                ops.append(Op(STORED, parent, h, blk))
                held[h] = None
            parent = h
        try:
            tree.apply(node.name, ops)
        except ValueError:
            pass                                           # a node's holdings are capped at 64 blocks
        clock[0] += gap
    return {"us_per_pick": 1e6 * seconds / requests, "digest": digest.hexdigest()}


def extract(commit: str, into: str) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "kvd", "engine"],
                             check=True, capture_output=True).stdout
    path = Path(into) / "base.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")


def run_side(code: Path, args: argparse.Namespace, nodes: int, seed: int) -> dict:
    """``replay`` in a subprocess with ``code`` first on the path."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--replay", str(nodes), "--code", str(code),
           "--requests", str(args.requests), "--prefixes", str(args.prefixes),
           "--in-flight", str(args.in_flight), "--gap", str(args.gap), "--seed", str(seed)]
    env = dict(os.environ, PYTHONPATH=str(code))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="", help="the commit to compare against (default: none)")
    ap.add_argument("--nodes", default="10,100,1000")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--prefixes", type=int, default=50)
    ap.add_argument("--in-flight", type=float, default=4.0, help="requests in flight per node")
    ap.add_argument("--gap", type=float, default=0.001, help="seconds of router clock per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--code", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "results/sim/bench_router.json"))
    args = ap.parse_args()
    if args.replay:
        sys.path.insert(0, args.code)
        print(json.dumps(replay(args.replay, args.requests, args.prefixes, args.in_flight, args.gap, args.seed)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            extract(args.base, tmp)
        for nodes in (int(n) for n in args.nodes.split(",")):
            times: dict[str, list[float]] = {"after": [], "before": []}
            digests: dict[str, set[str]] = {"after": set(), "before": set()}
            for r in range(args.rounds):
                sides = [("after", ROOT), ("before", Path(tmp))] if args.base else [("after", ROOT)]
                for side, code in (sides if r % 2 == 0 else sides[::-1]):
                    res = run_side(code, args, nodes, args.seed)
                    times[side].append(res["us_per_pick"])
                    digests[side].add(res["digest"])
            row = {"nodes": nodes, "after_us": round(statistics.median(times["after"]), 1),
                   "after_rounds": [round(t, 1) for t in times["after"]]}
            if args.base:
                row.update(before_us=round(statistics.median(times["before"]), 1),
                           before_rounds=[round(t, 1) for t in times["before"]],
                           same_decisions=digests["after"] == digests["before"] and len(digests["after"]) == 1)
                row["speedup"] = round(row["before_us"] / row["after_us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    from tools.loadgen.report import machine_info
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "base": args.base, "args": vars(args), "rows": rows},
                              indent=1))
    print("| nodes | before µs/decision | after µs/decision | speedup | same decisions |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r.get('before_us', '')} | {r['after_us']} | {r.get('speedup', '')} | "
              f"{r.get('same_decisions', '')} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
