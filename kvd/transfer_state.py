"""The states of one KV transfer, on both sides (kvd/node/kvmove.py:
``KVSender``, ``KVReceiver``), and the ones a ``KVCommit`` may carry on the
wire (kvd/protocol.py): one vocabulary."""

from __future__ import annotations

import enum


class TransferState(str, enum.Enum):
    PENDING = "pending"            # the receiver's region is reserved; nothing sent yet
    SENDING = "sending"            # sender: the receiver's blocks are known, layers go out
    RECEIVING = "receiving"        # receiver: layers are landing
    DONE = "done"                  # every layer landed and the region was committed
    FINISHED = "finished"          # token 0 ended the request on the prefill node (disagg)
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"        # the request was aborted


FINAL = frozenset((TransferState.DONE, TransferState.FINISHED, TransferState.FAILED,
                   TransferState.TIMED_OUT, TransferState.CANCELLED))
# how a prefill node ends a disaggregated prompt's transfer (KVCommit.status)
COMMIT_STATUSES = tuple(s.value for s in (TransferState.DONE, TransferState.FINISHED, TransferState.FAILED))
