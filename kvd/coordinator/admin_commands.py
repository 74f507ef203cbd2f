"""The coordinator's admin commands (``kvctl``): status, nodes, requests, drain,
undrain, set-role, handoff, cache stats/flush, fail, tree (the global prompt
trees), routing, ledger (borrowed KV memory: the debt ledger and DGFM).

Served on the coordinator's 0600 admin Unix socket. Commands naming a node
are forwarded to it as an ``AdminCommand`` (which a node accepts from the
coordinator's key only, kvd/trust.py); ``cache`` commands without a node go
to every node at once, each with its own deadline (``FANOUT_TIMEOUT_S``).
``fail`` also reaches a node that is no longer registered (declared dead,
e.g. after ``fail stop``) over a one-off link to its last address, so that
``fail resume`` through the coordinator brings it back.

Imports no torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvd import protocol
from kvd.cluster_config import ClusterConfig, Role
from kvd.coordinator.cache_router import ROUTING_WEIGHTS
from kvd.coordinator.cache_sync import CacheSync
from kvd.coordinator import dgfm
from kvd.coordinator.dgfm_rounds import DGFMRounds
from kvd.coordinator.handoff import Handoffs
from kvd.coordinator.ledger import DebtLedger
from kvd.coordinator.roles import copy_memory, redundant_blocks
from kvd.coordinator.membership import Membership, NodeInfo
from kvd.coordinator.pairs import PairRouter
from kvd.coordinator.prompt_tree import PromptTrees
from kvd.coordinator.router import Router
from transports import Connection, TransportError

if TYPE_CHECKING:
    from kvd.coordinator.client import RemoteEngineClient

log = logging.getLogger("kvd.coordinator")

FAIL_MODES = ("exit", "stop", "resume", "drop-transfers", "engine")   # served by the node (kvd.node.daemon)
FANOUT_TIMEOUT_S = 5.0     # per node, for commands sent to every node: under the admin deadline
MAX_STALL_S = 60.0         # the longest stall `fail mode=stall` injects


@dataclasses.dataclass(eq=False)
class CoordinatorAdmin:
    """The command handlers; each ``cmd_*(args) -> dict`` raises ValueError,
    TransportError or TimeoutError for a command that cannot be done.

    Given what the commands read and change, not the daemon: ``status``
    (the daemon's status dict), ``set_draining`` (the front door's cluster
    drain), ``connect`` (a new link to a node by address and name, for a
    node no longer registered) and ``make_router`` (a router for a policy)."""

    client: RemoteEngineClient
    membership: Membership
    cluster: ClusterConfig
    trees: PromptTrees
    cache_sync: CacheSync
    _: dataclasses.KW_ONLY
    status: Callable[[], dict[str, Any]]
    set_draining: Callable[[bool], None]
    connect: Callable[[str, str], Awaitable[Connection]]
    make_router: Callable[..., Router]
    ledger: DebtLedger | None = None       # the debt ledger of borrowed KV blocks
    dgfm_rounds: DGFMRounds | None = None  # DGFM's moves carried out (dgfm_rounds.py)

    def __post_init__(self) -> None:
        self.handoffs = Handoffs(self.client, self.forward)

    def _node(self, args: dict) -> NodeInfo:
        name = args.get("node")
        info = self.membership.nodes.get(name) if name else None
        if info is None:
            raise ValueError(f"unknown node {name!r}; nodes: {sorted(self.membership.nodes)}")
        return info

    async def forward(self, node: str, command: str, args: dict | None = None,
                      timeout: float | None = None) -> dict:
        """Send an AdminCommand to ``node`` and return its result (raises ValueError,
        TransportError, TimeoutError)."""
        link = self.client.links.get(self._node({"node": node}).name)
        if link is None:
            raise ValueError(f"node {node} has no link")
        return await self._call(link.conn, node, command, args, timeout or self.cluster.request_timeout)

    async def forward_departed(self, node: str, command: str, args: dict | None = None) -> dict:
        """``forward`` to a node that is not registered (declared dead, left),
        over a link opened to its last address for this one command and closed
        after; ValueError for a node never registered, for an error reply, and
        for a node that does not answer within FANOUT_TIMEOUT_S."""
        address = self.membership.departed.get(node)
        if address is None:
            raise ValueError(f"unknown node {node!r}; nodes: {sorted(self.membership.nodes)}")
        timeout = min(self.cluster.request_timeout, FANOUT_TIMEOUT_S)
        conn = None
        try:
            async with asyncio.timeout(timeout):
                conn = await self.connect(address, node)
                return await self._call(conn, node, command, args, timeout)
        except (TransportError, TimeoutError) as exc:
            raise ValueError(f"node {node} is not registered and did not answer at its last address "
                             f"{address} within {timeout:g} s: {str(exc) or type(exc).__name__}") from None
        finally:
            if conn is not None:
                await conn.close()

    @staticmethod
    async def _call(conn, node: str, command: str, args: dict | None, timeout: float) -> dict:
        reply = await protocol.call(conn, protocol.AdminCommand(
            id=f"admin-{time.monotonic_ns()}", command=command, args=args or {}), timeout=timeout)
        if not isinstance(reply, protocol.AdminReply):
            raise ValueError(f"node {node}: {getattr(reply, 'message', reply)}")
        if not reply.ok:
            raise ValueError(f"node {node}: {reply.error}")
        return reply.result

    async def cmd_status(self, args: dict) -> dict:
        return self.status()

    async def cmd_nodes(self, args: dict) -> dict:
        nodes, pairs = self.membership.nodes, self.client.recovery.pairs
        return {"nodes": [dict(n.describe(), prefill_queue_tokens=self.client.prefill_queue(n),
                               redundant_blocks=redundant_blocks(self.client.recovery.table.by_holder, n),
                               copies=copy_memory(n),
                               **pairs.describe(n.name, nodes))
                          for n in nodes.values()]}

    async def cmd_set_role(self, args: dict) -> dict:
        """Switch a node's role (``kvctl role NODE ROLE``; kvd/coordinator/roles.py):
        routing follows it from now on, the node records it, its cached blocks
        move to the role's prompt tree, and a paired node switched to prefill
        hands its decodes to its partner (kvd/coordinator/handoff.py); the
        node answers once its next step decodes none of those it can hand
        off (``held``: how many it stopped), so the reply is the switch's effect. A
        refused switch (ValueError), or a node that cannot be told, changes
        nothing."""
        pairs = self.client.recovery.pairs
        name, role = args["node"], args["role"]
        pairs.check_switch(self.membership.nodes, name, role)
        info = self.membership.nodes[name]
        old = info.role
        held = 0
        if role != old:
            reply = await self.forward(name, "set-role", {"role": role})
            held = len(reply["held"]) if isinstance(reply.get("held"), dict) else 0
            info.role = role
            self.cache_sync.registered(name, info.block_size, role)   # its next events resync the tree
            pairs.switches[name] += 1
            log.warning("node %s switched from %s to %s", name, old, role)
            if role == Role.PREFILL:
                self.handoffs.evacuate(name)
        return {"node": name, "role": role, "was": old, "held": held}

    async def cmd_handoff(self, args: dict) -> dict:
        """Move a running decode to its node's pair partner (``kvctl handoff``)."""
        return await self.handoffs.hand_off(args["request"])

    async def cmd_requests(self, args: dict) -> dict:
        return {"requests": self.client.requests()}

    async def cmd_drain(self, args: dict) -> dict:
        if not args.get("node"):
            self.set_draining(True)
            return {"draining": "cluster"}
        info = self._node(args)
        info.admin_drained = True            # routing stops now, before the node's next beat
        result = await self.forward(info.name, "drain")
        return {"node": info.name, **result}

    async def cmd_undrain(self, args: dict) -> dict:
        if not args.get("node"):
            self.set_draining(False)
            return {"draining": False}
        info = self._node(args)
        result = await self.forward(info.name, "undrain")
        info.admin_drained = False
        return {"node": info.name, **result}

    async def forward_all(self, command: str, args: dict | None = None) -> dict[str, dict]:
        """``command`` on every registered node at once: node -> result, or
        {"error": message} for a node that failed or did not answer in time."""
        async def one(name: str) -> dict:
            try:
                return await self.forward(name, command, args,
                                          timeout=min(self.cluster.request_timeout, FANOUT_TIMEOUT_S))
            except (ValueError, TransportError, TimeoutError) as exc:
                return {"error": str(exc) or type(exc).__name__}

        async with asyncio.TaskGroup() as tg:
            tasks = {name: tg.create_task(one(name)) for name in sorted(self.membership.nodes)}
        return {name: task.result() for name, task in tasks.items()}

    async def cmd_fail(self, args: dict) -> dict:
        if not args.get("node"):
            if args["mode"] != "stall":
                raise ValueError("fail needs a node, except mode stall (this coordinator's own loop)")
            seconds = args.get("seconds", 5.0)
            if not 0 < seconds <= MAX_STALL_S:
                raise ValueError(f"seconds must be in (0, {MAX_STALL_S:g}], got {seconds}")
            log.warning("fault injection: blocking the event loop for %gs", seconds)
            time.sleep(seconds)       # on purpose: what a handler that never yields does to this loop
            return {"stalled_s": seconds}
        if args["mode"] not in FAIL_MODES:
            raise ValueError(f"fail mode must be one of {', '.join(FAIL_MODES)}, got {args['mode']!r}")
        node, fail = args["node"], {"mode": args["mode"]}
        if node in self.membership.nodes:
            return {"node": node, "registered": True, **await self.forward(node, "fail", fail)}
        return {"node": node, "registered": False, **await self.forward_departed(node, "fail", fail)}

    async def cmd_cache_stats(self, args: dict) -> dict:
        """Per node MemPool stats and their sums (blocks per tier, hit/miss tokens)."""
        if args.get("node"):
            nodes = {args["node"]: await self.forward(self._node(args).name, "cache stats")}
        else:
            nodes = await self.forward_all("cache stats")
        return {"nodes": nodes, "kv": sum_counters(r["kv"] for r in nodes.values() if "kv" in r)}

    async def cmd_cache_flush(self, args: dict) -> dict:
        if args.get("node"):
            nodes = {args["node"]: await self.forward(self._node(args).name, "cache flush")}
        else:
            nodes = await self.forward_all("cache flush")
        return {"nodes": nodes, "freed": sum_counters(r["freed"] for r in nodes.values() if "freed" in r),
                "errors": sorted(n for n, r in nodes.items() if "error" in r)}

    async def cmd_tree(self, args: dict) -> dict:
        """The global prompt trees: per role and node, cached blocks and tokens
        and the longest shared prefixes; the event sync state. With ``verify``,
        each node's own cached blocks are fetched and compared with what the
        tree holds for it (``equal``, and the blocks ``missing`` / ``extra``)."""
        out = {"roles": self.trees.describe(), "sync": self.cache_sync.stats()}
        if args.get("verify"):
            nodes = await self.forward_all("cache blocks")
            out["verify"] = {name: verify_holdings(self.trees.for_node(name).held(name), result)
                             for name, result in nodes.items()}
        return out

    async def cmd_routing(self, args: dict) -> dict:
        """Show the routing policy, or switch to ``policy`` (from the next
        request on; the current one when only weights are given). Prompt-tree
        cost weights given here override ``[cluster]`` routing_* for this
        router only: the next switch without them is back to the config."""
        from kvd.coordinator.cache_router import POLICIES, policy_name

        client = self.client
        weights = {k: args[k] for k in ROUTING_WEIGHTS if k in args}
        if args.get("policy") or weights:
            policy = args.get("policy") or policy_name(client.router)
            if weights and policy != "prompt-tree":
                raise ValueError(f"cost weights apply to prompt-tree routing, not {policy}")
            router = self.make_router(policy, **weights)        # ValueError: unknown policy, bad weight
            prefill_router = self.make_router(policy, **weights)
            if isinstance(client.router, PairRouter):        # pairs keep routing prompts to pairs
                client.router.inner = router
                router = client.router
            client.set_routers(router, prefill_router)
            log.warning("routing policy switched to %s %s", policy, weights or "")
        describe = getattr(client.router, "describe", None)
        return {"policy": policy_name(client.router), "policies": list(POLICIES),
                **(describe() if describe else {})}

    async def cmd_ledger(self, args: dict) -> dict:
        """The debt ledger (loose: each node's last heartbeat): per node free,
        lendable, lent and borrowed blocks; the debt graph; and the
        recall-and-swap moves DGFM finds for cycles of at least ``min_blocks``
        (default ``[cluster].dgfm_min_blocks``), and DGFM's moves carried out:
        counts, and the last round's moves with their outcomes."""
        ledger = self.ledger or DebtLedger()
        min_blocks = args.get("min_blocks", self.cluster.dgfm_min_blocks)
        if min_blocks < 1:
            raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
        ledger.retain(self.membership.nodes)
        out = ledger.describe()
        out["dgfm"] = [dataclasses.asdict(m) for m in dgfm.plan(ledger.debt_graph(), min_blocks)]
        out["dgfm_interval_s"] = self.cluster.dgfm_interval_s
        out["dgfm_last_round"] = self.dgfm_rounds.last if self.dgfm_rounds is not None else []
        return out

    def handlers(self) -> dict[str, tuple[Any, str, dict | None]]:
        return {
            "status": (self.cmd_status, "coordinator status and bad-message counters", None),
            "nodes": (self.cmd_nodes, "registered nodes: load, heartbeat age, KV", None),
            "requests": (self.cmd_requests, "request id -> node", None),
            "drain": (self.cmd_drain, "stop routing to a node (or the cluster, no node)",
                      {"node": (str, False)}),
            "undrain": (self.cmd_undrain, "route to a node (or the cluster) again", {"node": (str, False)}),
            "set-role": (self.cmd_set_role, "switch a node's role at run time: mixed | prefill | decode (a "
                         "paired node switched to prefill hands its decodes to its partner)",
                         {"node": (str, True), "role": (str, True)}),
            "handoff": (self.cmd_handoff, "move a running decode to its node's pair partner",
                        {"request": (str, True)}),
            "cache stats": (self.cmd_cache_stats, "prefix-cache blocks and hits, per node and summed "
                            "(node: one node)", {"node": (str, False)}),
            "cache flush": (self.cmd_cache_flush, "drop unlocked cached prefixes on every node "
                            "(node: one node)", {"node": (str, False)}),
            "tree": (self.cmd_tree, "global prompt trees: per node cached blocks/tokens, longest shared "
                     "prefixes, event sync (verify: compare with every node's own cache)",
                     {"verify": (bool, False)}),
            "routing": (self.cmd_routing, "show the routing policy, or switch it: policy = prompt-tree | "
                        "session | least-load; prompt-tree weights (" + ", ".join(ROUTING_WEIGHTS)
                        + ") override the config's", {"policy": (str, False),
                                                      **{k: (t, False) for k, t in ROUTING_WEIGHTS.items()}}),
            "ledger": (self.cmd_ledger, "borrowed KV memory: per node free, lendable, lent and borrowed blocks, "
                       "the debt graph, DGFM's recall-and-swap moves (min_blocks: their threshold, default "
                       "[cluster].dgfm_min_blocks) and those carried out", {"min_blocks": (int, False)}),
            "fail": (self.cmd_fail, "fault injection on a node (registered, or declared dead: reached at its "
                     "last address): mode exit | stop | resume | drop-transfers | engine; without a node, mode stall "
                     "blocks this coordinator's event loop for `seconds` (5)",
                     {"node": (str, False), "mode": (str, True), "seconds": (float, False)}),
        }


def verify_holdings(held: dict[int, tuple[int, tuple]], node_reply: dict) -> dict:
    """Compare a prompt tree's blocks for a node (``{hash: (parent, tokens)}``)
    with the node's ``cache blocks`` reply."""
    if "blocks" not in node_reply:
        return {"error": node_reply.get("error", "no blocks in the reply")}
    own = {h: p for h, p in node_reply["blocks"]}
    missing = [h for h, p in own.items() if h not in held or held[h][0] != p]
    extra = [h for h in held if h not in own]
    return {"equal": not missing and not extra, "blocks": len(own), "missing": len(missing),
            "extra": len(extra), "node_seq": node_reply.get("seq")}


def sum_counters(dicts) -> dict:
    """Sum the integer fields of dicts (one level of nesting: per-tier tables);
    ``block_size`` and strings are not counters and are left out."""
    total: dict = {}
    for d in dicts:
        for key, value in d.items():
            if isinstance(value, dict):
                sub = total.setdefault(key, {})
                for k, v in value.items():
                    if type(v) is int:
                        sub[k] = sub.get(k, 0) + v
            elif type(value) is int and key != "block_size":
                total[key] = total.get(key, 0) + value
    return total
