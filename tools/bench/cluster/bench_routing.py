"""Routing policies side by side: prompt-tree vs session affinity vs least load.

Starts ONE cluster (``kvd serve --nodes 3``, the tiny model unless
``--model``) and, for each dataset (``sessions`` with a shared system prompt,
``prefix-repetition``) and each policy, flushes every node's prefix cache,
switches the policy at run time (``kvctl routing``; a policy may carry
prompt-tree weights, ``prompt-tree[load_weight=2]``), optionally warms the
cluster through that policy with each distinct prompt head once
(``--warmup``), runs the same kvd-loadgen trace (chat endpoint, greedy) and
reports:

- cached share: prompt tokens served from a prefix cache / all prompt tokens
  (the nodes' MemPool hit and miss counters, ``kvctl cache stats``);
- TTFT p50 / p99 (kvd-loadgen's records);
- balance: max over mean requests per node (``kvctl nodes``' routed counts);
- the slowest five TTFTs with their start times (a cold start or a queue);
- against the ideal: the same traces on ONE node whose cache holds
  everything (``--reference-kv-blocks``), whose cached share is what any
  routing policy could reach at best; each row's ``of_ideal`` is its cached
  share over that one.

    .venv/bin/python -m tools.bench.cluster.bench_routing [--num-prompts 24] [--request-rate 4] \
        [--policies prompt-tree,session,least-load] [--reference-kv-blocks 8192] \
        [--cluster routing_load_weight=8.0 ...] [--datasets sessions,prefix-repetition] \
        [--sessions-num-turns 4 --sessions-user-len 64 --sessions-output-len 32 \
         --sessions-shared-prefix-len 512] [--prefix-repetition-num-prefixes 6 \
         --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64]

Prints a markdown table and writes JSON to results/bench_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tools.loadgen import datasets  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402
from tools.loadgen.runner import RunConfig, run  # noqa: E402

POLICIES = ("prompt-tree", "session", "least-load")


def admin(path: str, cmd: str, **args) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    reply = json.loads(buf)
    if not reply.get("ok"):
        raise RuntimeError(f"{cmd}: {reply.get('error')}")
    return reply


def start_cluster(tmp: Path, model: str, nodes: int, kv_blocks: int,
                  extra_cluster: str = "") -> tuple[subprocess.Popen, str, str]:
    """``kvd serve --nodes N`` with an admin socket; (process, base URL, socket)
    once every node registered. ``extra_cluster``: more [cluster] TOML lines."""
    sock = str(tmp / "coordinator.sock")
    (tmp / "kvd.toml").write_text(f'[cluster]\nadmin_socket = "{sock}"\n{extra_cluster}')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "-c", str(tmp / "kvd.toml"),
                             "--nodes", str(nodes), "--model", model, "--dtype", "float32",
                             "--kv-blocks", str(kv_blocks), "--num-threads", "1", "--port", str(port)],
                            cwd=REPO, stdout=open(tmp / "serve.log", "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if len(admin(sock, "nodes")["nodes"]) == nodes:
                return proc, base, sock
        except (OSError, ValueError, RuntimeError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"kvd serve exited:\n{(tmp / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the cluster did not come up")


def counters(sock: str) -> tuple[dict[str, int], int, int]:
    routed = {n["name"]: n["routed"] for n in admin(sock, "nodes")["nodes"]}
    nodes = admin(sock, "cache stats")["nodes"]
    hit = sum(r.get("kv", {}).get("hit_tokens", 0) for r in nodes.values())
    miss = sum(r.get("kv", {}).get("miss_tokens", 0) for r in nodes.values())
    return routed, hit, miss


def policy_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``prompt-tree[recent_weight=0,load_weight=2]`` -> (policy, weight overrides)."""
    name, _, rest = spec.partition("[")
    weights = {}
    for item in filter(None, rest.rstrip("]").split(",")):
        key, _, value = item.partition("=")
        weights[key.strip()] = json.loads(value)
    return name, weights


def warmup_requests(convs) -> list:
    """One single-token request per distinct prompt head (the first 256
    characters: a prefix-repetition prefix, a shared system prompt), each the
    first trace request that has it: what a cluster that has served the
    trace's prefixes for a while has cached, whatever its policy."""
    seen: dict[str, datasets.Conversation] = {}
    for conv in convs:
        head = conv.turns[0].text[:256]
        if head not in seen:
            t = conv.turns[0]
            seen[head] = datasets.Conversation((datasets.Turn(t.text, t.prompt_len, 1),))
    return list(seen.values())


def one_run(base: str, sock: str, model: str, policy: str, convs, args) -> dict:
    admin(sock, "cache flush")
    name, weights = policy_spec(policy)
    admin(sock, "routing", policy=name, **weights)
    cfg = RunConfig(url=base + "/v1/chat/completions", model=model, chat=True,
                    request_rate=args.request_rate, ignore_eos=True, seed=args.seed, progress=False)
    if args.warmup:                  # through the policy under test, then measured from here
        asyncio.run(run(warmup_requests(convs), cfg))
    routed0, hit0, miss0 = counters(sock)
    result = asyncio.run(run(convs, cfg))
    routed1, hit1, miss1 = counters(sock)
    ok = [r for r in result.records if r.success]
    ttft = np.array([r.ttft for r in ok if r.ttft is not None]) * 1000
    per_node = [routed1[n] - routed0.get(n, 0) for n in routed1]
    hit, miss = hit1 - hit0, miss1 - miss0
    return {"policy": policy, "requests": len(result.records), "failed": len(result.records) - len(ok),
            "cached_share": hit / max(1, hit + miss), "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)), "per_node": per_node,
            "max_over_mean": max(per_node) / max(1e-9, float(np.mean(per_node))),
            # the tail, to tell a cold start from a queue: (TTFT, start) of the slowest five
            "slowest_ms_at_s": sorted(([round(r.ttft * 1000), round(r.start, 1)] for r in ok if r.ttft is not None),
                                      reverse=True)[:5],
            "duration_s": result.duration_s}


