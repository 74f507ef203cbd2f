"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust BPE) and adds what a
server needs around it: the model's BOS/EOS ids, the chat template rendered the
way Hugging Face renders it, and ``IncrementalDetokenizer`` for streaming text
out one token at a time.

Two builders:

- ``Tokenizer.from_gguf(path)`` rebuilds the tokenizer a GGUF file's metadata
  describes (``engine.model.gguf_tokenizer``: byte-level BPE or
  SentencePiece-style, as transformers' GGUF converter builds it), so the ids
  equal those of ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.
- ``Tokenizer.from_hf_dir(path)`` loads ``tokenizer.json`` plus
  ``tokenizer_config.json`` (and ``chat_template.jinja`` / ``generation_config.json``
  when present).

A ``Tokenizer`` never changes after construction, so one instance may be shared
by every request and thread in a process.
"""

from __future__ import annotations

import codecs
import json
import logging
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders
from tokenizers import Tokenizer as BackendTokenizer

log = logging.getLogger(__name__)

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


# Gemma's SentencePiece decoder (engine/model/gguf_tokenizer.py), as tokenizers serializes it:
# decoding is joining each token's bytes (``Tokenizer.token_bytes``)
_SENTENCEPIECE_JOINING = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}


class Tokenizer:
    """A model's tokenizer: encode, decode, chat template.

    Immutable after construction and safe to share. Build it with
    ``from_gguf`` or ``from_hf_dir``; the constructor is for those builders
    and for tests.
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None,
                 special_tokens: dict[str, str | None]) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._chat_template_source = chat_template
        # The names HF hands a chat template (bos_token, eos_token, unk_token, pad_token).
        self._special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self._compiled_template = _compile_chat_template(chat_template) if chat_template else None

    # ------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._compiled_template is not None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``)
        are matched whole. ``add_special_tokens`` runs the post-processor (e.g. BOS).

        Releases the GIL while the Rust BPE runs (the batch entry point does;
        ``Tokenizer.encode`` holds it for the whole call, 6 s for a 4 MiB
        prompt), so a server can tokenize in a thread while its event loop goes
        on. Same ids as ``encode``."""
        batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)  # fast: >= 0.20
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) shows as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of input text one token stands for:
        a text of more than ``n * max_token_bytes`` bytes has more than ``n``
        tokens, so a server can refuse an over-long prompt before tokenizing it.

        A byte-level vocabulary (every character one of the 256 byte symbols)
        counts one byte per character; any other counts a token's UTF-8 bytes
        (SentencePiece's 3-byte ``▁`` stands for a 1-byte space: over, never
        under). Added tokens count their content. A normalizer may shrink the
        text it tokenizes (NFC composes 3 Hangul jamo, 9 bytes, into one
        3-byte syllable), hence the factor 4 when there is one."""
        byte_symbols = set(bytes_to_unicode().values())
        added = {t.content for t in self._backend.get_added_tokens_decoder().values()}
        longest = 1
        for token in self._backend.get_vocab(with_added_tokens=True):
            if token in added:
                n = len(token.encode("utf-8", "surrogatepass"))
            elif byte_symbols.issuperset(token):
                n = len(token)
            else:
                n = len(token.encode("utf-8", "surrogatepass"))
            longest = max(longest, n)
        return longest * (4 if self._backend.normalizer is not None else 1)

    @cached_property
    def token_bytes(self) -> tuple[tuple[bytes, ...], frozenset[int]] | None:
        """(each id's bytes, the special ids) where decoding is joining bytes, else None.

        That is byte-level BPE's decoder (``decoders.ByteLevel``): ``decode(ids)``
        is the UTF-8 of the ids' bytes joined, each invalid sequence one U+FFFD
        (Rust's ``from_utf8_lossy``, as Python's ``errors="replace"``), with the
        special ids left out when ``skip_special_tokens``. A token stands for the
        bytes its characters spell in the byte alphabet, or, when one of its
        characters is not in it, for its own UTF-8 (the decoder's rule). Ids the
        vocabulary lacks stand for no bytes (decode skips them). And it is
        Gemma's SentencePiece decoder (``▁`` -> space, byte fallback, fuse: no
        leading space dropped): a ``<0xNN>`` token stands for byte NN, any other
        for its UTF-8 with ``▁`` spelled as a space. A SentencePiece decoder that
        drops the text's first space (Llama 2's) is not joining bytes: None.
        Built on first use (one pass over the vocabulary)."""
        decoder = self._backend.decoder
        if isinstance(decoder, decoders.ByteLevel):
            byte_of = {c: b for b, c in bytes_to_unicode().items()}

            def spell(token: str) -> bytes:
                try:
                    return bytes(byte_of[c] for c in token)
                except KeyError:
                    return token.encode("utf-8", "surrogatepass")
        elif decoder is not None and json.loads(decoder.__getstate__()) == _SENTENCEPIECE_JOINING:
            def spell(token: str) -> bytes:
                if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                    try:
                        return bytes([int(token[3:5], 16)])
                    except ValueError:
                        pass
                return token.replace("\u2581", " ").encode("utf-8", "surrogatepass")
        else:
            return None
        vocab = self._backend.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            table[i] = spell(token)
        special = frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)
        return tuple(table), special

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # ----------------------------------------------------------- chat template
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) to a prompt string.

        Matches ``transformers``' ``apply_chat_template(..., tokenize=False)``:
        same jinja environment (sandboxed, trim_blocks, lstrip_blocks,
        loopcontrols, ``raise_exception``, ``strftime_now``, JSON ``tojson``),
        and the special-token strings passed as variables. Raises ``ValueError``
        if the model has no template, ``jinja2.TemplateError`` if the template
        rejects the conversation.
        """
        if self._compiled_template is None:
            raise ValueError("this tokenizer has no chat template")
        for message in messages:
            if not isinstance(message, dict):
                raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
        variables = dict(self._special_tokens)
        variables.update(template_kwargs)
        return self._compiled_template.render(messages=messages, tools=None, documents=None,
                                              add_generation_prompt=add_generation_prompt,
                                              **variables)

    # ---------------------------------------------------------------- builders
    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (``engine.model.gguf_tokenizer``:
        byte-level BPE or SentencePiece-style, as transformers builds it).

        The chat template is the file's own, else its architecture's standard
        turn format (``engine.model.chat_formats``), else none. Raises
        ``ValueError`` for a missing file, a file without tokenizer metadata,
        or a tokenizer kind kvd does not build.
        """
        from engine.model import chat_formats, gguf_tokenizer  # noqa: PLC0415 -- only the GGUF path needs them
        from engine.model.gguf_meta import read_metadata  # noqa: PLC0415

        path = Path(path)
        meta = read_metadata(path)      # ValueError for a missing or malformed file
        built = gguf_tokenizer.build(path, meta)
        template = built.chat_template
        if template is None:
            template = chat_formats.standard_template(built.architecture, built.backend)
            log.info("%s has no chat template; using the %s turn format%s", path.name, built.architecture,
                     "" if template else ": none known, chat requests are refused")
        return cls(built.backend, bos_token_id=built.bos_token_id, eos_token_ids=built.eos_token_ids,
                   chat_template=template, special_tokens=built.special_tokens)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` from a Hugging Face directory.

        The chat template comes from ``tokenizer_config.json`` or
        ``chat_template.jinja``; EOS ids from the config's ``eos_token`` plus
        ``generation_config.json``'s ``eos_token_id`` (int or list).
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        special = {name: _token_content(config.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        eos_ids: list[int] = []
        if special["eos_token"] and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids.append(backend.token_to_id(special["eos_token"]))
        gen_eos = generation.get("eos_token_id")
        eos_ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if bos_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_id = generation["bos_token_id"]

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name", "template"}, ...]
            by_name = {t["name"]: t["template"] for t in template}
            template = by_name.get("default")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(backend, bos_token_id=bos_id, eos_token_ids=tuple(dict.fromkeys(eos_ids)),
                   chat_template=template, special_tokens=special)


    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` (and EOS ids in
        ``generation_config.json``) so ``from_hf_dir(path)`` rebuilds an equal
        tokenizer. Creates ``path``; returns it."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path / "tokenizer.json"))
        config: dict[str, Any] = dict(self._special_tokens)
        if self._chat_template_source is not None:
            config["chat_template"] = self._chat_template_source
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        generation: dict[str, Any] = {"eos_token_id": list(self.eos_token_ids)}
        if self.bos_token_id is not None:
            generation["bos_token_id"] = self.bos_token_id
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n",
                                                     encoding="utf-8")
        return path


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, one request at a time.

    ``push(id)`` returns the text that became stable with this token (possibly
    ""); ``flush()`` returns whatever is left at the end. The concatenation of
    every push and the flush equals ``tokenizer.decode(all_ids)``.

    Where decoding is joining bytes (``Tokenizer.token_bytes``: byte-level BPE),
    each id's bytes go through an incremental UTF-8 decoder, which holds back a
    character's first bytes until its last arrives: one table lookup a token.

    Any other decoder (vLLM's ``detokenize_incrementally``): decode a short window
    ``ids[prefix_offset:]`` and compare it with the already-emitted part of that
    window ``ids[prefix_offset:read_offset]``; the difference is new text. Text
    ending in U+FFFD is held back: a character may span several tokens, and half
    of it decodes to U+FFFD until the rest arrives.

        ids:   [ ... | prefix_offset ... read_offset | new ids ... ]
                       `--- emitted, kept as context ---'

    Decoding a window instead of only the new ids keeps decoders that look at
    neighbours (sentencepiece's leading-space rule) right. Not thread-safe;
    one per request.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted_chars = 0
        table = tokenizer.token_bytes
        self._bytes: tuple[bytes, ...] | None = None
        if table is not None:
            self._bytes, special = table
            self._skipped = special if skip_special_tokens else frozenset()
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._bytes is not None:
            if token_id in self._skipped or not 0 <= token_id < len(self._bytes):
                return ""
            return self._utf8.decode(self._bytes[token_id])
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        new_text = decode(self._ids[self._prefix_offset:], self._skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted_chars += len(delta)
        return delta

    def flush(self) -> str:
        """The held-back tail (e.g. a cut character, as U+FFFD). Call once at the end."""
        if self._bytes is not None:
            return self._utf8.decode(b"", True)
        full = self._tokenizer.decode(self._ids, self._skip_special)
        tail = full[self._emitted_chars:]
        self._emitted_chars = len(full)
        self._prefix_offset = self._read_offset = len(self._ids)
        return tail


# ---------------------------------------------------------------------- helpers
class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: HF's marker for assistant
    tokens (training masks). Serving only needs the body rendered as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in HF's environment.

    Cached because a template is pure text -> compiled code and compiling
    costs milliseconds per call; the cache holds no request state.
    """

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # HF overrides jinja's tojson, which HTML-escapes.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


