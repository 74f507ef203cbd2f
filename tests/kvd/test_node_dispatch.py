"""kvd.node.daemon's dispatch: one handler per message type a node serves,
every leg of a request among them, the coordinator's only (kvd/trust.py);
a type a node does not serve is an error value, counted. No engine runs."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from kvd import protocol, trust
from kvd.cluster_config import COORDINATOR_NAME, ClusterConfig
from kvd.node.daemon import NodeDaemon

LEGS = [protocol.GenerateRequest(request_id="r", prompt_token_ids=(1, 2)),
        protocol.DecodeLeg(request_id="r", prompt_token_ids=(1, 2), prefill_node="p1"),
        protocol.PrefillLeg(request_id="r", prompt_token_ids=(1, 2), kv_to_node="d1", kv_to_address="a",
                            kv_transfer_id="t", kv_block_ids=(1,), kv_num_layers=2, kv_dtype="float32"),
        protocol.ResumeRequest(request_id="r", prompt_token_ids=(1, 2), output_token_ids=(3,))]


@pytest.fixture
def node() -> NodeDaemon:
    return NodeDaemon(EngineConfig(model="tiny"), ClusterConfig(), "n0")   # not started: no engine


def test_every_leg_type_has_its_own_handler(node):
    legs = {cls for cls in protocol.MESSAGE_TYPES.values() if issubclass(cls, protocol.LegRequest)}
    assert legs == {type(m) for m in LEGS}
    handlers = [node._dispatch[cls] for cls in legs]
    assert len({h.__func__ for h in handlers}) == len(legs)


def test_a_node_serves_what_the_coordinator_and_its_peers_send(node):
    served = set(node._dispatch)
    assert {protocol.Abort, protocol.AdminCommand} <= served
    assert set(trust.FROM_NODES) <= served
    assert not served & {protocol.Hello, protocol.Heartbeat, protocol.TokenChunk, protocol.Accepted}


@pytest.mark.parametrize("msg", LEGS, ids=lambda m: m.TYPE)
def test_legs_come_from_the_coordinator_only(msg):
    assert trust.node_refusal(msg, COORDINATOR_NAME, authenticated=True) is None
    assert "only the coordinator" in trust.node_refusal(msg, "n2", authenticated=True)


async def test_a_type_the_node_does_not_serve_is_an_error_value(node):
    reply = await node._handle(protocol.Hello(node="n1", address="a", blocks_per_tier={}, block_size=16), None)
    assert isinstance(reply, protocol.Error) and reply.code == "unexpected_type"
    assert node.bad_messages["unexpected_type"] == 1


@pytest.mark.parametrize("msg", LEGS, ids=lambda m: m.TYPE)
async def test_a_draining_node_refuses_every_leg(node, msg):
    node.draining = True
    reply = await node._handle(msg, None)
    assert isinstance(reply, protocol.Error) and reply.code == "draining" and reply.request_id == "r"
    assert not node.streams
