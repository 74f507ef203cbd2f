"""Cache-aware routing on the global prompt trees (MemServe §6), and the
routing policies by name.

``PromptTreeRouter`` scores every routable node ``n`` for a prompt of ``B``
full blocks (of the prompt minus its last token: what the engine can reuse)::

    cached(n)  = leading blocks n holds (global prompt tree) or has pending
    cost(n)    = overlap_weight * (B - cached(n)) + load_weight * load(n)

where ``load(n)`` is the requests this coordinator has in flight there (exact
and never reset by a heartbeat), and picks the cheapest node among the
*eligible* ones:

    eligible   = { n : load(n)   <= min_load + max_imbalance
                   and share(n) <= max_share * mean_share + 1 }

``share(n)`` counts the requests that ended on ``n`` lately, each decaying
as ``exp(-age / share_decay)`` from its end (``RecentShare``).

The guards work both ways. Affinity never piles work on a node: a node more
than ``max_imbalance`` requests above the least-loaded one gets nothing,
however much it caches (SGLang's balance threshold), and neither does one
that served more than ``max_share`` times its fair share of the recent
requests. The second guard is what balances a cluster whose requests end
before the next arrives: in-flight counts are then all 0, and the cost alone
would send every conversation sharing a system prompt to the node that
computed it first (measured: 41 / 0 / 23 requests over 3 nodes). With it the
prefix spreads, each node computing it once, and the conversations'
later turns keep their node while it is within its share. Finished requests
count, not routed ones, so a burst sharing a new prefix still follows its
first request (pending blocks), within the in-flight guard. The counts
decay instead of resetting (vllm-project/router #179: counters that reset
create hot spots). Load balance never throws all affinity away: among the
eligible nodes the cached blocks still count (SGLang PR #32195 dropped the
cache score entirely once load was uneven), and the least-shared,
least-loaded node is always eligible. A miss everywhere is decided by load
alone: no preference for the node with the smallest tree (the cause of
sglang PR #14305's pile-up). Ties: lower load, then fewer running requests
(heartbeat), then name.

After a pick the prompt's blocks are recorded as pending on the chosen node
(``pending_ttl``), so a burst sharing a new prefix follows the first request
instead of scattering before that request's blocks are confirmed by events.

``make_router`` builds a policy by name: ``prompt-tree`` (this one),
``session`` (least load with session affinity) or ``least-load``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.cluster_config import ROUTING_POLICIES
from kvd.coordinator.membership import NodeInfo
from kvd.coordinator.prompt_tree import DEFAULT_ROLE, PromptTrees, block_hashes
from kvd.coordinator.router import LeastLoadRouter, Router

POLICIES = ROUTING_POLICIES


@dataclass(frozen=True)
class CostWeights:
    """The cost formula's parameters (``[cluster]`` routing_*; defaults in etc/)."""

    overlap_weight: float = 1.0      # per block the node would have to prefill
    load_weight: float = 4.0         # per request in flight there (in blocks: 64 tokens)
    max_imbalance: int = 4           # requests above the least-loaded node that stop affinity
    max_share: float = 1.2           # times the mean recent share that stops affinity; 0: off
    share_decay: float = 60.0        # seconds: time constant of the recent shares

    def __post_init__(self) -> None:
        values = (self.overlap_weight, self.load_weight, self.max_imbalance, self.max_share,
                  self.share_decay)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError("routing weights, max_imbalance, max_share and share_decay "
                             "must be finite and >= 0")
        if 0 < self.max_share < 1:
            raise ValueError("routing max_share must be 0 (off) or >= 1 (a node's share over the mean)")


class RecentShare:
    """Requests that ended on each node lately, each decaying as
    ``exp(-age / decay)`` from its end.

    ``open`` records a routed request; it counts only once it has left its
    node's ``in_flight`` (``settle`` notices, at the next pick): while in
    flight it is the in-flight guard's. Per node one (value, time) pair:
    decaying it to ``now`` before adding is exact for a sum of exponentials.
    Not thread-safe (the coordinator's event loop owns it).
    """

    def __init__(self, decay: float, max_open: int = 100_000) -> None:
        self.decay = decay
        self.max_open = max_open
        self._open: set[tuple[str, str]] = set()            # (node, request id) in flight
        self._done: dict[str, tuple[float, float]] = {}      # node -> (value, at)

    def value(self, node: str, now: float) -> float:
        """The decayed count of requests ended on ``node`` at ``now`` (0 when none)."""
        if node not in self._done:
            return 0.0
        value, at = self._done[node]
        if self.decay <= 0:
            return value
        return value * math.exp(-max(0.0, now - at) / self.decay)

    def add(self, node: str, now: float, count: float = 1.0) -> None:
        """Count ``count`` requests ended on ``node`` at ``now``."""
        self._done[node] = (self.value(node, now) + count, now)

    def open(self, node: str, request_id: str) -> None:
        self._open.add((node, request_id))
        while len(self._open) > self.max_open:             # a coordinator that never settles
            self._open.pop()

    def settle(self, nodes: Sequence[NodeInfo], now: float) -> None:
        """Count the requests no longer in flight on their node (or whose
        node is not among ``nodes``) as ended now."""
        if not self._open:
            return
        by_name = {n.name: n for n in nodes}
        ended = [k for k in self._open if (n := by_name.get(k[0])) is None or k[1] not in n.in_flight]
        for key in ended:
            self._open.discard(key)
            self.add(key[0], now)

    def snapshot(self, now: float) -> dict[str, float]:
        return {n: round(self.value(n, now), 2) for n in sorted(self._done)}


