"""The remote-attention channel: DistAttention's per-layer round trip between
the debtor's engine thread and the creditor's attention worker, on sockets
those two threads own, with no event loop between them (Infinite-LLM §4.6:
the round trip must hide behind the debtor's local attention)::

    debtor engine thread                                creditor channel thread
    ChannelClient (DEALER)  ── RemoteAttend ─────────▶  ChannelServer (ROUTER, bound
      start: send, return at once                         beside the node's port)
      local micro-attention                              trust gate, rManager.access,
      wait: poll until the reply, by the deadline  ◀──   micro-attention: RemotePartials

Messages are kvd's typed ones (kvd/protocol.py: RemoteAttend, RemotePartials),
encoded and validated by kvd/wire.py: a JSON header plus the tensors' bytes as
zmq frames, sent and received without copies (frames larger than pyzmq's copy
threshold). CURVE authenticates both ends as on every port (kvd/links.py): the
server accepts only the keys of the cluster's key directory and names each
message's sender by its key; ``kvd.trust.node_refusal`` then requires
``debtor`` to be that name, and the rManager serves a loan to its debtor only
(kvd/node/remote_attention.py, ``AttentionServer.serve``).

Deadlines: the client's ``wait`` polls at most until the layer's deadline and
raises ``RemoteKVError`` after it (the debtor recomputes the request's KV,
engine/borrowing.py); a send the channel does not take by the deadline (no
connection, or the creditor's queue full) fails the same way. The server
polls in steps of ``POLL_S``, so ``close`` ends it.
A silent or dead creditor fails the request that used it, never the node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from engine.dist_attention import RemoteKVError
from kvd import protocol
from kvd.trust import node_refusal
from transports.keys import CurveClient, CurveServer, as_key_set

log = logging.getLogger("kvd.attention_channel")

POLL_S = 0.2            # the server thread's longest poll: how soon it sees close()
QUEUE = 64              # messages a socket queues per peer before a send fails


WILDCARDS = ("", "*", "0.0.0.0", "[::]")    # hosts a debtor could not be sent to


def channel_host(address: str) -> str | None:
    """The host a node listening at ``address`` binds its channel on (the same
    interface), or None where it has none: only a ``zmq+tcp`` listener on a named
    interface gets one (a wildcard's address could not be given to a debtor)."""
    scheme, sep, rest = address.partition("://")
    if scheme != "zmq+tcp" or not sep:
        return None
    host = rest.rpartition(":")[0]
    return None if host in WILDCARDS else host


def check_channel_url(url: str) -> None:
    """Raise ValueError unless ``url`` is a channel's address: ``tcp://host:port``."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    if not url.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a remote-attention channel is at tcp://host:port, not {url!r}")


class _NamingAuthenticator(ThreadAuthenticator):
    """ZAP on the channel's context: the server's key set names each client, or
    refuses it (``refused`` counts them); the name is each message's User-Id."""

    def __init__(self, ctx: zmq.Context, curve: CurveServer) -> None:
        super().__init__(ctx)
        self.keys = as_key_set(curve.allowed_clients)
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = self.keys.name_of(key) is not None
        self.refused += not ok
        return ok

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.keys.name_of(z85.encode(client_public_key)) or ""


class ChannelServer:
    """The creditor's end: a ROUTER bound on ``host`` (a free port: ``url``), read by a
    thread of its own that answers each RemoteAttend with ``serve(msg, debtor)`` (the
    attention server's, on this thread). ``curve``: the node's listener keys, or None
    (a cluster run insecure: senders are named by what they claim)."""

    def __init__(self, host: str, serve: Callable[[protocol.RemoteAttend, str | None], protocol.Message],
                 curve: CurveServer | None) -> None:
        self.serve = serve
        self.authenticated = curve is not None
        self.counts = {"served": 0, "rejected": 0, "forbidden": 0}
        self._ctx = zmq.Context()
        self._auth: _NamingAuthenticator | None = None
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, QUEUE)
        sock.setsockopt(zmq.RCVHWM, QUEUE)
        sock.setsockopt(zmq.IPV6, host.startswith("["))
        if curve is not None:
            self._auth = _NamingAuthenticator(self._ctx, curve)      # before bind: no handshake slips past
            self._auth.start()
            self._auth.configure_curve_callback("*", self._auth)
            sock.curve_server = True
            sock.curve_publickey = curve.public_key
            sock.curve_secretkey = curve.secret_key
        sock.bind(f"tcp://{host}:*")
        self.url = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock                       # the thread's from here on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvd-attention-channel", daemon=True)
        self._thread.start()

    @property
    def refused_keys(self) -> int:
        """Handshakes refused for an unknown key."""
        return self._auth.refused if self._auth is not None else 0

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(POLL_S * 1000):
                    continue
                parts = sock.recv_multipart(copy=False)
                try:
                    reply = self._answer(parts)
                except Exception as exc:  # noqa: BLE001 -- one bad message must not end the channel
                    log.exception("remote attention failed")
                    reply = protocol.RemotePartials(ok=False, reason=f"{type(exc).__name__}: {exc}"[:300])
                if reply is not None:
                    header, frames = protocol.encode_reply(reply)
                    try:
                        sock.send_multipart([parts[0], header, *frames], copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:           # the debtor reads no more: it has given up on it
                        pass
        finally:
            sock.close(0)

    def _answer(self, parts: list[zmq.Frame]) -> protocol.Message | None:
        if len(parts) < 2:
            self.counts["rejected"] += 1
            return None
        identity = parts[1].get("User-Id") if self.authenticated else None
        msg = protocol.decode(parts[1].bytes, [p.buffer for p in parts[2:]])
        if not isinstance(msg, protocol.RemoteAttend):
            self.counts["rejected"] += 1
            why = msg.detail if isinstance(msg, protocol.ProtocolError) else f"{msg.TYPE} on the attention channel"
            return protocol.RemotePartials(id=getattr(msg, "id", None) or "", ok=False, reason=why[:300])
        if why := node_refusal(msg, identity, self.authenticated):
            self.counts["forbidden"] += 1
            return protocol.RemotePartials(id=msg.id, ok=False, reason=f"forbidden: {why}")
        self.counts["served"] += 1
        return self.serve(msg, identity if self.authenticated else msg.debtor)

    def close(self) -> None:
        """Stop the thread (within ``POLL_S``) and free the sockets."""
        self._stop.set()
        self._thread.join(timeout=5 * POLL_S)
        if self._auth is not None:
            self._auth.stop()
        if not self._thread.is_alive():
            self._ctx.term()


class ChannelClient:
    """The debtor's end toward one creditor's channel ``url``: a DEALER socket that ONE
    thread uses (the engine thread: zmq sockets are not thread-safe). ``curve``: this
    node's keypair and the creditor's public key, or None (insecure)."""

    def __init__(self, ctx: zmq.Context, url: str, curve: CurveClient | None) -> None:
        check_channel_url(url)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, QUEUE)
        sock.setsockopt(zmq.RCVHWM, QUEUE)
        sock.setsockopt(zmq.IPV6, url.startswith("tcp://["))
        if curve is not None:
            sock.curve_publickey = curve.public_key
            sock.curve_secretkey = curve.secret_key
            sock.curve_serverkey = curve.server_key
        sock.connect(url)
        self.url, self._sock = url, sock
        self._waiting: set[str] = set()                 # ids sent, not yet answered or given up
        self._replies: dict[str, protocol.Message] = {}

    def send(self, msg: protocol.Message, timeout: float) -> None:
        """Send ``msg`` (its frames without copies: the caller leaves its tensors be
        until the reply). Raises RemoteKVError when the channel takes it not within
        ``timeout`` seconds (not connected yet, or the creditor's queue full)."""
        header, frames = protocol.encode(msg)
        ms = max(1, int(timeout * 1000))
        if self._sock.sndtimeo != ms:
            self._sock.sndtimeo = ms
        try:
            self._sock.send_multipart([header, *frames], copy=False)
        except zmq.Again:
            raise RemoteKVError(f"the creditor's channel {self.url} took no message within {timeout} s") from None
        self._waiting.add(msg.id)

    def wait(self, msg_id: str, timeout: float) -> protocol.Message:
        """The reply to the message ``msg_id``, received within ``timeout`` seconds (replies
        to other messages sent meanwhile are kept for their own ``wait``); raises
        RemoteKVError after it."""
        deadline = time.monotonic() + timeout
        try:
            while msg_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                    if time.monotonic() >= deadline:
                        raise RemoteKVError(f"a remote part gave no result within {timeout} s")
                    continue
                parts = self._sock.recv_multipart(copy=False)
                reply = protocol.decode(parts[0].bytes, [p.buffer for p in parts[1:]])
                if getattr(reply, "id", None) in self._waiting:      # a late one's, given up on: dropped
                    self._replies[reply.id] = reply
            return self._replies.pop(msg_id)
        finally:
            self._waiting.discard(msg_id)

    def close(self) -> None:
        self._sock.close(0)
