"""Endpoint pairs for every transport: `pair(url_kind)` -> (listener, connection)."""

from __future__ import annotations

import importlib.util

import pytest

import transports
from tools._twoproc import free_port
from transports import InprocRegistry, TransportOptions

HAVE_UCXX = importlib.util.find_spec("ucxx") is not None
KINDS = ["inproc", "zmq+tcp", "zmq+ipc",
         pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCXX, reason="ucxx not installed "
                                                       "(pip install 'kvd[ucx]')"))]

# Short deadlines keep the unhappy-path tests fast.
FAST = TransportOptions(send_timeout=2.0, request_timeout=2.0)


def url_for(kind: str, tmp_path) -> str:
    if kind == "inproc":
        return "inproc://node-a"
    if kind == "zmq+ipc":
        return f"zmq+ipc://{tmp_path}/node-a.sock"
    return f"{kind}://127.0.0.1:0"


def pytest_generate_tests(metafunc):
    """A test taking `kind` and not parametrizing it runs on every transport."""
    if "kind" in metafunc.fixturenames and not any(
            m.name == "parametrize" and "kind" in m.args[0] for m in metafunc.definition.iter_markers()):
        metafunc.parametrize("kind", KINDS)


@pytest.fixture
def fast_options() -> TransportOptions:
    return FAST


@pytest.fixture
def make_url(tmp_path):
    return lambda kind: url_for(kind, tmp_path)


@pytest.fixture
def registry() -> InprocRegistry:
    return InprocRegistry()


@pytest.fixture
async def endpoints(tmp_path, registry):
    """Factory: `await endpoints(kind)` -> (listener, connection); closed at teardown."""
    opened = []

    async def make(kind: str, options: TransportOptions = FAST):
        listener = await transports.listen(url_for(kind, tmp_path), options=options,
                                           registry=registry)
        opened.append(listener)
        conn = await transports.connect(listener.url, options=options, registry=registry)
        opened.append(conn)
        return listener, conn

    yield make
    for endpoint in reversed(opened):
        await endpoint.close()
