"""kvctl against a real AdminServer running on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from kvd import ctl
from kvd.api.admin import AdminError, AdminServer

ROOT = Path(__file__).resolve().parents[2]


class ThreadedAdmin:
    """An AdminServer with coordinator-like commands, served from a thread.

    `calls` records (command, args) as the handlers saw them.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[tuple[str, dict]] = []
        self.loop = asyncio.new_event_loop()
        self.server = AdminServer(path, name="coordinator", command_timeout=1.0)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._register()

    def _register(self) -> None:
        def record(name, result=None):
            async def handler(args):
                self.calls.append((name, args))
                return result if result is not None else {}
            return handler

        async def drain(args):
            self.calls.append(("drain", args))
            if args.get("node") == "n9":
                raise AdminError("drain: unknown node 'n9'")
            return {"draining": [args.get("node", "*")]}

        async def slow(args):
            await asyncio.sleep(0.8)
            return {"slow": True}

        reg = self.server.register
        reg("status", record("status", {"role": "coordinator", "nodes": 3}), help="cluster status")
        reg("nodes", record("nodes", {"nodes": [{"name": "n1", "alive": True}]}))
        reg("requests", record("requests", {"requests": []}))
        reg("drain", drain, args_schema={"node": (str, False)})
        reg("undrain", record("undrain"), args_schema={"node": (str, False)})
        reg("cache stats", record("cache stats", {"hit_rate": 0.5}))
        reg("cache flush", record("cache flush", {"flushed_blocks": 12}))
        reg("fail", record("fail"), args_schema={"node": (str, True), "mode": (str, True)})
        reg("tree", record("tree"), args_schema={"verify": (bool, False)})
        reg("routing", record("routing"), args_schema={"policy": (str, False), "recent_weight": (float, False),
                                                       "max_imbalance": (int, False)})
        reg("set-role", record("set-role"), args_schema={"node": (str, True), "role": (str, True),
                                                          "weight": (float, False)})
        reg("slow", slow)

    def __enter__(self) -> "ThreadedAdmin":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def sock_dir():
    with tempfile.TemporaryDirectory(prefix="kvd-ctl-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def admin(sock_dir):
    with ThreadedAdmin(sock_dir / "c.sock") as a:
        yield a


def run(admin, *argv, capsys):
    code = ctl.main(["--socket", str(admin.path), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_status_pretty_and_json(admin, capsys):
    code, out, err = run(admin, "status", capsys=capsys)
    assert code == 0 and err == ""
    assert json.loads(out) == {"role": "coordinator", "nodes": 3}
    assert out.count("\n") > 1  # indented
    code, out, _ = run(admin, "--json", "status", capsys=capsys)
    assert code == 0 and out.count("\n") == 1
    assert json.loads(out) == {"ok": True, "role": "coordinator", "nodes": 3}


@pytest.mark.parametrize("argv, call", [
    (["nodes"], ("nodes", {})),
    (["requests"], ("requests", {})),
    (["drain", "n1"], ("drain", {"node": "n1"})),
    (["drain"], ("drain", {})),
    (["undrain", "n2"], ("undrain", {"node": "n2"})),
    (["undrain"], ("undrain", {})),
    (["cache", "stats"], ("cache stats", {})),
    (["cache", "flush"], ("cache flush", {})),
    (["fail", "n1", "--mode", "stop"], ("fail", {"node": "n1", "mode": "stop"})),
    (["fail", "n3", "--mode", "drop-transfers"], ("fail", {"node": "n3", "mode": "drop-transfers"})),
    (["fail", "--mode", "resume", "n2"], ("fail", {"node": "n2", "mode": "resume"})),
    (["tree"], ("tree", {})),
    (["tree", "--verify"], ("tree", {"verify": True})),
    (["routing"], ("routing", {})),
    (["routing", "least-load"], ("routing", {"policy": "least-load"})),
    (["routing", "--set", "recent_weight=0.5", "--set", "max_imbalance=2"],
     ("routing", {"recent_weight": 0.5, "max_imbalance": 2})),
    (["call", "set-role", "node=n1", "role=prefill", "weight=0.5"],
     ("set-role", {"node": "n1", "role": "prefill", "weight": 0.5})),
    (["raw", '{"cmd": "cache", "sub": "stats"}'], ("cache stats", {})),
])
def test_commands_reach_their_handlers(admin, capsys, argv, call):
    code, out, err = run(admin, *argv, capsys=capsys)
    assert (code, err) == (0, "")
    assert admin.calls == [call]


def test_builtins_through_kvctl(admin, capsys):
    import logging
    root = logging.getLogger()
    saved = root.level
    try:
        code, out, _ = run(admin, "log-level", "DEBUG", capsys=capsys)
        assert code == 0 and json.loads(out)["level"] == "debug" and root.level == logging.DEBUG
    finally:
        root.setLevel(saved)
    code, out, _ = run(admin, "help", capsys=capsys)
    assert code == 0 and "cache flush" in [c["cmd"] for c in json.loads(out)["commands"]]
    code, out, _ = run(admin, "ping", capsys=capsys)
    assert code == 0 and json.loads(out)["name"] == "coordinator"


def test_error_reply_exits_1_with_one_line(admin, capsys):
    code, out, err = run(admin, "drain", "n9", capsys=capsys)
    assert (code, out, err) == (1, "", "kvctl: drain: unknown node 'n9'\n")
    code, out, err = run(admin, "fail", "--mode", "exit", capsys=capsys)  # coordinator needs a node
    assert code == 1 and "missing required argument 'node'" in err and err.count("\n") == 1
    code, _, err = run(admin, "raw", '{"cmd": "no such"}', capsys=capsys)
    assert code == 1 and "unknown command" in err


def test_server_deadline_and_client_deadline(admin, capsys):
    code, _, err = run(admin, "call", "slow", capsys=capsys)  # server deadline is 1 s: fine
    assert code == 0
    code, _, err = run(admin, "--timeout", "0.2", "call", "slow", capsys=capsys)
    assert code == 1 and "no reply" in err and "within 0.2 s" in err
    # The server is still fine afterwards.
    assert run(admin, "status", capsys=capsys)[0] == 0


def test_default_socket_from_environment(admin, capsys, monkeypatch):
    monkeypatch.setenv("KVD_ADMIN_SOCKET", str(admin.path))
    assert ctl.main(["status"]) == 0
    monkeypatch.delenv("KVD_ADMIN_SOCKET")
    assert ctl.default_socket({}) == "/run/kvd/coordinator.sock"


@pytest.mark.parametrize("argv", [
    [],
    ["bogus"],
    ["cache"],
    ["cache", "purge"],
    ["fail", "n1"],
    ["fail", "n1", "--mode", "explode"],
    ["log-level", "loud"],
    ["raw", "{not json"],
    ["raw", "[1]"],
    ["call", "x", "novalue"],
    ["keys", "--dir", "/tmp"],
    ["--timeout", "0", "status"],
])
def test_usage_errors_exit_2(sock_dir, capsys, argv):
    with pytest.raises(SystemExit) as e:
        ctl.main(["--socket", str(sock_dir / "none.sock"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()


def test_unreachable_sockets(sock_dir, capsys):
    missing = sock_dir / "missing.sock"
    assert ctl.main(["--socket", str(missing), "status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvctl: no admin socket at {missing}") and err.count("\n") == 1

    stale = sock_dir / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    assert ctl.main(["--socket", str(stale), "status"]) == 1
    assert "refuses connections" in capsys.readouterr().err

    # Accepts but never answers: the reply deadline ends it.
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(sock_dir / "silent.sock"))
    silent.listen()
    try:
        assert ctl.main(["--socket", str(sock_dir / "silent.sock"), "--timeout", "0.2", "status"]) == 1
        assert "no reply" in capsys.readouterr().err
    finally:
        silent.close()


def test_kvctl_process_without_daemon_prints_one_line(sock_dir):
    proc = subprocess.run([sys.executable, "-m", "kvd.ctl", "--socket", str(sock_dir / "x.sock"), "status"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no admin socket" in proc.stderr


def test_kvctl_process_against_server(admin):
    proc = subprocess.run([sys.executable, "-m", "kvd.ctl", "--socket", str(admin.path), "cache", "flush"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"flushed_blocks": 12}
    proc = subprocess.run([sys.executable, "-m", "kvd.ctl", "--socket", str(admin.path), "drain", "n9"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, "kvctl: drain: unknown node 'n9'\n")


def test_keys_locally(tmp_path, capsys):
    keydir = tmp_path / "keys"
    assert ctl.main(["--socket", "/nonexistent.sock", "keys", "--dir", str(keydir), "--name", "coordinator"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply == {"public": str(keydir / "coordinator.key"), "secret": str(keydir / "coordinator.key_secret")}
    assert stat.S_IMODE(os.stat(reply["secret"]).st_mode) == 0o600
    assert ctl.main(["keys", "--dir", str(keydir), "--name", "coordinator"]) == 1
    err = capsys.readouterr().err
    assert "already exists" in err and err.count("\n") == 1


def test_request_library_call(admin):
    assert ctl.request(admin.path, {"cmd": "cache stats"}) == {"ok": True, "hit_rate": 0.5}
    with pytest.raises(ctl.AdminUnavailable):
        ctl.request(admin.path.parent / "nope.sock", {"cmd": "status"})
