"""kvd.protocol: typed messages, tensor frames, and decode's error values."""

from __future__ import annotations

import math

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd import protocol as P
from kvd.protocol import (
    DTYPES,
    MESSAGE_TYPES,
    REASONS,
    ProtocolError,
    ProtocolLimits,
    RawTensor,
    decode,
    encode,
)

EXAMPLES = [
    P.Hello(id="h", node="n1", address="zmq+tcp://127.0.0.1:5555", role="decode",
            blocks_per_tier={"device": 100, "host": 400}, block_size=16),
    P.Welcome(id="h", node="n1", accepted=True, heartbeat_interval=0.5),
    P.Heartbeat(node="n1", seq=7, load=0.25, running=3, waiting=1, free_blocks={"device": 12},
                cached_blocks=5, cache_events=2, stats={"running": 3}),
    P.GenerateRequest(id="g", request_id="r1", prompt_token_ids=(1, 2, 3), deadline=2e9,
                      sampling={"temperature": 0.0, "max_tokens": 8, "stop_token_ids": [2],
                                "ignore_eos": False, "seed": 3}),
    P.Accepted(id="g", request_id="r1"),
    P.DecodeLeg(id="g2", request_id="r2", prompt_token_ids=tuple(range(40)), prefill_node="p1"),
    P.PrefillLeg(id="g3", request_id="r2", prompt_token_ids=tuple(range(40)), kv_to_node="d1",
                 kv_to_address="zmq+tcp://127.0.0.1:5562", kv_transfer_id="pd-1", kv_block_ids=(7, 8),
                 kv_have_blocks=1, kv_num_layers=30, kv_dtype="float32"),
    P.ResumeRequest(id="g4", request_id="r3", prompt_token_ids=(1, 2), output_token_ids=(5, 6), replica_from="n2"),
    P.Accepted(id="g2", request_id="r2", kv_transfer_id="pd-1", kv_block_ids=(7, 8), kv_have_blocks=1,
               kv_num_layers=30, kv_dtype="float32"),
    P.KVCommit(transfer_id="pd-1", request_id="r2", status="done", first_token=42, cached_tokens=16),
    P.ReplicaData(source="n1", block_size=2, request_ids=("r1",), starts=(0,), counts=(1,), token_ids=(5, 6),
                  frees=("r0",), tensors=(RawTensor("int8", (1, 2, 1, 2, 1, 2), memoryview(b"abcdefgh")),)),
    P.ReplicaAck(held={"r1": 2}, refused={"r2": "over the replica budget"}),
    P.TokenChunk(request_id="r1", start_index=4, token_ids=(9, 10), text="hi", text_ends=(1, 2),
                 finish_reason="stop", usage={"prompt_tokens": 3, "completion_tokens": 6}),
    P.Abort(request_id="r1", reason="client left"),
    P.Abort(request_id="r1", reason="prefill leg lost", leg="prefill"),
    P.Goodbye(node="n1", reason="drained"),
    P.Error(code="no_capacity", message="full", request_id="r1"),
    P.KVTransferRequest(transfer_id="t", request_id="r1", src_node="a", dst_node="b",
                        token_ids=tuple(range(32)), num_blocks=2, num_layers=30, dtype="bfloat16"),
    P.KVAllocReply(transfer_id="t", ok=True, block_ids=(5, 6)),
    P.KVData(transfer_id="t", seq=1, layer_start=0, layer_end=2, block_ids=(5, 6), last=True,
             tensors=(RawTensor("int8", (2, 2), memoryview(b"abcd")),)),
    P.KVAck(transfer_id="t", ok=True, inserted_tokens=32),
    P.CacheEvents(id="c", node="n1", seq=3, block_size=2, tensors=(
        RawTensor("int64", (2, 3), memoryview(bytes(8) * 2 + (1).to_bytes(8, "little") + bytes(24))),
        RawTensor("int64", (0, 2), memoryview(b"")))),
    P.CacheAck(id="c", node="n1", next_seq=5),
    P.AdminCommand(command="cache", args={"op": "stats", "verbose": True}),
    P.AdminReply(ok=True, result={"nodes": [{"name": "n1"}]}),
    P.CreditorQuery(node="n1", blocks=8, exclude=("n2",)),
    P.Creditors(candidates=("n2", "n3"), addresses=("zmq+tcp://h:1", "zmq+tcp://h:2")),
    P.BorrowRequest(debtor="n1", blocks=8),
    P.BorrowReply(ok=True, loan_id="ab12", blocks=8, lease_s=3.0),
    P.BorrowReply(ok=False, reason="over the lending cap"),
    P.ReturnLoan(debtor="n1", loan_id="ab12"),
    P.LeaseRenew(debtor="n1", loan_ids=("ab12",)),
    P.LoanWrite(debtor="n1", loan_id="ab12", start=2, layer_start=0, layer_end=2,
                tensors=(RawTensor("int8", (2, 2, 1, 1, 1, 2), memoryview(b"abcdefgh")),)),
    P.LoanAck(ok=False, renewed=0, gone=("ab12",), reason="loans expired or unknown here"),
    P.RemoteAttend(debtor="n1", loan_id="ab12", request_id="r1", lo=2, layer=1, ctx=300, first=299,
                   tensors=(RawTensor("float32", (1, 1, 2), memoryview(bytes(8))),
                            RawTensor("int8", (1, 1, 2), memoryview(b"ab")), RawTensor("int8", (1, 1, 2), memoryview(b"cd")))),
    P.RemotePartials(ok=False, reason="no loan 'ab12' of this node to 'n3'"),
    P.RingOpen(debtor="n1", loan_id="ab12", host="775ed33a-b7f1-4475-a8bd-6bf764a5863f"),
    P.RingOffer(ok=True, name="kvd-ring-" + "0" * 32, nonce="ff" * 16, slots=4, slot_bytes=524288),
    P.RecallKV(debtor="n1", loan_id="ab12", start=0, blocks=2),
    P.LoanKV(ok=True, tensors=(RawTensor("int8", (2, 2, 1, 1, 1, 2), memoryview(b"abcdefgh")),)),
]


