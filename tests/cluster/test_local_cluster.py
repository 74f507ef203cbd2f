"""``kvd serve --nodes 2``: a coordinator and two node processes from one command."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.cpus import host_places, parse_cpulist
from kvd.local_cluster import node_cpu_sets

from .conftest import HEARTBEAT, ROOT, TINY, admin, free_port, reference_tokens


def cpus_allowed(pid: str) -> frozenset[int]:
    status = open(f"/proc/{pid}/status").read()
    return parse_cpulist(re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M).group(1))


@pytest.mark.parametrize("split_cpus", ["auto", "off"])
def test_serve_with_two_local_nodes_and_sigterm(tmp_path, split_cpus, reference_engine):
    """Also where each node computes: each on the CPUs node_cpu_sets plans for this host
    (auto, mixed nodes: cores of their own where there are 2; off: all of them), told how
    many nodes share them (1 where they are its own); greedy tokens either way those of
    the single-node engine."""
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--nodes", "2", "--port", str(port),
                             "--transport", "zmq+ipc", "--split-cpus", split_cpus, *TINY], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        m = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'kvd_cluster_nodes{state="routable"} 2.0' in m
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        prompts = [[(7 * i + 3 * j) % 900 + 1 for j in range(n)] for i, n in enumerate((5, 24, 70, 130))]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:      # at once, batched on the nodes
            texts = list(pool.map(lambda ids: client.completions.create(
                model="tiny", prompt=ids, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text, prompts))
        assert texts == [reference_engine.tokenizer.decode(r)
                         for r in reference_tokens(reference_engine, prompts, 12)]
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        mine = frozenset(os.sched_getaffinity(0))
        sets = node_cpu_sets(2, "", split_cpus)
        if split_cpus == "auto" and len(set(host_places(mine).values())) >= 2:
            assert sets is not None
        bound = sorted(cpus_allowed(pid) for pid in children)
        assert bound == (sorted(parse_cpulist(c) for c in sets) if sets else [mine, mine])
        for pid in children:            # how many nodes share its CPUs (load_engine sizes its team's waits by it)
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            assert (b"KVD_HOST_NODES=1" if sets else b"KVD_HOST_NODES=2") in env
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}"), f"node process {pid} outlived kvd serve"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


class LocalServe:
    """``kvd serve --nodes 2`` in its own session, logging to a file, with a
    coordinator admin socket (from a config file: ``[cluster].admin_socket``)."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin_socket = tmp / "coordinator.sock"
        config = tmp / "kvd.toml"
        config.write_text(f'[cluster]\nadmin_socket = "{self.admin_socket}"\n')
        self.log_path = tmp / "serve.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "-c", str(config), "--nodes", "2",
                                      "--port", str(self.port), *TINY, *HEARTBEAT, *extra],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_text()
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log_text()[-3000:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def node_pids(self) -> dict[str, int]:
        """node name -> pid of each child process of kvd serve (zombies included)."""
        out = {}
        for pid in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                  text=True).stdout.split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            name = argv[argv.index(b"--name") + 1].decode() if b"--name" in argv else "?"
            out[name] = int(pid)
        return out

    def nodes(self) -> dict[str, dict]:
        return {n["name"]: n for n in admin(self.admin_socket, "nodes")["nodes"]}

    def complete(self, prompt: str, max_tokens: int = 4):
        client = openai.OpenAI(base_url=self.base + "/v1", api_key="x", max_retries=0, timeout=60)
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def process_state(pid: int) -> str | None:
    """The State: letter of /proc/PID/status ("Z" for a zombie), None once reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return re.search(r"^State:\s+(\S)", status, re.M).group(1)


def wait_until(what, timeout: float, message) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, message()
        time.sleep(0.1)


@pytest.fixture
def serve(tmp_path):
    started: list[LocalServe] = []

    def start(*extra: str) -> LocalServe:
        s = LocalServe(tmp_path, *extra)
        started.append(s)
        s.wait_healthy()
        return s

    yield start
    for s in started:
        s.close()


def test_a_killed_node_is_reaped_logged_restarted_and_rejoins(serve):
    s = serve()
    before = s.nodes()
    pids = s.node_pids()
    assert sorted(before) == sorted(pids) == ["n1", "n2"]
    joins = admin(s.admin_socket, "status")["joins"]
    os.kill(pids["n1"], signal.SIGKILL)
    # reaped at once (no zombie left in /proc) and its end logged with pid and signal
    wait_until(lambda: process_state(pids["n1"]) is None, 5,
               lambda: f"node n1 (pid {pids['n1']}) not reaped: state {process_state(pids['n1'])}")
    wait_until(lambda: f"node n1 (pid {pids['n1']}) killed by SIGKILL" in s.log_text(), 5, s.log_text)
    assert s.complete("the survivor serves").usage.completion_tokens == 4
    # restarted after its backoff: a new process, which registers again as a new incarnation
    wait_until(lambda: s.node_pids().get("n1") not in (None, pids["n1"]), 15, s.log_text)
    wait_until(lambda: "n1" in s.nodes() and s.nodes()["n1"]["incarnation"] != before["n1"]["incarnation"],
               60, s.log_text)
    assert admin(s.admin_socket, "status")["joins"] == joins + 1
    assert s.node_pids()["n2"] == pids["n2"]
    assert all(s.complete(f"after the restart {i}").usage.completion_tokens == 4 for i in range(4))
    assert {n["name"]: n["routed"] > 0 for n in s.nodes().values()}["n1"]      # it takes requests again
    children = list(s.node_pids().values())
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0
    assert all(process_state(pid) is None for pid in children)


def test_no_restart_nodes_leaves_a_dead_node_dead_but_reaped(serve):
    s = serve("--no-restart-nodes")
    pids = s.node_pids()
    os.kill(pids["n2"], signal.SIGKILL)
    wait_until(lambda: process_state(pids["n2"]) is None, 5, lambda: f"state {process_state(pids['n2'])}")
    wait_until(lambda: "killed by SIGKILL; not restarted" in s.log_text(), 5, s.log_text)
    wait_until(lambda: "n2" not in s.nodes(), 10, lambda: str(s.nodes()))       # the failure detector
    time.sleep(2.0)                                                   # past the first restart backoff
    assert s.node_pids() == {"n1": pids["n1"]}
    assert s.complete("n1 alone").usage.completion_tokens == 4
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0


def test_nodes_exit_when_kvd_serve_is_killed(serve):
    """SIGKILL of kvd serve itself (no drain, no chance to stop its children):
    each node process gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and exits
    instead of living on as an orphan that holds its port and memory."""
    s = serve("--drain-timeout", "2")
    pids = s.node_pids()
    assert sorted(pids) == ["n1", "n2"]
    s.proc.send_signal(signal.SIGKILL)          # the process only, not its session
    s.proc.wait(10)

    def gone(pid: int) -> bool:
        return process_state(pid) in (None, "Z")    # exited (an orphan is reaped by init)
    wait_until(lambda: all(gone(pid) for pid in pids.values()), 30,
               lambda: f"orphaned nodes still running: {[(p, process_state(p)) for p in pids.values()]}")
