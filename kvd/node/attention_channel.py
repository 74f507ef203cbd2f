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

On one host the debtor asks the channel for a shared-memory ring (``RingOpen``,
kvd/node/attention_ring.py): the creditor's answer names a segment only this
user can open, and a thread of the creditor serves it in the debtor's name with
the checks above; the debtor's ``send`` then takes the ring for every message
that fits it, the zmq channel for the rest.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from engine.dist_attention import RemoteKVError
from kernels.dist_attention import Partials
from kernels.shm_wait import Doorbells
from kvd import protocol
from kvd.node import ring_lane
from kvd.node.attention_ring import (REPLIES, REQUESTS, RingClient, RingPolicy, RingServer, Segment, StepRequest,
                                    host_id)
from kvd.node.ring_lane import RingLane
from kvd.node.step_template import StepTemplate
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
    (a cluster run insecure: senders are named by what they claim). ``rings``: whom it
    gives a same-host shared-memory ring, each served by a thread of its own (None: no
    one). ``lanes(msg, debtor, pieces, shape)``: a native answer to the rest of a served
    message's step on a ring (``AttentionServer.lane``; None: every message the full way)."""

    def __init__(self, host: str, serve: Callable[[protocol.RemoteAttend, str | None], protocol.Message],
                 curve: CurveServer | None, rings: RingPolicy | None = None,
                 lanes: Callable[..., RingLane | None] | None = None) -> None:
        self.serve, self.lanes = serve, lanes
        self.authenticated = curve is not None
        self.counts = {"served": 0, "rejected": 0, "forbidden": 0, "rings": 0, "ring_refused": 0, "ring_served": 0,
                       "rings_open": 0, "ring_templated": 0, "ring_native": 0}
        self._counts_lock = threading.Lock()            # the channel thread and the rings' count
        self.ring_policy = rings
        self._rings: dict[str, RingServer] = {}         # debtor -> its ring (the channel thread's)
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
        if self.ring_policy is not None:
            Doorbells.create()                  # built here, not while a debtor waits for its RingOffer
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

    def _count(self, key: str, n: int = 1) -> None:
        with self._counts_lock:
            self.counts[key] += n

    def _answer(self, parts: list[zmq.Frame]) -> protocol.Message | None:
        if len(parts) < 2:
            self._count("rejected")
            return None
        identity = parts[1].get("User-Id") if self.authenticated else None
        return self.answer(parts[1].bytes, [p.buffer for p in parts[2:]], identity, self.authenticated)

    def answer(self, header: bytes, frames: list, identity: str | None, authenticated: bool,
               ring: bool = False, reply_into: Callable | None = None,
               template: StepTemplate | None = None) -> protocol.Message:
        """The reply to one message from ``identity`` (checked by the trust gate when
        ``authenticated``): RemoteAttend served, RingOpen answered (not on a ``ring``),
        anything else refused and counted. ``reply_into(msg_id, shape)``: where a ring's
        reply to ``msg_id`` takes partials of ``shape`` (its slot), passed on to ``serve`` as
        ``into``. ``template``: the ring's ``StepTemplate`` (a header that fits it is taken
        as its message; a RemoteAttend decoded in full and let through becomes it). Any
        thread (the channel's, a ring's)."""
        msg = template.match(header, frames) if template is not None else None
        learn = template is not None and msg is None
        if msg is None:
            msg = protocol.decode(header, frames)
        if isinstance(msg, protocol.RingOpen) and not ring:
            return self._open_ring(msg, identity)
        if not isinstance(msg, protocol.RemoteAttend):
            self._count("rejected")
            why = msg.detail if isinstance(msg, protocol.ProtocolError) else f"{msg.TYPE} on the attention channel"
            return protocol.RemotePartials(id=getattr(msg, "id", None) or "", ok=False, reason=why[:300])
        if why := node_refusal(msg, identity, authenticated):
            self._count("forbidden")
            return protocol.RemotePartials(id=msg.id, ok=False, reason=f"forbidden: {why}")
        if learn:
            template.learn(bytes(header), msg)
        elif template is not None:
            self._count("ring_templated")
        self._count("served")
        if ring:
            self._count("ring_served")
        debtor = identity if authenticated else msg.debtor
        if reply_into is None:
            return self.serve(msg, debtor)
        reply = self.serve(msg, debtor, into=lambda shape: reply_into(msg.id, shape))
        if template is not None and template.lane is None and template.pieces is not None and reply.ok:
            lane = self.lanes(msg, debtor, template.pieces, reply.tensors[-1].shape) if self.lanes else None
            template.lane = lane or False                   # False: this step has none, do not ask again
        return reply

    def _lane_answer(self, seg: Segment, seq: int, template: StepTemplate) -> bool:
        """Answer request ``seq`` of ``seg`` by ``template``'s native lane, where it has one
        and the request is its step's (kvd/node/ring_lane.py): True when answered (its reply
        slot filled). A ring's thread."""
        lane = template.lane
        if not lane:
            return False
        got = lane.serve(seg.slot_address(REQUESTS, seq), seg.slot_address(REPLIES, seq), seq, seg.slot_bytes)
        if got == ring_lane.SERVED:
            with self._counts_lock:
                for key in ("served", "ring_served", "ring_templated", "ring_native"):
                    self.counts[key] += 1
            return True
        if got == ring_lane.REFUSED:
            template.lane = False
        return False

    def _open_ring(self, msg: protocol.RingOpen, identity: str | None) -> protocol.RingOffer:
        """A shared-memory ring for ``msg.debtor`` (attention_ring.py), or why not."""
        if self.authenticated and msg.debtor != identity:
            self._count("forbidden")
            return protocol.RingOffer(id=msg.id, ok=False, reason=f"forbidden: debtor {msg.debtor!r} is not the "
                                                                  f"sender's key {identity!r}")
        policy, bells = self.ring_policy, Doorbells.create()
        if policy is None or bells is None or not host_id():
            return protocol.RingOffer(id=msg.id, ok=False, reason="this node offers no shared-memory ring")
        if msg.host != host_id():
            return protocol.RingOffer(id=msg.id, ok=False, reason="another host")
        if why := policy.may_open(msg.loan_id, msg.debtor):
            self._count("ring_refused")
            return protocol.RingOffer(id=msg.id, ok=False, reason=why)
        try:
            segment = Segment.create()
        except OSError as exc:
            log.warning("no shared-memory ring for %s: %s", msg.debtor, exc)
            return protocol.RingOffer(id=msg.id, ok=False, reason=f"no shared memory: {exc}"[:300])
        if (old := self._rings.pop(msg.debtor, None)) is not None:
            old.close()                                 # one ring per debtor: a new engine asks again
        self._rings = {d: r for d, r in self._rings.items() if r.alive}
        debtor = msg.debtor
        self._count("rings_open")
        template = StepTemplate()
        self._rings[debtor] = RingServer(segment, bells, debtor,
                                         lambda header, frames, into: self.answer(header, frames, debtor, True,
                                                                                  ring=True, reply_into=into,
                                                                                  template=template),
                                         policy.holds, lambda: self._count("rejected"),
                                         lambda: self._count("rings_open", -1), self._may_spin,
                                         lambda seq: self._lane_answer(segment, seq, template))
        self._count("rings")
        return protocol.RingOffer(id=msg.id, ok=True, name=segment.name, nonce=segment.nonce.hex(),
                                  slots=segment.slots, slot_bytes=segment.slot_bytes)

    def _may_spin(self) -> bool:
        """Whether a ring thread may spin for its debtor's next request: this node's engine
        computes nothing and no other debtor's ring is open (their threads would spin against
        each other's answers on the node's cores). A ring's thread, at every request."""
        return self.counts["rings_open"] <= 1 and self.ring_policy.engine_idle()

    def close_ring(self, debtor: str) -> None:
        """End ``debtor``'s ring, if it has one (its last loans here ended with their lease: a
        debtor gone), without waiting: its thread ends within ``SLICE_S`` and unmaps the
        segment (``counts["rings_open"]`` then drops). Any thread."""
        if (ring := self._rings.get(debtor)) is not None:
            ring.stop()

    def close(self) -> None:
        """Stop the thread (within ``POLL_S``), the rings, and free the sockets."""
        self._stop.set()
        self._thread.join(timeout=5 * POLL_S)
        for ring in list(self._rings.values()):
            ring.close()
        if self._auth is not None:
            self._auth.stop()
        if not self._thread.is_alive():
            self._ctx.term()


