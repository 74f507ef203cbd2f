"""Pairs and run-time roles (AcceLLM §4; docs/cluster.md, "Pairs and roles").

Pure bookkeeping: no I/O, no asyncio, no torch.

- A *pair* is two nodes that each announced the other in their Hello
  (``[nodes.NAME].pair``, ``[cluster].pairs``, ``kvd node --pair``). Only a
  pair whose two nodes are both registered counts (``PairBook.partner``): a
  node whose partner is dead or not yet registered serves alone. A paired
  node's replica peer is its partner (kvd/coordinator/recovery.py), so each
  holds the redundant copy of the other's requests.
- A node's *role* (``NodeInfo.role``: mixed, prefill, decode) is what the
  router sends it, and changes at run time (``check_switch``, then the admin
  command ``set-role``): from the switch on, routing follows the new role.
  A switch that would leave no routable node able to decode, or none able to
  take prompts (mixed or prefill), or a paired node prefilling while its
  partner is dead or prefilling too, is refused and changes nothing.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvd.cluster_config import ROLES, Role
from kvd.coordinator.membership import NodeInfo

DECODES = (Role.MIXED.value, Role.DECODE.value)       # roles the router gives running decodes to
TAKES_PROMPTS = (Role.MIXED.value, Role.PREFILL.value)


@dataclass
class PairBook:
    """Who announced which partner, and each node's role switches and handoffs."""

    announced: dict[str, str] = field(default_factory=dict)     # node -> the partner its Hello named
    switches: collections.Counter[str] = field(default_factory=collections.Counter)    # node -> role switches
    handoffs: collections.Counter[str] = field(default_factory=collections.Counter)    # source node -> handoffs
    refused: collections.Counter[str] = field(default_factory=collections.Counter)     # reason -> handoffs not done

    def announce(self, node: str, partner: str) -> None:
        """``node`` registered naming ``partner`` ("" = unpaired)."""
        if partner:
            self.announced[node] = partner
        else:
            self.announced.pop(node, None)

    def paired(self, node: str) -> bool:
        """Whether ``node`` belongs to a pair (its partner alive or not)."""
        return node in self.announced

    def partner(self, node: str, nodes: Mapping[str, NodeInfo]) -> NodeInfo | None:
        """``node``'s partner when both named each other and it is registered; else None."""
        name = self.announced.get(node)
        info = nodes.get(name) if name else None
        return info if info is not None and self.announced.get(info.name) == node else None

    def check_switch(self, nodes: Mapping[str, NodeInfo], node: str, role: str) -> None:
        """Raise ValueError (nothing changes) unless ``node`` may switch to
        ``role`` now (module docstring). Switching to the role it has is allowed."""
        info = nodes.get(node)
        if info is None:
            raise ValueError(f"unknown node {node!r}; nodes: {sorted(nodes)}")
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == info.role:
            return
        after = {n.name: role if n.name == node else n.role for n in nodes.values() if not n.draining}
        after[node] = role
        if not any(r in DECODES for r in after.values()):
            raise ValueError(f"switching {node} to {role} would leave no node that decodes (mixed or decode)")
        if not any(r in TAKES_PROMPTS for r in after.values()):
            raise ValueError(f"switching {node} to {role} would leave no node that takes prompts "
                             "(mixed or prefill)")
        if role == Role.PREFILL and self.paired(node):
            partner = self.partner(node, nodes)
            if partner is None:
                raise ValueError(f"{node}'s partner {self.announced[node]} is not registered: it would have "
                                 "no node to hand its decodes to")
            if partner.role not in DECODES:
                raise ValueError(f"{node}'s partner {partner.name} is {partner.role}: a pair needs a node "
                                 "that decodes")

    def describe(self, node: str, nodes: Mapping[str, NodeInfo]) -> dict:
        """``kvctl nodes``' pair fields of ``node``."""
        partner = self.partner(node, nodes)
        return {"pair": self.announced.get(node, ""), "pair_alive": partner is not None,
                "role_switches": self.switches[node], "handoffs": self.handoffs[node]}


def redundant_blocks(by_holder: Mapping[str, Mapping[str, Mapping[str, int]]], node: NodeInfo) -> int:
    """Blocks ``node`` holds as copies of other nodes' requests, from the
    holders' reports (``ReplicaTable.by_holder``: holder -> sender ->
    request -> tokens): a pair's redundant copies, or ring replicas."""
    return sum(tokens // node.block_size for by_rid in by_holder.get(node.name, {}).values()
               for tokens in by_rid.values())


def copy_memory(node: NodeInfo) -> dict[str, int]:
    """What ``node``'s copies of its partner's requests cost and lost, from
    its last heartbeat (kvd/node/replica_store.py ``stats``): blocks held
    in each tier (``device_blocks``, ``host_blocks``), and the copies (and
    their blocks) it gave up to its own work (``reclaimed``,
    ``reclaimed_blocks``)."""
    copies = node.heartbeat.stats.get("copies", {}) if node.heartbeat else {}
    return {k: int(copies.get(k, 0)) for k in ("device_blocks", "host_blocks", "reclaimed", "reclaimed_blocks")}
