"""The node processes of ``kvd serve --nodes N``: started, reaped, logged, restarted.

One task per node (``_watch``) starts its process and awaits its exit, so a
node that dies is reaped at once (never left a zombie) and its end is logged
with its pid and exit code or signal name. With ``restart``
(``[cluster].restart_nodes``, on by default) a node that exits while the
cluster runs is started again with the same command (name, keys, flags) after
a backoff: RESTART_BACKOFF_S, doubled for each further exit within
STABLE_RUN_S of its start, up to RESTART_BACKOFF_MAX_S. The new process
registers with the coordinator as a new incarnation, as a node restarted by
systemd would (docs/cluster.md). A node whose engine died exits with
ENGINE_DEAD_EXIT (after its Goodbye named the cause and its lost requests)
and is restarted the same way. ``stop`` ends them all and restarts none.

Contracts: ``run`` returns once every watcher ended (after ``stop``, or, with
restart off, once every node exited); ``stop`` returns once every process was
reaped, SIGKILLing those still alive after its timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger("kvd.supervisor")

RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
STABLE_RUN_S = 60.0        # a node that ran this long starts over at the first backoff
KILL_WAIT_S = 5.0          # after SIGKILL: how long stop waits for the kernel to reap
ENGINE_DEAD_EXIT = 3       # the exit status of a kvd process whose engine died (kvd.cli)


def describe_exit(returncode: int) -> str:
    """"exited with code 1", "killed by SIGKILL" (asyncio's negative returncode),
    "exited with code 3 (its engine died)"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == ENGINE_DEAD_EXIT:
        return f"exited with code {returncode} (its engine died)"
    return f"exited with code {returncode}"


class NodeSupervisor:
    def __init__(self, commands: dict[str, list[str]], *, restart: bool,
                 env: dict[str, str] | None = None,
                 on_exit: Callable[[str, str], Awaitable[None]] | None = None) -> None:
        self.commands = commands               # node name -> argv
        self.restart = restart
        self.env = env
        self.on_exit = on_exit                 # (name, "killed by SIGKILL"): an unplanned exit
        self.procs: dict[str, asyncio.subprocess.Process] = {}   # live processes
        self.exits: list[tuple[str, int, int]] = []              # (name, pid, returncode)
        self.restarts: collections.Counter[str] = collections.Counter()
        self._stopping = asyncio.Event()

    @property
    def pids(self) -> dict[str, int]:
        """name -> pid of each node process now running."""
        return {name: p.pid for name, p in self.procs.items()}

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for name in self.commands:
                tg.create_task(self._watch(name), name=f"node process {name}")

    async def _watch(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        quick_exits = 0
        while not self._stopping.is_set():
            proc = await asyncio.create_subprocess_exec(*self.commands[name], env=self.env)
            self.procs[name] = proc
            if self._stopping.is_set():         # stop came while it was being started
                proc.send_signal(signal.SIGTERM)
            started = loop.time()
            try:
                code = await proc.wait()       # reaps it
            finally:
                self.procs.pop(name, None)
            self.exits.append((name, proc.pid, code))
            if self._stopping.is_set():
                log.info("node %s (pid %d) %s", name, proc.pid, describe_exit(code))
                return
            how = describe_exit(code)
            if not self.restart:
                log.error("node %s (pid %d) %s; not restarted (restart_nodes is off)", name, proc.pid, how)
            else:
                quick_exits = quick_exits + 1 if loop.time() - started < STABLE_RUN_S else 1
                delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (quick_exits - 1))
                log.error("node %s (pid %d) %s; restarting it in %gs", name, proc.pid, how, delay)
            if self.on_exit is not None:
                try:
                    await self.on_exit(name, how)
                except Exception:  # noqa: BLE001 -- the watcher must go on restarting the node
                    log.exception("node %s: handling its exit failed", name)
            if not self.restart:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stopping.wait()
            if not self._stopping.is_set():
                self.restarts[name] += 1

    async def stop(self, timeout: float) -> None:
        """Restart nothing more; send every node SIGTERM then SIGINT (its first
        and second stop signal: it leaves without draining, as the front door has
        already ended what ran there); SIGKILL those alive after ``timeout``."""
        self._stopping.set()
        for sig in (signal.SIGTERM, signal.SIGINT):
            for proc in list(self.procs.values()):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
        if await self._all_exited(timeout):
            return
        for name, proc in list(self.procs.items()):
            log.warning("node %s (pid %d) still running %gs after SIGTERM: SIGKILL", name, proc.pid, timeout)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await self._all_exited(KILL_WAIT_S)

    async def _all_exited(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.procs:
                    await asyncio.sleep(0.05)
        return not self.procs