def test_every_registered_type_has_an_example():
    assert {type(m).TYPE for m in EXAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    header, frames = encode(msg)
    back = decode(header, frames)
    assert not isinstance(back, ProtocolError), back
    if isinstance(msg, P.KVData):
        assert [bytes(t.data) for t in back.tensors] == [bytes(t.data) for t in msg.tensors]
        assert [(t.dtype, t.shape) for t in back.tensors] == [(t.dtype, t.shape) for t in msg.tensors]
    else:
        assert back == msg


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_tensor_frames_decode_to_views_without_copy(dtype):
    torch_dtype = getattr(torch, dtype)
    kv = torch.arange(2 * 3 * 4).reshape(2, 3, 4).to(torch_dtype)  # kv: [layers, tokens, dim]
    header, frames = encode(P.KVData(transfer_id="t", tensors=(kv, kv[:, :1])))
    assert orjson.loads(header)["frames"][0] == {"dtype": dtype, "shape": [2, 3, 4]}
    msg = decode(header, frames)
    whole, sliced = msg.as_torch()
    assert whole.dtype == torch_dtype and torch.equal(whole, kv) and torch.equal(sliced, kv[:, :1])
    assert whole.data_ptr() == kv.data_ptr()  # encode and decode shared the memory


def test_unpicklable_dtypes_are_refused_at_construction():
    with pytest.raises(ValueError, match="not allowed"):
        P.KVData(transfer_id="t", tensors=(torch.zeros(2, dtype=torch.complex64),))


def test_empty_tensor_frame():
    msg = decode(*encode(P.KVData(transfer_id="t", tensors=(torch.zeros(0, 4),))))
    assert msg.as_torch()[0].shape == (0, 4)


GRANT = dict(kv_to_node="d1", kv_to_address="a", kv_transfer_id="t", kv_num_layers=2, kv_dtype="float32",
             kv_block_ids=(1,))


@pytest.mark.parametrize("cls, bad, match", [
    (P.GenerateRequest, dict(sampling={"temperature": -1.0}), r"temperature must be a number in \[0, 2\]"),
    (P.GenerateRequest, dict(sampling={"beam_width": 4}), "unknown sampling"),
    (P.GenerateRequest, dict(sampling={"max_tokens": True}), "int"),
    (P.GenerateRequest, dict(prompt_token_ids=()), "empty"),
    (P.GenerateRequest, dict(prompt_token_ids=(1, -2)), ">= 0"),
    (P.GenerateRequest, dict(prompt_token_ids=(1, 2.0)), "int"),
    (P.GenerateRequest, dict(request_id=""), "request_id"),
    (P.GenerateRequest, dict(deadline=float("nan")), "finite"),
    (P.GenerateRequest, dict(replica_to="d2", replica_address="a"),
     "replica_to needs replica_address and replica_ticket"),
    (P.DecodeLeg, dict(prefill_node=""), "prefill_node"),
    (P.DecodeLeg, dict(prefill_node="p1", prompt_token_ids=()), "empty"),
    (P.PrefillLeg, GRANT | dict(kv_to_node=""), "kv_to_node"),
    (P.PrefillLeg, GRANT | dict(kv_transfer_id=""), "kv_transfer_id"),
    (P.PrefillLeg, GRANT | dict(kv_block_ids=(1, 1)), "distinct"),
    (P.PrefillLeg, GRANT | dict(kv_block_ids=(1, 2), kv_have_blocks=5), "more blocks"),
    (P.PrefillLeg, GRANT | dict(kv_to_address=""), "kv_to_address"),
    (P.PrefillLeg, GRANT | dict(replica_to="d2", replica_ticket="ab"), "replica_address"),
    (P.PrefillLeg, GRANT | dict(prompt_token_ids=tuple(range(32)), kv_have_blocks=1, replica_to="d2",
                                replica_address="b", replica_ticket="ab"), "from block 0"),
    (P.PrefillLeg, GRANT | dict(replica_to="d1", replica_address="a", replica_ticket="ab"), "to another node"),
    (P.ResumeRequest, dict(output_token_ids=()), "output_token_ids"),
    (P.ResumeRequest, dict(output_token_ids=(3, -1)), ">= 0"),
])
def test_leg_request_validation(cls, bad, match):
    fields = dict(request_id="r", prompt_token_ids=(1,)) | bad
    with pytest.raises(ValueError, match=match):
        cls(**fields)


@pytest.mark.parametrize("type_, field_", [
    ("GenerateRequest", "prefill_node"), ("GenerateRequest", "kv_to_node"), ("GenerateRequest", "output_token_ids"),
    ("DecodeLeg", "kv_to_node"), ("PrefillLeg", "prefill_node"), ("ResumeRequest", "kv_transfer_id"),
])
def test_a_leg_carries_only_its_own_fields(type_, field_):
    body = dict(type=type_, v=P.PROTOCOL_VERSION, request_id="r", prompt_token_ids=[1]) | {field_: "x"}
    err = decode(orjson.dumps(body), [])
    assert isinstance(err, P.ProtocolError) and err.reason == "unknown_field", err


def test_a_leg_of_a_request_keeps_its_common_fields():
    plain = P.GenerateRequest(id="r", request_id="r", prompt_token_ids=(1, 2), deadline=2e9,
                              sampling={"max_tokens": 3}, replica_to="n2", replica_address="a", replica_ticket="ab")
    leg = P.ResumeRequest.of(plain, id="r.r1", output_token_ids=(7,))
    assert isinstance(leg, P.LegRequest) and (leg.id, leg.output_token_ids) == ("r.r1", (7,))
    assert (leg.request_id, leg.prompt_token_ids, leg.deadline, leg.sampling, leg.replica_to) == \
        (plain.request_id, plain.prompt_token_ids, plain.deadline, plain.sampling, plain.replica_to)
    assert "LegRequest" not in MESSAGE_TYPES          # a base, not a message of its own


V = P.PROTOCOL_VERSION


def h(**body) -> bytes:
    return orjson.dumps(body)


KV = dict(type="KVData", v=V, transfer_id="t")
F32x4 = [{"dtype": "float32", "shape": [4]}]


@pytest.mark.parametrize("header, frames, reason", [
    (b"\x00\x01", [], "bad_json"),
    (b"[]", [], "not_object"),
    (h(type="Abort", request_id="r"), [], "bad_version"),
    (h(type="Abort", v=V - 1, request_id="r"), [], "bad_version"),     # an older build
    (h(type="Abort", v=V + 1, request_id="r"), [], "bad_version"),
    (h(type="Abort", v=True, request_id="r"), [], "bad_version"),
    (h(type="Pickle", v=V), [], "unknown_type"),
    (h(type=["Abort"], v=V), [], "unknown_type"),
    (h(type="Abort", v=V), [], "missing_field"),
    (h(type="Abort", v=V, request_id="r", extra=1), [], "unknown_field"),
    (h(type="Abort", v=V, request_id=5), [], "invalid_field"),
    (h(type="Abort", v=V, request_id="r"), [b"x"], "unexpected_frames"),
    (h(**KV, frames=F32x4), [], "frame_mismatch"),
    (h(**KV, frames="nope"), [b""], "frame_mismatch"),
    (h(**KV, frames=[{"dtype": "float32"}]), [b""], "frame_mismatch"),
    (h(**KV, frames=[{"dtype": "object", "shape": [1]}]), [b"x"], "bad_dtype"),
    (h(**KV, frames=[{"dtype": "float32", "shape": [-1]}]), [b""], "bad_shape"),
    (h(**KV, frames=[{"dtype": "float32", "shape": [1.5]}]), [b""], "bad_shape"),
    (h(**KV, frames=[{"dtype": "float32", "shape": [1] * 9}]), [b"abcd"], "bad_shape"),
    (h(**KV, frames=F32x4), [b"x" * 15], "size_mismatch"),
    (h(**KV, frames=F32x4), [12345], "bad_frame"),
    (h(**KV, frames=[{"dtype": "uint8", "shape": [1 << 40]}]), [b""], "frame_too_large"),
])
def test_bad_messages_are_error_values(header, frames, reason):
    result = decode(header, frames)
    assert isinstance(result, ProtocolError) and result.reason == reason, result
    assert result.reason in REASONS


@pytest.mark.parametrize("shape", [[True, 2], [1.0, 2], [1, 2.0]])
def test_a_remembered_descriptor_does_not_admit_look_alike_shapes(shape):
    """Valid descriptors are remembered (the pieces of a KV transfer share
    one); a shape that compares and hashes equal to a remembered one but is
    not made of ints is still refused."""
    good = decode(h(**KV, frames=[{"dtype": "float32", "shape": [1, 2]}]), [b"x" * 8])
    assert not isinstance(good, ProtocolError) and good.tensors[0].shape == (1, 2)
    bad = decode(h(**KV, frames=[{"dtype": "float32", "shape": shape}]), [b"x" * 8])
    assert isinstance(bad, ProtocolError) and bad.reason == "bad_shape", bad
    ndim = decode(h(**KV, frames=[{"dtype": "float32", "shape": [1, 2]}]), [b"x" * 8],
                  ProtocolLimits(max_ndim=1))          # a stricter limit applies to it as well
    assert isinstance(ndim, ProtocolError) and ndim.reason == "bad_shape"


def test_limits_are_configurable():
    assert decode(b" " * 101, [], ProtocolLimits(max_header_bytes=100)).reason == "header_too_large"
    limits = ProtocolLimits(max_frames=2, max_frame_bytes=8)
    frames_3 = h(**KV, frames=[{"dtype": "uint8", "shape": [1]}] * 3)
    assert decode(frames_3, [b"a"] * 3, limits).reason == "too_many_frames"
    big = h(**KV, frames=[{"dtype": "uint8", "shape": [9]}])
    assert decode(big, [b"a" * 9], limits).reason == "frame_too_large"
    total = ProtocolLimits(max_total_frame_bytes=10)
    two = h(**KV, frames=[{"dtype": "uint8", "shape": [6]}] * 2)
    assert decode(two, [b"a" * 6] * 2, total).reason == "frame_too_large"


def test_error_keeps_type_and_id_for_the_reply():
    result = decode(h(type="Abort", v=V, id="q-9"), [])
    assert (result.reason, result.type, result.id) == ("missing_field", "Abort", "q-9")


def test_expired():
    assert P.Abort(request_id="r", deadline=1.0).expired()
    assert not P.Abort(request_id="r").expired()


# ─── property: nothing raises, every bad message is a reasoned error ─────────

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
field_names = st.sampled_from(sorted({f for m in EXAMPLES for f in orjson.loads(encode(m)[0])}))
descriptor = st.fixed_dictionaries({"dtype": st.sampled_from([*DTYPES, "object", 3]),
                                    "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values})


@st.composite
def mutated_messages(draw):
    """A valid message, then damaged: fields replaced, dropped, frames and bytes mangled."""
    header, frames = encode(draw(st.sampled_from(EXAMPLES)))
    body = orjson.loads(header)
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["set", "drop", "frames"]))
        if action == "set":
            body[draw(field_names)] = draw(json_values)
        elif action == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body["frames"] = draw(st.lists(descriptor, max_size=3))
    raw = orjson.dumps(body)
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))]  # truncated
    frames = [bytes(f) for f in frames]
    if draw(st.booleans()):
        frames = draw(st.lists(st.binary(max_size=64), max_size=3))
    return raw, frames


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_messages())
def test_decode_never_raises_on_damaged_messages(case):
    header, frames = case
    result = decode(header, frames)
    if isinstance(result, ProtocolError):
        assert result.reason in REASONS and result.reason != "internal", result
    else:
        assert type(result).TYPE in MESSAGE_TYPES
        # a message that decodes re-encodes to the same meaning
        again = decode(*encode(result))
        assert not isinstance(again, ProtocolError)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256), st.lists(st.binary(max_size=32) | st.integers() | st.none(), max_size=4))
