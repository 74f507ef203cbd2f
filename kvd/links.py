"""Opening transport endpoints the way a cluster config says (CURVE, inproc).

Every daemon (coordinator, node) listens and connects through these two
functions so that CURVE is applied uniformly: with ``curve_keys_dir`` set, a
listener accepts exactly the public keys found there (``*.key``) and a
connection to daemon NAME authenticates with this daemon's secret
(``SELF.key_secret``) against ``NAME.key``. A peer whose key is not in the
directory, or that speaks without CURVE, never completes the handshake.
"""

from __future__ import annotations

from pathlib import Path

import transports
from kvd.cluster_config import ClusterConfig, ConfigError


def _keys(cfg: ClusterConfig) -> Path:
    path = Path(cfg.curve_keys_dir)
    if not path.is_dir():
        raise ConfigError(f"cluster.curve_keys_dir {path} is not a directory")
    return path


def _own_keypair(cfg: ClusterConfig, self_name: str) -> tuple[bytes, bytes]:
    from transports.zmq import load_keypair

    secret_path = _keys(cfg) / f"{self_name}.key_secret"
    if not secret_path.is_file():
        raise ConfigError(f"CURVE secret key {secret_path} not found (kvctl keys {self_name})")
    public, secret = load_keypair(secret_path)
    if secret is None:
        raise ConfigError(f"{secret_path} holds no secret key")
    return public, secret


def curve_server(cfg: ClusterConfig, self_name: str):
    """The CurveServer for daemon ``self_name``'s listener, or None without CURVE."""
    if not cfg.curve_keys_dir or not cfg.transport.startswith("zmq+"):
        return None
    from transports.zmq import CurveServer, load_public_keys

    public, secret = _own_keypair(cfg, self_name)
    allowed = load_public_keys(sorted(_keys(cfg).glob("*.key")))
    return CurveServer(public, secret, allowed)


def curve_client(cfg: ClusterConfig, self_name: str, peer_name: str):
    """The CurveClient for ``self_name`` reaching ``peer_name``, or None without CURVE."""
    if not cfg.curve_keys_dir or not cfg.transport.startswith("zmq+"):
        return None
    from transports.zmq import CurveClient, load_keypair

    public, secret = _own_keypair(cfg, self_name)
    server_path = _keys(cfg) / f"{peer_name}.key"
    if not server_path.is_file():
        raise ConfigError(f"CURVE public key {server_path} of {peer_name} not found")
    return CurveClient(public, secret, load_keypair(server_path)[0])


def _uses_curve(url: str) -> bool:
    return url.startswith("zmq+")


async def listen(url: str, cfg: ClusterConfig, self_name: str, *,
                 registry: transports.InprocRegistry | None = None,
                 options: transports.TransportOptions | None = None) -> transports.Listener:
    curve = curve_server(cfg, self_name) if _uses_curve(url) else None
    return await transports.listen(url, options=options, registry=registry, curve=curve)


async def connect(url: str, cfg: ClusterConfig, self_name: str, peer_name: str, *,
                  registry: transports.InprocRegistry | None = None,
                  options: transports.TransportOptions | None = None) -> transports.Connection:
    curve = curve_client(cfg, self_name, peer_name) if _uses_curve(url) else None
    return await transports.connect(url, options=options, registry=registry, curve=curve)
