"""A creditor's shortcut through one ring's RemoteAttend headers (kvd/node/attention_ring.py).

A debtor's messages for one remote part of one decode step differ only in their id and
layer (kvd/node/remote_attention.py ``StepLane``): every other byte of the header (the
debtor, loan, request, chunk, context, first position, deadline, frame descriptors) is the
same at every layer. ``StepTemplate`` keeps the last RemoteAttend the ring decoded and
checked in full, as a pattern of its header's bytes with the id and the layer left open,
and takes a header that fits the pattern (an id of ``ID`` characters, a layer in plain
decimal) with frames of the template's sizes as that message with that id and layer:
what ``protocol.decode`` would give for those bytes, without decoding and validating the
JSON again. Anything else is decoded in full (and, once checked, becomes the template).
"""

from __future__ import annotations

import copy
import re

import orjson

from kvd import protocol
from kvd.wire import RawTensor

ID = re.compile(r"[0-9A-Za-z_-]{1,64}")          # ids a pattern takes: JSON strings with no escapes
ID_BYTES = re.compile(rb"[0-9A-Za-z_-]{1,64}")
LAYER = re.compile(rb"0|[1-9][0-9]{0,5}")        # a layer as JSON writes it


class StepTemplate:
    """One ring's last fully checked RemoteAttend, as a pattern (module docstring). The
    ring thread's only."""

    def __init__(self) -> None:
        self._msg: protocol.RemoteAttend | None = None
        self._kinds: tuple[tuple[str, tuple[int, ...]], ...] = ()     # each frame's dtype and shape
        self._sizes: tuple[int, ...] = ()
        # the pattern: the header's bytes before the id, between the id and the layer, after the layer
        self.pieces: tuple[bytes, bytes, bytes] | None = None
        self.lane = None            # the step's native answer (kvd/node/ring_lane.py), set by the ring's server
        self.hits = 0

    def learn(self, header: bytes, msg: protocol.RemoteAttend) -> None:
        """``msg``, decoded from ``header`` and checked in full (the trust gate passed), is
        the pattern from now on (none where its id is not an ``ID`` or the header does not
        name its id and layer once each)."""
        self._msg = self.pieces = self.lane = None
        ident, layer = b'"id":' + orjson.dumps(msg.id), b'"layer":%d,' % msg.layer
        if not ID.fullmatch(msg.id) or header.count(ident) != 1 or header.count(layer) != 1:
            return
        i, j = header.index(ident), header.index(layer)
        if j < i + len(ident):
            return
        self.pieces = (header[:i] + b'"id":"', b'"' + header[i + len(ident):j] + b'"layer":',
                       b"," + header[j + len(layer):])
        self._msg = copy.copy(msg)
        object.__setattr__(self._msg, "tensors", ())          # no view of the ring's slot kept
        self._kinds = tuple((t.dtype, t.shape) for t in msg.tensors)
        self._sizes = tuple(t.data.nbytes for t in msg.tensors)

    def match(self, header: bytes, frames: list[memoryview]) -> protocol.RemoteAttend | None:
        """The message ``header`` and ``frames`` (1-D byte views) are, when they fit the
        pattern: the template with their id, layer and frames; else None."""
        if self.pieces is None or len(frames) != len(self._sizes):
            return None
        pre, mid, post = self.pieces
        if len(header) < len(pre) + len(mid) + len(post) + 2 or not header.startswith(pre) \
                or not header.endswith(post):
            return None
        body = header[len(pre):len(header) - len(post)]     # id + mid + layer; an id holds no quote
        ident, _, rest = body.partition(b'"')
        layer = rest[len(mid) - 1:]
        if (not ID_BYTES.fullmatch(ident) or not rest.startswith(mid[1:]) or not LAYER.fullmatch(layer)
                or any(f.nbytes != n for f, n in zip(frames, self._sizes))):
            return None
        msg = copy.copy(self._msg)
        object.__setattr__(msg, "id", ident.decode())
        object.__setattr__(msg, "layer", int(layer))
        object.__setattr__(msg, "tensors", tuple(RawTensor(dtype, shape, f)
                                                 for (dtype, shape), f in zip(self._kinds, frames)))
        self.hits += 1
        return msg
