"""A ring's StepTemplate: a header that is the last checked RemoteAttend's bytes but for
its id and layer is that message with them (what protocol.decode gives); any other byte,
id or frame size is decoded in full."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvd import protocol
from kvd.node.step_template import StepTemplate


def attend(**change) -> protocol.RemoteAttend:
    fields = dict(id="a1b2c3", deadline=1795990000.25, debtor="n1", loan_id="loan-x", request_id="cmpl-1", lo=16,
                  layer=3, ctx=4096, first=4095,
                  tensors=(torch.randn(1, 9, 64), torch.randn(1, 3, 64), torch.randn(1, 3, 64)))
    return protocol.RemoteAttend(**{**fields, **change})


def wire(msg: protocol.Message) -> tuple[bytes, list[memoryview]]:
    header, frames = protocol.encode(msg)
    return header, [memoryview(bytes(f)) for f in frames]


def learnt(msg: protocol.RemoteAttend) -> StepTemplate:
    t = StepTemplate()
    t.learn(wire(msg)[0], msg)
    return t


@pytest.mark.parametrize("ident, layer", [("ffee0011", 0), ("x", 29), ("Z" * 64, 123456), ("a-b_c", 10)])
def test_another_id_and_layer_of_the_step_is_what_decode_gives(ident, layer):
    t = learnt(attend())
    header, frames = wire(attend(id=ident, layer=layer))
    got, want = t.match(header, frames), protocol.decode(header, frames)
    assert isinstance(want, protocol.RemoteAttend) and got is not None and t.hits == 1
    for f in dataclasses.fields(want):
        if f.name != "tensors":
            assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert [(a.dtype, a.shape, bytes(a.data)) for a in got.tensors] == \
        [(a.dtype, a.shape, bytes(a.data)) for a in want.tensors]


@pytest.mark.parametrize("change", [dict(ctx=4097), dict(first=4094), dict(deadline=1795990001.0),
                                    dict(loan_id="loan-y"), dict(lo=17), dict(debtor="n2"),
                                    dict(tensors=(torch.randn(2, 9, 64), torch.randn(1, 3, 64),
                                                  torch.randn(1, 3, 64)))])
def test_any_other_field_of_the_header_is_decoded_in_full(change):
    t = learnt(attend())
    assert t.match(*wire(attend(id="b2", **change))) is None and t.hits == 0


def test_bytes_that_only_look_like_the_step_are_decoded_in_full():
    t = learnt(attend())
    header, frames = wire(attend(id="b2", layer=7))
    for forged in (header.replace(b'"layer":7', b'"layer":07'),          # not JSON's decimal
                   header.replace(b'"layer":7', b'"layer":-7'),
                   header.replace(b'"id":"b2"', b'"id":"b\\u0032"'),      # an escape: the id is decoded
                   header.replace(b'"id":"b2"', b'"id":"' + b"a" * 65 + b'"'),
                   header + b" ", header[:-1] + b',"x":1}'):
        assert t.match(forged, frames) is None
    assert t.match(header, frames[:2]) is None                          # a frame missing
    assert t.match(header, [frames[0], memoryview(bytes(frames[1])[:-4]), frames[2]]) is None
    assert t.match(header, frames) is not None


def test_no_pattern_before_a_message_nor_for_an_id_it_cannot_hold():
    assert StepTemplate().match(*wire(attend())) is None
    odd = attend(id='q"uote')
    t = learnt(odd)
    assert t.match(*wire(attend(id='q"uote', layer=4))) is None
