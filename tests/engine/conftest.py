"""Shared engine fixtures: tiny random models (fast) and the real SmolLM2 (slow)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine, build_model
from engine.model.registry import resolve_model

torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def one_gguf_parse_per_file():
    """transformers parses a GGUF with ``gguf.GGUFReader`` once for the config, again
    for the weights and again for a tokenizer: for Gemma 3's 262,144-token vocabulary
    each parse takes half a minute. The references here read each file version once per
    session: the reader is read-only (a read-only memory map and views of it), so
    sharing it changes no value transformers computes. Keyed by (path, mtime, size):
    a rewritten file is parsed again. The packaged models' files (over 64 MiB) stay for
    the session (transformers reads Gemma 3's in two modules); of the small files
    written by tests, the last two."""
    try:
        import gguf
    except ImportError:                     # nothing to share: the references skip without it
        yield
        return
    parse = gguf.GGUFReader

    @functools.lru_cache(maxsize=2)
    def parsed(path: str, mtime_ns: int, size: int):
        del mtime_ns, size                  # part of the cache key only
        return parse(path)

    packaged: dict[tuple[str, int, int], object] = {}

    def reader(path, mode="r"):
        if mode != "r":
            return parse(path, mode)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
        if st.st_size < 64 << 20:
            return parsed(*key)
        if key not in packaged:
            packaged[key] = parse(key[0])
        return packaged[key]

    gguf.GGUFReader = reader
    yield
    gguf.GGUFReader = parse
    parsed.cache_clear()
    packaged.clear()


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


# The fidelity prompts (tests/engine/test_fidelity.py and the tests that share its fixtures)
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "1, 1, 2, 3, 5, 8, 13,",
    "Les mathématiques sont",
    "Photosynthesis converts light energy into",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain on Earth?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]




@pytest.fixture(scope="session")
def prompts(smollm2_source):
    """The fidelity prompts as SmolLM2's token ids, chat-templated ones included."""
    tok = smollm2_source.load_tokenizer()
    ids = [tok.encode(p) for p in PLAIN]
    ids += [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in CHATS]
    assert len(ids) >= 8
    return ids


@pytest.fixture(scope="session")
def engine(smollm2_weights, smollm2_source):
    """SmolLM2 on the exact path (``weights = "dequantize"``, fp32), built once per session."""
    return build_engine(smollm2_weights, smollm2_source.load_tokenizer(), name="smollm2",
                        dtype="float32", kv_blocks=256, host_kv_blocks=0)


@pytest.fixture(scope="session")
def native_engine(smollm2_source):
    """SmolLM2 as served (weights = "native": the file's Q4_1 layers and Q8_0 embedding/LM
    head in their blocks), built once per session; its model keeps no state, so tests
    build engines of their own configs over ``native_engine.model``."""
    cfg = EngineConfig(model="smollm2", dtype="float32", kv_blocks=256, host_kv_blocks=0)
    model = build_model(cfg, smollm2_source.load_weights(quantized=True))
    assert model.quantized and model.lm_head.kernel is not None, "the host's quantized kernel did not load"
    return LLMEngine(cfg, model, smollm2_source.load_tokenizer(), "smollm2")


@pytest.fixture(scope="session")
def hf_model(smollm2_source):
    """transformers' float32 SmolLM2 read from the bundled GGUF: the fidelity reference,
    loaded once per session (reading the GGUF through transformers takes most of a minute)."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_source.weights_path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    return model.eval()


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
