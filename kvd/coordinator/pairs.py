"""The pair scheduler (AcceLLM §4.2.1; docs/cluster.md, "Pairs and roles").

Within each registered pair a node never keeps decodes while it computes a
prompt: every ``interval`` the scheduler looks at each pair's requests and
plans handoffs (``plan_moves``, pure), which ``Handoffs`` carries out (each
checked first: a request whose copy is incomplete stays where it is, and is
planned again at the next tick).

- A node that is prefilling (computing the prompt of a request of its own,
  or its role is ``prefill``) hands every decode to its partner, unless
  the partner prefills too (or does not decode): the prompt runs alone, as
  on a prefill node, and the decodes do not stall behind it.
- Otherwise, when the two nodes' decode counts differ by two or more, the
  busier node hands ``difference // 2`` decodes to the other, those with the
  most tokens left to generate first (they weigh on a batch the longest):
  after a prefill both nodes decode again, balanced.

The scheduler looks at a pair the moment a prompt is routed to one of its
nodes (``PairRouter.on_pick`` wakes it), not at its next tick: the
prompt's node hands its decodes to the partner while the prompt is on its
way there, so they do not wait behind the prompt's steps; a pair's moves
of one look run concurrently (each its own handoff). The tick remains for
what no routing announces: a prompt's first token (the rebalance after
it), a copy that became complete, a role switch.

Prompts to pairs (``PairRouter``, wrapping the cluster's router): a new
prompt goes to the pair with the most free device memory, less the blocks
of the prompts it was given in the last ``PENDING_S`` (its heartbeats do
not show them yet: prompts that arrive together are spread over pairs),
and within the pair to the node with fewer requests in flight (decodes)
(never to a node whose role is ``decode`` while its partner's is not),
among the nodes whose prefill queue (``queued``: prompt tokens in flight
there without a first token) holds at most ``queue_factor`` times the
prompt's tokens, the bound 1P1D's prefill legs have
(``[cluster].prefill_queue_factor``): a short prompt does not wait behind
a long one while the partner could start it (when neither node is within
the bound, the one with the shorter queue). Nodes without a partner are
routed by the wrapped router as before.
Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import time
from collections.abc import Callable, Sequence

from kvd.cluster_config import Role
from kvd.coordinator.handoff import decoding
from kvd.coordinator.roles import DECODES

if TYPE_CHECKING:
    from kvd.coordinator.client import RemoteEngineClient
    from kvd.coordinator.handoff import Handoffs
    from kvd.coordinator.membership import NodeInfo
    from kvd.coordinator.roles import PairBook
    from kvd.coordinator.router import Router

PENDING_S = 2.0        # a prompt's blocks count against its pair this long (until heartbeats show them)

log = logging.getLogger("kvd.coordinator.pairs")

TICK_S = 0.05             # between two looks at the pairs


@dataclass(frozen=True)
class Running:
    """One request in flight on a node of a pair, as the scheduler sees it."""

    request_id: str
    node: str
    decoding: bool           # the node decodes it (a handoff may move it)
    prefilling: bool         # the node computes its prompt now
    left: int                # tokens it may still generate


def plan_moves(a: str, b: str, running: Iterable[Running], decodes: dict[str, bool]
               ) -> list[tuple[str, str, str]]:
    """The handoffs (request, from, to) for the pair ``a``-``b`` (module
    docstring). ``decodes``: whether each node's role takes decodes (a node
    whose role is prefill counts as prefilling). Pure."""
    running = list(running)
    prefilling = {n: not decodes.get(n, True) or any(r.node == n and r.prefilling for r in running)
                  for n in (a, b)}
    on = {n: sorted((r for r in running if r.node == n and r.decoding), key=lambda r: (-r.left, r.request_id))
          for n in (a, b)}
    for src, dst in ((a, b), (b, a)):
        if prefilling[src] and not prefilling[dst] and decodes.get(dst, True):
            return [(r.request_id, src, dst) for r in on[src]]
    if any(prefilling.values()):
        return []
    busy, idle = (a, b) if len(on[a]) >= len(on[b]) else (b, a)
    moves = (len(on[busy]) - len(on[idle])) // 2
    return [(r.request_id, busy, idle) for r in on[busy][:moves]]


class PairScheduler:
    """Runs ``plan_moves`` for every registered pair each ``TICK_S`` and
    whenever ``wake`` is called (an owned task of the coordinator: ``run``).
    Attaches ``wake`` to the client's router when that is a ``PairRouter``."""

    def __init__(self, client: RemoteEngineClient, handoffs: Handoffs, tick: float = TICK_S) -> None:
        self.client = client
        self.handoffs = handoffs
        self.pairs = client.recovery.pairs
        self.tick = tick
        self.moved = 0
        self._woken = asyncio.Event()
        if isinstance(client.router, PairRouter):
            client.router.on_pick = self.wake

    def wake(self, node: str = "") -> None:
        """Look at the pairs now (a prompt was just routed to ``node``). Never blocks."""
        self._woken.set()

    def pairs_now(self) -> list[tuple[str, str]]:
        """The registered pairs, each once, by name."""
        nodes = self.client.membership.nodes
        return sorted({tuple(sorted((name, p.name))) for name in nodes
                       if (p := self.pairs.partner(name, nodes)) is not None})

    def running(self, a: str, b: str) -> list[Running]:
        """The requests in flight on ``a`` or ``b`` (not those another task moves)."""
        out = []
        for rid, stream in self.client.failover.streams.items():
            if stream.node in (a, b) and not stream.recovering:
                max_tokens = stream.request.sampling.max_tokens
                out.append(Running(rid, stream.node, decoding(stream), not stream.tokens and not stream.prefill,
                                   max(0, max_tokens - len(stream.tokens))))
        return out

    async def step(self) -> int:
        """One look at every pair; the handoffs done (all the moves planned
        in this look run concurrently)."""
        nodes = self.client.membership.nodes
        moves = []
        for a, b in self.pairs_now():
            decodes = {n: nodes[n].role in DECODES and not nodes[n].draining for n in (a, b) if n in nodes}
            moves += [rid for rid, _, _ in plan_moves(a, b, self.running(a, b), decodes)]
        done = sum(await asyncio.gather(*(self.handoffs.try_hand_off(rid) for rid in moves)))
        self.moved += done
        return done

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self.tick)
            self._woken.clear()
            try:
                await self.step()
            except Exception:  # noqa: BLE001 -- one bad tick must not end scheduling
                log.exception("pair scheduler tick failed")


