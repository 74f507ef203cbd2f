"""Admin socket: line-delimited JSON commands over a Unix stream socket.

One `AdminServer` per daemon (coordinator or node). Operators reach it with
`kvctl`; tests reach it with `kvd.ctl.request`.

Protocol (one request line in, one reply line out, in order, per connection):

    -> {"cmd": "cache stats"}                       (canonical form)
    -> {"cmd": "cache", "sub": "stats"}             (same command)
    -> {"cmd": "drain", "node": "n1"}               (arguments are top-level keys)
    <- {"ok": true, ...result}
    <- {"ok": false, "error": "unknown command 'x' (try 'help')"}

A line is at most 64 KiB (`MAX_LINE`). Anything wrong with a request (not
JSON, not an object, unknown command, bad arguments, a handler that raises or
overruns its deadline) is answered with an error line; the connection and
the server keep working. Only an oversized line costs the rest of that line:
it is discarded up to the next newline.

No client can hold the server (the HTTP edge's bounds, kvd/api/connections.py):
a connection must complete a request line within `line_timeout` seconds of
opening and of each reply, and read its replies within as long, else it gets
an error line if it can take one and is closed; at most `max_connections`
are served at once, and one beyond gets a single error line and is closed
(`RefusedConnection`). Connections are served concurrently, so one slow
command delays only its own connection's later replies.

Security: the socket file is mode 0600 (only the daemon's user may connect)
and a missing parent directory is created 0700. There is no other
authentication: whoever can open the socket is an operator.

Handlers:

    async def drain(args: dict) -> dict: ...
    admin.register("drain", drain, help="stop routing to a node",
                   args_schema={"node": (str, False)})

`args` holds only the keys the schema declares (validated for type and
presence; unknown keys are an error). `args_schema=None` means the command
takes no arguments. A handler raises `AdminError("message")` for an error the
operator should read verbatim; any other exception is logged with its
traceback and answered as an internal error.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from kvd.api.connections import RefusedConnection
from kvd.ratelog import RateLimitedLog
from transports import TransportError

log = logging.getLogger("kvd.admin")

MAX_LINE = 64 * 1024
DEFAULT_COMMAND_TIMEOUT = 10.0
DEFAULT_LINE_TIMEOUT = 10.0      # seconds to send a complete request line (and to read a reply)
DEFAULT_MAX_CONNECTIONS = 64     # admin connections served at once; more are refused
# Linux sun_path is 108 bytes including the trailing NUL.
MAX_SOCKET_PATH = 107

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# name -> (type or tuple of types, required)
ArgsSchema = Mapping[str, tuple[type | tuple[type, ...], bool]]

_RESERVED_KEYS = frozenset({"cmd", "sub"})
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The packages whose loggers `log-level` may set (kvd's own code).
KVD_LOGGER_PACKAGES = ("kvd", "engine", "kernels", "transports", "tools")
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class AdminError(Exception):
    """An error whose message is sent to the operator as is."""


# what a command handler raises for bad input or an unreachable or slow peer: the
# command's error, not a bug (``as_admin_errors``)
ADMIN_ERRORS = (ValueError, TypeError, TransportError, TimeoutError)


def as_admin_errors(handler: Callable[[dict], Awaitable[dict]], *,
                    name_type: bool = False) -> Callable[[dict], Awaitable[dict]]:
    """``handler`` with an ``ADMIN_ERRORS`` exception turned into an
    ``AdminError`` (the command's error reply, its message as is, or
    prefixed with the exception's type name when ``name_type``)."""
    async def wrapped(args: dict) -> dict:
        try:
            return await handler(args)
        except ADMIN_ERRORS as exc:
            raise AdminError(f"{type(exc).__name__}: {exc}" if name_type else str(exc)) from None
    return wrapped


class AdminSocketInUse(RuntimeError):
    """Another live server answers on the socket path."""


@dataclass(frozen=True)
class Command:
    name: str
    handler: Handler
    help: str = ""
    args_schema: Mapping[str, tuple[tuple[type, ...], bool]] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "cmd": self.name,
            "help": self.help,
            "args": {k: {"type": "|".join(t.__name__ for t in types), "required": req}
                     for k, (types, req) in self.args_schema.items()},
        }