def test_decode_never_raises_on_garbage(header, frames):
    result = decode(header, frames)
    assert isinstance(result, ProtocolError) and result.reason in REASONS
    assert result.reason != "internal", result


def test_floats_on_the_wire_stay_finite():
    assert math.isinf(float("inf"))
    with pytest.raises(ValueError):
        P.Heartbeat(node="n", seq=0, load=float("inf"), running=0, waiting=0, free_blocks={})


def test_tier_names_are_the_engines():
    from engine.memory.mempool import TIERS as ENGINE_TIERS
    assert P.TIERS == ENGINE_TIERS == ("device", "host")
    hello = dict(type="Hello", v=V, node="n", address="zmq+tcp://127.0.0.1:1", block_size=16)
    assert isinstance(decode(h(**hello, blocks_per_tier={"device": 4, "host": 8}), []), P.Hello)
    for wire_name in ("gpu", "cpu", "disk"):   # the old wire names are refused, not mapped
        err = decode(h(**hello, blocks_per_tier={wire_name: 4}), [])
        assert isinstance(err, P.ProtocolError) and err.reason == "invalid_field" and "tiers must be in" in err.detail
        beat = dict(type="Heartbeat", v=V, node="n", seq=1, load=0.0, running=0, waiting=0)
        err = decode(h(**beat, free_blocks={wire_name: 1}), [])
        assert isinstance(err, P.ProtocolError) and err.reason == "invalid_field"


