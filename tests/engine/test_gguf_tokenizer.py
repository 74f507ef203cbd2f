"""Tokenizers and chat templates built from GGUF metadata, against transformers on the same files.

Files: the real Gemma 3 270M (``gemma3-270m``, SentencePiece-style, no chat
template), and small tokenizer-only GGUFs written here with real vocabularies:
SmolLM2's byte-level BPE labelled ``llama-bpe`` (Llama 3) and ``qwen2`` (with a
Qwen 3-style template), and a slice of Gemma's SentencePiece vocabulary labelled
``llama`` (Llama 2 / Mistral style, merges rebuilt from scores), ``phi3`` and
``gemma3``.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import jinja2
import pytest

from engine.model import chat_formats
from engine.model.gguf_meta import read_metadata
from engine.model.gguf_tokenizer import merges_from_vocab
from engine.model.registry import bundled_gguf_path, resolve_model
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")
os.environ.setdefault("TQDM_DISABLE", "1")

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "  two leading spaces and trailing   ",
    " one leading space",
    "tabs\tand\nnewlines\r\n\n\nmany\n\n\n\n\n",
    "numbers 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000 ٣٤٥",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "Ünïcödé àccents ñ ß Ωμέγα Привет мир",
    "def f(x):\n    return x ** 2  # square\n",
    "don't won't I'm you're we've they'll she'd",
    "mixed\u00a0nbsp\u2003emspace\u200bzero-width",
    "repeated!!!!!!!!!!!!???????......      ",
    "\x00control\x07chars\x1b[0m",
    "a" * 120,
]
# control tokens written in text, per vocabulary
SPECIAL_TEXTS = {
    "smollm": ["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
               "special <|endoftext|> in the middle<|im_end|>x"],
    "gemma": ["<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
              "<bos>text<eos> and <pad> <unused0> [multimodal]"],
}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    "multi": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "  Tell me a joke 😀  "}],
    "system_multi": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHey."},
                     {"role": "user", "content": "中文?"}],
}

# Qwen 3's template shape: a namespace walked over the reversed messages, the
# system turn, reasoning split out of earlier assistant turns, enable_thinking,
# and raise_exception for a role it does not know.
QWEN3_STYLE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def write_tokenizer_gguf(path: Path, arch: str, meta: dict) -> Path:
    """A GGUF holding ``meta``'s tokenizer keys and a small ``arch`` header, no tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"test {arch}")
    for key, value in (("context_length", 4096), ("embedding_length", 64), ("block_count", 1),
                       ("feed_forward_length", 128), ("attention.head_count", 2),
                       ("attention.head_count_kv", 1), ("attention.key_length", 32),
                       ("attention.value_length", 32)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("unknown_token_id", w.add_unk_token_id), ("padding_token_id", w.add_pad_token_id),
                     ("add_bos_token", w.add_add_bos_token), ("add_eos_token", w.add_add_eos_token)):
        if f"tokenizer.ggml.{key}" in meta:
            add(meta[f"tokenizer.ggml.{key}"])
    if meta.get("tokenizer.chat_template"):
        w.add_chat_template(meta["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokenizer_meta(path: Path) -> dict:
    return {k: v for k, v in read_metadata(path).items() if k.startswith("tokenizer.")}


def gemma_slice(meta: dict, keep: int = 3000) -> dict:
    """The first ``keep`` tokens of Gemma's vocabulary plus its 256 byte tokens,
    with scores, types and special ids carried over."""
    types = meta["tokenizer.ggml.token_type"]
    index = [i for i, t in enumerate(types) if i < keep or t == 6]
    new_id = {old: new for new, old in enumerate(index)}
    out = {k: v for k, v in meta.items() if not k.endswith("_token_id")}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        out[key] = [meta[key][i] for i in index]
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        out[f"tokenizer.ggml.{key}"] = new_id[meta[f"tokenizer.ggml.{key}"]]
    return out


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return resolve_model("gemma3-270m").weights_path


@pytest.fixture(scope="module")
def files(tmp_path_factory, gemma_path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf_tok")
    smollm = tokenizer_meta(bundled_gguf_path())
    gemma = gemma_slice(tokenizer_meta(gemma_path))
    return {
        "llama-bpe": write_tokenizer_gguf(d / "llama-bpe.gguf", "llama", {
            **smollm, "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": True}),
        "qwen2": write_tokenizer_gguf(d / "qwen2.gguf", "qwen2", {
            **smollm, "tokenizer.ggml.pre": "qwen2", "tokenizer.chat_template": QWEN3_STYLE}),
        "sentencepiece-llama": write_tokenizer_gguf(d / "sp-llama.gguf", "llama", {
            **gemma, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}),
        "sentencepiece-phi3": write_tokenizer_gguf(d / "sp-phi3.gguf", "phi3", gemma),
        "sentencepiece-gemma3": write_tokenizer_gguf(d / "sp-gemma3.gguf", "gemma3", gemma),
    }


def hf_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def pairs(files) -> dict[str, tuple[Tokenizer, object]]:
    return {name: (Tokenizer.from_gguf(path), hf_tokenizer(path)) for name, path in files.items()}


@pytest.fixture(scope="module")
def gemma(gemma_path) -> tuple[Tokenizer, object]:
    return resolve_model("gemma3-270m").load_tokenizer(), hf_tokenizer(gemma_path)


def check_same_ids(ours: Tokenizer, hf, texts: list[str]) -> None:
    for text in texts:
        for add_special in (False, True):
            want = hf.encode(text, add_special_tokens=add_special)
            assert ours.encode(text, add_special_tokens=add_special) == want, (text, add_special)
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


# ------------------------------------------------------------------ encode parity
@pytest.mark.parametrize("name", ["llama-bpe", "qwen2"])
def test_byte_level_files_match_transformers(pairs, name):
    ours, hf = pairs[name]
    check_same_ids(ours, hf, TEXTS + SPECIAL_TEXTS["smollm"])


@pytest.mark.parametrize("name", ["sentencepiece-llama", "sentencepiece-phi3", "sentencepiece-gemma3"])
def test_sentencepiece_files_match_transformers(pairs, name):
    ours, hf = pairs[name]
    check_same_ids(ours, hf, TEXTS + SPECIAL_TEXTS["gemma"])


def test_gemma3_file_matches_transformers(gemma):
    ours, hf = gemma
    check_same_ids(ours, hf, TEXTS + SPECIAL_TEXTS["gemma"])
    assert ours.vocab_size == len(hf) == 262144


def test_gemma3_special_tokens_bos_and_end_of_turn(gemma):
    ours, _ = gemma
    assert ours.bos_token_id == 2
    assert ours.eos_token_ids == (1, ours.token_to_id("<end_of_turn>")) == (1, 106)
    assert ours.encode("hi", add_special_tokens=True) == [2] + ours.encode("hi")     # add_bos_token
    assert ours.encode("<start_of_turn>") == [105]                                   # matched whole
    assert ours.token_bytes[0][105] == b"<start_of_turn>" and 105 in ours.token_bytes[1]   # a special id, skipped


def test_pre_tokenizer_regexes_split_as_named(pairs):
    """The three byte-level splits are really in effect: GPT-2's regex keeps a
    digit run together, Llama 3's cuts it every three digits, Qwen 2's into
    single digits."""
    smollm = Tokenizer.from_gguf(bundled_gguf_path())
    llama3, qwen2 = pairs["llama-bpe"][0], pairs["qwen2"][0]

    def split(tok: Tokenizer, text: str) -> list[str]:
        return [piece for piece, _ in tok._backend.pre_tokenizer.pre_tokenize_str(text)]

    assert split(smollm, "x 1234567") == ["x", "Ġ1234567"]
    assert split(llama3, "x 1234567") == ["x", "Ġ", "123", "456", "7"]
    assert split(qwen2, "x 1234567") == ["x", "Ġ", *"1234567"]


def test_add_bos_and_add_eos_follow_the_file(pairs):
    sp, _ = pairs["sentencepiece-llama"]
    ids = sp.encode("hello", add_special_tokens=True)
    assert ids[0] == sp.bos_token_id and ids[-1] == sp.eos_token_ids[0]
    phi3, _ = pairs["sentencepiece-phi3"]      # no add_bos key: SentencePiece adds BOS, as llama.cpp
    assert phi3.encode("hello", add_special_tokens=True)[0] == phi3.bos_token_id
    qwen, _ = pairs["qwen2"]                   # byte-level without the key: no BOS
    assert qwen.encode("hello", add_special_tokens=True) == qwen.encode("hello")


@pytest.mark.parametrize("name", ["sentencepiece-llama", "sentencepiece-gemma3"])
def test_incremental_detokenizer_on_sentencepiece(pairs, name):
    ours, _ = pairs[name]
    for text in TEXTS:
        ids = ours.encode(text)
        detok = IncrementalDetokenizer(ours)
        streamed = "".join(detok.push(i) for i in ids) + detok.flush()
        assert streamed == ours.decode(ids), text


def test_merges_from_vocab_orders_by_score_then_longer_left_piece():
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4}
    scores = {"a": 0.0, "b": 0.0, "ab": -1.0, "abb": -2.0, "bb": -1.0}
    assert merges_from_vocab(vocab, scores) == [("a", "b"), ("b", "b"), ("ab", "b"), ("a", "bb")]


def test_unsupported_tokenizer_model_is_refused(tmp_path, gemma_path):
    meta = {**gemma_slice(tokenizer_meta(gemma_path), keep=50), "tokenizer.ggml.model": "t5"}
    path = write_tokenizer_gguf(tmp_path / "t5.gguf", "llama", meta)
    with pytest.raises(ValueError, match="tokenizer.ggml.model='t5' is not supported"):
        Tokenizer.from_gguf(path)


# ------------------------------------------------------------------ chat templates
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_style_template_from_the_file_matches_transformers(pairs, conversation, add_generation_prompt):
    ours, hf = pairs["qwen2"]
    assert ours.chat_template == QWEN3_STYLE == hf.chat_template
    messages = CONVERSATIONS[conversation]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                  enable_thinking=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                    enable_thinking=False) == want


def test_qwen_style_template_raises_as_transformers(pairs):
    ours, hf = pairs["qwen2"]
    bad = [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}]
    with pytest.raises(jinja2.TemplateError, match="Unexpected message role: narrator"):
        ours.apply_chat_template(bad)
    with pytest.raises(Exception, match="Unexpected message role: narrator"):
        hf.apply_chat_template(bad, tokenize=False)


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_gemma3_file_without_template_gets_gemma_turns_as_transformers_renders_them(gemma, conversation):
    ours, hf = gemma
    assert read_metadata(resolve_model("gemma3-270m").weights_path).get("tokenizer.chat_template") is None
    assert ours.chat_template == chat_formats.GEMMA
    messages = CONVERSATIONS[conversation]
    for add in (True, False):
        want = hf.apply_chat_template(messages, chat_template=chat_formats.GEMMA, tokenize=False,
                                      add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == want


def test_gemma3_turn_format_is_llama_cpps(gemma):
    """llama.cpp's built-in gemma format: the system message opens the first user turn."""
    ours, _ = gemma
    assert ours.apply_chat_template(CONVERSATIONS["system"]) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    assert ours.apply_chat_template(CONVERSATIONS["multi"], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nTell me a joke 😀<end_of_turn>\n")
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])
    prompt = ours.apply_chat_template(CONVERSATIONS["single"])
    assert ours.encode(prompt)[:2] == [2, 105]         # one BOS, written by the template


