"""Tokenizer: GGUF-built BPE vs transformers, chat templates, incremental detokenization."""

from __future__ import annotations

import os

import jinja2
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, decoders

from engine.model.registry import bundled_gguf_path, load_tokenizer
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "    leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\n\nmany",
    "numbers 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "Ünïcödé àccents ñ ß Ωμέγα Привет мир",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "special <|endoftext|> in the middle<|im_end|>x",
    "<|im_start|> not at start and <repo_name> <file_sep>",
    "don't won't I'm you're we've they'll she'd",
    "URL https://example.com/path?q=1&r=two#frag",
    "mixed\u00a0nbsp\u2003emspace\u200bzero-width",
    "repeated!!!!!!!!!!!!???????......",
    "CamelCaseIdentifiers and snake_case_names and SCREAMING_CASE",
    "math: ∑_{i=1}^{n} x_i² ≤ ∞ ∂f/∂x",
    "JSON {\"key\": [1, 2.5, null, true], \"s\": \"v\"}",
    "\x00control\x07chars\x1b[0m",
    "a" * 200,
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "system_single": [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "What is 2+2?"}],
    "multi": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me a joke 😀"}],
    "system_multi": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hey."}, {"role": "user", "content": "中文?"}],
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("TQDM_DISABLE", "1")
    path = bundled_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# ----------------------------------------------------------------------- basics
def test_smollm2_tokenizer_basics(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.has_chat_template
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")   # SmolLM2 adds no BOS


@pytest.mark.parametrize("text", [t for t in TEXTS if "<" not in t])
def test_decode_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_save_and_from_hf_dir_roundtrip(tok, tmp_path):
    again = Tokenizer.from_hf_dir(tok.save(tmp_path / "tok"))
    assert (again.vocab_size, again.bos_token_id, again.eos_token_ids) == (49152, 1, (2,))
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    messages = CONVERSATIONS["multi"]
    assert again.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_hf_dir_chat_template_file_and_eos_list(tok, tmp_path):
    d = tok.save(tmp_path / "tok")
    (d / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|im_end|>"}}')
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    (d / "generation_config.json").write_text('{"eos_token_id": [0, 2]}')
    again = Tokenizer.from_hf_dir(d)
    assert again.eos_token_ids == (2, 0)
    assert again.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_from_hf_dir_missing(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_from_gguf_missing(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "none.gguf")


# ---------------------------------------------------------------- chat template
def _byte_tokenizer(template: str | None) -> Tokenizer:
    backend = BackendTokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=template,
                     special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def test_chat_template_helpers_and_whitespace_control():
    template = ("{% if messages|length == 0 %}{{ raise_exception('empty') }}{% endif %}\n"
                "{% for m in messages %}\n"
                "    {{ bos_token }}{{ m | tojson }}\n"
                "{% endfor %}")
    t = _byte_tokenizer(template)
    # trim_blocks + lstrip_blocks remove the block lines; tojson does not HTML-escape.
    assert t.apply_chat_template([{"role": "user", "content": "<&>"}]) == \
        '    <s>{"role": "user", "content": "<&>"}\n'
    with pytest.raises(jinja2.TemplateError, match="empty"):
        t.apply_chat_template([])


def test_chat_template_is_sandboxed():
    t = _byte_tokenizer("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        t.apply_chat_template([])


def test_no_chat_template():
    t = _byte_tokenizer(None)
    assert not t.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_generation_tag_renders_body():
    t = _byte_tokenizer("{% for m in messages %}{% generation %}<{{ m['content'] }}>{% endgeneration %}{% endfor %}")
    assert t.apply_chat_template([{"role": "assistant", "content": "ok"}]) == "<ok>"


# ------------------------------------------------------- incremental detokenizer
@pytest.mark.parametrize("text", ["emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 done", "中文字符测试，日本語のテキスト",
                                  "plain ascii text", "mixé 中 😀 end", "🇫🇷🇫🇷🇫🇷"])
def test_incremental_detokenizer_equals_decode(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)   # never a half character on the wire
    assert len([p for p in pieces if p]) > 1        # it actually streamed


def test_incremental_detokenizer_holds_back_partial_utf8(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1   # byte-level BPE splits this emoji
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "😀"


def test_incremental_detokenizer_flushes_cut_character(tok):
    ids = tok.encode("ok 😀")[:-1]           # stream stopped mid-emoji
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in ids)
    assert streamed + detok.flush() == tok.decode(ids)
    assert detok.flush() == ""


def test_incremental_detokenizer_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nSure 😀<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out = "".join(detok.push(i) for i in ids) + detok.flush()
        assert out == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_random_ids(tok):
    import random
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok)
        out = "".join(detok.push(i) for i in ids) + detok.flush()
        assert out == tok.decode(ids)


def test_byte_table_detokenizer_equals_decode_for_every_id_and_byte_soup(tok):
    """The byte-level path (Tokenizer.token_bytes, an incremental UTF-8 decoder) against
    the Rust decode: every id alone, both skip modes, and sequences rich in lone bytes
    (cut and invalid UTF-8), where U+FFFD placement must match from_utf8_lossy's."""
    import random
    table, special = tok.token_bytes
    assert len(table) == tok.vocab_size and special
    for i in range(tok.vocab_size):
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            assert detok.push(i) + detok.flush() == tok.decode([i], skip_special_tokens=skip), i
    short = [i for i, b in enumerate(table) if len(b) <= 2]
    rng = random.Random(1)
    for _ in range(400):
        ids = [rng.choice(short) if rng.random() < 0.8 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 30))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out = "".join(detok.push(i) for i in ids) + detok.flush()
        assert out == tok.decode(ids, skip_special_tokens=skip), ids


def test_window_detokenizer_serves_decoders_that_are_not_byte_joins():
    """A decoder that looks at its neighbours (sentencepiece's Metaspace) has no byte
    table; the window path streams it and still equals decode."""
    from tokenizers import decoders as dec

    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁": 4, "é": 5}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.decoder = dec.Metaspace()
    t = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=None, special_tokens={})
    assert t.token_bytes is None
    ids = [1, 2, 3, 4, 5, 1]
    detok = IncrementalDetokenizer(t)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == t.decode(ids) == "hello world! é hello"


# ------------------------------------------------------------ vs transformers
@pytest.mark.slow
def test_encode_matches_transformers(tok, hf_tok):
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_special_tokens=True) == hf_tok.encode(text), text