@pytest.mark.parametrize("type_, field_", [
    ("Heartbeat", "cached_prefixes"), ("Heartbeat", "replicated"),
    ("KVTransferRequest", "purpose"), ("Hello", "capabilities"),
])
def test_fields_nothing_used_are_gone(type_, field_):
    # they were never read; a peer that still sends one is told so
    assert field_ not in P.MESSAGE_TYPES[type_]._FIELDS


@pytest.mark.parametrize("bad, match", [
    (dict(owner="n1"), "owner is another node"),
    (dict(adopt={"r": "n1"}), "adopt maps"),
    (dict(adopt={"": "p1"}), "adopt maps"),
    (dict(adopt={"r": ""}), "adopt maps"),
    (dict(owner="d1", adopt={"r": "p1"}), "either writes for an owner or adopts"),
])
def test_replica_data_owner_and_adopt_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        P.ReplicaData(**(dict(source="n1", block_size=16) | bad))


@pytest.mark.parametrize("bad, match", [
    (dict(status="maybe"), "status"),
    (dict(status="done"), "first_token"),
    (dict(status="failed", cached_tokens=-1), "cached_tokens"),
])
def test_kv_commit_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        P.KVCommit(**(dict(transfer_id="t", request_id="r") | bad))


def test_roles_and_legs_are_checked():
    with pytest.raises(ValueError, match="role"):
        P.Hello(node="n", address="a", role="both", blocks_per_tier={}, block_size=16)
    with pytest.raises(ValueError, match="leg"):
        P.Abort(request_id="r", leg="decode")