def test_a_fallback_template_is_logged_once_per_build(files, caplog):
    caplog.set_level("INFO", logger="engine.model.tokenizer")
    Tokenizer.from_gguf(files["sentencepiece-gemma3"])
    Tokenizer.from_gguf(files["qwen2"])                     # has its own: nothing said
    assert [r.getMessage() for r in caplog.records] == [
        "sp-gemma3.gguf has no chat template; using the gemma3 turn format"]


@pytest.mark.parametrize("arch, vocabulary_token, expected", [
    ("qwen3", None, chat_formats.CHATML), ("phi3", None, chat_formats.PHI3),
    ("llama", "<|start_header_id|>", chat_formats.LLAMA3), ("llama", "<|im_start|>", chat_formats.CHATML),
    ("llama", None, None), ("mamba", None, None)])
def test_standard_template_by_architecture(arch, vocabulary_token, expected):
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models

    vocab = {"a": 0, **({vocabulary_token: 1} if vocabulary_token else {})}
    assert chat_formats.standard_template(arch, BackendTokenizer(models.WordLevel(vocab, "a"))) == expected


@pytest.mark.parametrize("template", [chat_formats.CHATML, chat_formats.LLAMA3, chat_formats.PHI3])
def test_standard_templates_render_as_transformers(pairs, template):
    ours, hf = pairs["qwen2"]
    fallback = Tokenizer(ours._backend, bos_token_id=None, eos_token_ids=(), chat_template=template,
                         special_tokens={"bos_token": hf.bos_token, "eos_token": hf.eos_token})
    for messages in CONVERSATIONS.values():
        want = hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
        assert fallback.apply_chat_template(messages) == want


