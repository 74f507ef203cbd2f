"""A debtor reads a creditor's answer to a remote part: anything but good
partials of the right shape ends the request with RemoteKVError naming why."""

from __future__ import annotations

import pytest

from engine.dist_attention import RemoteKVError
from kvd import protocol
from kvd.node.remote_attention import partials_of


@pytest.mark.parametrize("reply, why", [
    (protocol.ProtocolError(reason="bad_frame", detail="a frame of 3 bytes"), "bad_frame: a frame of 3 bytes"),
    (protocol.RemotePartials(id="x", ok=False, reason="not lent to you"), "not lent to you"),
])
def test_a_refused_or_undecodable_answer_is_a_remote_kv_error(reply, why):
    with pytest.raises(RemoteKVError, match=why):
        partials_of(reply, rows=1, lo=0, ctx=16, head_dim=64)
