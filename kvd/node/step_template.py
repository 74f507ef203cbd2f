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


class StepTemplate:
    """One ring's last fully checked RemoteAttend, as a pattern (module docstring). The
    ring thread's only."""

    def __init__(self) -> None:
        self._pattern: re.Pattern[bytes] | None = None
        self._msg: protocol.RemoteAttend | None = None
        self._kinds: tuple[tuple[str, tuple[int, ...]], ...] = ()     # each frame's dtype and shape
        self._sizes: tuple[int, ...] = ()
        self.pieces: tuple[bytes, bytes, bytes] | None = None   # the pattern's bytes around the id and the layer
        self.lane = None            # the step's native answer (kvd/node/ring_lane.py), set by the ring's server
        self.hits = 0

    def learn(self, header: bytes, msg: protocol.RemoteAttend) -> None:
        """``msg``, decoded from ``header`` and checked in full (the trust gate passed), is
        the pattern from now on (none where its id is not an ``ID`` or the header does not
        name its id and layer once each)."""
        self._pattern = self._msg = self.pieces = self.lane = None
        ident, layer = b'"id":' + orjson.dumps(msg.id), b'"layer":%d,' % msg.layer
        if not ID.fullmatch(msg.id) or header.count(ident) != 1 or header.count(layer) != 1:
            return
        i, j = header.index(ident), header.index(layer)
        if j < i + len(ident):
            return
        self._pattern = re.compile(re.escape(header[:i]) + rb'"id":"([0-9A-Za-z_-]{1,64})"'
                                   + re.escape(header[i + len(ident):j]) + rb'"layer":(0|[1-9][0-9]{0,5}),'
                                   + re.escape(header[j + len(layer):]), re.DOTALL)
        self.pieces = (header[:i] + b'"id":"', b'"' + header[i + len(ident):j] + b'"layer":', b"," + header[j + len(layer):])
        self._msg = copy.copy(msg)
        object.__setattr__(self._msg, "tensors", ())          # no view of the ring's slot kept
        self._kinds = tuple((t.dtype, t.shape) for t in msg.tensors)
        self._sizes = tuple(t.data.nbytes for t in msg.tensors)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The pattern's frames' sizes in bytes (none without a pattern)."""
        return self._sizes if self._pattern is not None else ()

    def match(self, header: bytes, frames: list[memoryview]) -> protocol.RemoteAttend | None:
        """The message ``header`` and ``frames`` (1-D byte views) are, when they fit the
        pattern: the template with their id, layer and frames; else None."""
        if self._pattern is None or len(frames) != len(self._sizes):
            return None
        found = self._pattern.fullmatch(header)
        if found is None or any(f.nbytes != n for f, n in zip(frames, self._sizes)):
            return None
        msg = copy.copy(self._msg)
        object.__setattr__(msg, "id", found.group(1).decode())
        object.__setattr__(msg, "layer", int(found.group(2)))
        object.__setattr__(msg, "tensors", tuple(RawTensor(dtype, shape, f)
                                                 for (dtype, shape), f in zip(self._kinds, frames)))
        self.hits += 1
        return msg