@pytest.mark.parametrize("bad, match", [
    (dict(token_ids=(1, 2), text="ab", text_ends=(2,)), "one end per token"),
    (dict(token_ids=(1, 2), text="ab", text_ends=(2, 1)), "non-decreasing"),
    (dict(token_ids=(1,), text="ab", text_ends=(-1,)), "non-decreasing"),
    (dict(token_ids=(1, 2), text="ab", text_ends=(1, 3)), "end at len"),
    (dict(token_ids=(), text="ab", text_ends=()), "end at len"),
])
def test_token_chunk_text_ends_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        P.TokenChunk(**(dict(request_id="r", start_index=0) | bad))


def test_a_message_over_the_limits_is_refused_by_its_sender_and_a_reply_becomes_an_error():
    """What ``decode`` would drop unread (so that nobody could tell whose request it
    was) never leaves: ``encode`` raises, and a reply too large to send answers its
    request with an Error instead."""
    from kvd.wire import CODE_TOO_LARGE, MessageTooLarge, encode, encode_reply
    chunk = P.TokenChunk(request_id="r", start_index=0, token_ids=(1,), text="x" * 200, text_ends=(200,))
    limits = ProtocolLimits(max_header_bytes=250)
    with pytest.raises(MessageTooLarge, match="250-byte limit"):
        encode(chunk, limits)
    header, _ = encode_reply(chunk, limits)
    err = decode(header, [])
    assert isinstance(err, P.Error) and err.code == CODE_TOO_LARGE and err.request_id == "r"
    kv = decode(h(**KV, frames=[{"dtype": "uint8", "shape": [9]}]), [b"a" * 9])
    for small in (ProtocolLimits(max_frame_bytes=8), ProtocolLimits(max_total_frame_bytes=8)):
        with pytest.raises(MessageTooLarge, match="frames"):
            encode(kv, small)
    assert decode(*encode(kv)) == kv                  # within the default limits: sent as it is


