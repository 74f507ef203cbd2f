"""Cache-aware routing on the global prompt trees (MemServe §6), and the
routing policies by name.

``PromptTreeRouter`` scores every routable node ``n`` for a prompt of ``B``
full blocks (of the prompt minus its last token: what the engine can reuse)::

    cached(n)  = leading blocks n holds (global prompt tree) or has pending
    cost(n)    = overlap_weight * (B - cached(n)) + load_weight * load(n)

where ``load(n)`` is the requests this coordinator has in flight there (exact
and never reset by a heartbeat), and picks the cheapest node among the
*eligible* ones:

    eligible   = { n : load(n) <= min_load + max_imbalance }

The guard works both ways. Affinity never piles work on an overloaded node:
a node more than ``max_imbalance`` requests above the least-loaded one gets
nothing, however much it caches (SGLang's balance threshold). Load balance
never throws all affinity away: the eligible set always includes every node
within the slack, and among them the cached blocks still count (SGLang PR
#32195 dropped the cache score entirely once load was uneven). A miss
everywhere is decided by load alone: no preference for the node with the
smallest tree (the cause of sglang PR #14305's pile-up). Ties: lower load,
then fewer running requests (heartbeat), then name.

After a pick the prompt's blocks are recorded as pending on the chosen node
(``pending_ttl``), so a burst sharing a new prefix follows the first request
instead of scattering before that request's blocks are confirmed by events.

``make_router`` builds a policy by name: ``prompt-tree`` (this one),
``session`` (least load with session affinity) or ``least-load``.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.load_weight < 0 or self.max_imbalance < 0:
            raise ValueError("routing weights and max_imbalance must be >= 0")


def role_of(node: NodeInfo) -> str:
    """The prompt tree a node's blocks live in: its role's (from its Hello)."""
    return node.role or DEFAULT_ROLE


class PromptTreeRouter:
    """Router on cost = overlap_weight * blocks to prefill + load_weight * load; see the module docstring."""

    name = "prompt-tree"

    def __init__(self, trees: PromptTrees, weights: CostWeights | None = None) -> None:
        self.trees = trees
        self.weights = weights or CostWeights()
        self.cache_routed = 0                # picks that had cached blocks on the chosen node
        self.guarded = 0                     # picks where the guard excluded a better-cached node

    def pick(self, nodes: Sequence[NodeInfo], prompt_ids: Sequence[int]) -> NodeInfo | None:
        if not nodes:
            return None
        w = self.weights
        now = time.monotonic()
        # reusable prefix: the engine matches the prompt minus its last token
        usable = prompt_ids[:-1]
        total = len(usable) // self.trees.block_size
        cached: dict[str, int] = {}
        for role in {role_of(n) for n in nodes}:
            tree = self.trees.of_role(role)
            tree.expire(now)
            cached.update(tree.match(usable, now))
        min_load = min(n.load for n in nodes)
        eligible = [n for n in nodes if n.load <= min_load + w.max_imbalance]

        def score(n: NodeInfo) -> tuple:
            cost = w.overlap_weight * (total - cached.get(n.name, 0)) + w.load_weight * n.load
            return (cost, n.load, n.heartbeat.running if n.heartbeat else 0, n.name)

        choice = min(eligible, key=score)
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