@pytest.mark.slow
def test_decode_matches_transformers(tok, hf_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip), text


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.slow
def test_from_hf_dir_reads_transformers_save(hf_tok, tok, tmp_path):
    hf_tok.save_pretrained(tmp_path / "saved")
    again = Tokenizer.from_hf_dir(tmp_path / "saved")
    assert again.eos_token_ids[0] == 2 and again.bos_token_id == 1
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text), text
    messages = CONVERSATIONS["system_multi"]
    assert again.apply_chat_template(messages) == tok.apply_chat_template(messages)


@pytest.mark.parametrize("text", TEXTS + ["\n" + " " * 80, " " * 5000, "<|im_start|>" * 50])
def test_encode_is_the_backends_encode(tok, text):
    """``encode`` goes through the batch entry point (it releases the GIL): same ids."""
    for special in (False, True):
        assert tok.encode(text, add_special_tokens=special) == \
            tok._backend.encode(text, add_special_tokens=special).ids


@pytest.mark.parametrize("text", TEXTS + ["\n" + " " * 80, " " * 5000, "<|im_start|>" * 50])
def test_max_token_bytes_bounds_the_bytes_a_token_stands_for(tok, text):
    """No token covers more than ``max_token_bytes`` bytes of input: a prompt
    refused for its bytes could never have fit in the context."""
    ids = tok.encode(text)
    assert len(text.encode()) <= len(ids) * tok.max_token_bytes
    # byte-level BPE: the bound is the longest token exactly ("\n" + 80 spaces here)
    assert tok.max_token_bytes == 81
    assert len(tok.encode("\n" + " " * 80)) == 1


def test_max_token_bytes_counts_utf8_for_other_vocabularies_and_a_normalizer_4x():
    from tokenizers import normalizers

    vocab = {"[UNK]": 0, "▁": 1, "é": 2, "▁héllo": 3}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    plain = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=None, special_tokens={})
    assert plain.max_token_bytes == len("▁héllo".encode())      # 9: not byte-level, UTF-8 counted
    backend.normalizer = normalizers.NFC()
    normalized = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=None, special_tokens={})
    assert normalized.max_token_bytes == 4 * 9
