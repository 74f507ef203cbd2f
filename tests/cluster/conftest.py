"""Real cluster daemons on loopback: ``kvd coordinator`` and ``kvd node`` processes.

Logs go to the test's tmp dir (printed on failure with KVD_TEST_LOGS=1 they
go to the terminal). Everything is the tiny random model in float32 with
small KV pools, so a node starts in a few seconds on 2 cores.

Every cluster is authenticated, as a real one must be: a keys directory per
cluster with a keypair for the coordinator and for each node it starts
(``--curve-keys-dir``). ``Cluster.connect`` opens a link to a daemon under
one of those keys, the way the daemons themselves do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

import transports
from tools._twoproc import free_port
from transports.keys import CurveClient, generate_keypair, load_keypair

from ..probes import admin, kvd_metrics

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
# batch-invariant: the tiny model's float matrices prefill on the decode kernel, so a token has
# the same bits on every path (engine/exactness.py) and seeded streams survive every feature
TINY = ("--model", "tiny", "--dtype", "float32", "--block-size", "16", "--kv-blocks", "512",
        "--host-kv-blocks", "32", "--max-model-len", "2048", "--num-threads", "1", "--batch-invariant")
HEARTBEAT = ("--heartbeat-interval", "0.5", "--heartbeat-deadline", "3")


class Proc:
    def __init__(self, name: str, cmd: list[str], logdir: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.logdir = logdir
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = None if os.environ.get("KVD_TEST_LOGS") else open(self.logdir / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT if log else None)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: a hung process (no beats, no tokens, sockets open)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        path = self.logdir / f"{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


class Cluster:
    """A coordinator and named nodes; ``url(kind)`` builds loopback addresses.

    ``keys_dir`` holds the cluster's keys (made here, one per daemon);
    ``insecure=True`` runs every daemon without keys (``--insecure``)."""

    def __init__(self, tmp: Path, transport: str = "zmq+tcp", extra: tuple[str, ...] = (),
                 insecure: bool = False) -> None:
        self.tmp = tmp
        self.transport = transport
        self.extra = extra
        self.keys_dir = tmp / "keys"
        if insecure:
            self.auth: tuple[str, ...] = ("--insecure",)
        else:
            self.make_key("coordinator")
            self.auth = ("--curve-keys-dir", str(self.keys_dir))
        self.http_port = free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.coordinator_url = self.url("coordinator")
        self.admin_socket = tmp / "coordinator.sock"
        self.coordinator = Proc("coordinator", [
            sys.executable, "-m", "kvd.cli", "coordinator", "--listen", self.coordinator_url,
            "--port", str(self.http_port), "--model", MODEL, "--admin-socket", str(self.admin_socket),
            "--transport", transport, *HEARTBEAT, *self.auth, *extra], tmp)
        self.nodes: dict[str, Proc] = {}
        self.node_urls: dict[str, str] = {}

    def make_key(self, name: str) -> None:
        """A keypair for daemon ``name`` in the cluster's keys directory (once)."""
        if not (self.keys_dir / f"{name}.key_secret").exists():
            generate_keypair(self.keys_dir, name)

    def client_keys(self, server: str, as_name: str = "coordinator") -> CurveClient:
        """The keys daemon ``as_name`` uses to reach daemon ``server``."""
        return CurveClient(*load_keypair(self.keys_dir / f"{as_name}.key_secret"),
                           server_key=load_keypair(self.keys_dir / f"{server}.key")[0])

    async def connect(self, server: str, as_name: str = "coordinator", **kw) -> transports.Connection:
        """A transport link to ``server`` (a node name, or "coordinator"),
        authenticated as ``as_name`` (default: the coordinator's key)."""
        url = self.coordinator_url if server == "coordinator" else self.node_urls[server]
        curve = None if "--insecure" in self.auth else self.client_keys(server, as_name)
        return await transports.connect(url, curve=curve, **kw)

    def url(self, name: str) -> str:
        if self.transport == "zmq+ipc":
            return f"zmq+ipc://{self.tmp}/{name}.ipc"
        return f"{self.transport}://127.0.0.1:{free_port()}"

    def node_admin(self, name: str) -> Path:
        return self.tmp / f"{name}.sock"

    def start_node(self, name: str, *extra: str, url: str | None = None, make_key: bool = True) -> Proc:
        """Start node ``name`` (with a key of its own in the cluster's keys
        directory unless ``make_key=False``; ``extra`` flags come last and win)."""
        url = url or self.node_urls.get(name) or self.url(name)
        self.node_urls[name] = url
        if make_key and "--insecure" not in self.auth:
            self.make_key(name)
        proc = Proc(name, [sys.executable, "-m", "kvd.cli", "node", "--name", name, "--listen", url,
                           "--coordinator", self.coordinator_url, "--admin-socket",
                           str(self.node_admin(name)), "--transport", self.transport,
                           *TINY, *HEARTBEAT, *self.auth, *self.extra, *extra], self.tmp)
        self.nodes[name] = proc
        return proc

    def nodes_up(self) -> list[str]:
        try:
            return sorted(n["name"] for n in admin(self.admin_socket, "nodes")["nodes"])
        except (OSError, ValueError, KeyError):
            return []

    def wait_nodes(self, names: list[str], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if set(names) <= set(self.nodes_up()):
                return
            for p in [self.coordinator, *self.nodes.values()]:
                if p.proc.poll() is not None and p.name in [*names, "coordinator"]:
                    raise RuntimeError(f"{p.name} exited {p.proc.returncode}:\n{p.log_text()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"nodes {names} did not register; up: {self.nodes_up()}\n"
                           + "\n".join(f"--- {p.name}\n{p.log_text()[-2000:]}" for p in self.nodes.values()))

    def wait_gone(self, name: str, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if name not in self.nodes_up():
                return time.monotonic() - t0
            time.sleep(0.05)
        raise TimeoutError(f"{name} still registered after {timeout}s")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="x", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        return kvd_metrics(self.base)

    def stop(self) -> None:
        for p in self.nodes.values():
            p.stop()
        self.coordinator.stop()



@contextlib.contextmanager
def running_cluster(tmp: Path, transport: str, nodes: list[str], extra: tuple[str, ...] = ()):
    """A coordinator and ``nodes``, all registered, stopped on exit (for module fixtures)."""
    c = Cluster(tmp, transport, extra)
    for n in nodes:
        c.start_node(n)
    try:
        c.wait_nodes(nodes)
        yield c
    finally:
        c.stop()

@pytest.fixture(scope="session")
def reference_engine():
    """The plain single-node engine, in this process, for token-exact comparisons."""
    from engine.engine import EngineConfig, LLMEngine

    return LLMEngine.from_config(EngineConfig(model="tiny", dtype="float32", block_size=16, kv_blocks=256,
                                              host_kv_blocks=32, max_model_len=512, num_threads=1,
                                              batch_invariant=True))


# Seeded sampling as the cluster tests draw it beside greedy (the body's fields: top_k goes in
# extra_body): temperatures 0.7 to 1.0, top-p and top-k. Every feature gives these the
# single-node engine's text (engine/exactness.py).
SEEDED = ({"temperature": 0.7, "top_p": 0.9, "seed": 5}, {"temperature": 0.85, "top_k": 40, "seed": 6},
          {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 7})


def reference_tokens(engine, prompts: list[list[int]], max_tokens: int,
                     sampling: dict | list[dict] | None = None) -> list[list[int]]:
    """The single-node engine's tokens for ``prompts``: greedy, or each prompt's ``sampling``
    (one dict for all, or one per prompt: SEEDED's fields)."""
    from engine.request import SamplingParams

    each = sampling if isinstance(sampling, list) else [sampling or {"temperature": 0.0}] * len(prompts)
    return engine.generate(prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **s) for s in each])


def body_of(sampling: dict | None) -> dict:
    """``sampling`` (SEEDED's fields) as the openai client's create() takes them."""
    s = dict(sampling or {"temperature": 0.0})
    top_k = s.pop("top_k", None)
    return {**s, "extra_body": {"ignore_eos": True, **({"top_k": top_k} if top_k else {})}}