def role_of(node: NodeInfo) -> str:
    """The prompt tree a node's blocks live in: its role's (from its Hello)."""
    return node.role or DEFAULT_ROLE


class PromptTreeRouter:
    """Router on cost = overlap_weight * blocks to prefill + load_weight * load,
    among the nodes within both guards; see the module docstring."""

    name = "prompt-tree"

    def __init__(self, trees: PromptTrees, weights: CostWeights | None = None) -> None:
        self.trees = trees
        self.weights = weights or CostWeights()
        self.share = RecentShare(self.weights.share_decay)
        self.cache_routed = 0                # picks that had cached blocks on the chosen node
        self.guarded = 0                     # picks where a guard excluded a better-cached node

    def eligible(self, nodes: Sequence[NodeInfo], now: float) -> list[NodeInfo]:
        """The nodes within both guards (never empty when ``nodes`` is not)."""
        w = self.weights
        min_load = min(n.load for n in nodes)
        within = [n for n in nodes if n.load <= min_load + w.max_imbalance]
        if not w.max_share:
            return within
        shares = {n.name: self.share.value(n.name, now) for n in nodes}
        cap = w.max_share * sum(shares.values()) / len(nodes) + 1.0
        fair = [n for n in within if shares[n.name] <= cap]
        return fair or within

    def pick(self, nodes: Sequence[NodeInfo], prompt_ids: Sequence[int],
             request_id: str | None = None) -> NodeInfo | None:
        if not nodes:
            return None
        w = self.weights
        now = time.monotonic()
        self.share.settle(nodes, now)
        # reusable prefix: the engine matches the prompt minus its last token
        usable = prompt_ids[:-1]
        total = len(usable) // self.trees.block_size
        cached: dict[str, int] = {}
        for role in {role_of(n) for n in nodes}:
            tree = self.trees.of_role(role)
            tree.expire(now)
            cached.update(tree.match(usable, now))
        eligible = self.eligible(nodes, now)

        def score(n: NodeInfo) -> tuple:
            cost = w.overlap_weight * (total - cached.get(n.name, 0)) + w.load_weight * n.load
            return (cost, n.load, n.heartbeat.running if n.heartbeat else 0, n.name)

        choice = min(eligible, key=score)
        if request_id is None:
            self.share.add(choice.name, now)              # a caller that cannot say when it ends
        else:
            self.share.open(choice.name, request_id)
        best_cached = max((cached.get(n.name, 0) for n in nodes), default=0)
        if cached.get(choice.name, 0):
            self.cache_routed += 1
        if best_cached > max(cached.get(n.name, 0) for n in eligible):
            self.guarded += 1
        self.trees.of_role(role_of(choice)).add_pending(
            choice.name, block_hashes(usable, self.trees.block_size), now)
        return choice

    def describe(self) -> dict:
        return {"policy": self.name, "overlap_weight": self.weights.overlap_weight,
                "load_weight": self.weights.load_weight, "max_imbalance": self.weights.max_imbalance,
                "max_share": self.weights.max_share, "share_decay": self.weights.share_decay,
                "recent_share": self.share.snapshot(time.monotonic()),
                "pending_ttl": self.trees.pending_ttl, "cache_routed": self.cache_routed,
                "guarded": self.guarded}


def make_router(policy: str, trees: PromptTrees, *, affinity_tokens: int = 64,
                weights: CostWeights | None = None) -> Router:
    """The router for ``policy`` (one of POLICIES); raises ValueError for another name."""
    if policy == "prompt-tree":
        return PromptTreeRouter(trees, weights)
    if policy == "session":
        return LeastLoadRouter(affinity_tokens or 64)
    if policy == "least-load":
        return LeastLoadRouter(0)
    raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def policy_name(router: Router) -> str:
    """The POLICIES name of a router ``make_router`` built."""
    if isinstance(router, PromptTreeRouter):
        return router.name
    return "session" if getattr(router, "affinity_tokens", 0) else "least-load"
