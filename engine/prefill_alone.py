"""A paired node runs no decode in the same step as a prompt's chunks
(AcceLLM §4.2.1; docs/cluster.md, "Pairs and roles").

``PrefillAlone`` is an engine's ``pair_rule``: before each step's schedule
(``before``), while a prompt waits or is being computed here
(``prompt_pending``), every decoding request the partner could take now
(``takeable``, the node's answer: its copy at the partner complete, the
same test a handoff passes, and the partner computing no prompt of its
own) is held (``exact_copy.hold``, the hold a handoff uses), so the
coordinator's handoff resumes it on the partner with no token computed
twice or lost. A request whose copy is incomplete is never handed off and
keeps decoding here, in the prompt's steps; so does one the partner cannot
take because it computes a prompt too (the coordinator moves nothing while
both nodes prefill): a hold of the rule whose request is no longer
takeable is released at the next step boundary, so that decodes never
wait for both nodes' prompts to drain. The rule's holds have no deadline
and read no clock: once no prompt is left they are released, at the
engine's own step boundary, except those a handoff took over (``taken``:
the handoff's hold, with its deadline, replaced it).

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
    """The pair rule (module docstring). ``takeable(req)``: whether the
    partner could take ``req`` now (read on the engine thread)."""

    def __init__(self, takeable: Callable[[Request], bool]) -> None:
        self.takeable = takeable
        self.holding: set[str] = set()      # request ids this rule holds (not a handoff)
        self.counts = {"prompt_holds": 0, "prompt_releases": 0, "mixed_steps": 0, "mixed_held": 0}

    def before(self, engine: Any) -> None:
        """Hold or release, between two steps (module docstring)."""
        sched = engine.scheduler
        self.holding &= engine.requests.keys()
        if prompt_pending(engine):
            for req in sched.running:
                rid = req.request_id
                if rid in self.holding and not self.takeable(req):      # the partner took a prompt meanwhile
                    sched.held.pop(rid, None)
                    self.holding.discard(rid)
                    self.counts["prompt_releases"] += 1
                    continue
                if rid in self.holding or rid in sched.held or req.prefilling or not self.takeable(req):
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


def prompt_pending(engine: Any) -> bool:
    """Whether ``engine`` has a prompt waiting or being computed (a paired node
    then runs no decode the partner could take). Read on the engine thread."""
    sched = engine.scheduler
    return bool(sched.waiting) or any(r.prefilling for r in sched.running)
