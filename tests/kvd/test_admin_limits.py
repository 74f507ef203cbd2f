"""AdminServer's connection bounds over a real Unix socket: the line timeout,
the connection cap and its refusal, commands served while idle connections
are held; and `log-level`, which sets kvd's loggers only."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

import pytest

from kvd.api.admin import AdminServer

LINE_TIMEOUT = 1.0
WAIT = 15.0             # the deadline of every wait below: far beyond LINE_TIMEOUT


@pytest.fixture
def sock_path():
    # Short path: sun_path is 108 bytes and pytest's tmp_path can be long.
    with tempfile.TemporaryDirectory(prefix="kvd-adl-", dir="/tmp") as d:
        yield Path(d) / "a.sock"


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: Path) -> "Conn":
        return cls(*await asyncio.open_unix_connection(os.fspath(path)))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def call(self, msg: dict) -> dict:
        await self.send(json.dumps(msg).encode() + b"\n")
        return await self.reply()

    async def reply(self) -> dict:
        line = await asyncio.wait_for(self.reader.readline(), WAIT)
        assert line.endswith(b"\n"), line
        return json.loads(line)

    async def closed_by_server(self) -> list[dict]:
        """The lines the server sent until it closed the connection (EOF);
        fails if it is still open after WAIT seconds."""
        data = await asyncio.wait_for(self.reader.read(), WAIT)
        return [json.loads(line) for line in data.splitlines()]

    def close(self) -> None:
        self.writer.close()


async def open_all(path: Path, n: int) -> list[Conn]:
    return list(await asyncio.gather(*(Conn.open(path) for _ in range(n))))


async def ping(path: Path) -> dict:
    """`ping` on a connection of its own."""
    c = await Conn.open(path)
    try:
        return await c.call({"cmd": "ping"})
    finally:
        c.close()


async def until(predicate, what: str) -> None:
    """Poll the async ``predicate`` every 50 ms for up to WAIT seconds."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


# -- the line timeout -------------------------------------------------------------

async def test_half_line_and_idle_connections_are_closed_after_the_line_timeout(sock_path):
    async with AdminServer(sock_path, line_timeout=LINE_TIMEOUT) as server:
        half = await open_all(sock_path, 40)
        for c in half:
            await c.send(b'{"cmd": "pi')
        idle = await open_all(sock_path, 10)        # connected, never sends a byte
        for c in half + idle:
            lines = await c.closed_by_server()
            assert len(lines) == 1 and lines[0]["ok"] is False, lines
            assert "no complete request line within 1 s" in lines[0]["error"]
            c.close()
        assert server.timed_out == 50
        probe = await Conn.open(sock_path)
        pong = await probe.call({"cmd": "ping"})
        assert pong["connections"] == {"open": 1, "max": server.max_connections, "refused": 0, "timed_out": 50}
        probe.close()


async def test_a_trickled_line_and_blank_lines_do_not_keep_a_connection(sock_path):
    async with AdminServer(sock_path, line_timeout=LINE_TIMEOUT):
        trickle, blanks = await open_all(sock_path, 2)

        async def feed(conn: Conn, byte: bytes) -> None:
            # a byte every 0.2 s: far more often than the line timeout, never a request line
            with contextlib.suppress(ConnectionError):
                for _ in range(int(WAIT / 0.2)):
                    await conn.send(byte)
                    await asyncio.sleep(0.2)

        feeders = [asyncio.create_task(feed(trickle, b"x")), asyncio.create_task(feed(blanks, b"\n"))]
        try:
            for c in (trickle, blanks):
                lines = await c.closed_by_server()
                assert [r["ok"] for r in lines] == [False] and "no complete request line" in lines[0]["error"]
        finally:
            for task in feeders:
                task.cancel()
            await asyncio.gather(*feeders, return_exceptions=True)


async def test_the_timer_restarts_after_each_reply(sock_path):
    """A client that keeps sending requests stays connected for many line timeouts."""
    async with AdminServer(sock_path, line_timeout=LINE_TIMEOUT) as server:
        c = await Conn.open(sock_path)
        for _ in range(12):                         # 12 x 0.25 s: three line timeouts
            assert (await c.call({"cmd": "ping"}))["ok"]
            await asyncio.sleep(0.25)
        assert server.timed_out == 0
        c.close()


async def test_a_client_that_reads_no_replies_is_closed(sock_path):
    async with AdminServer(sock_path, line_timeout=LINE_TIMEOUT) as server:
        async def big(args):
            return {"pad": "x" * (1 << 20)}

        server.register("big", big)
        c = await Conn.open(sock_path)
        # requests whose replies (1 MiB each) the client never reads: the server
        # blocks on the full socket buffer, then gives up on the connection
        await c.send(b'{"cmd": "big"}\n' * 64)

        async def dropped() -> bool:
            return (await ping(sock_path))["connections"]["open"] == 1     # the ping's own
        await until(dropped, "a client that reads nothing is still held")
        c.close()


