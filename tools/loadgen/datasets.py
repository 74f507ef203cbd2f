"""Workloads: conversations whose lengths are measured in the model's tokens.

Every dataset yields a list of ``Conversation``; all but ``sessions`` have one
turn each.  A turn carries the user text, its length in tokens of the served
model's tokenizer, and the number of tokens to ask for.

Random text is made of real tokens (vLLM's method): sample ids uniformly from
the vocabulary without special tokens, decode, re-encode and trim or top up
until the text is exactly the wanted number of tokens.

Datasets named as vLLM ``bench serve`` names them behave as vLLM's do:
``random`` (with ``--random-prefix-len``: one random prefix shared by every
prompt; lengths drawn from ``[floor(len*(1-r)), ceil(len*(1+r))]``),
``prefix_repetition`` (``prefix-repetition`` is the same), ``sharegpt``,
``custom`` (JSONL, one ``{"prompt": ...}`` object a line) and ``sonnet``
(``sonnet.py``).  ``custom`` and ``sonnet`` render a completions prompt through
the model's chat template, as vLLM does; on the chat endpoint the server
applies it, so the user text is sent as it is.

The tokenizer is anything with ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``vocab_size`` and ``eos_token_ids`` (the API of
``engine.model.registry.load_tokenizer``), and ``apply_chat_template`` for
the datasets that render one.  Errors the user can fix (missing file, bad
format) raise ``DatasetError`` with a one-line message.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

DATASETS = ("random", "prefix_repetition", "prefix-repetition", "sessions", "sharegpt", "custom",
            "sonnet", "file")
# Datasets whose prompts are generated, never read: vLLM refuses --dataset-path with them.
SYNTHETIC = ("random", "prefix_repetition", "prefix-repetition", "sessions")


class DatasetError(Exception):
    """A dataset cannot be built from the given options (user error)."""


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: Sequence[int]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str: ...


@dataclass(frozen=True)
class Turn:
    text: str          # the user's message (or the whole prompt)
    prompt_len: int    # tokens in ``text``
    output_len: int    # max_tokens to ask for


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class DatasetOptions:
    """Every dataset's knobs, with vLLM's flag names (``--random-input-len`` ...)."""

    name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_output_len: int = 128
    sessions_num_turns: int = 4
    sessions_user_len: int = 64
    sessions_output_len: int = 64
    sessions_shared_prefix_len: int = 0
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None
    file_output_len: int = 128
    custom_output_len: int = 256
    sonnet_input_len: int = 550
    sonnet_output_len: int = 150
    sonnet_prefix_len: int = 200
    chat: bool = False               # the chat endpoint: the server renders the chat template
    skip_chat_template: bool = False  # custom: the prompts already hold it
    shuffle: bool = True             # sharegpt/custom order: shuffled by the seed (--disable-shuffle: file order)

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise DatasetError(f"unknown dataset {self.name!r} (choose from {', '.join(DATASETS)})")
        if self.num_prompts < 1:
            raise DatasetError("--num-prompts must be at least 1")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise DatasetError("--random-range-ratio must be in [0, 1)")
        positive = {
            "--random-input-len": self.random_input_len, "--random-output-len": self.random_output_len,
            "--prefix-repetition-num-prefixes": self.prefix_repetition_num_prefixes,
            "--prefix-repetition-output-len": self.prefix_repetition_output_len,
            "--sessions-num-turns": self.sessions_num_turns, "--sessions-user-len": self.sessions_user_len,
            "--sessions-output-len": self.sessions_output_len, "--file-output-len": self.file_output_len,
            "--custom-output-len": self.custom_output_len, "--sonnet-input-len": self.sonnet_input_len,
            "--sonnet-output-len": self.sonnet_output_len,
        }
        for flag, value in positive.items():
            if value < 1:
                raise DatasetError(f"{flag} must be at least 1, got {value}")
        for flag, value in {"--prefix-repetition-prefix-len": self.prefix_repetition_prefix_len,
                            "--prefix-repetition-suffix-len": self.prefix_repetition_suffix_len,
                            "--sessions-shared-prefix-len": self.sessions_shared_prefix_len,
                            "--random-prefix-len": self.random_prefix_len,
                            "--sonnet-prefix-len": self.sonnet_prefix_len}.items():
            if value < 0:
                raise DatasetError(f"{flag} must be >= 0, got {value}")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise DatasetError("--sharegpt-output-len must be at least 1")
        if self.name in SYNTHETIC and self.dataset_path:
            raise DatasetError(f"--dataset-name {self.name} generates its prompts and reads no "
                               f"--dataset-path (a file is read by sharegpt, custom, sonnet or file)")
        if self.name in ("sharegpt", "file", "custom"):
            if not self.dataset_path:
                raise DatasetError(f"--dataset-name {self.name} needs --dataset-path FILE")
        if self.dataset_path and not Path(self.dataset_path).is_file():
            raise DatasetError(f"dataset file not found: {self.dataset_path}")


class TokenSampler:
    """Random text of an exact token length, from one tokenizer and one RNG."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.pool = allowed_token_ids(tokenizer)

    def ids(self, n: int) -> list[int]:
        return self.rng.choice(self.pool, size=n).tolist()

    def text(self, n: int, head: Sequence[int] = ()) -> tuple[str, int]:
        """Text that encodes to ``n`` tokens (or as close as a few passes get),
        made of the ids ``head`` (at most ``n``) and random ones after them."""
        if n == 0:
            return "", 0
        tok = self.tokenizer
        ids = list(head) + self.ids(n - len(head))
        text = tok.decode(ids)
        # Decoding then re-encoding can merge or split tokens at byte-level
        # boundaries; trim or top up until the round trip is exact.
        for _ in range(8):
            ids = tok.encode(text)
            if len(ids) == n:
                return text, n
            text = tok.decode(ids[:n]) if len(ids) > n else tok.decode(ids + self.ids(n - len(ids)))
        return text, len(tok.encode(text))


