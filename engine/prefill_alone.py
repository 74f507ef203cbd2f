"""A paired node runs no decode in the same step as a prompt's chunks
(AcceLLM §4.2.1; docs/cluster.md, "Pairs and roles").

``PrefillAlone`` is an engine's ``pair_rule``: before each step's schedule
(``before``), while a prompt waits or is being computed here, every
decoding request whose copy at the partner is complete (``complete``, the
node's answer: the same test a handoff passes) is held
(``exact_copy.hold``, the hold a handoff uses), so the coordinator's
handoff resumes it on the partner with no token computed twice or lost.
A request whose copy is incomplete is never handed off and keeps decoding
here, in the prompt's steps. The rule's holds have no deadline: once no
prompt is left they are released, at the engine's own step boundary (no
clock), except those a handoff took over (``taken``: the handoff's hold,
with its deadline, replaced it).

``ran`` counts what each scheduled step ran: ``mixed_steps`` (prefill and
decode together: the decodes of incomplete copies) and ``mixed_held``
(decodes in those steps that were held: the rule's breaches, always 0).
Runs on the engine thread.
No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine import exact_copy
from engine.request import Request


class PrefillAlone:
    """The pair rule (module docstring). ``complete(req)``: whether the
    partner's copy of ``req`` is complete (read on the engine thread)."""

    def __init__(self, complete: Callable[[Request], bool]) -> None:
        self.complete = complete
        self.holding: set[str] = set()      # request ids this rule holds (not a handoff)
        self.counts = {"prompt_holds": 0, "prompt_releases": 0, "mixed_steps": 0, "mixed_held": 0}

    def before(self, engine: Any) -> None:
        """Hold or release, between two steps (module docstring)."""
        sched = engine.scheduler
        self.holding &= engine.requests.keys()
        if sched.waiting or any(r.prefilling for r in sched.running):
            for req in sched.running:
                rid = req.request_id
                if rid in self.holding or rid in sched.held or req.prefilling or not self.complete(req):
                    continue
                if exact_copy.hold(engine, rid, math.inf) is not None:
                    self.holding.add(rid)
                    self.counts["prompt_holds"] += 1
        elif self.holding:
            for rid in self.holding:
                sched.held.pop(rid, None)
            self.counts["prompt_releases"] += len(self.holding)
            self.holding.clear()

    def taken(self, request_id: str) -> None:
        """A handoff holds ``request_id`` now: the prompt's end leaves it held."""
        self.holding.discard(request_id)

    def ran(self, engine: Any, batch: Any) -> None:
        """Count a scheduled step (module docstring)."""
        if batch.prefill and batch.decode:
            self.counts["mixed_steps"] += 1
            held = self.holding | engine.scheduler.held.keys()
            self.counts["mixed_held"] += sum(1 for req in batch.decode if req.request_id in held)
