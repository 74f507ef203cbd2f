"""The build fingerprint (engine/fingerprint.py) as a client sees it: every
response and stream chunk of ``kvd serve`` carries one ``system_fingerprint``,
the one a plain engine of the same build computes in another process; another
dtype or model is another fingerprint; a cluster of one build reads as that build."""

from __future__ import annotations

import re

from engine.engine import EngineConfig, LLMEngine
from engine.fingerprint import combine, engine_parts, fingerprint

from .test_sampling_http import client, engine  # noqa: F401 -- kvd serve's openai client, the engine

FORMAT = re.compile(r"fp_[0-9a-f]{16}")


def test_every_response_and_chunk_names_the_build_of_the_engine_that_computed_it(client, engine):
    kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    whole = client.completions.create(**kw).system_fingerprint
    chunks = [c.system_fingerprint for c in client.completions.create(stream=True, **kw)]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).system_fingerprint
    assert FORMAT.fullmatch(whole) and set(chunks) == {whole} and chat == whole
    assert engine.fingerprint == whole           # this process, another thread count: the same build


def test_what_changes_the_arithmetic_changes_the_fingerprint(engine):
    other = LLMEngine.from_config(EngineConfig(model="tiny", dtype="bfloat16", kv_blocks=64, max_model_len=128))
    assert other.fingerprint != engine.fingerprint
    seeded = LLMEngine.from_config(EngineConfig(model="tiny:1", dtype="float32", kv_blocks=64, max_model_len=128))
    assert seeded.fingerprint != engine.fingerprint            # another model
    parts = engine_parts(engine.kernels(), "tiny:0", None, "2.13.0", "g++")
    assert not any("threads" in k for k in parts)
    assert fingerprint(parts) == fingerprint(dict(reversed(list(parts.items()))))   # order-free


def test_a_cluster_of_one_build_reads_as_that_build():
    a, b = "fp_" + "a" * 16, "fp_" + "b" * 16
    assert combine([a, a, a]) == a
    mixed = combine([a, b])
    assert FORMAT.fullmatch(mixed) and mixed not in (a, b) and combine([b, a, b]) == mixed
