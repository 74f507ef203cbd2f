"""A sliding-window architecture over real daemons: a random gemma3 GGUF (window
of 8 keys on 6 of its 7 layers) served 1P1D, the prompt's KV streamed layer by
layer from the prefill node to the decode node, and on a replicating ring whose
busiest node is killed mid-stream. Greedy and seeded tokens equal the plain
single-node engine's on the same file, after a recovery too (the engine computes
this model with one arithmetic per token: sliding layers included), for prompts and
outputs that run far past the window."""

from __future__ import annotations

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from tools.random_gguf import write_architecture

from . import test_recovery
from .conftest import Cluster
from .test_disagg import ROLES, node_status, prompt, wait_idle
from .test_recovery import NODES, ON, decoding, kill_the_busiest_and_resume, start

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3") / "gemma3-tiny.gguf"
    write_architecture("gemma3", path, "Q8_0")
    return path


@pytest.fixture(scope="module")
def pd(tmp_path_factory, gemma3_file):
    model = ("--model", str(gemma3_file))
    c = Cluster(tmp_path_factory.mktemp("pd-gemma3"), "zmq+tcp", extra=("--prefill-queue-factor", "0", *model))
    for name, role in ROLES.items():
        c.start_node(name, "--role", role, "--prefill-threshold", "0", "--kv-transfer-timeout", "10", *model)
    c.wait_nodes(sorted(ROLES))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(gemma3_file):
    return LLMEngine.from_config(EngineConfig(model=str(gemma3_file), dtype="float32", block_size=16,
                                              kv_blocks=256, host_kv_blocks=0, num_threads=1))


@pytest.mark.parametrize("seed", [None, 77], ids=["greedy", "seeded"])
def test_1p1d_sliding_window_tokens_equal_the_single_node_engine(pd, reference, seed):
    assert reference.model.config.sliding_window == 8
    client = pd.client(timeout=120)
    served = client.models.list().data[0].id
    temperature = 0.0 if seed is None else 0.9
    for i, n in enumerate((5, 40, 100)):
        ids = prompt(i, n)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, ignore_eos=True)
        want = reference.generate([ids], params)[0]
        out = client.completions.create(model=served, prompt=ids, max_tokens=MAX_TOKENS, temperature=temperature,
                                        seed=seed, extra_body={"ignore_eos": True})
        assert out.choices[0].text == reference.tokenizer.decode(want), (n, seed)
    assert node_status(pd, "d1")["disaggregation"]["decode"]["remote"] >= 3      # decoded on d1, not p1
    wait_idle(pd, ROLES)


@pytest.fixture(scope="module")
def ring(tmp_path_factory, gemma3_file):
    c = start(tmp_path_factory.mktemp("ring-gemma3"), "zmq+tcp", extra=(*ON, "--model", str(gemma3_file)))
    yield c
    c.stop()


def test_kill9_mid_stream_resumes_past_the_window_with_the_uninterrupted_text(ring, gemma3_file, monkeypatch):
    reference = LLMEngine.from_config(EngineConfig(model=str(gemma3_file), dtype="float32", block_size=16,
                                                   kv_blocks=512, host_kv_blocks=0, max_model_len=2048,
                                                   num_threads=1))
    # check_texts then holds the seeded streams (odd ones) to the reference's text too
    assert reference.kernels()["same_bits"] == "yes" and reference.kernels()["decode"] != "torch"
    monkeypatch.setattr(test_recovery, "MODEL", ring.client().models.list().data[0].id)   # Streams' model
    kill_the_busiest_and_resume(ring, decoding(ring, 4, seed0=0), reference, NODES, 64)
