"""Failure recovery's bookkeeping (DéjàVu §4.2.3; docs/cluster.md, "Failure
semantics"): who replicates to whom, how far each replica got, and where a
dead node's request resumes. Pure: no I/O, no asyncio, no torch.

- ``ring_peers``: every node that decodes (role mixed or decode, not
  draining) streams its requests' KV to the next one by name, cyclically;
  a node alone has no peer. Assignments travel in the heartbeat replies, so
  a ring change reaches every node within one heartbeat interval. A paired
  node (kvd/coordinator/roles.py) is in no ring: its peer is its partner,
  whatever either's role, and none while its partner is not registered.
- Replica tickets (kvd/trust.py): a holder takes a replica of request R
  run by S only with this coordinator's ticket for (holder, S, R). The
  holder's key derives from ``secret`` (random per coordinator process)
  and the holder's incarnation; ``replica_fields`` gives S (and its
  prefill node) the ticket with R, ``tickets`` repeats them for S's
  current peer in each heartbeat reply.
- ``ReplicaTable``: what each holder reported in its last heartbeat, sender
  -> {request id -> tokens held} (DéjàVu's ``(x, j, t)``).
- ``RecoveryPolicy``: ``replica`` resumes on the live holder with the most
  tokens of the dead node's replica, else like ``reprefill``; ``reprefill``
  re-runs prompt and tokens so far on the least-loaded other node
  (Dynamo's request migration); ``fail`` ends the request. A request is
  recovered at most ``max_recoveries`` times and never sent back to a node
  process that already failed it: an (name, incarnation) pair, as Dynamo
  excludes worker instances. A node that restarts (systemd, a kill -9 and
  a new process under the same name) is a new instance: empty, but as good
  a target as any, where excluding its name would leave a 3-node cluster
  with no target for a request that outlived three kills.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvd import trust
from kvd.cluster_config import Role
from kvd.coordinator.membership import NodeInfo
from kvd.coordinator.roles import PairBook


def ring_peers(nodes: list[NodeInfo], paired: Iterable[str] = ()) -> dict[str, NodeInfo]:
    """node name -> the node it replicates to (absent: none); the ``paired``
    nodes (by name) are in no ring."""
    paired = set(paired)
    ring = sorted((n for n in nodes if n.role != Role.PREFILL and not n.draining and n.name not in paired),
                  key=lambda n: n.name)
    if len(ring) < 2:
        return {}
    return {n.name: ring[(i + 1) % len(ring)] for i, n in enumerate(ring)}


class ReplicaTable:
    """The replicas each holder reported, as of its last heartbeat."""

    def __init__(self) -> None:
        self.by_holder: dict[str, dict[str, dict[str, int]]] = {}

    def update(self, holder: str, replicas: dict[str, dict[str, int]]) -> None:
        self.by_holder[holder] = replicas

    def forget(self, holder: str) -> None:
        self.by_holder.pop(holder, None)

    def best(self, source: str, request_id: str, alive: set[str]) -> tuple[str, int] | None:
        """(holder, tokens) of the fullest replica of ``request_id`` made by
        ``source`` on a node in ``alive``; None when there is none."""
        found = [(held[request_id], holder) for holder, by_src in self.by_holder.items()
                 if holder in alive and (held := by_src.get(source)) and request_id in held]
        if not found:
            return None
        tokens, holder = max(found)
        return holder, tokens

    def stale(self, holder: str, in_flight: dict[str, str]) -> tuple[str, ...]:
        """Request ids ``holder`` holds replicas of that it may drop: the
        request is not in flight, or runs on the holder itself."""
        return tuple(rid for by_src in self.by_holder.get(holder, {}).values() for rid in by_src
                     if in_flight.get(rid) in (None, holder))


@dataclass
class RecoveryPolicy:
    policy: str = "replica"                  # cluster_config.RECOVERY_POLICIES
    max_recoveries: int = 3
    replicas: int = 0                        # [cluster].replicas: 1 = every decoding node has a ring peer
    table: ReplicaTable = field(default_factory=ReplicaTable)
    outcomes: collections.Counter = field(default_factory=collections.Counter)   # (how, outcome) -> n
    secret: bytes = field(default_factory=lambda: os.urandom(32), repr=False)     # the holders' keys derive from it
    pairs: PairBook = field(default_factory=PairBook)                             # the announced pairs

    def holder_key(self, holder: NodeInfo) -> str:
        """The replica key of ``holder``'s process: its registration Welcome's ``replica_key``."""
        return trust.holder_key(self.secret, holder.name, holder.incarnation)

    def tickets(self, holder: NodeInfo | None, owner: str, request_ids: Iterable[str]) -> dict[str, str]:
        """request id -> the ticket to write its replica, run by ``owner``, at
        ``holder`` ({} without a holder)."""
        if holder is None:
            return {}
        key = self.holder_key(holder)
        return {rid: trust.replica_ticket(key, owner, rid) for rid in request_ids}

    def replica_fields(self, owner: str, request_id: str, nodes: Iterable[NodeInfo],
                       holder: NodeInfo | None = None) -> dict[str, str]:
        """The GenerateRequest fields that let ``request_id``, run by
        ``owner``, be replicated at ``holder`` (default: ``owner``'s ring
        peer): ``replica_to``, ``replica_address``, ``replica_ticket``; {}
        when there is none (or ``replicas = 0``)."""
        holder = holder or self.peer_of(owner, nodes)
        if holder is None:
            return {}
        return {"replica_to": holder.name, "replica_address": holder.address,
                "replica_ticket": self.tickets(holder, owner, (request_id,))[request_id]}

    def peer_of(self, name: str, nodes: Iterable[NodeInfo]) -> NodeInfo | None:
        """The node ``name`` replicates to: its partner when it is paired
        (none while the partner is not registered), else its ``ring_peers``
        peer; None with ``replicas = 0`` (pairs replicate regardless) or no peer."""
        nodes = list(nodes)
        if self.pairs.paired(name):
            return self.pairs.partner(name, {n.name: n for n in nodes})
        return ring_peers(nodes, self.pairs.announced).get(name) if self.replicas else None

    def target(self, request_id: str, dead: str, exclude: set[tuple[str, str]], candidates: list[NodeInfo],
               pick) -> tuple[NodeInfo, int] | None:
        """Where ``request_id`` of dead node ``dead`` resumes: (node, tokens
        its replica holds; 0 = none, recompute) or None (no node is left).
        ``exclude``: (name, incarnation) of the node processes that failed
        it. ``pick(nodes)`` chooses among equals (the router)."""
        usable = [n for n in candidates if (n.name, n.incarnation) not in exclude and n.role != Role.PREFILL]
        if self.policy == "replica":
            best = self.table.best(dead, request_id, {n.name for n in usable})
            if best is not None:
                holder, tokens = best
                return next(n for n in usable if n.name == holder), tokens
        node = pick(usable) if usable else None
        return (node, 0) if node is not None else None
