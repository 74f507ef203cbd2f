"""The remote-attention channel's same-host fast path: a shared-memory ring between
one debtor's engine thread and a thread of the creditor, for the per-layer
RemoteAttend / RemotePartials round trip (the pattern of vLLM's shm_broadcast
MessageQueue: shared memory for local peers, zmq for remote ones). A round trip
on the zmq channel crosses six thread hand-offs (both sides' zmq I/O threads);
on the ring, two (a doorbell each way: kernels/shm_wait.py).

How a ring comes to be (kvd/node/attention_channel.py)::

    debtor engine thread                          creditor channel thread
    RingOpen(debtor, loan, boot id) ── CURVE ──▶  the sender's key is ``debtor``, which holds
                                                  the loan here, on this host (boot id): create
                                                  /dev/shm/kvd-ring-<128 random bits>, mode 0600,
                                                  every byte allocated, a random nonce in it;
                                     ◀── CURVE ── RingOffer(name, nonce, geometry)
    open it (a regular file of ours, mode 0600,   a RingServer thread serves it, bound to the
    its size, magic and nonce), map, unlink the   debtor's name: every message in it is that
    name: the memory lives while both map it      debtor's, checked as on the zmq channel

The name travels only over the CURVE channel, to the loan's debtor, and lives
until the debtor maps it (or ``ATTACH_S``, then the creditor unlinks it): no
segment outlives its processes, however they end. The mode grants no more than
the node's 0600 admin socket: the node's own user.

Segment layout (little-endian)::

    0     magic "kvd-ring", nonce (16 bytes), slots u32, slot bytes u32
    32    creditor closed u32, debtor closed u32
    64    request doorbell: requests posted (debtor), its sleepers     (shm_wait.cpp)
    128   reply doorbell: replies posted (creditor), its sleepers
    4096  request slots [slots][slot_bytes], then reply slots [slots][slot_bytes]

    a slot: seq u32, header bytes u32, frames u32, 0 u32, frame bytes u64 x 4,
            at +64: the wire header (kvd/wire.py), then each frame, 64-byte aligned

A reply's partials are computed straight into its slot (``Segment.reply_into``: the
header first, then the kernel writes m, l and o where the frames go), so posting it
copies nothing. What a reply of one shape needs in its slot (its header but for the
id, the frames' views) is worked out once per slot and shape, not per layer.

Request i sits in request slot i % slots and its reply in reply slot i % slots,
in order; the debtor posts request i only once it has read reply i - slots, so
neither side overwrites a slot the other still reads. Every slot is checked
(its sequence number, lengths within the slot) and its header and frames decoded
and validated as every wire message (``protocol.decode``); anything else is
answered with a refusal and counted, and the ring goes on. A message that does
not fit a slot (a long prefill chunk's), or finds the ring full, goes on the
zmq channel instead.

Waits: a doorbell spins, then sleeps, the GIL released, in slices of ``SLICE_S``
between which each side looks at the other's closed flag. How long it spins adapts
(``kernels.shm_wait.AdaptiveSpin``): about twice the waits each side has seen lately,
at most ``MAX_SPIN_S``, and only ``SPIN_S`` where its waits mostly run past that. The
debtor's engine thread has nothing else to do while a reply is coming; the creditor's
ring thread spins for the debtor's next request (its gap between layers) only while its
own engine computes nothing (``RingPolicy.engine_idle``: the thread shares that
engine's cores) and it is the creditor's only ring, else ``SPIN_S``. So between a
step's layers neither side sleeps on a futex and pays a wake-up. Every wait ends by its
deadline (``RemoteKVError`` on the debtor: its request is computed again,
engine/borrowing.py). A creditor closes a ring when it stops, when its debtor opens
another, when its debtor's last loans here end with their lease (a debtor gone:
``ChannelServer.close_ring``, within ``SLICE_S``), or when its debtor has held no loan
here for ``IDLE_S`` (it gave them back); a debtor seeing its ring
closed sends on the zmq channel.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import logging
import mmap
import os
import re
import secrets
import stat
import math
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import torch

from engine.dist_attention import RemoteKVError
from kernels import ring_lane
from kernels.dist_attention import Partials
from kernels.shm_wait import AdaptiveSpin, Doorbells
from kvd import protocol
from kvd.wire import RawTensor

log = logging.getLogger("kvd.attention_ring")

SHM_DIR = "/dev/shm"
NAME = re.compile(r"kvd-ring-[0-9a-f]{32}")
SLOTS = 4                     # requests in flight per ring
SLOT_BYTES = 512 * 1024       # a decode step's message and reply fit at 8K keys with room to spare
MAX_SLOT_BYTES = 64 << 20     # the most a debtor maps for one slot
SPIN_S = 20e-6                # a doorbell's shortest spin before it sleeps
MAX_SPIN_S = 2e-3             # its longest (AdaptiveSpin): a layer's gap on a small model, not a step's
SLICE_S = 0.05                # the longest sleep between looks at the other side
ATTACH_S = 10.0               # a name not mapped by its debtor within this is unlinked
IDLE_S = 30.0                 # a ring whose debtor holds no loan here this long is closed
REPLY_HEADER_BYTES = 2048     # what a debtor keeps free in a reply slot for the reply's header

_MAGIC = b"kvd-ring"
_HEAD = 4096
_GEOMETRY = struct.Struct("<8s16sII")
_CLOSED_BY = {"creditor": 32, "debtor": 36}
_REQUEST_BELL, _REPLY_BELL = 64, 128
_SLOT = struct.Struct("<IIII4Q")
MAX_FRAMES = 4
ALIGN = 64
REQUESTS, REPLIES = 0, 1
MASK = 0xFFFFFFFF
PLACES = 8 * SLOTS            # reply layouts a segment keeps (a slot's shape changes every 128 keys)
TAKES = 16                    # native takes' arguments a debtor's ring keeps (a step's parts' slots)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _address(view: memoryview) -> int | None:
    """Where ``view``'s bytes are (None for a read-only or empty one)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def _partials_shapes(shape: tuple[int, int, int, int]) -> tuple[tuple[int, ...], ...]:
    """The frames m, l, o of partials of ``shape`` (rows, chunks, heads, head dim)."""
    rows, chunks, heads, hd = shape
    return (rows, chunks, heads), (rows, chunks, heads), (rows, chunks, heads, hd)


