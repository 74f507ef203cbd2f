"""Who may send what to a daemon: the trust model, in code.

A listener with keys names the sender of every message (``Incoming.identity``,
the name of its key file, see kvd/links.py). The names that matter:

    "coordinator"   the coordinator's key (no node may be named so)
    any other name  a node's key: the node of that name

What each port accepts, from whom (docs/operations.md, "Trust model")::

    node port          LegRequest, Abort, AdminCommand        the coordinator only
                       KVTransferRequest, KVData, KVCommit,   a node (src_node / source = its own
                       ReplicaData                            name);
                                                              KVData/KVCommit only for a grant this
                                                              node made to that very link, or for
                                                              a prefill leg to the node the
                                                              coordinator named (transfer.py); a
                                                              grant bounded per peer in blocks and
                                                              seconds by this node's own config;
                                                              ReplicaData only with a replica
                                                              ticket (below)
                       BorrowRequest, ReturnLoan,             a node, as the debtor (debtor = its own
                       LeaseRenew, LoanWrite                  name); a loan's blocks take writes and
                                                              renewals from its debtor only
                                                              (engine/memory/rmanager.py)
    coordinator port   Hello, Heartbeat, Goodbye, CacheEvents a node, about itself (node = its name);
                       CreditorQuery
                                                              a new incarnation only from the
                                                              registered address or once the old
                                                              one is dead, heartbeats of the
                                                              registered incarnation only
                                                              (membership.py)

A listener without keys (``[cluster].insecure``) names nobody: everything is
accepted from anyone who reaches the port, which is what insecure means.
The daemons pass these functions to ``protocol.serve`` as its gate: a
refusal is an ``Error(code="forbidden")`` to the sender, counted by reason
and logged rate-limited, and the message reaches no handler.

Replica tickets. A replica holder accepts KV for request R owned by node S
only with a ticket the coordinator issued for exactly (holder, S, R):
``replica_ticket(key, S, R)``, an HMAC under a key the coordinator derived
for this holder's incarnation (``holder_key``) and gave to the holder alone,
in the Welcome that registered it. The coordinator gives the ticket to S
with the request (``GenerateRequest.replica_ticket``; to S's prefill node
too, which writes the prompt's replica for S) and again in S's heartbeat
replies for the peer S has then. So a node's key writes replicas only of
the requests the coordinator runs on it, to the peer the coordinator gave
it; and a replica is private to its holder until a recovery resumes from
it (kvd/node/replication.py).
"""

from __future__ import annotations

import hashlib
import hmac

from kvd import protocol
from kvd.cluster_config import COORDINATOR_NAME

TICKET_BYTES = 16            # an HMAC-SHA256 truncated to 128 bits, hex on the wire

FROM_COORDINATOR = (protocol.LegRequest, protocol.Abort, protocol.AdminCommand)
FROM_NODES = (protocol.KVTransferRequest, protocol.KVData, protocol.KVCommit, protocol.ReplicaData,
              *protocol.LENDING_MESSAGES)
NODE_ABOUT_ITSELF = (protocol.Hello, protocol.Heartbeat, protocol.Goodbye, protocol.CacheEvents,
                     protocol.CreditorQuery)


def node_refusal(msg: protocol.Message, identity: str | None, authenticated: bool) -> str | None:
    """Why a node must not act on ``msg`` from ``identity``; None: it may.

    ``authenticated``: the node's listener names every sender (keys, or
    inproc); False only for a daemon run insecure."""
    if not authenticated:
        return None
    if not identity:
        return "the sender is not authenticated"
    if isinstance(msg, FROM_COORDINATOR):
        if identity != COORDINATOR_NAME:
            return f"only the coordinator may send {msg.TYPE}; {identity!r} may not"
        return None
    if isinstance(msg, FROM_NODES):
        if identity == COORDINATOR_NAME:
            return f"{msg.TYPE} comes from a node, not from the coordinator"
        if isinstance(msg, protocol.KVTransferRequest) and msg.src_node != identity:
            return f"src_node {msg.src_node!r} is not the sender's key {identity!r}"
        if isinstance(msg, protocol.ReplicaData) and msg.source != identity:
            return f"source {msg.source!r} is not the sender's key {identity!r}"
        if isinstance(msg, protocol.LENDING_MESSAGES) and msg.debtor != identity:
            return f"debtor {msg.debtor!r} is not the sender's key {identity!r}"
        return None
    return None          # other types: the handler answers unexpected_type


def coordinator_refusal(msg: protocol.Message, identity: str | None, authenticated: bool) -> str | None:
    """Why the coordinator must not act on ``msg`` from ``identity``; None: it may."""
    if not authenticated:
        return None
    if not identity:
        return "the sender is not authenticated"
    if isinstance(msg, NODE_ABOUT_ITSELF) and identity == COORDINATOR_NAME:
        return f"{msg.TYPE} from the coordinator's own key: it speaks for no node"
    if isinstance(msg, NODE_ABOUT_ITSELF) and msg.node != identity:
        return f"{msg.TYPE} for node {msg.node!r} from key {identity!r}: a node speaks for itself only"
    return None



def holder_key(secret: bytes, holder: str, incarnation: str) -> str:
    """The replica key of node ``holder``'s process ``incarnation`` (hex),
    derived from the coordinator's own ``secret``: a restarted holder gets
    a new key, and the tickets made for its predecessor are void."""
    return hmac.new(secret, f"replica-key\0{holder}\0{incarnation}".encode(), hashlib.sha256).hexdigest()


def replica_ticket(key: str, owner: str, request_id: str) -> str:
    """The ticket to write the replica of ``request_id``, run by ``owner``,
    at the holder whose key is ``key`` (hex)."""
    mac = hmac.new(bytes.fromhex(key), f"{owner}\0{request_id}".encode(), hashlib.sha256)
    return mac.digest()[:TICKET_BYTES].hex()


def pair_refusal(partner: str, msg: protocol.ReplicaData) -> str | None:
    """Why a node paired with ``partner`` ("" = unpaired) may not hold what
    ``msg`` writes: a paired node holds the redundant copies of its
    partner's requests only (docs/cluster.md, "Pairs and roles"); None: it may."""
    owner = msg.owner or msg.source
    if partner and owner != partner:
        return f"this node holds copies of its partner {partner}'s requests only, not of {owner}'s"
    return None


def valid_ticket(key: str, owner: str, request_id: str, ticket: str) -> bool:
    """Whether ``ticket`` is the ticket for (this holder's ``key``, ``owner``,
    ``request_id``); compared in constant time."""
    return ticket.isascii() and hmac.compare_digest(replica_ticket(key, owner, request_id), ticket)