# -- the connection cap ---------------------------------------------------------------

async def test_connections_beyond_the_cap_get_one_error_line_and_are_closed(sock_path):
    async with AdminServer(sock_path, line_timeout=60.0, max_connections=8) as server:
        held = await open_all(sock_path, 7)         # a stuck script's connections
        for c in held:
            await c.send(b'{"cmd": "pi')
        last = await Conn.open(sock_path)           # the 8th: served
        assert (await last.call({"cmd": "ping"}))["connections"]["open"] == 8
        burst = await open_all(sock_path, 20)       # all refused, even in one burst
        for c in burst:
            lines = await c.closed_by_server()
            assert lines == [{"ok": False, "error": "too many admin connections (limit 8); "
                                                    "closing, retry later"}]
            c.close()
        assert server.refused == 20
        assert (await last.call({"cmd": "ping"}))["ok"]     # the served ones are untouched
        held.pop().close()                          # a slot frees up

        async def served() -> bool:
            return (await ping(sock_path))["ok"]
        await until(served, "the freed slot was never reused")
        for c in [*held, last]:
            c.close()


async def test_a_burst_beyond_the_cap_admits_exactly_the_cap(sock_path):
    async with AdminServer(sock_path, line_timeout=60.0, max_connections=8) as server:
        conns = await open_all(sock_path, 30)
        for c in conns:
            await c.send(b'{"cmd": "ping"}\n')
        served = refused = 0
        for c in conns:
            reply = await c.reply()
            if reply["ok"]:
                served += 1
            else:
                assert "too many admin connections" in reply["error"]
                refused += 1
            c.close()
        assert (served, refused) == (8, 22) and server.refused == 22


async def test_commands_are_answered_concurrently_while_idle_connections_are_held(sock_path):
    async with AdminServer(sock_path, line_timeout=60.0, max_connections=32, command_timeout=WAIT) as server:
        release = asyncio.Event()

        async def slow(args):
            await release.wait()
            return {"slow": True}

        server.register("slow", slow)
        idle = await open_all(sock_path, 29)
        for c in idle:
            await c.send(b'{"cmd": "he')
        waiting = await Conn.open(sock_path)
        await waiting.send(b'{"cmd": "slow"}\n')
        other = await Conn.open(sock_path)
        assert (await other.call({"cmd": "ping"}))["pong"] is True      # not behind the slow one
        assert (await other.call({"cmd": "help"}))["ok"]
        release.set()
        assert await waiting.reply() == {"ok": True, "slow": True}
        for c in [*idle, waiting, other]:
            c.close()


def test_limits_are_validated(sock_path):
    with pytest.raises(ValueError, match="line_timeout"):
        AdminServer(sock_path, line_timeout=0)
    with pytest.raises(ValueError, match="max_connections"):
        AdminServer(sock_path, max_connections=0)


# -- log-level ------------------------------------------------------------------------

async def test_log_level_sets_kvds_loggers_and_refuses_any_other_name(sock_path):
    import kvd.node.daemon  # noqa: F401  (its loggers exist, as in a node daemon)

    known = logging.getLogger("kvd.heartbeat")
    saved = known.level, logging.getLogger().level
    before = set(logging.Logger.manager.loggerDict)
    bogus = ["x" * 60_000, "kvd.admin\x00evil", "kvd.nonexistent", "aiohttp.access", "urllib3",
             *(f"kvd.flood{i}" for i in range(500))]
    try:
        async with AdminServer(sock_path) as server:
            c = await Conn.open(sock_path)
            for name in bogus:
                reply = await c.call({"cmd": "log-level", "level": "debug", "logger": name})
                assert reply["ok"] is False, name[:40]
                assert reply["error"].startswith("log-level: unknown logger ")
                assert "kvd.heartbeat" in reply["error"] and len(reply["error"]) < 4096
            assert set(logging.Logger.manager.loggerDict) == before         # nothing created
            reply = await c.call({"cmd": "log-level", "level": "warning", "logger": "kvd.heartbeat"})
            assert reply == {"ok": True, "logger": "kvd.heartbeat", "level": "warning",
                             "previous": logging.getLevelName(saved[0]).lower()}
            assert known.level == logging.WARNING
            reply = await c.call({"cmd": "log-level", "level": "error", "logger": "root"})
            assert reply["ok"] and reply["logger"] == "root" and logging.getLogger().level == logging.ERROR
            reply = await c.call({"cmd": "log-level", "level": "info", "logger": "kvd"})   # a parent
            assert reply["ok"] and logging.getLogger("kvd").level == logging.INFO
            c.close()
            assert server.timed_out == 0
    finally:
        known.setLevel(saved[0])
        logging.getLogger().setLevel(saved[1])
        logging.getLogger("kvd").setLevel(logging.NOTSET)