@functools.lru_cache(maxsize=256)
def partials_header(shape: tuple[int, int, int, int]) -> tuple[bytes, bytes]:
    """(prefix, suffix) of the header ``protocol.encode`` writes for an ok RemotePartials
    of ``shape``: the header is prefix + the id as JSON + suffix."""
    header, _ = protocol.encode(protocol.RemotePartials(id="", ok=True, tensors=tuple(
        RawTensor("float32", s, memoryview(b"")) for s in _partials_shapes(shape))))
    prefix, found, suffix = header.partition(b'"id":""')
    assert found and suffix.find(b'"id":""') < 0, "a RemotePartials header names its id once"
    return prefix + b'"id":', suffix


def slot_use(header_bytes: int, frame_bytes: list[int]) -> int:
    """Bytes a slot needs for a message of ``header_bytes`` and frames of ``frame_bytes``."""
    return ALIGN + _align(header_bytes) + sum(_align(n) for n in frame_bytes)


@dataclass
class SlotPartials(Partials):
    """Partials viewing a ring's reply slot (``Segment.reply_into``), with ``frames``: the
    same bytes as a RemotePartials' frames (m, l, o), so the reply is built from them
    without viewing the tensors again."""

    frames: tuple[RawTensor, ...] = ()


@dataclass(frozen=True)
class _Place:
    """Where a reply of one shape goes in one reply slot: its header around the id
    (``prefix`` + the id's JSON + ``suffix``: what ``protocol.encode`` writes), at ``at``;
    the partials viewing the frames' bytes after it."""

    at: int
    prefix: bytes
    suffix: bytes
    partials: SlotPartials
    sizes: tuple[int, ...]              # each frame's bytes


@dataclass(frozen=True)
class RingPolicy:
    """Whom a creditor gives a ring: ``may_open(loan_id, debtor)``, the reason ``debtor``
    may not have one (it holds no such loan here) or None; ``holds(debtor)``, whether it
    holds any loan here now; ``engine_idle()``, whether this node's engine computes
    nothing now (then a ring thread may spin for the debtor's next request: module
    docstring; the default, never, spins ``SPIN_S``). Each callable from the channel's and
    the rings' threads; ``engine_idle`` at every request, so a read of a flag."""

    may_open: Callable[[str, str], str | None]
    holds: Callable[[str], bool]
    engine_idle: Callable[[], bool] = lambda: False