def normalize_schema(schema: ArgsSchema | None) -> dict[str, tuple[tuple[type, ...], bool]]:
    out: dict[str, tuple[tuple[type, ...], bool]] = {}
    for key, spec in (schema or {}).items():
        if key in _RESERVED_KEYS:
            raise ValueError(f"argument name {key!r} is reserved")
        types, required = spec
        types = types if isinstance(types, tuple) else (types,)
        if not all(isinstance(t, type) for t in types) or not isinstance(required, bool):
            raise ValueError(f"bad schema entry for {key!r}: {spec!r}")
        out[key] = (types, required)
    return out


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    # JSON has no int/bool distinction in Python's eyes (bool subclasses int):
    # a `true` is never accepted as a number, and an integer is a valid float.
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def validate_args(command: Command, args: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments `command` declares, checked; raises AdminError otherwise."""
    schema = command.args_schema
    unknown = sorted(set(args) - set(schema))
    if unknown:
        allowed = ", ".join(sorted(schema)) or "none"
        raise AdminError(f"{command.name}: unknown argument(s) {', '.join(unknown)} (allowed: {allowed})")
    for key, (types, required) in schema.items():
        if key not in args:
            if required:
                raise AdminError(f"{command.name}: missing required argument {key!r}")
            continue
        if not _type_ok(args[key], types):
            want = " or ".join(t.__name__ for t in types)
            raise AdminError(f"{command.name}: argument {key!r} must be {want}, "
                             f"got {type(args[key]).__name__}")
    return dict(args)


def kvd_loggers() -> list[str]:
    """The names of the loggers kvd's modules have made (sorted), and their
    parent names (``kvd`` for ``kvd.admin``): the names `log-level` accepts.
    A name from this list never creates a logger beyond these (logging's
    manager already holds each, at least as a placeholder)."""
    return sorted(name for name in list(logging.Logger.manager.loggerDict)
                  if name.partition(".")[0] in KVD_LOGGER_PACKAGES)


def parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    """(command name, arguments) from one request line; raises AdminError."""
    try:
        msg = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise AdminError(f"invalid JSON: {e}") from None
    if not isinstance(msg, dict):
        raise AdminError(f"request must be a JSON object, got {type(msg).__name__}")
    cmd, sub = msg.pop("cmd", None), msg.pop("sub", None)
    if not isinstance(cmd, str) or not cmd.strip():
        raise AdminError('request needs "cmd": a non-empty string')
    if sub is not None and not isinstance(sub, str):
        raise AdminError('"sub" must be a string')
    name = " ".join(cmd.split() + (sub.split() if sub else []))
    return name, msg


class AdminServer:
    """Serves registered commands on a Unix socket until `close()`.

    Lifecycle: `register(...)` any time, `await start()`, `await close()`
    (also an async context manager). Each connection is a task owned by the
    server and cancelled by `close()`; requests on one connection run one at
    a time, connections run concurrently. Every handler runs under a deadline
    (`command_timeout` seconds). A connection that sends no complete request
    line (or reads no reply) for `line_timeout` seconds is closed; beyond
    `max_connections` open ones a new one is refused. `refused` and
    `timed_out` count both (and `ping` reports them).
    """

    def __init__(self, path: str | os.PathLike[str], *, name: str = "kvd",
                 command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
                 line_timeout: float = DEFAULT_LINE_TIMEOUT,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if command_timeout <= 0:
            raise ValueError("command_timeout must be > 0")
        if line_timeout <= 0:
            raise ValueError("line_timeout must be > 0")
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self.path = Path(path)
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise ValueError(f"admin socket path is longer than {MAX_SOCKET_PATH} bytes: {self.path}")
        self.name = name
        self.command_timeout = command_timeout
        self.line_timeout = line_timeout
        self.max_connections = max_connections
        self.refused = 0                   # connections turned away at max_connections
        self.timed_out = 0                 # connections closed by line_timeout
        self._open = 0                     # connections admitted and not yet finished
        self._refusal = orjson.dumps({"ok": False, "error": f"too many admin connections (limit "
                                      f"{max_connections}); closing, retry later"}) + b"\n"
        self._warn = RateLimitedLog(log)   # a flood of refusals or timeouts: one line per 10 s
        self._commands: dict[str, Command] = {}
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._inode: tuple[int, int] | None = None
        self._started = time.monotonic()
        self.register("help", self._help, help="list commands, their help and arguments")
        self.register("ping", self._ping, help="liveness check: name, pid, uptime")
        self.register("log-level", self._log_level,
                      help="set a logger's level: the root logger (default) or one of kvd's "
                           "(an unknown name lists them)",
                      args_schema={"level": (str, True), "logger": (str, False)})
        self.register("keys", self._keys,
                      help="generate a CURVE keypair: DIR/NAME.key and DIR/NAME.key_secret (0600)",
                      args_schema={"dir": (str, True), "name": (str, True)})

    # -- commands -------------------------------------------------------

    def register(self, name: str, handler: Handler, help: str = "",
                 args_schema: ArgsSchema | None = None) -> None:
        """Add command `name` ("cache stats": words separated by one space).

        Raises ValueError for a malformed or already registered name.
        """
        if name != " ".join(name.split()) or not name:
            raise ValueError(f"bad command name {name!r}")
        if name in self._commands:
            raise ValueError(f"command {name!r} is already registered")
        if not callable(handler):
            raise TypeError(f"handler for {name!r} is not callable")
        self._commands[name] = Command(name, handler, help, normalize_schema(args_schema))

    @property
    def commands(self) -> list[str]:
        return sorted(self._commands)

    async def dispatch(self, line: bytes) -> dict[str, Any]:
        """The reply object for one request line. Never raises (but CancelledError)."""
        name = "?"
        try:
            name, raw_args = parse_request(line)
            command = self._commands.get(name)
            if command is None:
                raise AdminError(f"unknown command {name!r} (try 'help')")
            args = validate_args(command, raw_args)
            try:
                async with asyncio.timeout(self.command_timeout):
                    result = command.handler(args)
                    if inspect.isawaitable(result):
                        result = await result
            except TimeoutError:
                raise AdminError(f"{name}: timed out after {self.command_timeout:g} s") from None
            if not isinstance(result, dict):
                log.error("admin command %r returned %s, not a dict", name, type(result).__name__)
                raise AdminError(f"{name}: internal error: handler returned {type(result).__name__}")
            return {**result, "ok": True}
        except AdminError as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:  # a handler bug must not take the server down
            log.exception("admin command %r failed", name)
            return {"ok": False, "error": f"{name}: internal error: {type(e).__name__}: {e}"}

    async def _help(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"name": self.name, "commands": [self._commands[c].describe() for c in self.commands]}

    async def _ping(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"pong": True, "name": self.name, "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - self._started, 3),
                "connections": {"open": self._open, "max": self.max_connections,
                                "refused": self.refused, "timed_out": self.timed_out}}

    async def _log_level(self, args: dict[str, Any]) -> dict[str, Any]:
        level = args["level"].upper()
        if level not in _LOG_LEVELS:
            raise AdminError(f"log-level: level must be one of {', '.join(l.lower() for l in _LOG_LEVELS)}")
        name = args.get("logger", "")
        if name not in ("", "root") and name not in kvd_loggers():
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise AdminError(f"log-level: unknown logger {shown!r}; kvd's loggers: root, "
                             + ", ".join(kvd_loggers()))
        name = "" if name == "root" else name
        logger = logging.getLogger(name or None)
        previous = logging.getLevelName(logger.level)
        logger.setLevel(level)
        log.info("log level of %s set to %s by admin", name or "root", level)
        return {"logger": name or "root", "level": level.lower(), "previous": previous.lower()}

    async def _keys(self, args: dict[str, Any]) -> dict[str, Any]:
        directory, key_name = Path(args["dir"]), args["name"]
        if not directory.is_absolute():
            raise AdminError("keys: dir must be an absolute path (it is resolved by the daemon)")
        if not _KEY_NAME.fullmatch(key_name):
            raise AdminError("keys: name must be 1-64 of [A-Za-z0-9_.-], not starting with . - or _")
        # Imported here: pyzmq is needed only by this command.
        from transports.zmq import generate_keypair
        try:
            public, secret = await asyncio.to_thread(generate_keypair, directory, key_name)
        except FileExistsError:
            raise AdminError(f"keys: {directory / key_name}.key_secret already exists") from None
        except OSError as e:
            raise AdminError(f"keys: {e.strerror or e}: {e.filename or directory}") from None
        return {"public": str(public), "secret": str(secret)}

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        """Bind and listen. Raises AdminSocketInUse if a live server owns the path."""
        if self._server is not None:
            raise RuntimeError("admin server already started")
        self._prepare_path()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.fspath(self.path))
            # No window: until listen() a connect() is refused whatever the
            # file's mode is, and the mode is 0600 before we listen. (We do
            # not touch the umask: it is process-wide and other threads
            # create files concurrently.)
            os.chmod(self.path, 0o600)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            self._server = await asyncio.get_running_loop().create_unix_server(self._accept, sock=sock)
        except BaseException:
            sock.close()
            self._unlink_own_socket()
            raise
        self._started = time.monotonic()
        log.info("admin socket listening on %s", self.path)

    def _prepare_path(self) -> None:
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise AdminSocketInUse(f"{self.path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(os.fspath(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale admin socket %s", self.path)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return
        except OSError as e:
            if e.errno == errno.EAGAIN:  # backlog full: someone is very much alive
                raise AdminSocketInUse(f"a server is listening on {self.path}") from None
            raise
        finally:
            probe.close()
        raise AdminSocketInUse(f"a server is already listening on {self.path}")

    def _unlink_own_socket(self) -> None:
        # Only remove the file we bound: a successor may have replaced it.
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if self._inode == (st.st_dev, st.st_ino):
            os.unlink(self.path)
        self._inode = None

    async def close(self) -> None:
        """Stop listening, cancel open connections, remove the socket file. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if server is not None:
            await server.wait_closed()
        self._unlink_own_socket()

    async def __aenter__(self) -> "AdminServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connections ------------------------------------------------------

    def _accept(self) -> asyncio.BaseProtocol:
        """The protocol of a new connection: served (it holds one of the
        `max_connections` slots until `_serve_connection` ends), or, at the
        cap, answered one error line and closed.

        Counted here, when the connection is accepted, not when its task
        first runs: a burst of connects is accepted in one go, before any of
        their tasks has run."""
        if self._open >= self.max_connections:
            self.refused += 1
            self._warn.warning("refused", "admin connection refused: %d open, the limit (%d refused so far)",
                               self._open, self.refused)
            return RefusedConnection(self._refusal)
        self._open += 1
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=MAX_LINE + 1), self._serve_connection)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        lines = _read_lines(reader, self.line_timeout)
        try:
            while True:
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    self.timed_out += 1
                    self._warn.log(logging.INFO, "timeout", "admin connection closed: no complete request "
                                   "line within %g s (%d so far)", self.line_timeout, self.timed_out)
                    await self._reply(writer, {"ok": False, "error": f"no complete request line within "
                                               f"{self.line_timeout:g} s; closing the connection"})
                    break
                reply = await self.dispatch(line) if line is not None else {
                    "ok": False, "error": f"request line longer than {MAX_LINE} bytes"}
                await self._reply(writer, reply)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass                      # gone, or not reading its replies
        except asyncio.CancelledError:
            # close(): end quietly (3.11's StreamReaderProtocol logs a
            # connection task that ends cancelled as an error)
            pass
        finally:
            self._open -= 1
            self._connections.discard(task)
            await lines.aclose()
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (ConnectionError, TimeoutError, asyncio.CancelledError):
                pass

    async def _reply(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        """Write one reply line; TimeoutError when the client has not read it
        (and what was queued before it) within `line_timeout` seconds."""
        writer.write(_encode_reply(reply))
        async with asyncio.timeout(self.line_timeout):
            await writer.drain()


def _encode_reply(reply: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(reply, option=orjson.OPT_NON_STR_KEYS) + b"\n"
    except TypeError as e:
        log.error("admin reply is not JSON-serializable: %s", e)
        return orjson.dumps({"ok": False, "error": f"internal error: reply not serializable: {e}"}) + b"\n"


async def _read_lines(reader: asyncio.StreamReader, line_timeout: float):
    """Yield each request line (without the newline), or None for an oversized one.

    An oversized line is reported once and skipped up to its newline, so the
    connection stays in step with the client. Blank lines are ignored.
    Raises TimeoutError when the next line (a blank one does not count) is
    not complete `line_timeout` seconds after the start or after the
    consumer resumed this generator (it has answered the previous line).
    """
    loop = asyncio.get_running_loop()
    buf = bytearray()
    discarding = False
    deadline = loop.time() + line_timeout
    while True:
        nl = buf.find(b"\n")
        if nl < 0:
            if len(buf) > MAX_LINE and not discarding:
                discarding = True
                buf.clear()
                yield None
                deadline = loop.time() + line_timeout
            elif discarding:
                buf.clear()
            async with asyncio.timeout_at(deadline):
                chunk = await reader.read(MAX_LINE)
            if not chunk:
                return  # EOF; a partial last line without newline is dropped
            buf += chunk
            continue
        line = bytes(buf[:nl])
        del buf[:nl + 1]
        if discarding:
            discarding = False
            continue
        if len(line) > MAX_LINE:
            yield None
        elif line.strip():
            yield line
        else:
            continue
        deadline = loop.time() + line_timeout
