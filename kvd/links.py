"""Opening transport endpoints the way a cluster config says: authenticated.

Every daemon (coordinator, node) listens and connects through these two
functions so that authentication is applied uniformly. With
``curve_keys_dir`` set, a zmq+tcp / zmq+ipc listener runs CURVE and a ucx
listener the handshake of transports/ucx_auth.py, both accepting exactly the
public keys found there (``NAME.key``, re-read when the directory changes)
and naming each sender by its key file (``Incoming.identity``: what
kvd/trust.py decides on); a connection to daemon NAME authenticates with
this daemon's secret (``SELF.key_secret``, mode 0600) against ``NAME.key``.
A peer whose key is not in the directory, or that speaks without keys,
never gets a message delivered.

Without ``curve_keys_dir`` a daemon refuses to listen (``ConfigError``)
unless ``[cluster].insecure`` says so; then it logs a warning, louder for an
address beyond loopback. inproc links need no keys: only this process
reaches them, and a connection names itself (``self_name``).
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import transports
from kvd.cluster_config import ClusterConfig, ConfigError

log = logging.getLogger("kvd.links")


def _keys(cfg: ClusterConfig) -> Path:
    path = Path(cfg.curve_keys_dir)
    if not path.is_dir():
        raise ConfigError(f"cluster.curve_keys_dir {path} is not a directory")
    return path


def _own_keypair(cfg: ClusterConfig, self_name: str) -> tuple[bytes, bytes]:
    from transports.keys import load_secret_keypair

    secret_path = _keys(cfg) / f"{self_name}.key_secret"
    if not secret_path.is_file():
        raise ConfigError(f"secret key {secret_path} not found "
                          f"(kvctl keys --dir {cfg.curve_keys_dir} --name {self_name})")
    try:
        return load_secret_keypair(secret_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _authenticated(url: str) -> bool:
    """Links of this scheme are authenticated by keys (inproc: by construction)."""
    return url.startswith(("zmq+", "ucx://"))


def curve_server(cfg: ClusterConfig, self_name: str):
    """The listener keys (CurveServer) of daemon ``self_name``, or None without a keys dir."""
    if not cfg.curve_keys_dir:
        return None
    from transports.keys import CurveServer, KeyDirectory

    public, secret = _own_keypair(cfg, self_name)
    return CurveServer(public, secret, KeyDirectory(_keys(cfg)))


def curve_client(cfg: ClusterConfig, self_name: str, peer_name: str):
    """The connection keys (CurveClient) for ``self_name`` reaching ``peer_name``, or None."""
    if not cfg.curve_keys_dir:
        return None
    from transports.keys import CurveClient, load_keypair

    public, secret = _own_keypair(cfg, self_name)
    server_path = _keys(cfg) / f"{peer_name}.key"
    if not server_path.is_file():
        raise ConfigError(f"public key {server_path} of {peer_name} not found")
    return CurveClient(public, secret, load_keypair(server_path)[0])


def _loopback(url: str) -> bool:
    scheme, _, rest = url.partition("://")
    if scheme in ("zmq+ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if scheme == "ucx":
        return False                      # ucxx listens on every interface, whatever the URL says
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False                      # a name or an interface ("*", "eth0"): assume beyond


def check_listen(cfg: ClusterConfig, url: str) -> None:
    """Refuse (ConfigError) to listen at ``url`` without authentication unless
    ``cfg.insecure``; with it, warn. Call before slow start-up work too."""
    if not _authenticated(url) or cfg.curve_keys_dir:
        return
    if not cfg.insecure:
        raise ConfigError(
            f"refusing to listen on {url} without authentication: any process that reaches it "
            "could send admin commands and KV. Generate keys (kvctl keys --dir DIR --name NAME, "
            "for the coordinator and each node) and set [cluster].curve_keys_dir / --curve-keys-dir, "
            "or run without authentication with [cluster].insecure = true / --insecure")
    where = "on loopback only" if _loopback(url) else "BEYOND LOOPBACK"
    log.warning("insecure: %s listens %s without authentication; anyone who reaches it can "
                "send it anything, admin commands included", url, where)


async def listen(url: str, cfg: ClusterConfig, self_name: str, *,
                 registry: transports.InprocRegistry | None = None,
                 options: transports.TransportOptions | None = None) -> transports.Listener:
    check_listen(cfg, url)
    curve = curve_server(cfg, self_name) if _authenticated(url) else None
    return await transports.listen(url, options=options, registry=registry, curve=curve)


async def connect(url: str, cfg: ClusterConfig, self_name: str, peer_name: str, *,
                  registry: transports.InprocRegistry | None = None,
                  options: transports.TransportOptions | None = None) -> transports.Connection:
    if url.startswith("inproc://"):
        return await transports.connect(url, options=options, registry=registry, identity=self_name)
    curve = curve_client(cfg, self_name, peer_name) if _authenticated(url) else None
    return await transports.connect(url, options=options, registry=registry, curve=curve)
