"""Key files and key sets: who may connect to a listener, and under which name.

Every authenticating transport uses the same CURVE keypairs (Curve25519, in
ZeroMQ's ZPL certificate format): zmq through CURVE itself, ucx through the
handshake in `transports.ucx_auth`. A listener holds its own keypair and a
key set that maps each authorized client public key to a *name*; that name
is what `Incoming.identity` reports for every message the client sends, so a
daemon can decide what each sender may do (kvd/trust.py).

Key files (`generate_keypair`): `NAME.key` holds the public key (mode 0644),
`NAME.key_secret` the public and the secret key (mode 0600, created so). In a
keys directory (`KeyDirectory`) every `NAME.key` authorizes client NAME.
"""

from __future__ import annotations

import datetime
import os
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.auth


class KeySet(Protocol):
    """What a listener asks about a client key during its handshake."""

    def name_of(self, public_key: bytes) -> str | None:
        """The client's name for an authorized z85 public key, None otherwise."""


class StaticKeys:
    """A fixed key set: z85 public key -> name (a plain set: the key is its own name)."""

    def __init__(self, keys: Mapping[bytes, str] | Iterable[bytes]) -> None:
        self._names = (dict(keys) if isinstance(keys, Mapping)
                       else {k: k.decode("ascii") for k in keys})

    def name_of(self, public_key: bytes) -> str | None:
        return self._names.get(public_key)


class KeyDirectory:
    """The public keys in a directory, each `NAME.key` authorizing client NAME.

    Re-read when the directory changes (its mtime: checked on every lookup
    of an unknown key, and at most every `recheck` seconds for known ones),
    so a key added with `kvctl keys` is accepted at once and a removed one
    refused for new connections, without a restart. Links that already
    completed their handshake are not affected. Not thread-safe: one event
    loop asks.
    """

    def __init__(self, path: str | os.PathLike[str], recheck: float = 1.0) -> None:
        self.path = Path(path)
        self.recheck = recheck
        self._names: dict[bytes, str] = {}
        self._mtime: int | None = None
        self._checked = -float("inf")
        self._refresh(force=True)

    def _refresh(self, force: bool = False, stat_now: bool = False) -> None:
        now = time.monotonic()
        if not (force or stat_now) and now - self._checked < self.recheck:
            return
        self._checked = now
        mtime = self.path.stat().st_mtime_ns
        if mtime == self._mtime and not force:
            return
        names = {}
        for public_path in sorted(self.path.glob("*.key")):
            try:
                names[load_keypair(public_path)[0]] = public_path.stem
            except (OSError, ValueError):
                continue          # a half-written or foreign file authorizes nobody
        self._names, self._mtime = names, mtime

    def name_of(self, public_key: bytes) -> str | None:
        try:
            # an unknown key is worth a stat (a flood of them: one stat each,
            # a re-read only when the directory really changed)
            self._refresh(stat_now=public_key not in self._names)
        except OSError:
            return None           # the directory is gone: nobody is authorized
        return self._names.get(public_key)


def as_key_set(allowed: Any) -> KeySet:
    """A KeySet from a KeySet, a {public: name} mapping or a set of public keys."""
    return allowed if hasattr(allowed, "name_of") else StaticKeys(allowed)


@dataclass(frozen=True, slots=True)
class CurveServer:
    """Listener-side keys: our keypair (z85) and the clients we accept
    (`allowed_clients`: a KeySet, a {public: name} mapping, or a set of
    public keys, each then named by itself)."""

    public_key: bytes
    secret_key: bytes
    allowed_clients: Any

    def name_of(self, client_key: bytes) -> str | None:
        return as_key_set(self.allowed_clients).name_of(client_key)


@dataclass(frozen=True, slots=True)
class CurveClient:
    """Connection-side keys: our keypair and the server's public key (z85)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes


def generate_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write `name.key` (public) and `name.key_secret` (mode 0600) in ZPL format.

    Returns (public_path, secret_path). Refuses to overwrite an existing secret.
    The files are readable by `load_keypair` and by `zmq.auth.load_certificate`.
    A directory it creates is mode 0700.
    """
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    banner = f"#   ****  Generated on {stamp} by kvd  ****\n"
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    public_text = f'{banner}metadata\ncurve\n    public-key = "{public.decode()}"\n'
    secret_text = public_text + f'    secret-key = "{secret.decode()}"\n'
    # O_EXCL + mode at creation: the secret is never world-readable, not even briefly.
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret_text)
    # the public key last, through a temporary name: a KeyDirectory never
    # reads half a file, and a key is authorized only once its secret exists
    tmp = directory / f".{name}.key.tmp"
    tmp.write_text(public_text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, public_path)
    return public_path, secret_path


def load_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a key file written by `generate_keypair`.
    Raises ValueError for a file that holds no key."""
    public, secret = zmq.auth.load_certificate(os.fspath(path))   # OSError, ValueError
    if not public or len(public) != 40:
        raise ValueError(f"{path}: no z85 public key")
    return public, secret


def load_secret_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) from a `NAME.key_secret` file that only its owner can
    read: a secret key file readable by group or others is refused (as ssh
    refuses such a private key). Raises ValueError."""
    mode = os.stat(path).st_mode
    if stat.S_IMODE(mode) & 0o077:
        raise ValueError(f"{path} is readable by others (mode {stat.S_IMODE(mode):04o}); chmod 600 it")
    public, secret = load_keypair(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    return public, secret


def load_public_keys(paths: Iterable[str | os.PathLike[str]]) -> frozenset[bytes]:
    return frozenset(load_keypair(p)[0] for p in paths)


__all__ = ["KeySet", "StaticKeys", "KeyDirectory", "as_key_set", "CurveServer", "CurveClient",
           "generate_keypair", "load_keypair", "load_secret_keypair", "load_public_keys"]
