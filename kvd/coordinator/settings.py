"""What the coordinator reads from a kvd TOML file: the same parser as every daemon.

The coordinator runs no engine, but it reads the file with ``kvd.config``'s
``load_config`` (torch-free since ``EngineConfig`` lives in ``engine/config.py``)
so one set of checks applies everywhere: a file a node rejects, the
coordinator rejects too. It keeps ``[server]`` as is, and from the engine part
only the model spec (for the served name and the tokenizer) and
``max_model_len`` (the context length it assumes until nodes report theirs).
The tokenizer comes from ``engine.model.registry``, whose weight loaders (the
only part that imports torch) load lazily.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvd.config import KvdConfig, ServerConfig, load_config

_ENGINE_KEYS = ("model", "max_model_len")


@dataclass(frozen=True)
class CoordinatorSettings:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: str = "smollm2"
    max_model_len: int | None = None

    @classmethod
    def from_config(cls, config: KvdConfig) -> "CoordinatorSettings":
        return cls(config.server, config.engine.model, config.engine.max_model_len)

    def assumed_max_model_len(self, context_length: int | None) -> int:
        """The context length to assume until nodes report theirs: the model
        file's (``context_length``, None if unknown) capped by ``max_model_len``."""
        limits = [n for n in (self.max_model_len, context_length) if n]
        return min(limits) if limits else 2048


def load_settings(path: str | os.PathLike | None, overrides: dict[str, Any] | None = None
                  ) -> CoordinatorSettings:
    """Read ``path`` with ``kvd.config.load_config``; ``overrides`` are flat
    ({server field or "model"/"max_model_len": value}, None = unset). Raises
    ``ConfigError`` (a ValueError) naming the file and key."""
    overrides = overrides or {}
    engine = {k: v for k, v in overrides.items() if k in _ENGINE_KEYS}
    server = {k: v for k, v in overrides.items() if k not in _ENGINE_KEYS}
    return CoordinatorSettings.from_config(load_config(path, {"engine": engine, "server": server}))


def load_tokenizer(spec: str):
    """(served model name, tokenizer, the file's context length or None) of a
    model spec; reads no weights, imports no torch."""
    from engine.model.registry import resolve_model

    source = resolve_model(spec)
    return source.name, source.load_tokenizer(), source.context_length
