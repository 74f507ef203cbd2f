"""Per-node load: which nodes each request in flight counts against.

``LoadBook`` is the one place that changes ``NodeInfo.in_flight``, the
count routers read as a node's load. A request is counted on a node when a
leg of it is sent there (``count``); uncounted from that node when the leg
ends or moves away (``uncount``: the prefill leg delivered token 0, a
recovery left the node); and uncounted from every node it is still counted
on when the request ends (``release``), whichever nodes it visited (its
prefill node, the nodes recoveries moved it to). Every request the
coordinator forgets is released, so every count is zero when nothing is in
flight.

Pure bookkeeping: no I/O, no asyncio. Imports no torch.
"""

from __future__ import annotations

from kvd.coordinator.membership import NodeInfo


class LoadBook:
    def __init__(self) -> None:
        # request id -> node name -> the membership entry it is counted in (the node
        # process it was sent to: a restarted node is a new entry, counted from zero)
        self._on: dict[str, dict[str, NodeInfo]] = {}

    def count(self, request_id: str, node: NodeInfo) -> None:
        """``request_id`` has a leg on ``node`` (idempotent). An older entry
        of the same name (a process that restarted) is uncounted."""
        legs = self._on.setdefault(request_id, {})
        old = legs.get(node.name)
        if old is not None and old is not node:
            old.in_flight.discard(request_id)
        legs[node.name] = node
        node.in_flight.add(request_id)

    def uncount(self, request_id: str, node_name: str) -> None:
        """``request_id`` no longer has a leg on ``node_name`` (idempotent)."""
        legs = self._on.get(request_id)
        node = legs.pop(node_name, None) if legs is not None else None
        if node is not None:
            node.in_flight.discard(request_id)
        if legs is not None and not legs:
            del self._on[request_id]

    def release(self, request_id: str) -> None:
        """``request_id`` ended: uncounted everywhere (idempotent)."""
        for node in self._on.pop(request_id, {}).values():
            node.in_flight.discard(request_id)

    def nodes_of(self, request_id: str) -> tuple[str, ...]:
        """The nodes ``request_id`` is counted on, by name."""
        return tuple(sorted(self._on.get(request_id, ())))

    def __len__(self) -> int:
        """Requests counted on some node."""
        return len(self._on)
