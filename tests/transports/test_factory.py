"""URL selection and the optional UCX extra."""

from __future__ import annotations

import sys

import pytest

import transports
from transports.inproc import InprocListener
from transports.zmq import ZmqListener, zmq_endpoint


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:1", "zmq+udp://x:1", "127.0.0.1:80", "http://x"])
async def test_unknown_scheme_is_a_clear_error(url):
    with pytest.raises(ValueError, match="unsupported transport url"):
        await transports.listen(url)


async def test_inproc_needs_an_explicit_registry():
    with pytest.raises(ValueError, match="InprocRegistry"):
        await transports.listen("inproc://x")


async def test_scheme_selects_the_implementation(tmp_path, registry):
    zl = await transports.listen("zmq+tcp://127.0.0.1:0")
    il = await transports.listen("inproc://a", registry=registry)
    try:
        assert isinstance(zl, ZmqListener) and zl.url.startswith("zmq+tcp://127.0.0.1:")
        assert not zl.url.endswith(":0")  # the bound port is reported
        assert isinstance(il, InprocListener) and il.url == "inproc://a"
    finally:
        await zl.close()
        await il.close()


def test_zmq_endpoint_translation():
    assert zmq_endpoint("zmq+tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert zmq_endpoint("zmq+tcp://127.0.0.1:0") == "tcp://127.0.0.1:*"
    assert zmq_endpoint("zmq+ipc:///run/kvd/n1.sock") == "ipc:///run/kvd/n1.sock"


async def test_missing_ucxx_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "ucxx", None)  # makes `import ucxx` fail
    with pytest.raises(ImportError, match=r"kvd\[ucx\]"):
        await transports.listen("ucx://127.0.0.1:0")


async def test_bad_ucx_url():
    with pytest.raises(ValueError, match="ucx://host:port"):
        await transports.connect("ucx://nohostport")
