"""The build fingerprint: one short string naming everything that decides a
request's tokens besides the request itself, as OpenAI's ``system_fingerprint``
does ("can be used in conjunction with the seed request parameter to understand
when backend changes have been made that might impact determinism").

What goes in (``fingerprint``'s ``parts``):

- the source: a digest of every file of ``engine/``, ``kernels/`` (the C++
  sources included) and ``kvd/``, so any change of code is a new fingerprint,
  and the versions of torch and of the C++ compiler that built the kernels;
- the model: its name, its file's size (a random model: its seed);
- how it computes: the engine's ``kernels()`` less its thread counts (the
  weights and activation dtypes, the KV cache's dtype, which kernel build runs
  matmuls, decode steps, prefill attention, row ops and sampling).

Two servers with the same fingerprint run the same arithmetic on the same
weights. Pure and cheap (a few ms: the source digest is read once per process).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("engine", "kernels", "kvd")
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
PREFIX = "fp_"
HEX_DIGITS = 16
# parts of EngineConfig-dependent kernel names that do not change a token's bits
NOT_ARITHMETIC = ("threads", "decode_threads")


@functools.cache
def source_digest() -> str:
    """sha256 over the relative path and bytes of every source file of SOURCE_DIRS, in path order."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for path in sorted((REPO / d).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def fingerprint(parts: Mapping[str, object]) -> str:
    """``fp_`` and 16 hex digits of sha256 over ``parts`` (sorted by key)."""
    h = hashlib.sha256()
    for key in sorted(parts):
        h.update(f"{key}={parts[key]}\n".encode())
    return PREFIX + h.hexdigest()[:HEX_DIGITS]


def combine(fingerprints: Iterable[str]) -> str:
    """One fingerprint for servers of these fingerprints: the fingerprint itself when
    they agree (a cluster of one build reads as that build), else one of the set."""
    distinct = sorted(set(fingerprints))
    if len(distinct) == 1:
        return distinct[0]
    return fingerprint({"builds": ",".join(distinct)})


def engine_parts(kernels: Mapping[str, str], model: str, model_bytes: int | None,
                 torch_version: str, compiler: str) -> dict[str, object]:
    """The ``parts`` of an engine's fingerprint (the module docstring)."""
    return {"source": source_digest(), "torch": torch_version, "compiler": compiler, "model": model,
            "model_bytes": model_bytes,
            **{f"kernel.{k}": v for k, v in kernels.items() if k not in NOT_ARITHMETIC}}