def allowed_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Vocabulary ids without special tokens (EOS/BOS and ``<|...|>``-style markers)."""
    special = set(int(i) for i in (getattr(tokenizer, "eos_token_ids", None) or ()))
    for attr in ("bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            special.add(value)
    for attr in ("special_token_ids", "all_special_ids"):
        special.update(int(i) for i in (getattr(tokenizer, attr, None) or ()))
    # Control tokens of byte-level BPE vocabularies sit at the low end and
    # decode to nothing (skipped as special) or to <|...|>-style markers;
    # check the first few hundred.
    for i in range(min(512, tokenizer.vocab_size)):
        piece = tokenizer.decode([i])
        if not piece or (len(piece) > 2 and piece.startswith("<") and piece.endswith(">")):
            special.add(i)
    ids = np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise DatasetError("the tokenizer has no ordinary tokens to sample from")
    return ids


def build(opts: DatasetOptions, tokenizer: Tokenizer) -> list[Conversation]:
    """The conversations of ``opts.name``, deterministic for a given seed."""
    from tools.loadgen import sonnet

    rng = np.random.default_rng(opts.seed)
    if opts.name == "random":
        return _random(opts, tokenizer, rng)
    if opts.name in ("prefix_repetition", "prefix-repetition"):
        return _prefix_repetition(opts, tokenizer, rng)
    if opts.name == "sessions":
        return _sessions(opts, tokenizer, rng)
    if opts.name == "sharegpt":
        return _sharegpt(opts, tokenizer, rng)
    if opts.name == "custom":
        return _custom(opts, tokenizer, rng)
    if opts.name == "sonnet":
        return sonnet.build(opts, tokenizer, rng)
    return _file(opts, tokenizer)


def _single(text: str, prompt_len: int, output_len: int) -> Conversation:
    return Conversation((Turn(text, prompt_len, output_len),))


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """``n`` lengths uniform on ``[floor(mean*(1-r)), ceil(mean*(1+r))]``, at least 1 (vLLM's bounds)."""
    low = max(1, math.floor(mean * (1 - ratio)))
    high = max(low, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _random(opts: DatasetOptions, tok: Tokenizer, rng: np.random.Generator) -> list[Conversation]:
    """Random prompts; with ``random_prefix_len``, every one opens with the same random prefix."""
    sampler = TokenSampler(tok, rng)
    prefix = sampler.ids(opts.random_prefix_len)
    in_lens = _lengths(rng, opts.random_input_len, opts.random_range_ratio, opts.num_prompts)
    out_lens = _lengths(rng, opts.random_output_len, opts.random_range_ratio, opts.num_prompts)
    out = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        text, n = sampler.text(len(prefix) + n_in, head=prefix)
        out.append(_single(text, n, n_out))
    return out


def _prefix_repetition(opts: DatasetOptions, tok: Tokenizer, rng: np.random.Generator
                       ) -> list[Conversation]:
    """``num_prefixes`` shared prefixes, each request one of them + a random suffix."""
    sampler = TokenSampler(tok, rng)
    prefixes = [sampler.text(opts.prefix_repetition_prefix_len)[0]
                for _ in range(opts.prefix_repetition_num_prefixes)]
    out = []
    for i in range(opts.num_prompts):
        suffix, _ = sampler.text(opts.prefix_repetition_suffix_len)
        text = prefixes[i % len(prefixes)] + suffix
        out.append(_single(text, len(tok.encode(text)), opts.prefix_repetition_output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def _sessions(opts: DatasetOptions, tok: Tokenizer, rng: np.random.Generator) -> list[Conversation]:
    """``num_prompts`` conversations of ``sessions_num_turns`` random user turns.

    An optional shared prefix (the same for every session, like a system
    prompt or a shared document) opens each session's first turn.
    """
    sampler = TokenSampler(tok, rng)
    shared, _ = sampler.text(opts.sessions_shared_prefix_len)
    out = []
    for _ in range(opts.num_prompts):
        turns = []
        for t in range(opts.sessions_num_turns):
            text, n = sampler.text(opts.sessions_user_len)
            if t == 0 and shared:
                text = shared + text
                n = len(tok.encode(text))
            turns.append(Turn(text, n, opts.sessions_output_len))
        out.append(Conversation(tuple(turns)))
    return out


def _sharegpt(opts: DatasetOptions, tok: Tokenizer, rng: np.random.Generator) -> list[Conversation]:
    """First human/gpt exchange of each ShareGPT conversation (vLLM's filter rules)."""
    try:
        data = json.loads(Path(opts.dataset_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read ShareGPT file {opts.dataset_path}: {exc}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{opts.dataset_path}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, answer = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(answer, str):
            pairs.append((prompt, answer))
    if not pairs:
        raise DatasetError(f"{opts.dataset_path}: no conversation with a prompt and an answer")
    out: list[Conversation] = []
    order = rng.permutation(len(pairs)).tolist() if opts.shuffle else range(len(pairs))
    for i in order:
        prompt, answer = pairs[i]
        prompt_len = len(tok.encode(prompt))
        output_len = opts.sharegpt_output_len or len(tok.encode(answer))
        # vLLM drops too-short and too-long pairs unless the output length is fixed.
        if prompt_len < 4 or (opts.sharegpt_output_len is None and output_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        out.append(_single(prompt, prompt_len, output_len))
        if len(out) == opts.num_prompts:
            break
    if not out:
        raise DatasetError(f"{opts.dataset_path}: every conversation was filtered out by length")
    return _cycle(out, opts.num_prompts)


def _custom(opts: DatasetOptions, tok: Tokenizer, rng: np.random.Generator) -> list[Conversation]:
    """vLLM's custom dataset: a JSONL file, one object with a string ``prompt`` a line.

    Shuffled by the seed unless ``shuffle`` is off; a completions prompt is
    rendered through the chat template unless ``skip_chat_template``.
    """
    prompts = []
    try:
        with open(opts.dataset_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{opts.dataset_path}:{lineno}: not JSON: {exc}") from None
                if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                    raise DatasetError(f"{opts.dataset_path}:{lineno}: expected an object with a "
                                       f"string \"prompt\" (vLLM's custom JSONL format)")
                prompts.append(item["prompt"])
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read custom dataset {opts.dataset_path}: {exc}") from None
    if not prompts:
        raise DatasetError(f"{opts.dataset_path}: no prompts (the file has no JSON line)")
    if opts.shuffle:
        prompts = [prompts[i] for i in rng.permutation(len(prompts)).tolist()]
    out = []
    for prompt in prompts[:opts.num_prompts]:
        if not (opts.chat or opts.skip_chat_template):
            prompt = chat_rendered(tok, prompt)
        out.append(_single(prompt, len(tok.encode(prompt)), opts.custom_output_len))
    return _cycle(out, opts.num_prompts)


def chat_rendered(tok: Tokenizer, user_text: str) -> str:
    """``user_text`` as one user message through the model's chat template,
    ready for the assistant's answer (what vLLM's datasets send to /v1/completions)."""
    render = getattr(tok, "apply_chat_template", None)
    if render is None or not getattr(tok, "has_chat_template", True):
        raise DatasetError("the tokenizer has no chat template to render the prompt with "
                           "(pass --skip-chat-template, or use --endpoint /v1/chat/completions)")
    return render([{"role": "user", "content": user_text}], add_generation_prompt=True)


def _file(opts: DatasetOptions, tok: Tokenizer) -> list[Conversation]:
    """One prompt per non-empty line, in file order, cycled to ``num_prompts``."""
    try:
        lines = Path(opts.dataset_path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read prompt file {opts.dataset_path}: {exc}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise DatasetError(f"{opts.dataset_path}: no prompts (the file has no non-empty line)")
    out = [_single(p, len(tok.encode(p)), opts.file_output_len) for p in prompts[:opts.num_prompts]]
    return _cycle(out, opts.num_prompts)


def _cycle(items: list[Conversation], n: int) -> list[Conversation]:
    return [items[i % len(items)] for i in range(n)]
