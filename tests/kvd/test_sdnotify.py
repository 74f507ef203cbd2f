"""sd_notify client against real Unix datagram sockets (path and abstract)."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
import uuid

import pytest

from kvd.sdnotify import Notifier, run_watchdog, watchdog_interval


@pytest.fixture
def listener():
    """(NOTIFY_SOCKET value, receiving socket) bound in a short tmp dir."""
    with tempfile.TemporaryDirectory(prefix="kvd-sd-", dir="/tmp") as d:
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(5)
        yield path, sock
        sock.close()


def drain(sock: socket.socket) -> list[bytes]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(5)


def test_datagrams_on_a_path_socket(listener):
    path, sock = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready()
    assert sock.recv(4096) == b"READY=1"
    assert n.ready(status="serving on 127.0.0.1:8000")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving on 127.0.0.1:8000"
    assert n.status("draining 3 requests\nsecond line")
    assert sock.recv(4096) == b"STATUS=draining 3 requests second line"
    assert n.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    assert n.stopping(status="draining")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    assert n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    reloading, stamp = sock.recv(4096).split(b"\n")
    assert reloading == b"RELOADING=1" and stamp.startswith(b"MONOTONIC_USEC=")
    assert before <= int(stamp.split(b"=")[1]) <= before + 10_000_000
    assert n.notify("READY=1", "STATUS=x", "MAINPID=1")
    assert sock.recv(4096) == b"READY=1\nSTATUS=x\nMAINPID=1"
    with pytest.raises(ValueError):
        n.notify("READY")
    with pytest.raises(ValueError):
        n.notify("STATUS=a\nREADY=1")
    n.close()
    assert drain(sock) == []


def test_abstract_namespace_socket():
    name = f"kvd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready() and n.watchdog()
        assert sock.recv(4096) == b"READY=1"
        assert sock.recv(4096) == b"WATCHDOG=1"
        n.close()
    finally:
        sock.close()


def test_noop_without_notify_socket():
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.ready() is False and n.status("x") is False and n.watchdog() is False
    assert Notifier.from_env({"NOTIFY_SOCKET": ""}).enabled is False
    assert Notifier("relative/path").enabled is False


def test_send_failure_is_reported_not_raised(tmp_path, caplog):
    n = Notifier(str(tmp_path / "nobody-listens"))
    assert n.enabled
    assert n.ready() is False
    assert n.watchdog() is False
    assert sum("sd_notify" in r.getMessage() for r in caplog.records) == 1  # warned once


def test_from_env_unset_strips_the_variables(listener, monkeypatch):
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier.from_env(unset=True)
    assert n.enabled and "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ
    assert n.ready() and sock.recv(4096) == b"READY=1"


def test_watchdog_interval():
    me = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": me}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}) is None
    for bad in ("", "0", "-5", "abc", "1.5"):
        assert watchdog_interval({"WATCHDOG_USEC": bad}) is None
    assert watchdog_interval({}) is None


async def test_run_watchdog_pings_from_the_event_loop(listener):
    path, sock = listener
    n = Notifier(path)
    task = asyncio.create_task(run_watchdog(n, interval=0.01))
    try:
        got = []
        while len(got) < 3:
            got.append(await asyncio.to_thread(sock.recv, 4096))
        assert got == [b"WATCHDOG=1"] * 3
        # Block the loop: the watchdog task cannot run, so no ping is sent.
        await asyncio.sleep(0.02)
        drain(sock)
        time.sleep(0.2)
        assert drain(sock) == []
        # Once the loop runs again the pings resume.
        assert await asyncio.to_thread(sock.recv, 4096) == b"WATCHDOG=1"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        n.close()


async def test_run_watchdog_returns_when_off(listener, monkeypatch):
    path, _ = listener
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    await asyncio.wait_for(run_watchdog(Notifier(path)), 1)   # watchdog off
    await asyncio.wait_for(run_watchdog(Notifier(None), interval=0.01), 1)  # not under systemd
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    task = asyncio.create_task(run_watchdog(Notifier(path)))  # interval from the environment: 10 ms
    await asyncio.sleep(0.1)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