def print_row(row: dict, ideal: dict[str, float]) -> None:
    ref = ideal.get(row["dataset"])
    row["of_ideal"] = row["cached_share"] / ref if ref else None
    of = f"{row['of_ideal']:.3f}" if ref else "n/a"
    print(f"| {row['dataset']} | {row['policy']} | {row['cached_share']:.3f} | {of} | {row['ttft_p50_ms']:.0f} | "
          f"{row['ttft_p99_ms']:.0f} | {row['max_over_mean']:.2f} {row['per_node']} | {row['failed']} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated, in run order; a policy may override prompt-tree weights: "
                        "'prompt-tree[recent_weight=0,load_weight=2],least-load'")
    p.add_argument("--reference-kv-blocks", type=int, default=8192,
                   help="KV blocks of the one-node ideal run (0: skip it)")
    p.add_argument("--cluster", action="append", default=[], metavar="KEY=VALUE",
                   help="a [cluster] setting (TOML value), e.g. routing_load_weight=8.0; repeatable")
    p.add_argument("--datasets", default="sessions,prefix-repetition", help="comma-separated, in run order")
    p.add_argument("--warmup", action="store_true",
                   help="before each policy's measured run, send each distinct prompt head once through "
                        "that policy (steady state: the cold start of a short trace left out)")
    # the traces' shapes, under kvd-loadgen's flag names (other defaults)
    for flag, default in (("--sessions-num-turns", 4), ("--sessions-user-len", 64), ("--sessions-output-len", 32),
                          ("--sessions-shared-prefix-len", 512), ("--prefix-repetition-num-prefixes", 6),
                          ("--prefix-repetition-prefix-len", 512), ("--prefix-repetition-suffix-len", 64)):
        p.add_argument(flag, type=int, default=default, help=f"as kvd-loadgen's (default {default})")
    args = p.parse_args()
    from engine.model.registry import load_tokenizer, resolve_model
    tokenizer = load_tokenizer(args.model)
    served = resolve_model(args.model).name
    traces = {
        "sessions": datasets.DatasetOptions(name="sessions", num_prompts=args.num_prompts, seed=args.seed,
                                            sessions_num_turns=args.sessions_num_turns,
                                            sessions_user_len=args.sessions_user_len,
                                            sessions_output_len=args.sessions_output_len,
                                            sessions_shared_prefix_len=args.sessions_shared_prefix_len),
        "prefix-repetition": datasets.DatasetOptions(
            name="prefix-repetition", num_prompts=args.num_prompts * 3, seed=args.seed,
            prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
            prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
            prefix_repetition_suffix_len=args.prefix_repetition_suffix_len, prefix_repetition_output_len=32),
    }
    unknown = set(args.datasets.split(",")) - set(traces)
    if unknown:
        p.error(f"unknown datasets {sorted(unknown)}; choose from {sorted(traces)}")
    traces = {name: traces[name] for name in args.datasets.split(",")}
    rows = []
    convs = {name: datasets.build(opts, tokenizer) for name, opts in traces.items()}
    print("| dataset | policy | cached share | of ideal | TTFT p50 ms | TTFT p99 ms | max/mean [per node] | failed |")
    print("|---|---|---|---|---|---|---|---|")
    ideal: dict[str, float] = {}
    if args.reference_kv_blocks:
        with tempfile.TemporaryDirectory(prefix="kvd-bench-routing-ref-") as tmp:
            proc, base, sock = start_cluster(Path(tmp), args.model, 1, args.reference_kv_blocks)
            try:
                for name in traces:
                    row = {"dataset": name, **one_run(base, sock, served, "least-load", convs[name], args)}
                    row["policy"] = "ideal: one node, unbounded cache"
                    ideal[name] = row["cached_share"]
                    rows.append(row)
                    print_row(row, ideal)
            finally:
                proc.terminate()
                proc.wait(60)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-routing-") as tmp:
        proc, base, sock = start_cluster(Path(tmp), args.model, args.nodes, args.kv_blocks,
                                         extra_cluster="".join(f"{kv}\n" for kv in args.cluster))
        try:
            for name in traces:
                for policy in re.findall(r"[^,\[\s]+(?:\[[^\]]*\])?", args.policies):
                    row = {"dataset": name, **one_run(base, sock, served, policy, convs[name], args)}
                    rows.append(row)
                    print_row(row, ideal)
        finally:
            proc.terminate()
            proc.wait(60)
    out = REPO / "results" / "bench_routing.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"date": dt.datetime.now().isoformat(timespec="seconds"),
                               "machine": machine_info(), "args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
