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

A pick reads every routable node, so at a thousand nodes it is the cost of
routing. From ``ARRAY_PICK_NODES`` nodes it computes the costs as numpy
arrays (the nodes' names, slots and in-flight sets built once per list of the
same node objects; the recent work mirrored in arrays) and scores only the
shortlist of nearly cheapest nodes with the loop's own key, so it picks
exactly what the loop picks (tests/kvd/test_cache_router_arrays.py compares
them on randomized clusters).

``make_router`` builds a policy by name: ``prompt-tree`` (this one),
``session`` (least load with session affinity) or ``least-load``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_, le, not_

import numpy as np

from kvd.cluster_config import ROUTING_POLICIES
from kvd.coordinator.membership import NodeInfo
from kvd.coordinator.prompt_tree import DEFAULT_ROLE, PromptTrees, block_hashes
from kvd.coordinator.router import LeastLoadRouter, Router

POLICIES = ROUTING_POLICIES
# from this many nodes a pick scores them as arrays (``PromptTreeRouter``); below, one loop is faster
ARRAY_PICK_NODES = 48
_NAME, _ROLE, _IN_FLIGHT = attrgetter("name"), attrgetter("role"), attrgetter("in_flight")
_NOTHING: frozenset[str] = frozenset()


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

    Each node also has a slot in two arrays mirroring ``_done`` (value, at),
    so ``values`` decays a thousand nodes' work in one numpy expression.
    """

    def __init__(self, decay: float, max_open: int = 100_000) -> None:
        self.decay = decay
        self.max_open = max_open
        self._open: dict[tuple[str, str], float] = {}        # (node, request id) -> blocks, oldest first
        # the same per node (request id -> blocks), a node's dict kept when it empties, so
        # that _names and _ids (its names and the sets of its request ids, in its order; a
        # set's subset test is the fastest in C) only grow; _busy: their indices with open requests
        self._by_node: dict[str, dict[str, float]] = {}
        self._names: list[str] = []
        self._ids: list[set[str]] = []
        self._index: dict[str, int] = {}
        self._busy: set[int] = set()
        self._flying: tuple[dict | None, list] = (None, [])   # (in_flight_of, the sets of _names there)
        self._done: dict[str, tuple[float, float]] = {}      # node -> (value, at)
        self._slot: dict[str, int] = {}                     # node -> its index in the arrays below
        self._value = np.zeros(64)
        self._at = np.zeros(64)

    def value(self, node: str, now: float) -> float:
        """The decayed finished work of ``node`` at ``now`` (0 when none)."""
        if self.decay <= 0 or node not in self._done:
            return 0.0
        value, at = self._done[node]
        return value * math.exp(-max(0.0, now - at) / self.decay)

    def add(self, node: str, blocks: float, now: float) -> None:
        """Count ``blocks`` of work finished on ``node`` at ``now``."""
        if self.decay > 0:
            value = self._done[node] = (self.value(node, now) + blocks, now)
            i = self._slot.get(node)
            if i is None:
                i = int(self.slots((node,))[0])
            self._value[i], self._at[i] = value

    def slots(self, names: Sequence[str]) -> np.ndarray:
        """The array index of each node named (new names get one)."""
        slot = self._slot
        for name in names:
            if name not in slot:
                slot[name] = len(slot)
        if len(slot) > len(self._value):
            grow = np.zeros(2 * len(slot))
            self._value = np.concatenate([self._value, grow])
            self._at = np.concatenate([self._at, grow])
        return np.fromiter(map(slot.__getitem__, names), dtype=np.intp, count=len(names))

    def values(self, slots: np.ndarray, now: float) -> np.ndarray:
        """``value`` of the nodes at ``slots`` (from ``slots``), as an array:
        the same expression, equal up to the last bits of numpy's exp."""
        if self.decay <= 0:
            return np.zeros(len(slots))
        return self._value[slots] * np.exp(-np.maximum(0.0, now - self._at[slots]) / self.decay)

    def worked(self, slots: np.ndarray) -> np.ndarray:
        """Whether ``value`` of each node at ``slots`` can be other than 0.0."""
        if self.decay <= 0:
            return np.zeros(len(slots), dtype=bool)
        return self._value[slots] != 0.0

    def open(self, node: str, request_id: str, blocks: float) -> None:
        if self.decay <= 0:
            return
        self._open[(node, request_id)] = blocks
        reqs = self._by_node.get(node)
        if reqs is None:
            reqs = self._by_node[node] = {}
            self._index[node] = len(self._names)
            self._names.append(node)
            self._ids.append(set())
        reqs[request_id] = blocks
        i = self._index[node]
        self._ids[i].add(request_id)
        self._busy.add(i)
        while len(self._open) > self.max_open:             # a coordinator that never settles
            self._forget(*next(iter(self._open)))

    def _forget(self, node: str, request_id: str) -> float:
        reqs, i = self._by_node[node], self._index[node]
        del reqs[request_id]
        self._ids[i].discard(request_id)
        if not reqs:
            self._busy.discard(i)
        return self._open.pop((node, request_id))

    def settle(self, nodes: Sequence[NodeInfo], now: float) -> None:
        """Move the work of requests no longer in flight on their node (or
        whose node is not among ``nodes``) into the finished work, each
        node's in the order it was opened (a float sum's order)."""
        if self._open:
            self.settle_at(dict(zip(map(_NAME, nodes), map(_IN_FLIGHT, nodes))), now)

    def settle_at(self, in_flight_of: dict[str, set[str]], now: float) -> None:
        """``settle`` for the nodes named in ``in_flight_of``, each with its requests in flight."""
        if not self._open:
            return
        of, flying = self._flying
        if of is not in_flight_of:                          # another set of nodes than last time
            flying = []
        if len(flying) < len(self._names):
            flying = flying + list(map(in_flight_of.get, self._names[len(flying):], repeat(_NOTHING)))
            self._flying = (in_flight_of, flying)
        # per node: are all its open requests still in flight there? (a subset test per node, in C)
        busy = list(self._busy)                             # nodes are independent: any order
        still = list(map(le, map(self._ids.__getitem__, busy), map(flying.__getitem__, busy)))
        if all(still):
            return
        names = self._names
        ended: list[tuple[str, str]] = []
        for i in compress(busy, map(not_, still)):
            ended.extend((names[i], rid) for rid in self._by_node[names[i]] if rid not in flying[i])
        for name, rid in ended:
            self.add(name, self._forget(name, rid), now)

    def snapshot(self, now: float) -> dict[str, float]:
        return {n: round(self.value(n, now), 1) for n in sorted(self._done)}


