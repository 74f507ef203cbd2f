"""Configuration: ``etc/kvd.toml`` sections onto frozen dataclasses, CLI on top.

Precedence: built-in defaults < TOML file < command-line flags. Unknown
sections or keys, and values of the wrong type, are errors (``ConfigError``)
naming the file and key: a typo in a config must not silently fall back to a
default at 3 a.m.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engine.config import EngineConfig


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_file: str | None = None
    served_model_name: str | None = None
    drain_timeout: float = 30.0
    log_level: str = "info"
    # HTTP limits (docs/operations.md "Limits"): a client cannot hold the server
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout: float = 30.0
    header_timeout: float = 15.0
    max_connections: int = 2048

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in 0..65535, got {self.port}")
        for name in ("max_body_bytes", "body_timeout", "header_timeout", "max_connections"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"server.{name} must be > 0, got {getattr(self, name)}")
        if self.drain_timeout < 0:
            raise ConfigError("server.drain_timeout must be >= 0")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"server.log_level must be debug|info|warning|error, got {self.log_level!r}")

    def resolved_api_key(self) -> str | None:
        """The API key from ``api_key``, ``api_key_file`` or ``$KVD_API_KEY`` (first set wins)."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            key = Path(self.api_key_file).read_text().strip()
            if not key:
                raise ConfigError(f"api_key_file {self.api_key_file} is empty")
            return key
        return os.environ.get("KVD_API_KEY") or None


@dataclass(frozen=True)
class KvdConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


# TOML section/key -> (dataclass attribute holder, field name)
_SECTIONS = {
    "model": ("engine", {"name": "model", "dtype": "dtype"}),
    "engine": ("engine", None),
    "server": ("server", None),
}
_SERVER_FROM_MODEL = {"served_name": "served_model_name"}


def _coerce(where: str, value: Any, current: Any, ftype: str) -> Any:
    """Check a TOML value against the field's declared type; 0 / "" mean None for optionals."""
    optional = "None" in ftype
    base = ftype.replace("| None", "").strip()
    if optional and ((base == "str" and value == "")
                     or (base in ("int", "float") and type(value) in (int, float) and value == 0)):
        return None
    expected = {"int": int, "float": (int, float), "str": str, "bool": bool}.get(base)
    if expected is None:
        return value
    if isinstance(value, bool) and base != "bool" or not isinstance(value, expected):
        raise ConfigError(f"{where} must be {base}, got {type(value).__name__} {value!r}")
    return float(value) if base == "float" else value


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, dict[str, Any]] | None = None
                ) -> KvdConfig:
    """Read ``path`` (optional) and apply ``overrides`` ({"engine": {...}, "server": {...}})."""
    parts: dict[str, dict[str, Any]] = {"engine": {}, "server": {}}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        for section, table in data.items():
            if section in ("cluster", "nodes"):
                continue  # read by the cluster daemons
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} is not allowed; options "
                                  f"live in the [model], [engine] and [server] tables")
            if section not in _SECTIONS:
                raise ConfigError(f"{path}: unknown section [{section}]")
            target, rename = _SECTIONS[section]
            for key, value in table.items():
                if section == "model" and key in _SERVER_FROM_MODEL:
                    parts["server"][_SERVER_FROM_MODEL[key]] = (f"{path}: model.{key}", value)
                    continue
                name = rename.get(key) if rename else key
                if name is None:
                    raise ConfigError(f"{path}: unknown key {section}.{key}")
                parts[target][name] = (f"{path}: {section}.{key}", value)
    for target, values in (overrides or {}).items():
        for name, value in values.items():
            if value is not None:
                parts[target][name] = (f"--{name.replace('_', '-')}", value)
    try:
        engine = _build(EngineConfig, parts["engine"])
        if engine.profile:
            engine = _with_profile(engine, explicit=parts["engine"].keys())
        server = _build(ServerConfig, parts["server"])
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        where = f"{path} (or a flag)" if path is not None else "command-line flags"
        raise ConfigError(f"{where}: {exc}") from None
    return KvdConfig(engine=engine, server=server)


def _with_profile(engine: EngineConfig, explicit) -> EngineConfig:
    """``engine`` with the cost_* coefficients its ``profile`` measured (those not
    set explicitly). A profile of another model or CPU, or a bad file: ConfigError."""
    from kvd.sim.profile_file import ProfileError, load_profile

    try:
        costs = load_profile(engine.profile, model=engine.model).engine_costs()
    except ProfileError as exc:
        raise ConfigError(f"engine.profile: {exc}") from None
    return replace(engine, **{k: v for k, v in costs.items() if k not in explicit})


def _build(cls, values: dict[str, tuple[str, Any]]):
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for name, (where, value) in values.items():
        if name not in known:
            raise ConfigError(f"{where}: unknown option")
        kwargs[name] = _coerce(where, value, None, str(known[name].type))
    return replace(cls(), **kwargs)
