"""The node's admin commands (``kvctl``): status, requests, drain, undrain,
set-role, fail, cache stats/flush/blocks, transfer.

Served twice by the same handlers: on the node's own 0600 admin Unix socket
(``serve_admin_socket``) and as ``AdminCommand`` messages on its listener
(``NodeAdmin.answer``), which a node takes from the coordinator's key only
(kvd/trust.py).

Fault injection (``fail``): ``exit`` crashes, ``stop`` pauses the heartbeats,
``drop-transfers`` makes the node refuse KV transfers both ways, ``resume``
clears both faults, ``engine`` makes the engine thread raise (the node
leaves: kvd/node/daemon.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.exact_copy import hold
from kvd import protocol
from kvd.engine_client import EngineDead
from kvd.node.cache_shipper import CacheShipper
from kvd.node.engine_driver import EngineDriver
from kvd.node.heartbeat import Heartbeater
from kvd.node.replica_store import ReplicaStore
from kvd.node.replication import HOLD_S, Replicator
from kvd.node.transfer import send_prefix
from transports import Connection, TransportError

if TYPE_CHECKING:
    from kvd.api.admin import AdminServer

log = logging.getLogger("kvd.node")

FAIL_MODES = ("exit", "stop", "resume", "drop-transfers", "engine")
SWITCH_HOLD_S = 2.0        # a switch to prefill answers without its holds after this (the coordinator holds each)
Handler = Callable[[dict], Awaitable[dict]]


@dataclass
class TransferFaults:
    """The node's KV-transfer fault switch and counts: ``drop`` (admin ``fail
    drop-transfers``, until ``fail resume``) makes the node refuse KV
    transfers both ways, ``dropped`` counts the messages refused so, ``sent``
    the blocks admin ``transfer`` moved."""

    drop: bool = False
    dropped: int = 0
    sent: int = 0


class NodeAdmin:
    """The command handlers; each ``cmd_*(args) -> dict`` raises ValueError,
    TypeError, TransportError or TimeoutError for a command that cannot be
    done. They reach the node through what is given here only: ``status()``,
    the requests in flight (``streams``, by id), ``set_draining(bool)`` and
    the transfer faults."""

    def __init__(self, name: str, driver: EngineDriver, heartbeat: Heartbeater, cache_shipper: CacheShipper,
                 connect: Callable[[str, str], Awaitable[Connection]], timeout: float, *,
                 status: Callable[[], dict], streams: Mapping[str, Any], set_draining: Callable[[bool], None],
                 transfers: TransferFaults, set_role: Callable[[str], None] | None = None,
                 replicas: ReplicaStore | None = None, replicator: Replicator | None = None) -> None:
        self.name = name
        self.driver = driver
        self.heartbeat = heartbeat
        self.cache_shipper = cache_shipper
        self.connect = connect              # (node, address) -> a one-off link (closed by the caller)
        self.timeout = timeout              # [cluster].request_timeout
        self.status = status
        self.streams = streams
        self.set_draining = set_draining
        self.transfers = transfers
        self.set_role = set_role            # the role this node announces (the coordinator routes by it)
        self.replicas = replicas            # the copies this node holds for its peers
        self.replicator = replicator        # this node's copies at its peer (a handoff's hold)
        self.extra: dict[str, tuple[Handler, str, dict | None]] = {}   # more commands (recall.py's)

    def handlers(self) -> dict[str, tuple[Handler, str, dict | None]]:
        """name -> (async handler(args) -> dict, help, args schema)."""
        return {
            "status": (self.cmd_status, "node status: load, KV, registration, bad-message counters", None),
            "requests": (self.cmd_requests, "request ids in flight", None),
            "drain": (self.cmd_drain, "finish in-flight requests, accept no new ones", None),
            "undrain": (self.cmd_undrain, "accept new requests again", None),
            "replica held": (self.cmd_replica_held, "tokens of a request's copy held here now",
                             {"source": (str, True), "request": (str, True)}),
            "replica keep": (self.cmd_replica_keep, "keep this node's KV of a request handed off to `owner` "
                             "as the copy it claims", {"request": (str, True), "owner": (str, True)}),
            "hold": (self.cmd_hold, "stop decoding a request here (a handoff from here) and bring the partner's "
                     "copy up to date: the tokens it made", {"request": (str, True)}),
            "set-role": (self.cmd_set_role, "the role the coordinator switched this node to",
                         {"role": (str, True)}),
            "fail": (self.cmd_fail, "fault injection: mode exit | stop (heartbeats) | drop-transfers"
                                    " | resume (heartbeats and transfers again) | engine (the engine "
                                    "thread raises: the node leaves)", {"mode": (str, True)}),
            "cache stats": (self.cmd_cache_stats, "MemPool blocks per tier", None),
            "cache flush": (self.cmd_cache_flush, "drop every unlocked cached prefix block", None),
            "cache blocks": (self.cmd_cache_blocks, "this node's cached blocks [hash, parent] and "
                             "its cache-event seq (the prompt tree's check)", None),
            "transfer": (self.cmd_transfer, "move the cached KV of token_ids to node `to` at `address`",
                         {"to": (str, True), "address": (str, True), "token_ids": (list, True)}),
            **self.extra,
        }

    async def answer(self, msg: protocol.AdminCommand) -> protocol.AdminReply:
        """The reply to an ``AdminCommand`` from the coordinator: the result,
        or the command's failure as ``ok=False``."""
        entry = self.handlers().get(msg.command)
        if entry is None:
            return protocol.AdminReply(id=msg.id, ok=False, error=f"unknown command {msg.command!r}")
        try:
            return protocol.AdminReply(id=msg.id, ok=True, result=await entry[0](dict(msg.args)))
        except (ValueError, KeyError, TypeError, TransportError, TimeoutError) as exc:
            return protocol.AdminReply(id=msg.id, ok=False, error=f"{type(exc).__name__}: {exc}")

    async def cmd_status(self, args: dict) -> dict:
        return self.status()

    async def cmd_requests(self, args: dict) -> dict:
        return {"requests": sorted(self.streams)}

    async def cmd_drain(self, args: dict) -> dict:
        self.set_draining(True)
        return {"draining": True, "in_flight": len(self.streams)}

    async def cmd_set_role(self, args: dict) -> dict:
        """Record the role the coordinator switched this node to (``kvctl role``):
        what its status and its next registration announce; the coordinator
        routes by it from the switch on. A paired node switched to prefill
        also stops decoding, at its next step boundary, every request whose
        copy at its partner is complete (``Replicator.hold_all``: the
        coordinator hands them off; ``held``, {request id: tokens made}), so
        the switch takes effect at that step; the rest go on here until
        their copy is complete and the coordinator moves them. Without a
        step boundary within ``SWITCH_HOLD_S`` it answers with none held."""
        from kvd.cluster_config import ROLES, Role

        role = args.get("role")
        if role not in ROLES or self.set_role is None:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.set_role(role)
        held: dict[str, int] = {}
        if role == Role.PREFILL and self.replicator is not None:
            try:
                held = await asyncio.wait_for(self.replicator.hold_all(), SWITCH_HOLD_S)
            except TimeoutError:
                log.warning("switch to prefill: no step boundary within %.0f s to hold the decodes at", SWITCH_HOLD_S)
        return {"role": role, "held": held}

    async def cmd_replica_held(self, args: dict) -> dict:
        """How many tokens of ``request``, run by ``source``, this node's copy
        holds now (0: none), and whether a leg of it still runs here (one
        handed off from here and not stopped yet): what the coordinator
        checks before a handoff."""
        rep = self.replicas.replicas.get((args["source"], args["request"])) if self.replicas else None
        return {"tokens": len(rep.tokens) if rep is not None else 0, "running": args["request"] in self.streams}

    async def cmd_replica_keep(self, args: dict) -> dict:
        """The coordinator handed ``request`` off from here to ``owner``, this
        node's pair partner: before it moves, its KV here becomes
        ``owner``'s copy of it (ReplicaStore.keep). Raises ValueError when
        ``owner`` is not the partner."""
        store = self.replicas
        if store is None or not store.partner or args["owner"] != store.partner:
            raise ValueError(f"{args['owner']!r} is not this node's pair partner")
        return {"tokens": await store.keep(args["request"], args["owner"])}

    async def cmd_hold(self, args: dict) -> dict:
        """The coordinator hands ``request`` off from here to this node's pair
        partner: no step decodes it any more (until its Abort, or for
        ``HOLD_S`` if the handoff fails), and the round that holds it sends
        the partner's copy every token it computed (``Replicator.hold``).
        Returns the tokens it made (``tokens``). Raises ValueError when it
        is not decoding here."""
        rid = args["request"]
        if self.replicator is not None:
            made = await self.replicator.hold(rid)
        else:
            made = await self.driver.call(lambda engine: hold(engine, rid, HOLD_S), timeout=self.timeout)
        if made is None:
            raise ValueError(f"request {rid!r} is not decoding here")
        return {"tokens": made}

    async def cmd_undrain(self, args: dict) -> dict:
        self.set_draining(False)
        return {"draining": False}

    async def cmd_fail(self, args: dict) -> dict:
        mode = args["mode"]
        if mode not in FAIL_MODES:
            raise ValueError(f"fail mode must be one of {', '.join(FAIL_MODES)}, got {mode!r}")
        if mode == "exit":
            # after the reply is on its way: a crash, not a shutdown (no drain, no goodbye)
            asyncio.get_running_loop().call_later(0.1, os._exit, 1)
        elif mode == "stop":
            self.heartbeat.paused = True
        elif mode == "drop-transfers":
            self.transfers.drop = True
        elif mode == "engine":
            log.warning("fault injection: engine")
            try:
                state = await self.driver.inject_failure("fault injection (admin fail --mode engine)",
                                                         timeout=self.timeout)
            except EngineDead as exc:
                raise ValueError(str(exc)) from None
            return {"mode": mode, "engine": state}
        else:  # resume
            self.heartbeat.paused = False
            self.transfers.drop = False
            self.heartbeat.kick()
        log.warning("fault injection: %s", mode)
        return {"mode": mode}

    async def cmd_cache_stats(self, args: dict) -> dict:
        return {"kv": self.driver.stats().get("kv", {})}

    async def cmd_cache_flush(self, args: dict) -> dict:
        """Drop every unlocked cached block (on the engine thread, between steps);
        blocks of running requests and locked prefixes stay."""
        freed = await self.driver.flush_cache(timeout=self.timeout)
        self.heartbeat.kick()       # the coordinator's view of cached blocks
        log.info("cache flush: freed %s", freed)
        return {"freed": freed, "kv": self.driver.stats().get("kv", {})}

    async def cmd_cache_blocks(self, args: dict) -> dict:
        """This node's own cached blocks, ``[block hash, parent hash]`` each
        (what the coordinator's prompt tree must hold for it), and the number
        of the next cache event it will send."""
        blocks = await self.driver.cache_snapshot(timeout=self.timeout)
        box = self.cache_shipper.outbox
        return {"blocks": [[b.block_hash, b.parent_hash] for b in blocks],
                "seq": box.seq, "need_snapshot": box.need_snapshot}

    async def cmd_transfer(self, args: dict) -> dict:
        if self.transfers.drop:
            raise ValueError(f"node {self.name} drops KV transfers (fault injection; fail resume)")
        tokens = args["token_ids"]
        if not all(type(t) is int and t >= 0 for t in tokens):
            raise ValueError("token_ids must be non-negative integers")
        conn = await self.connect(args["to"], args["address"])
        try:
            result = await send_prefix(self.driver, conn, tokens, src_node=self.name,
                                       dst_node=args["to"], timeout=self.timeout)
        finally:
            await conn.close()
        self.transfers.sent += result["transferred"]
        return result


async def serve_admin_socket(path: str, name: str, handlers: dict[str, tuple[Handler, str, dict | None]]
                             ) -> AdminServer:
    """Start the admin Unix socket at ``path`` serving ``handlers``
    (``NodeAdmin.handlers``); a handler's ADMIN_ERRORS exception is the
    command's error, named by its type."""
    from kvd.api.admin import AdminServer, as_admin_errors

    server = AdminServer(path, name=name)
    for command, (handler, help_, schema) in handlers.items():
        server.register(command, as_admin_errors(handler, name_type=True), help=help_, args_schema=schema)
    await server.start()
    return server