def _ring_reply(answered: str, header: bytes | None, frames: list) -> protocol.Message:
    """A reply read off the ring (``RingClient.next_reply``), decoded; a slot out of
    sequence, a message that does not decode or one that answers another id is a refusal
    of request ``answered``."""
    reply = protocol.decode(header, frames) if header is not None else None
    if not isinstance(reply, protocol.Message) or reply.id != answered:
        why = (reply.detail if isinstance(reply, protocol.ProtocolError) else
               "a slot out of sequence" if reply is None else getattr(reply, "reason", "") or reply.TYPE)
        reply = protocol.RemotePartials(id=answered, ok=False, reason=f"ring: {why}"[:300])
    return reply


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
        self.ring: RingClient | None = None             # the same-host fast path (open_ring)
        self._on_ring: set[str] = set()                 # ids sent on the ring, not yet answered
        self._ring_lost: set[str] = set()               # ids sent on a ring closed since: no answer will come
        # messages sent each way; of the ring's, those posted and replies copied natively
        self.counts = {"ring": 0, "channel": 0, "ring_posted": 0, "ring_taken": 0}

    def open_ring(self, debtor: str, loan_id: str, timeout: float) -> bool:
        """Ask the creditor for a shared-memory ring (attention_ring.py) for ``debtor``, which
        holds ``loan_id`` there; True when this client now has one (then ``send`` takes it for
        what fits). False, the zmq channel serving all: another host, a creditor that offers
        none or refuses, no doorbells here, no answer within ``timeout`` seconds."""
        if self.ring is not None and not self.ring.closed:
            return True
        self._drop_ring()
        bells = Doorbells.create()
        if bells is None or not host_id():
            return False
        ask = protocol.RingOpen(id=secrets.token_hex(6), debtor=debtor, loan_id=loan_id, host=host_id(),
                                deadline=time.time() + timeout)
        try:
            self.send(ask, timeout)
            offer = self.wait(ask.id, timeout)
        except RemoteKVError as exc:
            log.info("no shared-memory ring from %s: %s", self.url, exc)
            return False
        if not isinstance(offer, protocol.RingOffer) or not offer.ok:
            log.info("no shared-memory ring from %s: %s", self.url, getattr(offer, "reason", offer))
            return False
        self._ring_lost.clear()                         # what a step sent on the last one: given up by now
        try:
            self.ring = RingClient.attach(offer, bells)
        except (OSError, ValueError) as exc:            # another /dev/shm (a container): the channel serves
            log.info("the shared-memory ring %s offered by %s cannot be opened here: %s", offer.name, self.url, exc)
            return False
        return True

    def _drop_ring(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self._ring_lost |= self._on_ring
            self.ring, self._on_ring = None, set()

    def send(self, msg: protocol.Message, timeout: float, reply_bytes: int = 0) -> None:
        """Send ``msg`` (its frames without copies: the caller leaves its tensors be
        until the reply): on the ring where there is one, ``reply_bytes`` (the most its
        reply's frames take) is given and both fit, else on the zmq channel. Raises
        RemoteKVError when the channel takes it not within ``timeout`` seconds (not
        connected yet, or the creditor's queue full)."""
        header, frames = protocol.encode(msg)
        self.send_encoded(msg.id, header, frames, timeout, reply_bytes)

    def send_encoded(self, msg_id: str, header: bytes, frames: list, timeout: float, reply_bytes: int = 0) -> None:
        """``send`` of a message already encoded: ``header`` and ``frames`` exactly what
        ``protocol.encode`` gives for a message whose id is ``msg_id``."""
        ring = self.ring
        if ring is not None and ring.closed:
            self._drop_ring()
        elif ring is not None and reply_bytes and ring.send(msg_id, header, frames, reply_bytes):
            self._waiting.add(msg_id)
            self._on_ring.add(msg_id)
            self.counts["ring"] += 1
            return
        ms = max(1, int(timeout * 1000))
        if self._sock.sndtimeo != ms:
            self._sock.sndtimeo = ms
        try:
            self._sock.send_multipart([header, *frames], copy=False)
        except zmq.Again:
            raise RemoteKVError(f"the creditor's channel {self.url} took no message within {timeout} s") from None
        self._waiting.add(msg_id)
        self.counts["channel"] += 1

    def send_step(self, msg_id: str, step: StepRequest, layer: int, timeout: float, reply_bytes: int) -> None:
        """``send_encoded`` of ``step``'s request ``msg_id`` at ``layer``: on the ring by one
        native call where it takes it (``RingClient.send_step``), else encoded as ``send``."""
        ring = self.ring
        if ring is not None and reply_bytes and ring.send_step(msg_id, step, layer, reply_bytes):
            self._waiting.add(msg_id)
            self._on_ring.add(msg_id)
            self.counts["ring"] += 1
            self.counts["ring_posted"] += 1
            return
        self.send_encoded(msg_id, step.header(msg_id, layer), step.frames, timeout, reply_bytes)

    def wait(self, msg_id: str, timeout: float) -> protocol.Message:
        """The reply to the message ``msg_id``, received within ``timeout`` seconds (replies
        to other messages sent meanwhile are kept for their own ``wait``); raises
        RemoteKVError after it."""
        deadline = time.monotonic() + timeout
        try:
            if msg_id in self._on_ring:
                return self._wait_ring(msg_id, deadline)
            if msg_id in self._ring_lost:
                self._ring_lost.discard(msg_id)
                raise RemoteKVError("the creditor closed the shared-memory ring")
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

    def wait_as(self, msg_id: str, shape: tuple[int, int, int, int], timeout: float) -> Partials | protocol.Message:
        """``wait``, for a reply expected to be the ok RemotePartials of ``shape``
        (``RingClient.next_reply_as``): on the ring, when it is the next reply there and is
        exactly that, its partials viewing the ring's slot (valid until the next message
        sent: read them first); else the reply decoded, as ``wait`` returns it."""
        return self._wait_next(msg_id, timeout, lambda ring, deadline: ring.next_reply_as(shape, deadline))

    def wait_into(self, msg_id: str, shape: tuple[int, int, int, int], dst: Partials,
                  timeout: float) -> protocol.Message | None:
        """``wait_as``, the expected partials copied into ``dst`` (``RingClient.next_reply_into``):
        None once copied; else the reply decoded, as ``wait`` returns it (nothing copied)."""
        got = self._wait_next(msg_id, timeout, lambda ring, deadline: ring.next_reply_into(shape, dst, deadline))
        if got is True:
            self.counts["ring_taken"] += 1
            return None
        return got

    def _wait_next(self, msg_id: str, timeout: float, read: Callable) -> object:
        """``read(ring, deadline)``'s fast answer when ``msg_id``'s reply is the ring's next
        one; its fallback (a slot's tuple) decoded; ``wait``'s reply otherwise."""
        ring = self.ring
        if msg_id not in self._on_ring or ring is None or not ring.next_is(msg_id):
            return self.wait(msg_id, timeout)
        try:
            got = read(ring, time.monotonic() + timeout)
        finally:
            self._waiting.discard(msg_id)
            self._on_ring.discard(msg_id)
        return _ring_reply(*got) if isinstance(got, tuple) else got         # a tuple: decoded in full

    def _wait_ring(self, msg_id: str, deadline: float) -> protocol.Message:
        """``wait`` for a message sent on the ring: its replies come in order, each answering
        the request of its slot (a late one's, given up on, is dropped)."""
        try:
            while msg_id not in self._replies:
                answered, header, frames = self.ring.next_reply(deadline)
                if answered in self._waiting:
                    self._replies[answered] = _ring_reply(answered, header, frames)
            return self._replies.pop(msg_id)
        finally:
            self._on_ring.discard(msg_id)

    def close(self) -> None:
        self._drop_ring()
        self._sock.close(0)
