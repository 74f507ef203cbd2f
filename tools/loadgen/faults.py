"""Fault injection: ask a daemon's admin socket to fail a node mid-run.

The admin socket is a Unix socket speaking line-delimited JSON::

    -> {"cmd": "fail", "node": "n1", "mode": "exit"}\\n
    <- {"ok": ...}\\n          or   {"error": "why"}\\n

``--fail NODE@SECONDS[:MODE]`` schedules one such command SECONDS after the
run starts; MODE is ``exit`` (the node process dies, the default) or
``stop`` (it freezes, as with SIGSTOP).  Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from dataclasses import dataclass

import orjson

MODES = ("exit", "stop")


class AdminSocketError(Exception):
    """The admin socket is missing, refuses, or answers badly (one-line message)."""


@dataclass(frozen=True)
class FaultSpec:
    node: str
    at_s: float
    mode: str = "exit"

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """``"n1@5"``, ``"n1@2.5:stop"`` -> FaultSpec.  Raises ValueError with the reason."""
        node, sep, when = text.rpartition("@")
        if not sep or not node:
            raise ValueError(f"bad --fail {text!r}: expected NODE@SECONDS[:MODE]")
        when, _, mode = when.partition(":")
        mode = mode or "exit"
        if mode not in MODES:
            raise ValueError(f"bad --fail {text!r}: mode must be one of {', '.join(MODES)}")
        try:
            at_s = float(when)
        except ValueError:
            raise ValueError(f"bad --fail {text!r}: {when!r} is not a number of seconds") from None
        if not math.isfinite(at_s) or at_s < 0:
            raise ValueError(f"bad --fail {text!r}: seconds must be finite and >= 0")
        return cls(node, at_s, mode)


def check_admin_socket(path: str, timeout_s: float = 2.0) -> None:
    """Raise AdminSocketError unless something accepts connections at ``path``."""
    if not os.path.exists(path):
        raise AdminSocketError(f"target has no admin socket at {path} (no such file)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError as exc:
        raise AdminSocketError(f"target has no admin socket at {path} ({exc.strerror or exc})") from None
    finally:
        sock.close()


async def admin_request(path: str, payload: dict, timeout_s: float = 5.0) -> dict:
    """Send one command line, return the parsed reply line.

    Raises AdminSocketError on a missing socket, a timeout, or a reply that is
    not one JSON object; a reply with ``"error"`` is returned as is.
    """
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise AdminSocketError(f"target has no admin socket at {path} ({exc})") from None
    try:
        writer.write(orjson.dumps(payload) + b"\n")
        await asyncio.wait_for(writer.drain(), timeout_s)
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise AdminSocketError(f"admin socket {path}: no reply ({type(exc).__name__})") from None
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), timeout_s)
        except (OSError, asyncio.TimeoutError):
            pass
    try:
        reply = orjson.loads(line)
    except orjson.JSONDecodeError:
        reply = None
    if not isinstance(reply, dict):
        raise AdminSocketError(f"admin socket {path}: reply is not a JSON object: {line[:200]!r}")
    return reply


async def inject(path: str, spec: FaultSpec, run_start: float, log: list[dict],
                 timeout_s: float = 5.0) -> dict:
    """Sleep until ``run_start + spec.at_s`` (perf_counter clock), send the
    fail command, and append what happened to ``log``.  Never raises for the
    socket's or the daemon's errors; they are logged as the event's error.
    Returns the event (also in ``log`` from the start, so a cancelled
    injection still leaves its trace).
    """
    event = {"node": spec.node, "mode": spec.mode, "at_s": spec.at_s,
             "sent_s": None, "ok": False, "reply": None, "error": None}
    log.append(event)
    # The event loop's timer may fire a little early; never send before the moment.
    while (delay := run_start + spec.at_s - time.perf_counter()) > 0:
        await asyncio.sleep(delay)
    event["sent_s"] = time.perf_counter() - run_start
    try:
        reply = await admin_request(path, {"cmd": "fail", "node": spec.node, "mode": spec.mode}, timeout_s)
    except AdminSocketError as exc:
        event["error"] = str(exc)
        return event
    event["reply"] = reply
    if "error" in reply:
        event["error"] = str(reply["error"])
    else:
        event["ok"] = "ok" in reply
        if not event["ok"]:
            event["error"] = "reply has neither ok nor error"
    return event
