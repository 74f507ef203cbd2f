"""AdminServer over a real Unix socket: protocol, validation, lifecycle, bad input."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from kvd.api.admin import MAX_LINE, AdminError, AdminServer, AdminSocketInUse


@pytest.fixture
def sock_dir():
    # Short path: sun_path is 108 bytes and pytest's tmp_path can be long.
    with tempfile.TemporaryDirectory(prefix="kvd-adm-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
async def admin(sock_dir):
    server = AdminServer(sock_dir / "a.sock", name="test", command_timeout=2.0)
    await server.start()
    yield server
    await server.close()


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: Path) -> "Client":
        return cls(*await asyncio.open_unix_connection(os.fspath(path), limit=1 << 22))

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self) -> dict:
        line = await asyncio.wait_for(self.reader.readline(), 10)
        assert line.endswith(b"\n"), line
        return json.loads(line)

    async def call(self, msg: dict | bytes) -> dict:
        await self.send_raw((msg if isinstance(msg, bytes) else json.dumps(msg).encode()) + b"\n")
        return await self.reply()

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def call(path: Path, msg: dict | bytes) -> dict:
    c = await Client.open(path)
    try:
        return await c.call(msg)
    finally:
        await c.close()


# -- socket file -------------------------------------------------------------

async def test_socket_is_0600_and_new_parent_is_0700(sock_dir):
    path = sock_dir / "run" / "kvd" / "c.sock"
    async with AdminServer(path) as server:
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(path.parent).st_mode) & 0o077 == 0
        assert (await call(path, {"cmd": "ping"}))["pong"] is True
        assert server.path == path
    assert not path.exists()


async def test_stale_socket_is_replaced(sock_dir):
    path = sock_dir / "a.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.fspath(path))  # bound, never listening: what a crash leaves
    dead.close()
    assert path.exists()
    async with AdminServer(path):
        assert (await call(path, {"cmd": "ping"}))["ok"] is True


async def test_live_socket_is_refused(admin):
    second = AdminServer(admin.path)
    with pytest.raises(AdminSocketInUse):
        await second.start()
    await second.close()
    # The first server and its socket file are untouched.
    assert (await call(admin.path, {"cmd": "ping"}))["ok"] is True


async def test_regular_file_is_not_replaced(sock_dir):
    path = sock_dir / "a.sock"
    path.write_text("precious")
    with pytest.raises(AdminSocketInUse, match="not a socket"):
        await AdminServer(path).start()
    assert path.read_text() == "precious"


async def test_close_keeps_a_successors_socket(sock_dir):
    path = sock_dir / "a.sock"
    first = AdminServer(path)
    await first.start()
    os.unlink(path)  # e.g. an operator removed it and a new daemon took over
    async with AdminServer(path, name="second"):
        await first.close()
        assert (await call(path, {"cmd": "ping"}))["name"] == "second"


async def test_close_cancels_open_connections_and_is_idempotent(sock_dir):
    path = sock_dir / "a.sock"
    server = AdminServer(path)
    await server.start()
    client = await Client.open(path)
    assert (await client.call({"cmd": "ping"}))["ok"]
    await asyncio.wait_for(server.close(), 5)
    assert await asyncio.wait_for(client.reader.read(), 5) == b""  # EOF: server side closed
    await server.close()
    assert not path.exists()


def test_path_too_long_is_rejected():
    with pytest.raises(ValueError, match="longer"):
        AdminServer("/tmp/" + "x" * 200)


# -- commands ------------------------------------------------------------------

async def test_builtins(admin):
    ping = await call(admin.path, {"cmd": "ping"})
    assert ping["ok"] is True and ping["name"] == "test" and ping["pid"] == os.getpid()
    helped = await call(admin.path, {"cmd": "help"})
    names = [c["cmd"] for c in helped["commands"]]
    assert names == sorted(names) and {"help", "ping", "log-level", "keys"} <= set(names)
    ll = next(c for c in helped["commands"] if c["cmd"] == "log-level")
    assert ll["args"]["level"] == {"type": "str", "required": True}


async def test_multiword_command_in_both_forms(admin):
    seen = []

    async def stats(args):
        seen.append(args)
        return {"hits": 3}

    admin.register("cache stats", stats, help="cache counters")
    for msg in ({"cmd": "cache stats"}, {"cmd": "cache", "sub": "stats"}, {"cmd": "  cache   stats "}):
        assert await call(admin.path, msg) == {"ok": True, "hits": 3}
    assert seen == [{}, {}, {}]


async def test_args_are_validated(admin):
    got = []

    async def fail(args):
        got.append(args)
        return {}

    admin.register("fail", fail, args_schema={"node": (str, True), "mode": (str, True),
                                              "after_s": (float, False), "count": (int, False)})
    p = admin.path
    assert (await call(p, {"cmd": "fail", "node": "n1", "mode": "stop"}))["ok"]
    assert (await call(p, {"cmd": "fail", "node": "n1", "mode": "stop", "after_s": 2}))["ok"]  # int is a float
    assert got == [{"node": "n1", "mode": "stop"}, {"node": "n1", "mode": "stop", "after_s": 2}]
    bad = [
        ({"cmd": "fail", "node": "n1"}, "missing required argument 'mode'"),
        ({"cmd": "fail", "node": 1, "mode": "stop"}, "'node' must be str"),
        ({"cmd": "fail", "node": "n1", "mode": "stop", "count": True}, "'count' must be int"),
        ({"cmd": "fail", "node": "n1", "mode": "stop", "count": 1.5}, "'count' must be int"),
        ({"cmd": "fail", "node": "n1", "mode": "stop", "colour": "red"}, "unknown argument(s) colour"),
        ({"cmd": "ping", "extra": 1}, "unknown argument(s) extra (allowed: none)"),
    ]
    for msg, error in bad:
        reply = await call(p, msg)
        assert reply["ok"] is False and error in reply["error"], reply
    assert len(got) == 2


@pytest.mark.parametrize("line, error", [
    (b"{not json", "invalid JSON"),
    (b"\xff\xfe", "invalid JSON"),
    (b"[1, 2]", "must be a JSON object, got list"),
    (b'"status"', "must be a JSON object, got str"),
    (b"42", "must be a JSON object, got int"),
    (b"{}", 'needs "cmd"'),
    (b'{"cmd": 7}', 'needs "cmd"'),
    (b'{"cmd": "  "}', 'needs "cmd"'),
    (b'{"cmd": "cache", "sub": 1}', '"sub" must be a string'),
    (b'{"cmd": "nope"}', "unknown command 'nope'"),
])
async def test_bad_input_gets_an_error_and_the_connection_survives(admin, line, error):
    client = await Client.open(admin.path)
    reply = await client.call(line)
    assert reply["ok"] is False and error in reply["error"]
    assert (await client.call({"cmd": "ping"}))["ok"] is True
    await client.close()


async def test_oversized_line_is_rejected_and_skipped(admin):
    client = await Client.open(admin.path)
    big = json.dumps({"cmd": "ping", "pad": "x" * (3 * MAX_LINE)}).encode()
    await client.send_raw(big + b"\n" + b'{"cmd": "ping"}\n')
    first = await client.reply()
    assert first["ok"] is False and "longer than" in first["error"]
    assert (await client.reply())["pong"] is True  # the tail of the big line was discarded
    # A line of exactly MAX_LINE bytes is still accepted.
    exact = b'{"cmd": "ping"}'.ljust(MAX_LINE, b" ")
    assert (await client.call(exact))["ok"] is True
    await client.close()


async def test_blank_lines_and_pipelined_requests(admin):
    client = await Client.open(admin.path)
    await client.send_raw(b'\n  \n{"cmd": "ping"}\n{"cmd": "bad"}\n{"cmd": "help"}\n')
    replies = [await client.reply() for _ in range(3)]
    assert [r["ok"] for r in replies] == [True, False, True]
    assert "pong" in replies[0] and "commands" in replies[2]
    await client.close()


async def test_handler_exception_is_an_error_reply(admin, caplog):
    async def broken(args):
        raise KeyError("boom")

    async def refused(args):
        raise AdminError("node n9 is not a member")

    admin.register("broken", broken)
    admin.register("refused", refused)
    with caplog.at_level(logging.ERROR, logger="kvd.admin"):
        reply = await call(admin.path, {"cmd": "broken"})
    assert reply == {"ok": False, "error": "broken: internal error: KeyError: 'boom'"}
    assert any("broken" in r.getMessage() and r.exc_info for r in caplog.records)
    assert await call(admin.path, {"cmd": "refused"}) == {"ok": False, "error": "node n9 is not a member"}
    assert (await call(admin.path, {"cmd": "ping"}))["ok"]


async def test_handler_timeout(sock_dir):
    cancelled = asyncio.Event()

    async def stuck(args):
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()
        return {}

    async with AdminServer(sock_dir / "a.sock", command_timeout=0.2) as server:
        server.register("stuck", stuck)
        client = await Client.open(server.path)
        reply = await client.call({"cmd": "stuck"})
        assert reply == {"ok": False, "error": "stuck: timed out after 0.2 s"}
        assert cancelled.is_set()
        assert (await client.call({"cmd": "ping"}))["ok"]
        await client.close()


async def test_bad_results(admin):
    async def not_a_dict(args):
        return [1]

    async def not_json(args):
        return {"value": object()}

    def sync_handler(args):
        return {"sync": True}

    admin.register("list", not_a_dict)
    admin.register("object", not_json)
    admin.register("sync", sync_handler)
    assert "handler returned list" in (await call(admin.path, {"cmd": "list"}))["error"]
    assert "not serializable" in (await call(admin.path, {"cmd": "object"}))["error"]
    assert await call(admin.path, {"cmd": "sync"}) == {"ok": True, "sync": True}


async def test_concurrent_clients(admin):
    """N clients whose handlers all wait for each other: only concurrency completes."""
    n = 12
    arrived = 0
    everyone = asyncio.Event()

    async def rendezvous(args):
        nonlocal arrived
        arrived += 1
        if arrived == n:
            everyone.set()
        await everyone.wait()  # serialised handling would hit the 2 s deadline instead
        return {"i": args["i"]}

    admin.register("meet", rendezvous, args_schema={"i": (int, True)})
    replies = await asyncio.gather(*(call(admin.path, {"cmd": "meet", "i": i}) for i in range(n)))
    assert replies == [{"ok": True, "i": i} for i in range(n)]


async def test_client_that_disconnects_mid_command(admin):
    release = asyncio.Event()

    async def slow(args):
        await release.wait()
        return {"done": True}

    admin.register("slow", slow)
    client = await Client.open(admin.path)
    await client.send_raw(b'{"cmd": "slow"}\n')
    await asyncio.sleep(0.05)
    await client.close()
    release.set()
    await asyncio.sleep(0.05)
    assert (await call(admin.path, {"cmd": "ping"}))["ok"]


def test_register_rejects_bad_names_and_schemas(sock_dir):
    server = AdminServer(sock_dir / "a.sock")

    async def h(args):
        return {}

    with pytest.raises(ValueError, match="already registered"):
        server.register("ping", h)
    for name in ("", " x", "cache  stats"):
        with pytest.raises(ValueError, match="bad command name"):
            server.register(name, h)
    with pytest.raises(ValueError, match="reserved"):
        server.register("x", h, args_schema={"cmd": (str, True)})
    with pytest.raises(ValueError, match="bad schema"):
        server.register("y", h, args_schema={"n": ("int", True)})
    with pytest.raises(TypeError):
        server.register("z", "not callable")


# -- built-in commands with effects ------------------------------------------------

async def test_log_level(admin):
    root, named = logging.getLogger(), logging.getLogger("kvd.test_admin")
    saved = root.level, named.level
    try:
        reply = await call(admin.path, {"cmd": "log-level", "level": "debug"})
        assert reply["ok"] and reply["logger"] == "root" and reply["level"] == "debug"
        assert root.level == logging.DEBUG
        reply = await call(admin.path, {"cmd": "log-level", "level": "WARNING", "logger": "kvd.test_admin"})
        assert reply["ok"] and named.level == logging.WARNING
        bad = await call(admin.path, {"cmd": "log-level", "level": "loud"})
        assert bad["ok"] is False and "must be one of" in bad["error"]
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(saved[0])
        named.setLevel(saved[1])


async def test_keys(admin, tmp_path):
    keydir = tmp_path / "keys"
    reply = await call(admin.path, {"cmd": "keys", "dir": str(keydir), "name": "n1"})
    assert reply["ok"], reply
    public, secret = Path(reply["public"]), Path(reply["secret"])
    assert public == keydir / "n1.key" and secret == keydir / "n1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "secret-key" in secret.read_text() and "secret-key" not in public.read_text()
    from transports.zmq import load_keypair
    assert load_keypair(secret)[1] is not None

    again = await call(admin.path, {"cmd": "keys", "dir": str(keydir), "name": "n1"})
    assert again["ok"] is False and "already exists" in again["error"]
    rel = await call(admin.path, {"cmd": "keys", "dir": "keys", "name": "n2"})
    assert rel["ok"] is False and "absolute" in rel["error"]
    for name in ("../evil", "a/b", ".hidden", ""):
        bad = await call(admin.path, {"cmd": "keys", "dir": str(keydir), "name": name})
        assert bad["ok"] is False and "name must be" in bad["error"]
    assert sorted(p.name for p in keydir.iterdir()) == ["n1.key", "n1.key_secret"]
