"""Routing: which node runs a new request.

``Router`` is the pluggable interface; ``LeastLoadRouter`` picks the routable
node with the fewest requests in flight, keeping *session affinity*: requests
whose first ``affinity_tokens`` prompt tokens agree (the turns of one
conversation, which extend each other) go back to the node that served the
last one — its prefix cache holds their KV — unless that node is gone,
draining, or busier than the least-loaded node by more than ``slack``.
Prompt-tree (cache-aware) routing is ``PromptTreeRouter`` (cache_router.py).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvd.coordinator.membership import NodeInfo


class Router(Protocol):
    def pick(self, nodes: Sequence[NodeInfo], prompt_ids: Sequence[int],
             request_id: str | None = None) -> NodeInfo | None:
        """The node for a request, or None when ``nodes`` is empty. No side effects
        on ``nodes``; may update the router's own state. ``request_id`` names
        the request the caller will put in the chosen node's ``in_flight``
        (a router may follow it there to learn when it ended)."""


def affinity_key(prompt_ids: Sequence[int], num_tokens: int) -> bytes:
    head = prompt_ids[:num_tokens]
    return hashlib.blake2b(b",".join(str(t).encode() for t in head), digest_size=12).digest()


class LeastLoadRouter:
    def __init__(self, affinity_tokens: int = 64, slack: int = 2, ttl: float = 600.0,
                 max_sessions: int = 100_000) -> None:
        self.affinity_tokens = affinity_tokens
        self.slack = slack
        self.ttl = ttl
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self.affinity_hits = 0
        self.clock = time.monotonic      # the session TTL's clock (a simulator's, kvd/sim/)

    def pick(self, nodes: Sequence[NodeInfo], prompt_ids: Sequence[int],
             request_id: str | None = None) -> NodeInfo | None:
        if not nodes:
            return None
        # fewest in flight; ties: fewer running per heartbeat, then name (deterministic)
        least = min(nodes, key=lambda n: (n.load, n.heartbeat.running if n.heartbeat else 0, n.name))
        if self.affinity_tokens <= 0:
            return least
        now = self.clock()
        key = affinity_key(prompt_ids, self.affinity_tokens)
        choice = least
        sticky = self._sessions.get(key)
        if sticky is not None and now - sticky[1] < self.ttl:
            node = next((n for n in nodes if n.name == sticky[0]), None)
            if node is not None and node.load <= least.load + self.slack:
                choice = node
                self.affinity_hits += 1
        self._sessions[key] = (choice.name, now)
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return choice
