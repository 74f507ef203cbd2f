"""The tokenizer a GGUF file describes, rebuilt from its metadata (``tokenizer.ggml.*``).

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, the merges (or
scores), the token types and the special ids under llama.cpp's key names. This
module turns them into a ``tokenizers.Tokenizer`` the way transformers' GGUF
converter does (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``
and the tokenizer classes it hands the vocabulary to), so the ids equal those
of ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``:

==========================  ===============================================
``tokenizer.ggml.model``    what is built
==========================  ===============================================
``gpt2``                    byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen 2/3),
                            split by the regex ``tokenizer.ggml.pre`` names
``llama``, arch ``gemma*``  SentencePiece-style BPE with byte fallback: spaces
                            become ``▁`` in a normalizer, no prefix space;
                            merges rebuilt from the vocabulary's order
``llama``, arch ``phi3``    as ``llama`` below, the prefix ``▁`` from a normalizer
``llama``                   SentencePiece-style BPE with byte fallback, a
                            ``▁`` prefix (Metaspace); merges from the file or
                            rebuilt from the scores
==========================  ===============================================

Then, for every kind: control tokens become special added tokens (matched whole
in text), user-defined ones plain added tokens; ``add_bos_token`` /
``add_eos_token`` become the post-processor (a SentencePiece vocabulary that
does not say adds BOS, as llama.cpp does).

End of generation: the file's EOS and EOT ids, plus the end-of-turn token of
the chat format the vocabulary speaks (``<end_of_turn>``, ``<|im_end|>``,
``<|eot_id|>``, ``<|end|>``), as llama.cpp's vocabulary loader marks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.model.tokenizer import bytes_to_unicode

# GGUF token types (llama.cpp ``llama_token_type``).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes for llama.cpp pre-tokenizer names whose merges were learned on
# something other than GPT-2's regex: transformers' table for the architectures
# kvd serves. Names not listed (``smollm``, ``gpt2``, ``default``...) use
# ByteLevel's built-in GPT-2 regex, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}

# Architectures whose SentencePiece vocabulary needs its own builder.
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})
_PHI3_ARCHS = frozenset({"phi3"})

# Turn-closing tokens llama.cpp counts as end of generation wherever a
# vocabulary has them (``<|endoftext|>`` is left out: files use it as padding
# or a document separator, and their EOS id says when it ends a reply).
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


@dataclass(frozen=True)
class GGUFTokenizer:
    """What ``build`` reads from a file: the backend and the ids and strings
    around it. ``special_tokens`` maps bos_token/eos_token/unk_token/pad_token
    to their text (None where the file names none)."""

    backend: BackendTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict[str, str | None]
    architecture: str | None


def build(path: str | Path, meta: dict[str, Any]) -> GGUFTokenizer:
    """The tokenizer of the GGUF file at ``path`` whose metadata is ``meta``
    (``gguf_meta.read_metadata``). Raises ``ValueError`` naming the file for
    missing tokenizer metadata or a tokenizer model kvd does not build."""
    model_type = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    if model_type is None:
        raise ValueError(f"{path}: no tokenizer metadata (tokenizer.ggml.model)")
    if not tokens:
        raise ValueError(f"{path}: no vocabulary (tokenizer.ggml.tokens)")

    def token_at(key: str) -> tuple[int | None, str | None]:
        idx = meta.get(key)
        if idx is None or not 0 <= int(idx) < len(tokens):
            return None, None
        return int(idx), tokens[int(idx)]

    bos_id, bos = token_at("tokenizer.ggml.bos_token_id")
    eos_id, eos = token_at("tokenizer.ggml.eos_token_id")
    _, unk = token_at("tokenizer.ggml.unknown_token_id")
    _, pad = token_at("tokenizer.ggml.padding_token_id")

    if model_type == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise ValueError(f"{path}: byte-level BPE needs tokenizer.ggml.merges")
        vocab, backend = byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre"))
        default_add_bos = False
    elif model_type == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if arch in _GEMMA_ARCHS:
            vocab, backend = _gemma_bpe(tokens, unk)
        else:
            vocab, backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.merges"), scores,
                                                prefix_by_normalizer=arch in _PHI3_ARCHS)
        default_add_bos = True      # llama.cpp adds BOS to a SentencePiece vocabulary that does not say
    else:
        raise ValueError(f"{path}: tokenizer.ggml.model={model_type!r} is not supported; "
                         "kvd builds 'gpt2' (byte-level BPE) and 'llama' (SentencePiece-style BPE)")

    _add_gguf_tokens(backend, tokens, token_types, vocab, model_type == "gpt2", (bos, eos, unk, pad))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        backend.post_processor = _bos_eos_processor(bos if add_bos else None, bos_id,
                                                    eos if add_eos else None, eos_id)

    eos_ids = [i for i in (eos_id, _int_or_none(meta.get("tokenizer.ggml.eot_token_id")),
                           _int_or_none(meta.get("tokenizer.ggml.eom_token_id"))) if i is not None]
    eos_ids += [i for t in END_OF_TURN_TOKENS if (i := backend.token_to_id(t)) is not None]
    return GGUFTokenizer(backend, bos_token_id=bos_id, eos_token_ids=tuple(dict.fromkeys(eos_ids)),
                         chat_template=meta.get("tokenizer.chat_template"),
                         special_tokens={"bos_token": bos, "eos_token": eos, "unk_token": unk,
                                         "pad_token": pad},
                         architecture=arch)


# ----------------------------------------------------------------- builders
def byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None
                   ) -> tuple[dict[str, int], BackendTokenizer]:
    """The byte-level BPE of a GGUF vocabulary: (its vocab, the backend with
    ``pre``'s split regex and the byte-level decoder)."""
    # Tokens are stored in GPT-2's byte alphabet; one that uses other
    # characters (a mislabelled added token) is respelled byte by byte.
    # Later duplicates win, exactly like transformers' dict comprehension.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                     dropout=None, unk_token=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    backend = BackendTokenizer(bpe)
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return vocab, backend


def _gemma_bpe(tokens: list[str], unk: str | None) -> tuple[dict[str, int], BackendTokenizer]:
    """Gemma's SentencePiece-style BPE (transformers' ``gemma_tokenizer`` +
    ``GemmaTokenizer``): a token of two or more spaces is stored as spaces but
    looked up as ``▁``s, so it is respelled; the file lists no merges, and they
    are rebuilt ranked by the tokens' order in the file (Gemma's scores do not
    follow its merge order)."""
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    positions = {t: -i for i, t in enumerate(respelled)}
    bpe = models.BPE(vocab=vocab, merges=merges_from_vocab(vocab, positions), fuse_unk=True,
                     unk_token=unk or "<unk>", dropout=None, byte_fallback=True)
    backend = BackendTokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    return vocab, backend


def _sentencepiece_bpe(tokens: list[str], merges: list[str] | None, scores: list[float] | None, *,
                       prefix_by_normalizer: bool) -> tuple[dict[str, int], BackendTokenizer]:
    """Llama 2 / Mistral-style SentencePiece BPE (transformers' ``LlamaTokenizer``):
    byte fallback, a ``▁`` before the text (Metaspace, or for Phi-3 a normalizer,
    which also prefixes text that starts with a space), and a decoder that drops
    the first space again. Merges from the file, else rebuilt from the scores."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        merge_pairs = [tuple(m.split(" ")) for m in merges]
    else:
        if scores is None:
            raise ValueError("a SentencePiece vocabulary without merges needs tokenizer.ggml.scores")
        merge_pairs = merges_from_vocab(vocab, dict(zip(tokens, scores)))
    bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    backend = BackendTokenizer(bpe)
    if prefix_by_normalizer:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                         split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return vocab, backend


def merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies (transformers'
    ``generate_merges`` with scores): every split of a token into two tokens
    of the vocabulary, best score first, then the longer left piece, then the
    longer right piece; ties keep the order of ``scores``. (transformers also
    sorts each token's splits by their ids first: two splits of one token never
    tie on the left piece's length, so that order never shows.)"""
    found: list[tuple[float, int, int, str, str]] = []
    add = found.append
    for token, score in scores.items():
        n = len(token)
        for k in range(n - 1, 0, -1):
            left = token[:k]
            if left in vocab:
                right = token[k:]
                if right in vocab:
                    add((score, k, n - k, left, right))
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in found]


