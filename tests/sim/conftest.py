"""Simulator fixtures: a toy profile of this machine (no measuring), written as
``kvd profile`` writes one."""

from __future__ import annotations

import json

import pytest

from kvd.sim.profile_file import KIND, VERSION, this_cpu

TOY_COSTS = {"prefill_fixed_s": 0.004, "prefill_token_s": 2e-4, "prefill_attention_s": 1e-7,
             "decode_fixed_s": 0.003, "decode_seq_s": 2e-4, "decode_context_s": 1e-7,
             "swap_block_s": 1e-5, "transfer_latency_s": 2e-4, "transfer_byte_s": 1e-9}


def toy_profile_doc(**changes) -> dict:
    doc = {"kind": KIND, "version": VERSION, "model": "tiny", "cpu": this_cpu(), "threads": 2,
           "fingerprint": "fp_0000000000000000", "block_size": 16, "kv_bytes_per_token": 512,
           "num_layers": 4, "costs": dict(TOY_COSTS), "fit": {}, "samples": {}}
    doc.update(changes)
    return doc


@pytest.fixture
def write_profile(tmp_path):
    """``write_profile(**changes)``: the path of a toy profile with ``changes``."""
    def write(name: str = "toy.json", **changes):
        path = tmp_path / name
        path.write_text(json.dumps(toy_profile_doc(**changes)))
        return path
    return write


@pytest.fixture
def toy_profile(write_profile):
    return write_profile()
