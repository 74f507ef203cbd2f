"""systemd notify protocol (sd_notify(3)) without a dependency.

Under `Type=notify` systemd passes `$NOTIFY_SOCKET`, a Unix datagram socket
(a path, or an abstract name written with a leading `@`). Each message is
one datagram of newline-separated `KEY=VALUE` fields:

    READY=1            startup finished: the unit becomes "active"
    STATUS=text        one line shown by `systemctl status`
    STOPPING=1         shutdown began (drain), so systemd waits TimeoutStopSec
    RELOADING=1        configuration reload began (with MONOTONIC_USEC=)
    WATCHDOG=1         keep-alive; missing it for WatchdogSec restarts the unit

Outside systemd `$NOTIFY_SOCKET` is unset and every call is a no-op, so the
daemons call the notifier unconditionally.

The watchdog is pinged from a task on the event loop (`run_watchdog`), not
from a thread: a loop that is blocked stops the pings and systemd restarts
the unit, which is exactly the failure we want it to catch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("kvd.sdnotify")

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

STATUS_INTERVAL_S = 1.0    # how often report_status looks; STATUS= is sent only when the line changed


class Notifier:
    """Sends notify datagrams to one address; disabled when `address` is None.

    Send errors are logged (once) and reported as False, never raised: losing
    a status line must not take the daemon down.
    """

    def __init__(self, address: str | None) -> None:
        self.address = address or None
        self._target: str | bytes | None = None
        self._sock: socket.socket | None = None
        self._warned = False
        if self.address is not None:
            if self.address.startswith("@"):
                # Abstract namespace: the name starts with a NUL byte.
                self._target = b"\0" + self.address[1:].encode()
            elif self.address.startswith("/"):
                self._target = self.address
            else:
                log.warning("ignoring NOTIFY_SOCKET=%r: not a path or @abstract name", self.address)
                self.address = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, unset: bool = False) -> "Notifier":
        """From `$NOTIFY_SOCKET`. With unset=True the notify variables are removed
        from os.environ, so that child processes do not inherit them."""
        environ = os.environ if env is None else env
        notifier = cls(environ.get("NOTIFY_SOCKET"))
        if unset and env is None:
            for key in _ENV_KEYS:
                os.environ.pop(key, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self._target is not None

    def notify(self, *fields: str) -> bool:
        """Send one datagram made of `fields` ("KEY=VALUE" each). True if sent."""
        if self._target is None:
            return False
        for f in fields:
            if "=" not in f or "\n" in f:
                raise ValueError(f"bad notify field {f!r}")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto("\n".join(fields).encode(), self._target)
            return True
        except OSError as e:
            if not self._warned:
                log.warning("sd_notify to %s failed: %s", self.address, e)
                self._warned = True
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([_status(status)] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(_status(text))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([_status(status)] if status else []))

    def reloading(self) -> bool:
        # systemd >= 253 wants the CLOCK_MONOTONIC time of the reload request.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str) -> str:
    # STATUS is a single line; a newline would start a bogus field.
    return "STATUS=" + " ".join(text.splitlines())


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between watchdog pings (half of `$WATCHDOG_USEC`), or None.

    None when the watchdog is off, the value is malformed, or `$WATCHDOG_PID`
    names another process (the variables were inherited from a parent).
    """
    environ = os.environ if env is None else env
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid is not None:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2 / 1e6


async def run_watchdog(notifier: Notifier, interval: float | None = None) -> None:
    """Ping WATCHDOG=1 every `interval` seconds (default: `watchdog_interval()`) until cancelled.

    Returns at once when the notifier is disabled or the watchdog is off. Run it
    as an owned task (a TaskGroup or the daemon's task registry) on the loop
    whose liveness it vouches for.
    """
    if interval is None:
        interval = watchdog_interval()
    if not notifier.enabled or interval is None:
        return
    if interval <= 0:
        raise ValueError("watchdog interval must be > 0")
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


async def report_status(notifier: Notifier, status_line: Callable[[], str],
                        interval: float = STATUS_INTERVAL_S) -> None:
    """Send READY=1 with `status_line()` now, then a STATUS= line whenever it
    changes (looked at every `interval` seconds), until cancelled.

    The caller awaits whatever "ready" means for its daemon before calling; run
    it as an owned task like `run_watchdog`.
    """
    line = status_line()
    notifier.ready(line)
    while True:
        await asyncio.sleep(interval)
        if (new := status_line()) != line:
            line = new
            notifier.status(line)
