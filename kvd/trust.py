"""Who may send what to a daemon: the trust model, in code.

A listener with keys names the sender of every message (``Incoming.identity``,
the name of its key file, see kvd/links.py). The names that matter:

    "coordinator"   the coordinator's key (no node may be named so)
    any other name  a node's key: the node of that name

What each port accepts, from whom (docs/operations.md, "Trust model")::

    node port          GenerateRequest, Abort, AdminCommand   the coordinator only
                       KVTransferRequest, KVData, KVCommit,   a node (src_node / source = its own
                       ReplicaData                            name);
                                                              KVData/KVCommit only for a grant this
                                                              node made to that very link, or for
                                                              a prefill leg to the node the
                                                              coordinator named (transfer.py)
    coordinator port   Hello, Heartbeat, Goodbye, CacheEvents a node, about itself (node = its name)

A listener without keys (``[cluster].insecure``) names nobody: everything is
accepted from anyone who reaches the port, which is what insecure means.
The daemons pass these functions to ``protocol.serve`` as its gate: a
refusal is an ``Error(code="forbidden")`` to the sender, counted by reason
and logged rate-limited, and the message reaches no handler.
"""

from __future__ import annotations

from kvd import protocol
from kvd.cluster_config import COORDINATOR_NAME

FROM_COORDINATOR = (protocol.GenerateRequest, protocol.Abort, protocol.AdminCommand)
FROM_NODES = (protocol.KVTransferRequest, protocol.KVData, protocol.KVCommit, protocol.ReplicaData)
NODE_ABOUT_ITSELF = (protocol.Hello, protocol.Heartbeat, protocol.Goodbye, protocol.CacheEvents)


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

