"""Instance pairs in the simulator (``[cluster].pairs``; AcceLLM §4;
docs/cluster.md, "Pairs and roles"): n1-n2, n3-n4, ... as ``kvd serve
--nodes 2N --pairs`` pairs them.

The decisions are kvd's own objects:

- ``PairRouter`` (kvd/coordinator/pairs.py) wraps the cluster's router: a
  prompt goes to the pair with the most free device memory, less its recent
  prompts, and within it to the node with fewer requests in flight, under
  the prefill-queue bound (``queued``: this module's streams);
- ``plan_moves`` plans each pair's handoffs at every look: when a prompt is
  routed (``PairRouter.on_pick``) and every ``TICK_S`` while a paired node
  has a request in flight (a prompt's first token, a copy that became
  complete);
- each node runs the engine's ``PrefillAlone`` rule: while a prompt waits
  or is computed there, its decodes the partner could take (copy complete,
  the partner computing no prompt) are held (no decode in a prompt's
  steps) until a handoff takes them, the partner takes a prompt too, or
  the prompt is done.

What the daemons do in between is modelled: a planned handoff reaches the
source one hop later and takes the request at its step boundary (the token
of a step that was running still comes from the source), and the partner
resumes it two hops after that (the source's reply, the coordinator's
resume) from its copy: every token but the last computed, no prefill
(``SimNode.take_over``; a partner without room in its device tier
recomputes, as a resume does). A request's copy is complete once the node
that runs it made a token (its prompt's KV streamed by layer during the
prefill; after a move, the copy the source kept); until then, and while a
move of it is under way, ``plan_moves`` sees it as not decoding and never
moves it. The copies' CPU time on both nodes is charged
to their steps (kvd/sim/node.py). Not modelled: the copies' blocks in the
partner's memory (they are given up first under pressure), role switches,
and ``[cluster].pair_scheduler = false``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.prefill_alone import PrefillAlone, prompt_pending
from engine.request import Request
from kvd.coordinator.pairs import TICK_S, PairRouter, Running, plan_moves
from kvd.coordinator.roles import PairBook

if TYPE_CHECKING:
    from kvd.coordinator.membership import NodeInfo
    from kvd.sim.cluster import SimCluster, SimStream
    from kvd.sim.node import SimNode


class SimPairs:
    """The pairs of a simulated cluster (module docstring); installs its
    router as ``sim.router`` and its rule on each node."""

    def __init__(self, sim: "SimCluster") -> None:
        names = list(sim.nodes)
        if len(names) < 2 or len(names) % 2:
            raise ValueError(f"pairs need an even number of nodes (at least 2), got {len(names)}")
        if any(n.role == "prefill" for n in sim.nodes.values()):
            raise ValueError("pairs take no prefill nodes: a paired node must decode (mixed or decode)")
        self.sim = sim
        self.book = PairBook()
        self.pairs = list(zip(names[::2], names[1::2]))
        for a, b in self.pairs:
            self.book.announce(a, b)
            self.book.announce(b, a)
            sim.nodes[a].partner, sim.nodes[b].partner = sim.nodes[b], sim.nodes[a]
        for node in sim.nodes.values():
            node.pair_rule = PrefillAlone(self.takeable)
        router = PairRouter(self.book, sim.router, clock=sim.events.clock,
                            queue_factor=sim.cluster.prefill_queue_factor)
        router.queued = self.queued
        router.on_pick = self.wake
        sim.router = router
        self._ticking = False
        self._look_due = False

    # ------------------------------------------------------------------ reads
    def queued(self, info: "NodeInfo") -> int:
        """``info``'s prefill queue: prompt tokens in flight there without a first token."""
        return sum(s.prompt_len for s in self.sim.streams.values() if s.node == info.name and not s.tokens)

    def takeable(self, req: Request) -> bool:
        """Whether the partner could take ``req`` now, the pair rule's test: its
        copy complete (module docstring) and the partner computing no prompt
        (read from the partner itself: a real node learns it from the
        partner's last replica ack)."""
        stream = self.sim.streams.get(req.request_id)
        if stream is None or stream.made_here == 0:
            return False
        partner = self.sim.nodes[stream.node].partner
        return partner is not None and not partner.dead and not prompt_pending(partner)

    def running(self, a: str, b: str) -> list[Running]:
        return [Running(rid, s.node, s.made_here > 0 and not s.moving, not s.tokens, max(0, s.max_tokens - s.tokens))
                for rid, s in self.sim.streams.items() if s.node in (a, b)]

    # ------------------------------------------------------------------ looks
    def wake(self, node: str = "") -> None:
        """A prompt is routed to ``node`` of a pair: look once its stream is on
        the books (this event's end), and tick while anything is in flight."""
        if not self._look_due:
            self._look_due = True
            self.sim.events.after(0.0, self._woken)
        if not self._ticking:
            self._ticking = True
            self.sim.events.after(TICK_S, self._tick)

    def _woken(self) -> None:
        self._look_due = False
        self.look()

    def _tick(self) -> None:
        self.look()
        if any(s.node for s in self.sim.streams.values()):
            self.sim.events.after(TICK_S, self._tick)
        else:
            self._ticking = False

    def look(self) -> None:
        """One look at every pair whose nodes are both alive: its planned moves started."""
        sim = self.sim
        for a, b in self.pairs:
            if a not in sim.infos or b not in sim.infos:
                continue
            decodes = {n: sim.infos[n].role != "prefill" for n in (a, b)}
            for rid, src, dst in plan_moves(a, b, self.running(a, b), decodes):
                self.move(sim.streams[rid], src, dst)

    # --------------------------------------------------------------- handoffs
    def move(self, stream: "SimStream", src: str, dst: str) -> None:
        """Hand ``stream`` off from ``src`` to its partner ``dst`` (module docstring)."""
        stream.moving = True
        sim = self.sim
        sim.events.after(sim.hop, sim.nodes[src].leave, stream.request_id,
                         lambda req: sim.events.after(2 * sim.hop, self._resume, stream, req, src, dst))

    def _resume(self, stream: "SimStream", req: Request, src: str, dst: str) -> None:
        sim = self.sim
        stream.moving = False
        if sim.streams.get(stream.request_id) is not stream:
            return                                           # ended meanwhile
        node: SimNode = sim.nodes[dst]
        sim.load.uncount(stream.request_id, src)
        stream.node, stream.made_here = dst, 0
        if dst not in sim.infos:                             # declared dead meanwhile: recovered from there
            sim.failover.recover(stream, dst)
            return
        sim.load.count(stream.request_id, sim.infos[dst])
        if node.dead:
            return                                           # lost with it: recovered when it is declared dead
        self.book.handoffs[src] += 1
        try:
            node.take_over(req)
        except ValueError as exc:                            # could never fit there
            sim.end(stream, f"refused by {dst}: {exc}")

    def describe(self) -> dict:
        return {"pairs": ["+".join(p) for p in self.pairs], "handoffs": sum(self.book.handoffs.values())}
