"""Pluggable transports, selected by URL scheme.

    listener = await transports.listen("zmq+tcp://127.0.0.1:0")
    conn = await transports.connect(listener.url)

| scheme  | module            | notes                                              |
|---------|-------------------|----------------------------------------------------|
| zmq+tcp | transports.zmq    | default between hosts; keys: CURVE                 |
| zmq+ipc | transports.zmq    | Unix socket, same host; keys: CURVE                |
| ucx     | transports.ucx    | optional extra `[ucx]`, imported lazily; keys: the |
|         |                   | handshake of transports.ucx_auth                   |
| inproc  | transports.inproc | needs an explicit InprocRegistry                   |

`curve` (keys: transports.keys.CurveServer to listen, CurveClient to
connect) authenticates zmq+* and ucx links; a listener with keys reports
each sender's key name as `Incoming.identity`. An inproc connection names
itself instead (`identity=`): only this process can reach it.
"""

from __future__ import annotations

from typing import Any

from .base import (
    AuthenticationFailed,
    Connection,
    Incoming,
    Listener,
    PeerGone,
    RequestTimeout,
    TransportClosed,
    TransportError,
    TransportOptions,
    TransportStats,
)
from .inproc import InprocRegistry

SCHEMES = ("zmq+tcp", "zmq+ipc", "ucx", "inproc")


def _scheme(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"unsupported transport url {url!r}; schemes: {', '.join(SCHEMES)}")
    return scheme


def _keys_allowed(scheme: str, curve: Any) -> None:
    if curve is not None and scheme == "inproc":
        raise ValueError("CURVE keys authenticate zmq+* and ucx links; inproc:// cannot use them")


async def listen(url: str, *, options: TransportOptions | None = None,
                 registry: InprocRegistry | None = None, curve: Any = None) -> Listener:
    """Bind a Listener at `url`. `registry` is required for inproc://,
    `curve` (a transports.keys.CurveServer) is accepted for zmq+* and ucx."""
    options = options or TransportOptions()
    scheme = _scheme(url)
    _keys_allowed(scheme, curve)
    if scheme == "inproc":
        from . import inproc
        return await inproc.listen(url[len("inproc://"):], registry=_need(registry), options=options)
    if scheme == "ucx":
        from . import ucx
        return await ucx.listen(url, options=options, keys=curve)
    from . import zmq
    return await zmq.listen(url, options=options, curve=curve)


async def connect(url: str, *, options: TransportOptions | None = None,
                  registry: InprocRegistry | None = None, curve: Any = None,
                  identity: str | None = None) -> Connection:
    """Open a Connection to the listener at `url` (same keywords as `listen`;
    `curve` is a transports.keys.CurveClient; `identity`, inproc only: the
    name this caller's messages carry)."""
    options = options or TransportOptions()
    scheme = _scheme(url)
    _keys_allowed(scheme, curve)
    if identity is not None and scheme != "inproc":
        raise ValueError(f"{scheme}:// links are named by their keys, not by identity=")
    if scheme == "inproc":
        from . import inproc
        return await inproc.connect(url[len("inproc://"):], registry=_need(registry), options=options,
                                    identity=identity)
    if scheme == "ucx":
        from . import ucx
        return await ucx.connect(url, options=options, keys=curve)
    from . import zmq
    return await zmq.connect(url, options=options, curve=curve)


def _need(registry: InprocRegistry | None) -> InprocRegistry:
    if registry is None:
        raise ValueError("inproc:// needs an explicit InprocRegistry (registry=...)")
    return registry


__all__ = ["listen", "connect", "SCHEMES", "Listener", "Connection", "Incoming",
           "TransportOptions", "TransportStats", "TransportError", "TransportClosed",
           "PeerGone", "AuthenticationFailed", "RequestTimeout", "InprocRegistry"]