@functools.cache
def host_id() -> str:
    """This host's boot id ("" where it cannot be read: such a host offers and opens no ring)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Segment:
    """A ring's shared mapping: slots and doorbells (module docstring's layout). One per
    end; ``create`` (creditor) or ``attach`` (debtor)."""

    def __init__(self, fd: int, name: str, slots: int, slot_bytes: int) -> None:
        self.name, self.slots, self.slot_bytes = name, slots, slot_bytes
        self.nonce = b""
        self.size = _HEAD + 2 * slots * slot_bytes
        self.mm = mmap.mmap(fd, self.size)
        self._anchor = (ctypes.c_char * self.size).from_buffer(self.mm)     # pins the mapping's address
        self.base = ctypes.addressof(self._anchor)
        self.view = memoryview(self.mm)
        self._places: dict[tuple, _Place | None] = {}      # (slot, shape, id's length) -> its reply's place
        self._placed: dict[int, tuple] = {}                 # reply slot -> (seq, id, header bytes, frames) reply_into wrote

    @classmethod
    def create(cls, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> Segment:
        """A new segment under a fresh random name, mode 0600, every byte allocated (a full
        /dev/shm fails here, not as a SIGBUS later). Raises OSError (nothing left behind)."""
        name = f"kvd-ring-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)                            # whatever the umask left
            os.posix_fallocate(fd, 0, _HEAD + 2 * slots * slot_bytes)
            seg = cls(fd, name, slots, slot_bytes)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)                                    # the mapping holds the memory
        seg.nonce = secrets.token_bytes(16)
        _GEOMETRY.pack_into(seg.mm, 0, _MAGIC, seg.nonce, slots, slot_bytes)
        return seg

    @classmethod
    def attach(cls, offer: protocol.RingOffer) -> Segment:
        """Map the segment a RingOffer names, then unlink its name. Raises ValueError for a
        bad name or geometry, or a file that is not the creditor's segment (not a regular
        file of this user with mode 0600 and the offer's size, magic and nonce); OSError."""
        if not NAME.fullmatch(offer.name):
            raise ValueError(f"not a ring's name: {offer.name!r}")
        if not 0 < offer.slots <= 64 or not 4096 <= offer.slot_bytes <= MAX_SLOT_BYTES or offer.slot_bytes % ALIGN:
            raise ValueError(f"a ring of {offer.slots} slots of {offer.slot_bytes} bytes")
        try:
            nonce = bytes.fromhex(offer.nonce)
        except ValueError:
            raise ValueError("the ring's nonce is not hex") from None
        path = os.path.join(SHM_DIR, offer.name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            size = _HEAD + 2 * offer.slots * offer.slot_bytes
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size != size:
                raise ValueError(f"{path} is not a ring segment of this user (mode 0600, {size} bytes)")
            seg = cls(fd, offer.name, offer.slots, offer.slot_bytes)
        finally:
            os.close(fd)
        if _GEOMETRY.unpack_from(seg.mm, 0) != (_MAGIC, nonce, offer.slots, offer.slot_bytes):
            seg.close()
            raise ValueError(f"{path} is not the offered ring (magic, nonce or geometry differ)")
        seg.nonce = nonce
        seg.unlink()
        return seg

    def bell(self, which: int) -> int:
        """The address of a doorbell (``_REQUEST_BELL`` or ``_REPLY_BELL``)."""
        return self.base + which

    def closed(self, by: str) -> bool:
        return struct.unpack_from("<I", self.mm, _CLOSED_BY[by])[0] != 0

    def mark_closed(self, by: str) -> None:
        struct.pack_into("<I", self.mm, _CLOSED_BY[by], 1)

    def _slot(self, area: int, seq: int) -> int:
        return _HEAD + (area * self.slots + seq % self.slots) * self.slot_bytes

    def slot_address(self, area: int, seq: int) -> int:
        """The address of message ``seq``'s slot of ``area`` (``slot_bytes`` long), while mapped."""
        return self.base + self._slot(area, seq)

    def put(self, area: int, seq: int, header: bytes, frames: list[memoryview], placed: bool = False) -> bool:
        """Write message ``seq`` into its slot of ``area``; False (nothing written) when it
        does not fit. ``placed``: frames may lie where they go already (``reply_into``'s):
        those are not copied."""
        sizes = [f.nbytes for f in frames]
        if len(frames) > MAX_FRAMES or slot_use(len(header), sizes) > self.slot_bytes:
            return False
        at = self._slot(area, seq)
        pos = at + ALIGN
        self.mm[pos:pos + len(header)] = header
        pos = _align(pos + len(header))
        for f, n in zip(frames, sizes):
            if not placed or _address(f) != self.base + pos:     # else written there already
                self.mm[pos:pos + n] = f
            pos = _align(pos + n)
        _SLOT.pack_into(self.mm, at, seq & MASK, len(header), len(frames), 0, *sizes, *[0] * (MAX_FRAMES - len(sizes)))
        return True

    def reply_into(self, seq: int, msg_id: str, shape: tuple[int, int, int, int]) -> SlotPartials | None:
        """Partials of ``shape`` (rows, chunks, heads, head dim) viewing reply ``seq``'s slot
        where the frames of a RemotePartials answering ``msg_id`` go (its header written
        before them), or None when they do not fit. Posting that answer with ``put`` then
        copies nothing but the header. The same views for every reply of this shape in this
        slot (the segment's: ``close`` lets go of them); the views pin the mapping until they
        go."""
        ident = orjson.dumps(msg_id)                       # the id as the header's JSON writes it
        place = self._place_of(seq, shape, len(ident))
        if place is None:
            return None
        header = place.prefix + ident + place.suffix
        self.mm[place.at:place.at + len(header)] = header
        self._placed[seq % self.slots] = (seq, msg_id, len(header), place.partials.frames)
        return place.partials

    def reply_in_place(self, seq: int, msg_id: str, shape: tuple[int, int, int, int]) -> SlotPartials | None:
        """Reply ``seq``'s partials, viewing its slot, when the slot holds exactly the ok
        RemotePartials of ``shape`` answering ``msg_id`` (the header and frame sizes
        ``reply_into`` writes, which are ``protocol.encode``'s); else None (nothing read past
        the slot's head and header). The views are ``reply_into``'s for that slot and shape."""
        ident = orjson.dumps(msg_id)
        place = self._place_of(seq, shape, len(ident))
        if place is None:
            return None
        header = place.prefix + ident + place.suffix
        at = self._slot(REPLIES, seq)
        got, header_bytes, count, _, *sizes = _SLOT.unpack_from(self.mm, at)
        if (got != seq & MASK or header_bytes != len(header) or tuple(sizes[:count]) != place.sizes
                or self.view[place.at:place.at + header_bytes] != header):
            return None
        return place.partials

    def _place_of(self, seq: int, shape: tuple[int, int, int, int], ident_bytes: int) -> _Place | None:
        """``_place``, made once per (slot, shape, id's length) and kept (at most ``PLACES``)."""
        key = (seq % self.slots, shape, ident_bytes)
        place = self._places.get(key, False)
        if place is False:
            if len(self._places) >= PLACES:
                self._places.clear()
            place = self._places[key] = self._place(seq, shape, ident_bytes)
        return place

    def post_placed(self, seq: int, reply: protocol.Message) -> bool:
        """Post ``reply`` as reply ``seq`` when it is the ok RemotePartials whose header and
        frames ``reply_into`` wrote into that slot already (only the slot's head is written);
        False (nothing written) otherwise."""
        placed = self._placed.pop(seq % self.slots, None)
        if (placed is None or placed[0] != seq or not isinstance(reply, protocol.RemotePartials) or not reply.ok
                or reply.id != placed[1] or len(reply.tensors) != len(placed[3])
                or not all(a is b for a, b in zip(reply.tensors, placed[3]))):
            return False
        sizes = [f.data.nbytes for f in placed[3]]
        _SLOT.pack_into(self.mm, self._slot(REPLIES, seq), seq & MASK, placed[2], len(sizes), 0, *sizes,
                        *[0] * (MAX_FRAMES - len(sizes)))
        return True

    def _place(self, seq: int, shape: tuple[int, int, int, int], ident_bytes: int) -> _Place | None:
        """Reply ``seq``'s slot's layout for partials of ``shape`` and an id of ``ident_bytes``
        in JSON, or None when they do not fit."""
        shapes = _partials_shapes(shape)
        prefix, suffix = partials_header(shape)
        header_bytes = len(prefix) + ident_bytes + len(suffix)
        sizes = [4 * math.prod(s) for s in shapes]
        if slot_use(header_bytes, sizes) > self.slot_bytes or not all(sizes):
            return None
        at = self._slot(REPLIES, seq) + ALIGN
        pos, views = _align(at + header_bytes), []
        for s, n in zip(shapes, sizes):
            views.append(torch.frombuffer(self.mm, dtype=torch.float32, count=n // 4, offset=pos).view(s))
            pos = _align(pos + n)
        return _Place(at, prefix, suffix, SlotPartials(*views, frames=tuple(RawTensor.from_torch(t) for t in views)),
                      tuple(sizes))

    def take(self, area: int, seq: int, copy: bool) -> tuple[bytes, list] | str:
        """Message ``seq`` from its slot of ``area``: (header, frames: writable copies when
        ``copy``, the tensors made of them the caller's own; else views of the slot), or why
        the slot holds no such message."""
        at = self._slot(area, seq)
        got, header_bytes, count, _, *sizes = _SLOT.unpack_from(self.mm, at)
        if got != seq & MASK:
            return f"slot {seq % self.slots} holds message {got}, not {seq & MASK}"
        if count > MAX_FRAMES or slot_use(header_bytes, sizes[:count]) > self.slot_bytes:
            return f"slot {seq % self.slots}'s lengths overflow it"
        pos = at + ALIGN
        header = bytes(self.view[pos:pos + header_bytes])
        pos = _align(pos + header_bytes)
        frames = []
        for n in sizes[:count]:
            frames.append(bytearray(self.view[pos:pos + n]) if copy else self.view[pos:pos + n])
            pos = _align(pos + n)
        return header, frames

    def unlink(self) -> None:
        """Remove the name (the mappings stay); a name already gone is no error."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def close(self) -> None:
        """Unmap (deferred to the last view's release where views remain)."""
        if self._anchor is None:
            return
        self._places.clear()                                # its views of the mapping
        self._placed.clear()
        with contextlib.suppress(BufferError):
            self.view.release()
        self._anchor = None
        try:
            self.mm.close()
        except BufferError:         # a message's frames still view it: unmapped when they go
            pass


class StepRequest:
    """A decode step's request of one remote part, as its layers post it natively
    (``RingClient.send_step``): the header is ``pre`` + id + ``mid`` + layer in decimal +
    ``post`` (``protocol.encode``'s for the id and layer); the frames, the bytes of
    ``tensors`` (contiguous: the caller keeps them and rewrites them at every layer),
    ``frames`` views of them."""

    def __init__(self, pre: bytes, mid: bytes, post: bytes, frames: list, tensors: tuple[torch.Tensor, ...]) -> None:
        if len(tensors) > MAX_FRAMES or not all(t.is_contiguous() for t in tensors):
            raise ValueError(f"a step's request has at most {MAX_FRAMES} contiguous tensors")
        self.pre, self.mid, self.post, self.frames, self.tensors = pre, mid, post, frames, tensors
        n = len(tensors)
        pattern = ring_lane.pattern(pre, mid, post, [t.numel() * t.element_size() for t in tensors])
        self.args = ring_lane.Post(pattern, (ctypes.c_int64 * 4)(*(t.data_ptr() for t in tensors),
                                                                 *[0] * (4 - n)))
        self.ref = ctypes.byref(self.args)

    def header(self, msg_id: str, layer: int) -> bytes:
        """The header of the request ``msg_id`` at ``layer``: what ``protocol.encode`` gives."""
        return self.pre + msg_id.encode() + self.mid + b"%d" % layer + self.post


@functools.lru_cache(maxsize=64)
def _expected(shape: tuple[int, int, int, int]) -> tuple[bytes, bytes]:
    """The header of an ok RemotePartials of ``shape`` around its id's characters."""
    prefix, suffix = partials_header(shape)
    return prefix + b'"', b'"' + suffix


class RingClient:
    """The debtor's end: ``send`` posts a request, ``next_reply`` reads the replies in order
    (reply i answers request i, whatever id it claims). The engine thread's only (like the
    channel client that owns it)."""

    def __init__(self, segment: Segment, bells: Doorbells) -> None:
        self.seg, self.bells = segment, bells
        self.sent = 0               # requests posted
        self.read = 0               # replies read
        self.spin = AdaptiveSpin(MAX_SPIN_S, SPIN_S)               # the reply's wait: the engine thread's only work
        self._ids: collections.deque[str] = collections.deque()     # the ids of requests not answered yet, in order
        self._lib = ring_lane.library()                             # the native post and take (None: Python's)
        self._takes: dict[tuple, tuple] = {}                        # (id(dst), shape) -> next_reply_into's arguments
        # the most a reply's frames may take: its slot less its head, header room and alignment
        self._reply_room = segment.slot_bytes - 3 * ALIGN - _align(REPLY_HEADER_BYTES)

    @classmethod
    def attach(cls, offer: protocol.RingOffer, bells: Doorbells) -> RingClient:
        """Raises ValueError or OSError (Segment.attach)."""
        return cls(Segment.attach(offer), bells)

    @property
    def closed(self) -> bool:
        """Whether the creditor closed the ring (then every send goes on the zmq channel)."""
        return self.seg.closed("creditor")

    def send(self, msg_id: str, header: bytes, frames: list[memoryview], reply_bytes: int) -> bool:
        """Post the request ``msg_id`` whose reply's frames take at most ``reply_bytes`` (3 frames); False
        (nothing sent) when the ring is closed or full, or the request or its reply would
        not fit a slot."""
        if self.closed or self.sent - self.read >= self.seg.slots or reply_bytes > self._reply_room:
            return False
        if not self.seg.put(REQUESTS, self.sent, header, frames):
            return False
        self.sent += 1
        self._ids.append(msg_id)
        self.bells.post(self.seg.bell(_REQUEST_BELL), self.sent)
        return True

    def send_step(self, msg_id: str, step: StepRequest, layer: int, reply_bytes: int) -> bool:
        """``send`` of ``step``'s request ``msg_id`` at ``layer``, written into its slot by one
        native call (kernels/ring_lane.py); False (nothing sent) as ``send``'s, or where the
        native post does not build."""
        lib = self._lib
        if lib is None or self.closed or self.sent - self.read >= self.seg.slots or reply_bytes > self._reply_room:
            return False
        ident = msg_id.encode()
        if lib.post(self.seg.slot_address(REQUESTS, self.sent), self.seg.slot_bytes, self.sent & MASK, step.ref,
                    ident, len(ident), layer) != 0:
            return False
        self.sent += 1
        self._ids.append(msg_id)
        self.bells.post(self.seg.bell(_REQUEST_BELL), self.sent)
        return True

    def next_is(self, msg_id: str) -> bool:
        """Whether the next reply on the ring answers request ``msg_id``."""
        return bool(self._ids) and self._ids[0] == msg_id

    def next_reply(self, deadline: float) -> tuple[str, bytes | None, list[bytes]]:
        """The next reply: (the id of the request it answers, its header and frames copied
        out of the slot; header None for a slot out of sequence), waited for until
        ``deadline`` (time.monotonic). Raises RemoteKVError after it, or when the creditor
        closed the ring."""
        self._await_reply(deadline)
        got = self.seg.take(REPLIES, self.read, copy=True)
        self.read += 1
        msg_id = self._ids.popleft()
        if isinstance(got, str):
            log.warning("a reply on the ring refused: %s", got)
            return msg_id, None, []
        return msg_id, *got

    def next_reply_as(self, shape: tuple[int, int, int, int], deadline: float
                      ) -> SlotPartials | tuple[str, bytes | None, list[bytes]]:
        """The next reply, when it is exactly the ok RemotePartials of ``shape`` answering its
        request (``Segment.reply_in_place``): its partials viewing the slot (valid until the
        next request posted on this ring: read them first), nothing decoded or copied. Any
        other reply (a refusal, another shape, a slot out of sequence): ``next_reply``'s
        tuple, for the caller's full decode. Waits and raises as ``next_reply``."""
        self._await_reply(deadline)
        got = self.seg.reply_in_place(self.read, self._ids[0], shape)
        if got is None:
            return self.next_reply(deadline)
        self.read += 1
        self._ids.popleft()
        return got

    def next_reply_into(self, shape: tuple[int, int, int, int], dst: Partials, deadline: float
                        ) -> bool | tuple[str, bytes | None, list[bytes]]:
        """``next_reply_as``, its partials copied into ``dst`` (fp32 m, l [rows, chunks, heads]
        and o [..., head dim], each row's chunks contiguous: a gather's slots) by one native
        call: True once copied. Any other reply: ``next_reply``'s tuple (nothing copied).
        Raises ValueError for a ``dst`` of another shape or layout; waits and raises as
        ``next_reply``."""
        take = self._takes.get((id(dst), shape))
        if take is None or take[0] is not dst:
            take = self._take_of(shape, dst)
        self._await_reply(deadline)
        ident = self._ids[0].encode()
        if self._lib is None or self._lib.take(self.seg.slot_address(REPLIES, self.read), self.seg.slot_bytes,
                                               self.read & MASK, take[1], ident, len(ident)) != 0:
            return self.next_reply(deadline)
        self.read += 1
        self._ids.popleft()
        return True

    def _take_of(self, shape: tuple[int, int, int, int], dst: Partials) -> tuple:
        """(dst, the native take's arguments for replies of ``shape`` into it), checked and kept."""
        rows, chunks, heads, hd = shape
        m, l, o = dst.m, dst.l, dst.o
        if (m.shape != (rows, chunks, heads) or l.shape != m.shape or o.shape != (rows, chunks, heads, hd)
                or m.stride()[1:] != (heads, 1) or l.stride() != m.stride() or o.stride()[1:] != (heads * hd, hd, 1)
                or not m.dtype == l.dtype == o.dtype == torch.float32):
            raise ValueError(f"partials of {shape} go into fp32 slots with each row's chunks contiguous")
        rpre, rpost = _expected(shape)
        args = ring_lane.Take(ring_lane.address(rpre), len(rpre), ring_lane.address(rpost), len(rpost), rows, chunks,
                              heads, hd, m.data_ptr(), l.data_ptr(), o.data_ptr(), m.stride(0), o.stride(0))
        if len(self._takes) >= TAKES:
            self._takes.clear()
        take = self._takes[(id(dst), shape)] = (dst, ctypes.byref(args), args, rpre, rpost)
        return take

    def _await_reply(self, deadline: float) -> None:
        """Wait until reply ``read`` is posted (``next_reply``'s waits and errors)."""
        bell = self.seg.bell(_REPLY_BELL)
        if self.read == self.sent:
            raise RemoteKVError("no request awaits a reply on the ring")
        if self.bells.load(bell) == self.read & MASK:
            spin_s, since = self.spin.spin_s(), time.monotonic()
            while self.bells.load(bell) == self.read & MASK:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RemoteKVError("a remote part gave no result within the deadline on the ring")
                if self.closed:
                    raise RemoteKVError("the creditor closed the shared-memory ring")
                self.bells.wait(bell, self.read, spin_s, min(left, SLICE_S))
                spin_s = SPIN_S                             # past a slice: the creditor is slow, not busy
            self.spin.waited(time.monotonic() - since)

    def close(self) -> None:
        self.seg.mark_closed("debtor")
        self.seg.close()


class RingServer:
    """The creditor's end of one debtor's ring: a thread that answers each request with
    ``answer(header, frames, into)`` (the channel's checks, in ``debtor``'s name; its
    partials computed ``into(msg_id, shape)``, the reply slot) and ends when
    ``stop``ped or ``close``d, when the debtor closes its end, or when ``holds(debtor)`` has
    been false for ``IDLE_S``. ``fast(seq)``: answers request ``seq`` in its reply slot, or
    says it did not (True / False: then ``answer`` does; kvd/node/ring_lane.py).
    ``rejected()`` is called for each slot that holds no message,
    ``ended()`` once, by the thread, when it has unmapped the segment. After answering, it
    spins for the debtor's next request about the debtor's recent gap while
    ``engine_idle()`` (``RingPolicy``'s), else ``SPIN_S``."""

    def __init__(self, segment: Segment, bells: Doorbells, debtor: str,
                 answer: Callable[[bytes, list[memoryview], Callable], protocol.Message],
                 holds: Callable[[str], bool],
                 rejected: Callable[[], None], ended: Callable[[], None] = lambda: None,
                 engine_idle: Callable[[], bool] = lambda: False,
                 fast: Callable[[int], bool] = lambda seq: False) -> None:
        self.seg, self.bells, self.debtor, self.fast = segment, bells, debtor, fast
        self.answer, self.holds, self.rejected, self.ended = answer, holds, rejected, ended
        self.engine_idle = engine_idle
        self.spin = AdaptiveSpin(MAX_SPIN_S, SPIN_S)               # the debtor's gap between requests
        self._stop = threading.Event()
        self._created = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvd-attention-ring", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        seg, bell = self.seg, self.seg.bell(_REQUEST_BELL)
        done, named, idle_since = 0, True, None
        answered = None                                     # when the last answers went: the debtor's gap began
        try:
            while not self._stop.is_set():
                # the debtor's next request comes after its gap: spin that long where the
                # engine leaves this node's cores free, else sleep soon
                spin_s = self.spin.spin_s() if answered is not None and self.engine_idle() else SPIN_S
                posted = self.bells.wait(bell, done, spin_s, SLICE_S)
                if answered is not None:
                    self.spin.waited(time.monotonic() - answered if posted is not None else SLICE_S)
                    answered = None
                if posted is None:                          # quiet: look around
                    now = time.monotonic()
                    if named and now - self._created > ATTACH_S:
                        seg.unlink()
                        named = False
                    if seg.closed("debtor"):
                        return
                    if self.holds(self.debtor):
                        idle_since = None
                    elif idle_since is None:
                        idle_since = now
                    elif now - idle_since > IDLE_S:
                        return
                    continue
                if named:
                    seg.unlink()                            # the debtor mapped it: the name may go
                    named = False
                if (posted - done) & MASK > seg.slots:      # more in flight than slots: not a debtor's
                    self.rejected()
                    log.warning("ring of %s: %d requests posted past the %d slots; closed",
                                self.debtor, (posted - done) & MASK, seg.slots)
                    return
                while done & MASK != posted:
                    self._serve_one(done)
                    done += 1
                    self.bells.post(seg.bell(_REPLY_BELL), done)
                answered = time.monotonic()
        finally:
            seg.mark_closed("creditor")
            seg.unlink()
            seg.close()
            self.ended()

    def _serve_one(self, seq: int) -> None:
        if self.fast(seq):                                  # answered in its slot already
            return
        got = self.seg.take(REQUESTS, seq, copy=False)
        if isinstance(got, str):
            self.rejected()
            reply: protocol.Message = protocol.RemotePartials(ok=False, reason=got)
        else:
            try:
                reply = self.answer(*got, functools.partial(self.seg.reply_into, seq))
            except Exception as exc:  # noqa: BLE001 -- one bad message must not end the ring
                log.exception("remote attention on the ring failed")
                reply = protocol.RemotePartials(ok=False, reason=f"{type(exc).__name__}: {exc}"[:300])
            del got                                         # the request's views of the slot
        if self.seg.post_placed(seq, reply):
            return
        header, frames = protocol.encode_reply(reply)
        if not self.seg.put(REPLIES, seq, header, frames, placed=True):
            header, frames = protocol.encode_reply(protocol.RemotePartials(
                id=reply.id, ok=False, reason="the reply does not fit the ring's slot"))
            self.seg.put(REPLIES, seq, header, frames)

    def stop(self) -> None:
        """Ask the thread to end and return at once: it ends within ``SLICE_S`` (or once the
        request it is answering is answered), the segment with it. Any thread."""
        self._stop.set()

    def close(self) -> None:
        """Stop the thread and wait for it (at most ``10 * SLICE_S``); the segment goes with it."""
        self.stop()
        self._thread.join(timeout=10 * SLICE_S)
