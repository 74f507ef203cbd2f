"""The HTTP port is bound before anything else starts (``reserve_port``): a
taken port fails ``kvd serve`` at once with one line, before a model loads or
a node starts; a reserved port refuses clients until it serves."""

from __future__ import annotations

import asyncio
import errno
import socket
import subprocess
import sys

import pytest
from aiohttp import web

from kvd.api.connections import BindError, CappedSite, reserve_port

from .conftest import ROOT, TINY_ARGS


async def test_a_reserved_port_refuses_clients_until_the_site_serves_it():
    socks = reserve_port("127.0.0.1", 0)
    port = socks[0].getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="served")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = CappedSite(runner, socks, max_connections=4)
    await site.start()
    try:
        assert site.port == port and site.name == f"http://127.0.0.1:{port}"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"served")
        writer.close()
    finally:
        await runner.cleanup()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_reserve_port_binds_every_address_at_one_port_and_names_what_fails():
    socks = reserve_port("", 0)                    # every interface, IPv4 and IPv6 where the host has it
    try:
        assert len({s.getsockname()[1] for s in socks}) == 1
    finally:
        for s in socks:
            s.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=f"cannot bind HTTP port {port} on 127.0.0.1"):
            reserve_port("127.0.0.1", port)
    with pytest.raises(BindError, match="cannot resolve HTTP host"):
        reserve_port("no-such-host.invalid", 0)


@pytest.mark.parametrize("nodes", [[], ["--nodes", "2"]], ids=["embedded", "two-node-cluster"])
def test_kvd_serve_on_a_taken_port_exits_at_once_with_one_line(nodes):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--port", str(port), *TINY_ARGS, *nodes],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvd: error:")]
    assert errors == [f"kvd: error: [Errno 98] cannot bind HTTP port {port} on 127.0.0.1: Address already in use"]
    assert "Traceback" not in proc.stderr
    assert "loaded in" not in proc.stderr and "joined" not in proc.stderr   # no model loaded, no node started


def test_an_address_family_the_host_lacks_is_skipped(monkeypatch):
    """All interfaces on a host with IPv6 turned off: the IPv4 socket alone, as asyncio's
    create_server does; no family at all is a BindError naming the host."""
    real = socket.socket

    def without(*families):
        def make(family=socket.AF_INET, *args, **kwargs):
            if family in families:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            return real(family, *args, **kwargs)
        return make

    monkeypatch.setattr(socket, "socket", without(socket.AF_INET6))
    socks = reserve_port("", 0)
    try:
        assert [s.family for s in socks] == [socket.AF_INET]
    finally:
        for s in socks:
            s.close()
    monkeypatch.setattr(socket, "socket", without(socket.AF_INET, socket.AF_INET6))
    with pytest.raises(BindError, match="none of its address families"):
        reserve_port("127.0.0.1", 0)
