"""URL selection and the optional UCX extra."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import transports
from transports.inproc import InprocListener
from transports.zmq import ZmqListener, zmq_endpoint

ROOT = Path(__file__).resolve().parents[2]


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


def test_ucx_progress_mode_is_validated():
    with pytest.raises(ValueError, match="ucx_progress_mode"):
        transports.TransportOptions(ucx_progress_mode="spin")


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")
@pytest.mark.parametrize("mode, env, want", [(None, None, "blocking"), ("thread", None, "thread"),
                                             ("thread", "blocking", "blocking")])
def test_ucx_is_set_up_in_the_configured_progress_mode(mode, env, want):
    """UCX is set up once per process: in a fresh one, the first listener's
    option decides (default "blocking"), unless UCXPY_PROGRESS_MODE is set."""
    opts = f"transports.TransportOptions(ucx_progress_mode={mode!r})" if mode else "None"
    code = ("import asyncio, transports, ucxx.core\n"
            "async def main():\n"
            f"    lis = await transports.listen('ucx://127.0.0.1:0', options={opts})\n"
            "    print(ucxx.core._get_ctx().progress_mode)\n"
            "    await lis.close()\n"
            "asyncio.run(main())\n")
    environ = {k: v for k, v in os.environ.items() if k != "UCXPY_PROGRESS_MODE"}
    if env:
        environ["UCXPY_PROGRESS_MODE"] = env
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip().splitlines()[-1] == want
