"""Cache-aware routing on the global prompt trees (MemServe §6), and the
routing policies by name.

``PromptTreeRouter`` scores every routable node ``n`` for a prompt of ``B``
full blocks (of the prompt minus its last token: what the engine can reuse)::

    cached(n)  = leading blocks n holds (global prompt tree) or has pending
    prefill(n) = B - cached(n)                      blocks n would compute
    cost(n)    = overlap_weight * prefill(n)
               + load_weight    * load(n)           requests in flight there
               + recent_weight  * recent(n)         work it finished lately

where ``load(n)`` is the requests this coordinator has in flight there (exact
and never reset by a heartbeat) and ``recent(n)`` the work routed there
lately, in blocks: each request routed there adds ``prefill(n) +
load_weight`` (the blocks it computes plus what a request costs beyond them)
once it has left the node, decaying as ``exp(-age / load_decay)`` from then
(while in flight it counts in ``load(n)``). In-flight counts alone say nothing on a
cluster whose requests end before the next arrives: affinity then wins every
pick and a node that first computed a popular prefix takes all of its
traffic. The decayed term remembers who did the work: once a node has
absorbed about one prefix's worth of blocks more than another, computing the
prefix again elsewhere is cheaper than queueing behind it, so a hot prefix
spreads over the nodes, each computing it once. It decays rather than resets
(vllm-project/router #179: counters that reset create hot spots).

The cheapest node is picked among the *eligible* ones:

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

import dataclasses
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
    recent_weight: float = 0.25      # per block of work finished there lately (decayed)
    load_decay: float = 60.0         # seconds: time constant of that decay; 0 turns the term off

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in dataclasses.astuple(self)):
            raise ValueError("routing weights, max_imbalance and load_decay must be finite and >= 0")


# the weights an operator may override at run time (``kvctl routing --set``), and their types
ROUTING_WEIGHTS: dict[str, type] = {f.name: type(f.default) for f in dataclasses.fields(CostWeights)}


class RecentWork:
    """Work each node finished lately, in blocks, each request's decaying as
    ``exp(-age / decay)`` from when it ended.

    ``open`` records a routed request's work (by request id); it counts here
    only once the request has left its node's ``in_flight`` (``settle``
    notices, at the next pick), because while in flight it is already the
    load term's: a burst sharing a new prefix then follows its first request
    as before, and only finished work pushes later requests elsewhere. Per
    node one (value, time) pair: decaying it to ``now`` before adding is exact
    for a sum of exponentials. Not thread-safe (the coordinator's loop owns it).
    """

    def __init__(self, decay: float, max_open: int = 100_000) -> None:
        self.decay = decay
        self.max_open = max_open
        self._open: dict[tuple[str, str], float] = {}        # (node, request id) -> blocks
        self._done: dict[str, tuple[float, float]] = {}      # node -> (value, at)

    def value(self, node: str, now: float) -> float:
        """The decayed finished work of ``node`` at ``now`` (0 when none)."""
        if self.decay <= 0 or node not in self._done:
            return 0.0
        value, at = self._done[node]
        return value * math.exp(-max(0.0, now - at) / self.decay)

    def add(self, node: str, blocks: float, now: float) -> None:
        """Count ``blocks`` of work finished on ``node`` at ``now``."""
        if self.decay > 0:
            self._done[node] = (self.value(node, now) + blocks, now)

    def open(self, node: str, request_id: str, blocks: float) -> None:
        if self.decay <= 0:
            return
        self._open[(node, request_id)] = blocks
        while len(self._open) > self.max_open:             # a coordinator that never settles
            self._open.pop(next(iter(self._open)))

    def settle(self, nodes: Sequence[NodeInfo], now: float) -> None:
        """Move the work of requests no longer in flight on their node (or
        whose node is not among ``nodes``) into the finished work."""
        if not self._open:
            return
        by_name = {n.name: n for n in nodes}
        for key in [k for k in self._open if (n := by_name.get(k[0])) is None or k[1] not in n.in_flight]:
            self.add(key[0], self._open.pop(key), now)

    def snapshot(self, now: float) -> dict[str, float]:
        return {n: round(self.value(n, now), 1) for n in sorted(self._done)}


def role_of(node: NodeInfo) -> str:
    """The prompt tree a node's blocks live in: its role's (from its Hello)."""
    return node.role or DEFAULT_ROLE


class PromptTreeRouter:
    """Router on cost = overlap_weight * blocks to prefill + load_weight * load
    + recent_weight * recent work; see the module docstring."""

    name = "prompt-tree"

    def __init__(self, trees: PromptTrees, weights: CostWeights | None = None) -> None:
        self.trees = trees
        self.weights = weights or CostWeights()
        self.recent = RecentWork(self.weights.load_decay)
        self.cache_routed = 0                # picks that had cached blocks on the chosen node
        self.guarded = 0                     # picks where the guard excluded a better-cached node
        self.clock = time.monotonic          # the decay and pending TTL's clock (a simulator's, kvd/sim/)

    def pick(self, nodes: Sequence[NodeInfo], prompt_ids: Sequence[int],
             request_id: str | None = None) -> NodeInfo | None:
        if not nodes:
            return None
        w = self.weights
        now = self.clock()
        self.recent.settle(nodes, now)
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
            cost = (w.overlap_weight * (total - cached.get(n.name, 0)) + w.load_weight * n.load
                    + w.recent_weight * self.recent.value(n.name, now))
            return (cost, n.load, n.heartbeat.running if n.heartbeat else 0, n.name)

        choice = min(eligible, key=score)
        work = total - cached.get(choice.name, 0) + w.load_weight
        if request_id is None:
            self.recent.add(choice.name, work, now)       # a caller that cannot say when it ends
        else:
            self.recent.open(choice.name, request_id, work)
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
                "recent_weight": self.weights.recent_weight, "load_decay": self.weights.load_decay,
                "recent_work": self.recent.snapshot(self.clock()),
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