class PairRouter:
    """Prompts to pairs (module docstring; AcceLLM §4.2.1). ``pairs``: the
    coordinator's announced pairs; ``inner``: the router for the rest (no
    candidate is paired). A Router: no side effects on the nodes."""

    def __init__(self, pairs: PairBook, inner: Router, clock: Callable[[], float] = time.monotonic,
                 queue_factor: float = 0.0) -> None:
        self.pairs, self.inner, self.clock = pairs, inner, clock
        self.pending: dict[tuple[str, ...], list[tuple[float, int]]] = {}   # pair -> (when routed, blocks)
        self.on_pick: Callable[[str], None] | None = None    # told each node a prompt goes to in a pair
        self.queue_factor = queue_factor                     # [cluster].prefill_queue_factor; 0: no bound
        self.queued: Callable[[NodeInfo], int] | None = None    # a node's prefill queue, in prompt tokens

    def describe(self) -> dict:
        """The inner router's description, and the pairs prompts go to (each as "a+b")."""
        inner = getattr(self.inner, "describe", None)
        pairs = sorted({"+".join(sorted((a, b))) for a, b in self.pairs.announced.items()
                        if self.pairs.announced.get(b) == a})
        return {**(inner() if inner else {}), "pairs": pairs}

    def pick(self, nodes: Sequence[NodeInfo], prompt_ids: Sequence[int],
             request_id: str | None = None) -> NodeInfo | None:
        groups: dict[tuple[str, ...], list[NodeInfo]] = {}
        for n in nodes:
            partner = self.pairs.announced.get(n.name)
            if partner and self.pairs.announced.get(partner) == n.name:
                groups.setdefault(tuple(sorted((n.name, partner))), []).append(n)
        if not groups:
            return self.inner.pick(nodes, prompt_ids, request_id)
        now = self.clock()
        for key in list(self.pending):
            self.pending[key] = [(t, b) for t, b in self.pending[key] if now - t < PENDING_S]
        lone = [n for n in nodes if not any(n in g for g in groups.values())]
        if lone:       # unpaired candidates compete as pairs of one
            for n in lone:
                groups[(n.name,)] = [n]

        def free(key: tuple[str, ...]) -> int:
            have = sum(n.heartbeat.free_blocks.get("device", 0) if n.heartbeat else n.blocks_per_tier.get("device", 0)
                       for n in groups[key])
            return have - sum(b for _, b in self.pending.get(key, ()))
        # most free memory; ties: fewer in flight, then names (deterministic)
        key = min(groups, key=lambda k: (-free(k), sum(n.load for n in groups[k]), k))
        # a member whose role is decode takes no prompt while its partner does (kvctl role)
        members = [n for n in groups[key] if n.role != Role.DECODE.value] or groups[key]
        if self.queued is not None and self.queue_factor > 0 and len(members) > 1:
            queue = {n.name: self.queued(n) for n in members}
            bound = self.queue_factor * len(prompt_ids)
            members = [n for n in members if queue[n.name] <= bound] or [min(members, key=lambda n: queue[n.name])]
        node = min(members, key=lambda n: (n.load, n.heartbeat.running if n.heartbeat else 0, n.name))
        blocks = -(-len(prompt_ids) // max(1, node.block_size))
        self.pending.setdefault(key, []).append((now, blocks))
        if len(key) == 2 and self.on_pick is not None:
            self.on_pick(node.name)
        return node