def _add_gguf_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int],
                     vocab: dict[str, int], byte_level: bool, named_tokens: tuple[str | None, ...]) -> None:
    """Add a GGUF vocabulary's control, named (bos/eos/unk/pad) and user-defined
    tokens to ``backend``. Mutates ``backend``."""
    # Control tokens (<|im_start|>...) become special added tokens so text
    # containing them is matched whole; user-defined ones plain added tokens.
    # In a byte-level vocabulary a control token spelled outside the byte
    # alphabet is a llama.cpp mislabel, and is skipped as transformers does.
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(tok, normalized=False, special=True)
               for tok, kind in zip(tokens, token_types)
               if kind == _TOKEN_TYPE_CONTROL and (alphabet is None or set(tok) <= alphabet)]
    named = [AddedToken(t, normalized=False, special=True) for t in named_tokens
             if t is not None and t in vocab]
    if control or named:
        backend.add_special_tokens(control + named)
    user_defined = [AddedToken(tok, normalized=False, special=False)
                    for tok, kind in zip(tokens, token_types)
                    if kind == _TOKEN_TYPE_USER_DEFINED and tok in vocab]
    if user_defined:
        backend.add_tokens(user_defined)


def _bos_eos_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
                       ) -> processors.TemplateProcessing:
    """``[bos] $A [eos]`` (transformers' ``update_post_processor``)."""
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
