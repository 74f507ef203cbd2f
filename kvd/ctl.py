"""kvctl: the operator's client for a daemon's admin socket.

    kvctl [--socket PATH] [--json] [--timeout S] COMMAND [ARGS...]

    kvctl status | nodes | requests | ping | help
    kvctl drain [NODE]          kvctl undrain [NODE]
    kvctl role NODE mixed|prefill|decode    kvctl handoff REQUEST_ID
    kvctl cache stats           kvctl cache flush
    kvctl log-level LEVEL [--logger NAME]
    kvctl fail [NODE] --mode exit|stop|resume|drop-transfers|engine
    kvctl fail --mode stall [--seconds S]   (the coordinator blocks its own loop)
    kvctl keys --dir DIR --name NAME        (local: no daemon needed)
    kvctl call CMD [KEY=VALUE ...]          (any registered command)
    kvctl raw '{"cmd": "status"}'

The socket is `--socket`, else `$KVD_ADMIN_SOCKET`, else
/run/kvd/coordinator.sock. Exit status: 0 ok, 1 error (an error reply, or
the daemon cannot be reached: one line on stderr), 2 usage error.
The protocol is described in kvd/api/admin.py and docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_SOCKET = "/run/kvd/coordinator.sock"
CONNECT_TIMEOUT = 2.0
# Longer than the server's default command deadline (10 s), so that a slow
# command is reported by the server's own timeout error rather than ours.
REPLY_TIMEOUT = 15.0
MAX_REPLY = 64 * 1024 * 1024
FAIL_MODES = ("exit", "stop", "resume", "drop-transfers", "engine", "stall")


class AdminUnavailable(Exception):
    """The daemon could not be reached or did not answer in time."""


def default_socket(env: dict[str, str] | None = None) -> str:
    environ = os.environ if env is None else env
    return environ.get("KVD_ADMIN_SOCKET") or DEFAULT_SOCKET


def request(path: str | os.PathLike[str], message: dict[str, Any], *,
            connect_timeout: float = CONNECT_TIMEOUT, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
    """Send one request, return the reply object (whose "ok" may be false).

    Raises AdminUnavailable with an operator-readable message when the socket
    is missing, refuses, is not ours to open, or the reply misses `timeout`.
    Blocking; for async code run it in a thread.
    """
    path = os.fspath(path)
    line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(connect_timeout)
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise AdminUnavailable(f"no admin socket at {path} (is the daemon running? "
                                   "use --socket or $KVD_ADMIN_SOCKET)") from None
        except ConnectionRefusedError:
            raise AdminUnavailable(f"admin socket {path} refuses connections "
                                   "(stale socket: the daemon is not running)") from None
        except PermissionError:
            raise AdminUnavailable(f"permission denied on {path} (the socket is mode 0600: "
                                   "run kvctl as the daemon's user)") from None
        except TimeoutError:
            raise AdminUnavailable(f"connecting to {path} timed out after {connect_timeout:g} s") from None
        except OSError as e:
            raise AdminUnavailable(f"cannot connect to {path}: {e.strerror or e}") from None
        deadline = time.monotonic() + timeout
        try:
            sock.sendall(line)
            buf = bytearray()
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise AdminUnavailable(f"the daemon closed {path} without replying")
                buf += chunk
                if len(buf) > MAX_REPLY:
                    raise AdminUnavailable(f"reply from {path} is larger than {MAX_REPLY} bytes")
        except TimeoutError:
            raise AdminUnavailable(f"no reply from {path} within {timeout:g} s") from None
        except (ConnectionError, BrokenPipeError) as e:
            raise AdminUnavailable(f"connection to {path} lost: {e.strerror or e}") from None
    finally:
        sock.close()
    try:
        reply = json.loads(bytes(buf[:buf.index(b"\n")]))
    except ValueError:
        raise AdminUnavailable(f"malformed reply from {path}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise AdminUnavailable(f"malformed reply from {path}")
    return reply


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2, as argparse does, minus the usage dump
        self.exit(2, f"{self.prog}: usage error: {message} (see --help)\n")


def _value(text: str) -> Any:
    """A KEY=VALUE value: JSON if it parses (numbers, true, lists), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _pairs(items: list[str], what: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """KEY=VALUE arguments as a dict (values by ``_value``); a malformed one is a usage error."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"{what}: expected KEY=VALUE, got {item!r}")
        out[key] = _value(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvctl", description="Talk to a kvd daemon's admin socket.")
    p.add_argument("--socket", "-s", default=None,
                   help=f"admin socket (default: $KVD_ADMIN_SOCKET or {DEFAULT_SOCKET})")
    p.add_argument("--json", action="store_true", help="print the reply as one JSON line")
    p.add_argument("--timeout", type=float, default=REPLY_TIMEOUT,
                   help=f"seconds to wait for the reply (default {REPLY_TIMEOUT:g})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, text in (("status", "daemon status"), ("nodes", "cluster members (coordinator)"),
                       ("requests", "requests in flight: node, replica holder, replicated tokens"), ("ping", "liveness check"),
                       ("help", "commands the daemon knows")):
        sub.add_parser(name, help=text)
    for name, text in (("drain", "stop routing new requests to NODE (or to the whole cluster)"),
                       ("undrain", "route to NODE (or the whole cluster) again")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("node", nargs="?", help="node name; omitted: the whole cluster / this node")
    role = sub.add_parser("role", help="switch NODE's role at run time (coordinator; a paired node switched "
                          "to prefill hands its decodes to its partner)")
    role.add_argument("node")
    role.add_argument("role", choices=("mixed", "prefill", "decode"))
    handoff = sub.add_parser("handoff", help="move a running decode to its node's pair partner (coordinator)")
    handoff.add_argument("request", help="the request id (kvctl requests)")
    cache = sub.add_parser("cache", help="prefix cache: stats | flush")
    cache.add_argument("action", choices=("stats", "flush"))
    tree = sub.add_parser("tree", help="global prompt trees (coordinator): per node cached blocks, "
                          "tokens, longest shared prefixes")
    tree.add_argument("--verify", action="store_true", help="compare with every node's own cache")
    routing = sub.add_parser("routing", help="show or switch the routing policy (coordinator)")
    routing.add_argument("policy", nargs="?", help="prompt-tree | session | least-load; omitted: show")
    routing.add_argument("--set", action="append", default=[], metavar="WEIGHT=VALUE",
                         help="override a prompt-tree cost weight until the next switch (overlap_weight, "
                              "load_weight, max_imbalance, recent_weight, load_decay); repeatable")
    ledger = sub.add_parser("ledger", help="borrowed KV memory (coordinator): per node free, lent and borrowed "
                            "blocks, the debt graph, DGFM's moves planned and those carried out")
    ledger.add_argument("--min-blocks", type=int,
                        help="DGFM's threshold per edge (default [cluster].dgfm_min_blocks)")
    ll = sub.add_parser("log-level", help="set the daemon's log level")
    ll.add_argument("level", choices=("debug", "info", "warning", "error", "critical"),
                    type=str.lower)
    ll.add_argument("--logger", help="logger name (default: root)")
    fail = sub.add_parser("fail", help="fault injection (tests): exit, stop heartbeats, resume, drop transfers, "
                                       "engine (its thread raises)")
    fail.add_argument("node", nargs="?", help="node name (required by the coordinator)")
    fail.add_argument("--mode", required=True, choices=FAIL_MODES)
    fail.add_argument("--seconds", type=float, help="stall: how long the coordinator blocks its loop")
    keys = sub.add_parser("keys", help="generate a CURVE keypair locally")
    keys.add_argument("--dir", required=True, help="directory for NAME.key and NAME.key_secret")
    keys.add_argument("--name", required=True, help="key name, e.g. coordinator or n1")
    call = sub.add_parser("call", help="any command: kvctl call 'cache stats' key=value ...")
    call.add_argument("cmd")
    call.add_argument("args", nargs="*", metavar="KEY=VALUE")
    raw = sub.add_parser("raw", help="send one JSON request object as is")
    raw.add_argument("json")
    return p


def to_request(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    cmd = ns.command
    if cmd in ("drain", "undrain"):
        return {"cmd": cmd, **({"node": ns.node} if ns.node else {})}
    if cmd == "role":
        return {"cmd": "set-role", "node": ns.node, "role": ns.role}
    if cmd == "handoff":
        return {"cmd": cmd, "request": ns.request}
    if cmd == "cache":
        return {"cmd": f"cache {ns.action}"}
    if cmd == "tree":
        return {"cmd": cmd, **({"verify": True} if ns.verify else {})}
    if cmd == "routing":
        return {"cmd": cmd, **({"policy": ns.policy} if ns.policy else {}),
                **_pairs(ns.set, "routing --set", parser)}
    if cmd == "ledger":
        if ns.min_blocks is not None and ns.min_blocks < 1:
            parser.error(f"ledger: --min-blocks must be >= 1, got {ns.min_blocks}")
        return {"cmd": cmd, **({"min_blocks": ns.min_blocks} if ns.min_blocks is not None else {})}
    if cmd == "log-level":
        return {"cmd": cmd, "level": ns.level, **({"logger": ns.logger} if ns.logger else {})}
    if cmd == "fail":
        return {"cmd": cmd, "mode": ns.mode, **({"node": ns.node} if ns.node else {}),
                **({"seconds": ns.seconds} if ns.seconds is not None else {})}
    if cmd == "call":
        return {"cmd": ns.cmd, **_pairs(ns.args, "call", parser)}
    if cmd == "raw":
        try:
            msg = json.loads(ns.json)
        except ValueError as e:
            parser.error(f"raw: invalid JSON: {e}")
        if not isinstance(msg, dict):
            parser.error("raw: the request must be a JSON object")
        return msg
    return {"cmd": cmd}


def _local_keys(directory: str, name: str) -> dict[str, Any]:
    from transports.zmq import generate_keypair  # pyzmq only for this command

    public, secret = generate_keypair(Path(directory), name)
    return {"ok": True, "public": str(public), "secret": str(secret)}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.timeout <= 0:
        parser.error("--timeout must be > 0")
    try:
        if ns.command == "keys":
            try:
                reply = _local_keys(ns.dir, ns.name)
            except FileExistsError as e:
                reply = {"ok": False, "error": f"{e.filename} already exists; refusing to overwrite"}
            except OSError as e:
                reply = {"ok": False, "error": f"{e.strerror or e}: {e.filename or ns.dir}"}
        else:
            message = to_request(ns, parser)
            reply = request(ns.socket or default_socket(), message, timeout=ns.timeout)
    except AdminUnavailable as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if not reply.get("ok"):
        error = " ".join(str(reply.get("error", "error reply without a message")).splitlines())
        print(f"kvctl: {error}", file=sys.stderr)
        return 1
    if ns.json:
        print(json.dumps(reply, separators=(",", ":")))
    else:
        body = {k: v for k, v in reply.items() if k != "ok"}
        print(json.dumps(body, indent=2, sort_keys=True) if body else "ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
