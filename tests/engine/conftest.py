"""Shared engine fixtures: tiny random models (fast) and the real SmolLM2 (slow)."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine, build_model
from engine.model.registry import resolve_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_source():
    return resolve_model("tiny:7")


@pytest.fixture(scope="session")
def tiny_weights(tiny_source):
    return tiny_source.load_weights()


@pytest.fixture(scope="session")
def tokenizer(tiny_source):
    return tiny_source.load_tokenizer()


@pytest.fixture(scope="session")
def smollm2_source():
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_weights(smollm2_source):
    return smollm2_source.load_weights()


def build_engine(weights, tokenizer, name="tiny", **overrides) -> LLMEngine:
    """An engine over already-loaded weights (loading once per session keeps tests fast),
    its model built as ``LLMEngine.from_config`` builds it (``build_model``: an fp32 model
    decodes on the plan executor unless ``decode_kernel = "torch"``)."""
    defaults = dict(model=name, dtype="float32", kv_blocks=256, host_kv_blocks=256, max_num_seqs=32)
    defaults.update(overrides)
    cfg = EngineConfig(**defaults)
    return LLMEngine(cfg, build_model(cfg, weights), tokenizer, name)


@pytest.fixture
def make_tiny(tiny_weights, tokenizer):
    def make(**overrides) -> LLMEngine:
        return build_engine(tiny_weights, tokenizer, **overrides)
    return make
