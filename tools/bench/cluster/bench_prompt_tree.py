"""The global prompt tree's costs, and how fast it learns about a prefix.

Part 1 (pure Python, this process): per cache event, what the node pays to
pack it (``kvd.cache_events.pack``) and the coordinator to decode and apply
it (``protocol.decode`` + ``CacheSync.handle``); ``GlobalPromptTree.match``
of a 4,096-token prompt; a 16,384-block snapshot, both sides.

Part 2 (``--lag``, real daemons): a one-node cluster per
``cache_events_interval`` (0.05 s: pushed, the default; 0.5 s: what riding
on the heartbeat, every ``heartbeat_interval`` = 0.5 s, would give); after
each completion returns, how long until ``kvctl tree`` shows its blocks.

    .venv/bin/python -m tools.bench.cluster.bench_prompt_tree [--lag]

Prints the figures and writes JSON to results/bench_prompt_tree.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from engine.memory.mempool import MemPool  # noqa: E402
from kvd import protocol  # noqa: E402
from kvd.cache_events import pack  # noqa: E402
from kvd.coordinator.cache_sync import CacheSync  # noqa: E402
from kvd.coordinator.prompt_tree import PromptTrees  # noqa: E402
from tools.bench.cluster.bench_routing import admin, start_cluster  # noqa: E402
from tools.loadgen.report import machine_info  # noqa: E402

BS = 16


def best(fn, repeat: int = 5) -> float:
    """Best wall time of ``repeat`` calls (this VM is shared)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def wire(msg: protocol.Message) -> protocol.Message:
    header, frames = protocol.encode(msg)
    return protocol.decode(header, [bytes(f) for f in frames])


def costs() -> dict:
    rng = random.Random(0)
    system = [rng.randrange(1, 40000) for _ in range(1024)]
    prompts = [system + [rng.randrange(1, 40000) for _ in range(3072)] for _ in range(16)]
    pool = MemPool(device_blocks=16 * 256, host_blocks=0, block_size=BS, node_id="n1")
    for p in prompts:                      # as the engine retires a request: hit + new blocks
        hit = pool.match(p)
        ids = pool.alloc_mem(len(p) // BS - len(hit.blocks))
        pool.insert(p, [r.block_id for r in hit.blocks] + ids)
        pool.release(hit)
    events = pool.take_events()            # 16 x 4,096-token prompts: 64 + 16*192 stored events
    out = {"events": len(events)}
    out["pack_us_per_event"] = best(lambda: pack("n1", 0, BS, events)) / len(events) * 1e6
    msg = pack("n1", 0, BS, events)

    def apply() -> None:
        sync = CacheSync(PromptTrees(BS))
        sync.registered("n1", BS)
        sync.handle(wire(pack("n1", 0, BS, [], snapshot=True)))
        reply = sync.handle(wire(msg))
        assert isinstance(reply, protocol.CacheAck) and not reply.resync, reply
    out["decode_apply_us_per_event"] = best(apply) / len(events) * 1e6
    sync = CacheSync(PromptTrees(BS))
    for n in ("n1", "n2", "n3"):
        sync.registered(n, BS)
        sync.handle(wire(pack(n, 0, BS, pool.cache_snapshot(), snapshot=True)))
    tree = sync.trees.for_node("n1")
    out["match_4096_tokens_3_nodes_ms"] = best(lambda: tree.match(prompts[3]), 20) * 1e3
    big = MemPool(device_blocks=16384, host_blocks=0, block_size=BS, node_id="n1")
    for i in range(64):
        p = [rng.randrange(1, 40000) for _ in range(256 * BS)]
        big.insert(p, big.alloc_mem(256))
    out["snapshot_blocks"] = big.stats()["device"]["cached"]
    out["snapshot_node_ms"] = best(lambda: pack("n1", 0, BS, big.cache_snapshot(), snapshot=True)) * 1e3
    snap = pack("n1", 0, BS, big.cache_snapshot(), snapshot=True)
    out["snapshot_bytes"] = sum(len(bytes(f)) for f in protocol.encode(snap)[1])

    def resync() -> None:
        s = CacheSync(PromptTrees(BS))
        s.registered("n1", BS)
        s.handle(wire(snap))
    out["snapshot_coordinator_ms"] = best(resync) * 1e3
    return out


def lag(interval: float, samples: int = 10) -> dict:
    import openai

    with tempfile.TemporaryDirectory(prefix="kvd-bench-tree-") as tmp:
        tmp_path = Path(tmp)
        proc, base, sock = start_cluster(tmp_path, "tiny", 1, 512,
                                         extra_cluster=f"cache_events_interval = {interval}\n")
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            delays = []
            for i in range(samples):
                rng = random.Random(1000 + i)
                prompt = [rng.randrange(1, 40000) for _ in range(8 * BS)]
                before = admin(sock, "tree")["sync"]["applied_events"]
                client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
                t0 = time.perf_counter()
                while admin(sock, "tree")["sync"]["applied_events"] < before + 8:
                    if time.perf_counter() - t0 > 10:
                        raise SystemExit(f"no events after 10 s: {admin(sock, 'tree')}\n"
                                         + (tmp_path / "serve.log").read_text()[-3000:])
                    time.sleep(0.002)
                delays.append(time.perf_counter() - t0)
                time.sleep(rng.random() * 0.1)
        finally:
            proc.terminate()
            proc.wait(60)
    return {"interval_s": interval, "median_ms": statistics.median(delays) * 1e3,
            "max_ms": max(delays) * 1e3, "samples": samples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lag", action="store_true", help="also measure the event lag with real daemons")
    args = p.parse_args()
    result: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
                    "costs": costs()}
    print(json.dumps(result["costs"], indent=1))
    if args.lag:
        result["lag"] = [lag(0.05), lag(0.5)]
        print(json.dumps(result["lag"], indent=1))
    out = REPO / "results" / "bench_prompt_tree.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
