"""Soak: kvd-loadgen on a 3-node cluster whose nodes are ``kill -9``'d and
restarted every ``--every`` seconds, against the same trace without failures.

A real coordinator and ``--nodes`` node processes (authenticated, one torch
thread each, nodes pinned round-robin to the cores), ``replicas = 1`` and
``recovery = replica`` by default. Two runs of the same seeded
``kvd-loadgen`` trace (``--save-outputs``), each on a fresh cluster:

- ``clean``: nothing fails;
- ``faults``: every ``--every`` seconds the next node in turn gets SIGKILL
  (a real ``kill -9``: no goodbye, no flush) and is started again at once
  under the same name and address, empty; it registers again and rejoins
  the replica ring.

Reported: requests failed in each run (target: 0 with faults), the kills,
the coordinator's recoveries by policy and outcome, and the faults run's
generated texts against the clean run's, request by request
(``kvd-loadgen compare --outputs``; target: all identical, greedy).

    .venv/bin/python -m tools.bench.cluster.bench_soak [--duration 600] [--every 30] [--rate 0.5]
        [--input-len 256] [--output-len 128] [--recovery replica] [--keep DIR]

Prints a summary and writes JSON to results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kvd.ctl import AdminUnavailable  # noqa: E402
from kvd.ctl import request as admin_request  # noqa: E402
from tools._twoproc import free_port, stop_processes, write_results  # noqa: E402
from tools.loadgen.compare import compare_outputs  # noqa: E402
from tools.loadgen.report import cpu_model  # noqa: E402
from transports.keys import generate_keypair  # noqa: E402


class Cluster:
    """A coordinator and named node processes; a node can be killed and started again."""

    def __init__(self, tag: str, args: argparse.Namespace, tmp: str) -> None:
        self.args, self.tag = args, tag
        self.names = [f"n{i + 1}" for i in range(args.nodes)]
        self.keys = os.path.join(tmp, f"keys-{tag}")
        for name in ("coordinator", *self.names):
            generate_keypair(self.keys, name)
        self.coord_url = f"zmq+tcp://127.0.0.1:{free_port()}"
        self.addresses = {n: f"zmq+tcp://127.0.0.1:{free_port()}" for n in self.names}
        self.port, self.sock = free_port(), os.path.join(tmp, f"coord-{tag}.sock")
        self.common = ["--curve-keys-dir", self.keys, "--heartbeat-interval", str(args.deadline / 4),
                       "--heartbeat-deadline", str(args.deadline), "--replicas", str(args.replicas),
                       "--recovery", args.recovery]
        self.log = open(os.path.join(tmp, f"{tag}.log"), "ab")
        self.coordinator = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli", "coordinator", "--listen", self.coord_url, "--port", str(self.port),
             "--model", args.model, "--admin-socket", self.sock, *self.common],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.nodes = {n: self.start_node(n) for n in self.names}
        self.wait_nodes(len(self.names), 300)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_node(self, name: str) -> subprocess.Popen:
        core = self.names.index(name) % (os.cpu_count() or 1)
        max_len = self.args.input_len * 2 + self.args.output_len + 64
        return subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, "-m", "kvd.cli", "node", "--name", name,
             "--listen", self.addresses[name], "--coordinator", self.coord_url, "--model", self.args.model,
             "--num-threads", "1", "--max-model-len", str(max_len), "--kv-blocks", "2048",
             "--host-kv-blocks", "2048", *self.common],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_nodes(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(AdminUnavailable, OSError, ValueError, KeyError):
                if len(admin_request(self.sock, {"cmd": "nodes"})["nodes"]) >= n:
                    return
            if time.monotonic() > deadline or self.coordinator.poll() is not None:
                raise SystemExit(f"bench_soak: {self.tag}: {n} nodes not registered; see {self.log.name}")
            time.sleep(0.5)

    def kill_and_restart(self, name: str) -> None:
        proc = self.nodes[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        self.nodes[name] = self.start_node(name)

    def stop(self) -> None:
        stop_processes([self.coordinator, *self.nodes.values()])
        self.log.close()


def loadgen(base: str, args: argparse.Namespace, out: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tools.loadgen.cli", "run", "--base-url", base, "--tokenizer", args.model,
         "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-range-ratio", "0.5",
         "--random-output-len", str(args.output_len), "--num-prompts", str(max(1, round(args.rate * args.duration))),
         "--request-rate", str(args.rate), "--ignore-eos", "--seed", str(args.seed), "--save-outputs",
         "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out), "--disable-tqdm"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def run(tag: str, args: argparse.Namespace, tmp: str, faults: bool) -> dict:
    c = Cluster(tag, args, tmp)
    kills: list[dict] = []
    try:
        out = os.path.join(tmp, f"{tag}.json")
        t0 = time.monotonic()
        lg = loadgen(c.base, args, out)
        stop = threading.Event()

        def killer() -> None:
            i = 0
            while not stop.wait(args.every):
                name = c.names[i % len(c.names)]
                c.kill_and_restart(name)
                kills.append({"node": name, "at_s": round(time.monotonic() - t0, 1)})
                print(f"  {tag}: kill -9 {name} at {kills[-1]['at_s']} s, restarted", flush=True)
                i += 1
        thread = threading.Thread(target=killer, daemon=True) if faults else None
        if thread:
            thread.start()
        rc = lg.wait(args.duration * 10 + 1200)
        stop.set()
        if thread:
            thread.join()
        if rc != 0:
            raise SystemExit(f"bench_soak: kvd-loadgen exited {rc} in {tag}; see {c.log.name}")
        status = admin_request(c.sock, {"cmd": "status"})
        doc = json.loads(Path(out).read_text())
        return {"run": tag, "seconds": round(time.monotonic() - t0, 1), "kills": kills,
                "recoveries": status.get("recoveries", {}), "failed_requests": doc["metrics"].get("failed"),
                "completed": doc["metrics"].get("completed"), "doc": doc}
    finally:
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=1, choices=(0, 1))
    ap.add_argument("--recovery", default="replica", choices=("replica", "reprefill", "fail"))
    ap.add_argument("--deadline", type=float, default=1.0, help="heartbeat deadline, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_soak.json"))
    ap.add_argument("--keep", metavar="DIR", help="keep the daemons' logs and the loadgen results in DIR")
    args = ap.parse_args()
    keep = contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="kvd-soak-")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with keep as tmp:
        clean = run("clean", args, tmp, faults=False)
        print(f"clean: {clean['completed']} completed, {clean['failed_requests']} failed in {clean['seconds']} s",
              flush=True)
        faults = run("faults", args, tmp, faults=True)
    same = compare_outputs(clean.pop("doc"), faults.pop("doc"))
    print(f"faults: {faults['completed']} completed, {faults['failed_requests']} failed in {faults['seconds']} s; "
          f"{len(faults['kills'])} kill -9; recoveries {faults['recoveries']}")
    print(f"outputs, faults vs clean: {same['same']} identical, {same['different']} different, "
          f"{same['failed']} failed, {same['missing']} missing"
          + (f"; differing (session, turn): {same['examples']}" if same["examples"] else ""))
    print(f"CPU: {cpu_model()}; {args.nodes} nodes, replicas {args.replicas}, recovery {args.recovery}, "
          f"rate {args.rate}/s for {args.duration:.0f} s, kill -9 every {args.every:.0f} s")
    write_results(args.out, [clean, faults], cpu=cpu_model(), args=vars(args), outputs=same)


if __name__ == "__main__":
    main()