class _Nodes:
    """What a pick reads of its nodes that a node never changes (its name,
    the set object of its requests in flight), built once per list of the
    same node objects (compared by identity, the objects held so no id is
    reused meanwhile)."""

    def __init__(self, nodes: Sequence[NodeInfo], recent: RecentWork) -> None:
        self.nodes = tuple(nodes)
        self.names = list(map(_NAME, nodes))
        self.position = dict(zip(self.names, range(len(self.names))))
        self.in_flight = list(map(_IN_FLIGHT, nodes))
        self.in_flight_of = dict(zip(self.names, self.in_flight))
        self.slots = recent.slots(self.names)                # a node's slot never changes

    def same(self, nodes: Sequence[NodeInfo]) -> bool:
        return len(nodes) == len(self.nodes) and all(map(is_, nodes, self.nodes))


def _ties(n: NodeInfo) -> tuple:
    """Between nodes of equal cost: lower load, then fewer running (heartbeat), then name."""
    return (n.load, n.heartbeat.running if n.heartbeat else 0, n.name)


def _least_tied(nodes: list[NodeInfo]) -> NodeInfo:
    """``min(nodes, key=_ties)`` for nodes of equal cost and load; by name
    alone, in C, when no heartbeat says how many run (a thousand ties)."""
    if len(nodes) > 1 and list(map(attrgetter("heartbeat"), nodes)).count(None) == len(nodes):
        names = list(map(_NAME, nodes))
        return nodes[names.index(min(names))]
    return min(nodes, key=_ties)


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
        self._nodes = _Nodes((), self.recent)
        self.array_pick_nodes = ARRAY_PICK_NODES   # the same choice either way: the tests compare them

    def pick(self, nodes: Sequence[NodeInfo], prompt_ids: Sequence[int],
             request_id: str | None = None) -> NodeInfo | None:
        if not nodes:
            return None
        w = self.weights
        now = self.clock()
        if not self._nodes.same(nodes):
            self._nodes = _Nodes(nodes, self.recent)
        view = self._nodes
        self.recent.settle_at(view.in_flight_of, now)
        # reusable prefix: the engine matches the prompt minus its last token
        usable = prompt_ids[:-1]
        total = len(usable) // self.trees.block_size
        cached: dict[str, int] = {}
        for role in {r or DEFAULT_ROLE for r in set(map(_ROLE, nodes))}:
            tree = self.trees.of_role(role)
            tree.expire(now)
            cached.update(tree.match(usable, now))
        score = self._score(cached, total, now)
        if len(nodes) >= self.array_pick_nodes:
            choice, best_cached, eligible_cached = self._choose_by_arrays(view, cached, total, now, score)
        else:
            min_load = min(n.load for n in nodes)
            eligible = [n for n in nodes if n.load <= min_load + w.max_imbalance]
            choice = min(eligible, key=score)
            best_cached = max((cached.get(n.name, 0) for n in nodes), default=0)
            eligible_cached = max(cached.get(n.name, 0) for n in eligible)
        work = total - cached.get(choice.name, 0) + w.load_weight
        if request_id is None:
            self.recent.add(choice.name, work, now)       # a caller that cannot say when it ends
        else:
            self.recent.open(choice.name, request_id, work)
        if cached.get(choice.name, 0):
            self.cache_routed += 1
        if best_cached > eligible_cached:
            self.guarded += 1
        self.trees.of_role(role_of(choice)).add_pending(
            choice.name, block_hashes(usable, self.trees.block_size), now)
        return choice

    def _score(self, cached: dict[str, int], total: int, now: float) -> Callable[[NodeInfo], tuple]:
        """A node's sort key for this pick: (cost, *``_ties``)."""
        w, recent = self.weights, self.recent

        def score(n: NodeInfo) -> tuple:
            cost = (w.overlap_weight * (total - cached.get(n.name, 0)) + w.load_weight * n.load
                    + w.recent_weight * recent.value(n.name, now))
            return (cost, *_ties(n))

        return score

    def _choose_by_arrays(self, view: _Nodes, cached: dict[str, int], total: int, now: float,
                          score: Callable[[NodeInfo], tuple]) -> tuple[NodeInfo, int, int]:
        """The loop's choice (and its best cached counts, over all nodes and
        over the eligible ones) with every node's cost computed as arrays.
        numpy's exp may differ from math's in the last bits, so the arrays
        only shortlist: the nodes within a relative 1e-9 of the cheapest are
        scored again by ``score``, the loop's own key, and the least wins."""
        w, nodes, position = self.weights, view.nodes, view.position
        load = np.fromiter(map(len, view.in_flight), dtype=np.float64, count=len(nodes))
        prefill = np.full(len(nodes), float(total))
        hits = [(position[name], c) for name, c in cached.items() if name in position]
        for i, c in hits:
            prefill[i] = total - c
        slots = view.slots
        cost = w.overlap_weight * prefill + w.load_weight * load + w.recent_weight * self.recent.values(slots, now)
        eligible = load <= load.min() + w.max_imbalance
        cost[~eligible] = np.inf
        best = cost.min()
        shortlist = np.flatnonzero(cost <= best + 1e-9 * (1.0 + abs(best)))
        if len(shortlist) > 1:
            # a node with no recent work has its exact cost already (no exp in it); the
            # others are scored by the loop's own key
            costs = cost[shortlist]
            for j in np.flatnonzero(self.recent.worked(slots[shortlist])):
                costs[j] = score(nodes[shortlist[j]])[0]
            tied = shortlist[costs == costs.min()]
            tied = tied[load[tied] == load[tied].min()]
            choice = _least_tied([nodes[i] for i in tied])
        else:
            choice = nodes[shortlist[0]]
        best_cached = max((c for _, c in hits), default=0)
        eligible_cached = max((c for i, c in hits if eligible[i]), default=0)
        return choice, best_cached, eligible_cached

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
    router = getattr(router, "inner", router)      # a pair router (kvd/coordinator/pairs.py) wraps one
    if isinstance(router, PromptTreeRouter):
        return router.name
    return "session" if getattr(router, "affinity_tokens", 0) else "least-load"
