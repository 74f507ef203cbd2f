"""Gemma 3 270M (the ``gemma3-270m`` package's Q4_K_M file) in kvd vs transformers
loading the same GGUF, both fp32 on the exact path (every tensor dequantized):
logits within 1e-3 at every position of prompts longer than the 512-key
window of its sliding layers, and the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.model.registry import resolve_model
from engine.request import SamplingParams

from .conftest import build_engine
from .test_architectures import _hf_greedy
from .test_fidelity import all_logits

TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]


@pytest.fixture(scope="module")
def source():
    try:
        return resolve_model("gemma3-270m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def engine(source):
    return build_engine(source.load_weights(), source.load_tokenizer(), name="gemma3-270m", dtype="float32",
                        kv_blocks=128, host_kv_blocks=0)


@pytest.fixture(scope="module")
def hf_model(source):
    transformers = pytest.importorskip("transformers")
    path = source.weights_path
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(source, engine):
    """The texts after the file's BOS (Gemma is trained with it), and 600 tokens."""
    tok, bos = source.load_tokenizer(), engine.model.config.bos_token_id
    ids = [t if t[:1] == [bos] else [bos] + t for t in (tok.encode(t) for t in TEXTS)]
    gen = torch.Generator().manual_seed(0)        # and one past the window: 600 tokens of the vocabulary
    ids.append(ids[0][:1] + torch.randint(1000, 200000, (599,), generator=gen).tolist())
    return ids


def test_the_file_reads_as_gemma3(engine):
    cfg = engine.model.config
    assert (cfg.architecture, cfg.num_layers, cfg.sliding_window, cfg.head_dim) == ("gemma3", 18, 512, 256)
    assert [cfg.layer_window(i) is None for i in range(cfg.num_layers)].count(True) == 3


def test_logits_match_transformers(engine, hf_model, prompts):
    for ids in prompts:
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        worst = (all_logits(engine, ids) - ref).abs().max().item()
        assert worst <= 1e-3, f"{len(ids)} tokens: max |logit delta| {worst}"


def test_greedy_tokens_match_transformers(engine, hf_model, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, params) == [_hf_greedy(hf_model, ids, 16) for ids in prompts]
    engine.check_integrity()