async def test_a_chunk_too_large_for_the_wire_ends_its_request_with_an_error_at_once():
    """A node whose next TokenChunk cannot travel (its peer would drop it unread and
    the request would wait for ever) sends an Error for the request instead."""
    from engine.request import RequestOutput, TokenLogprobs
    from kvd.cluster_config import ClusterConfig
    from kvd.node.legs import Legs

    sent = []

    async def send(peer, msg):
        sent.append(decode(*P.encode(msg)))       # the real encoding, as the node's link does

    async def outputs():
        huge = [TokenLogprobs(7, -1.0, ((7, -1.0),) * 20)] * 6000           # ~1.8 MB of JSON
        yield RequestOutput("r", [5], "a", False, num_prompt_tokens=6001, num_output_tokens=1, text_ends=[1],
                            prompt_logprobs=huge)
        raise AssertionError("the stream goes on after a chunk that could not be sent")

    lost = []
    legs = Legs("n1", ClusterConfig(), None, send=send, answer=None, report_lost=lost.append, peers=None, inbox=None,
                replicator=None)
    await legs.pipe("r", b"peer", outputs())
    assert [type(m).__name__ for m in sent] == ["Error"] and not lost
    assert sent[0].request_id == "r" and sent[0].code == P.CODE_TOO_LARGE and "limit" in sent[0].message


@pytest.mark.parametrize("build", [
    lambda: P.BorrowRequest(debtor="", blocks=1), lambda: P.BorrowRequest(debtor="a", blocks=0),
    lambda: P.BorrowReply(ok=True), lambda: P.BorrowReply(ok=False, loan_id="x"),
    lambda: P.BorrowReply(ok=True, loan_id="x", blocks=0, lease_s=1.0),
    lambda: P.LeaseRenew(debtor="a", loan_ids=("",)), lambda: P.CreditorQuery(node="a", blocks=-1),
    lambda: P.Creditors(candidates=("a",)), lambda: P.Creditors(candidates=tuple("abcd"), addresses=tuple("abcd")),
    lambda: P.LoanWrite(debtor="a", loan_id="x", layer_start=0, layer_end=2, tensors=(torch.zeros(1, 2, 1, 4, 1, 4),)),
    lambda: P.LoanWrite(debtor="a", loan_id="x", layer_start=1, layer_end=1),
    lambda: P.Heartbeat(node="a", seq=1, load=0, running=0, waiting=0, free_blocks={}, lent={"b": -1}),
])
def test_lending_messages_refuse_bad_fields(build):
    with pytest.raises((ValueError, TypeError)):
        build()