def test_gemma_decodes_by_joining_bytes_so_structured_output_runs_on_its_vocabulary(gemma):
    """Gemma's SentencePiece decoder (▁ -> space, byte fallback, fuse) is joining each
    token's bytes: the streaming detokenizer takes the byte path, and a JSON schema
    compiles over the vocabulary and accepts the tokens of a document it allows."""
    import torch

    from engine.structured.grammar import GrammarCompiler
    from engine.structured.masks import MaskComputer
    from engine.structured.spec import StructuredOutput

    ours, _ = gemma
    table, special = ours.token_bytes
    assert table[ours.token_to_id("<0x41>")] == b"A" and table[ours.token_to_id("\u2581the")] == b" the"
    assert ours.bos_token_id in special
    text = '{"name": "Åsa 日本", "tags": ["a b", "c"], "score": -12.5}'
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == ours.decode(ids) == text
    schema = {"type": "object", "required": ["name", "tags", "score"],
              "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                             "score": {"type": "number"}}}
    compiler = GrammarCompiler(ours)
    state = compiler.start(StructuredOutput.json_schema(schema))
    masks = MaskComputer(compiler.vocab_size, overlap=False)
    # spell a compact document through the masks: each step the longest allowed token that
    # continues it (the grammar picks the tokenization of the text it forces)
    rest = '{"name":"Åsa 日本","tags":["a b","c"],"score":-12.5}'.encode()     # the schema's key order
    while rest:
        logits = torch.zeros(1, compiler.vocab_size)
        assert masks.start([state]).apply(logits) == []
        allowed = torch.nonzero(logits[0] == 0.0)[:, 0].tolist()
        tok = max((t for t in allowed if t < len(table) and table[t] and rest.startswith(table[t])),
                  key=lambda t: len(table[t]))
        assert state.accept(tok)
        rest = rest[len(table[tok]):]
    assert state.complete
