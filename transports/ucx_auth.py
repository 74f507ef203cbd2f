"""Authenticating a UCX link before any message crosses it.

UCX has no CURVE, so kvd authenticates each UCX endpoint itself, with the
same CURVE keypairs (Curve25519) and key sets the zmq transport uses
(transports/keys.py): both ends prove they hold the secret of a public key
the other end trusts, and the listener learns the client's name. Until the
handshake has succeeded the listener reads nothing but it, into fixed-size
buffers (a stranger cannot make it allocate), and delivers no message.

    client (connector)                              server (listener)
    HELLO  MAGIC | client_pub | nonce_c      ──▶   name = key set(client_pub), else close
                                             ◀──   CHALLENGE nonce_s | MAC(k, "server" | T)
    check the server's MAC: it holds server_secret
    PROOF  MAC(k, "client" | T)              ──▶   check: the client holds client_secret
                                             ◀──   OK

    k = HMAC-SHA256(X25519(own secret, peer public), "kvd ucx link key v1")
    T = client_pub | server_pub | nonce_c | nonce_s      (raw 32-byte keys, 32-byte nonces)

k is the static Diffie-Hellman secret of the two keypairs: only their two
holders can compute it. Fresh nonces from both sides make every transcript
new (no replay); the "server"/"client" labels stop a MAC being reflected.
What it does not give: UCX traffic is neither encrypted nor integrity
protected after the handshake (RDMA fabrics rarely can afford it); a
network that an attacker can inject into needs zmq+tcp, whose CURVE
encrypts and authenticates every frame. See docs/operations.md.

X25519 comes from the `cryptography` package (OpenSSL; installed with the
`ucx` extra), imported on first use.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from zmq.utils import z85

from .base import AuthenticationFailed
from .keys import CurveClient, CurveServer

MAGIC = b"KVDAUTH1"
OK = b"KVDAUTOK"
NONCE = 32
KEY = 32
MAC = 32
HELLO_SIZE = len(MAGIC) + KEY + NONCE
CHALLENGE_SIZE = NONCE + MAC
_KDF_LABEL = b"kvd ucx link key v1"


def link_key(own_secret: bytes, peer_public: bytes) -> bytes:
    """The MAC key two keypairs share (z85 keys in, 32 raw bytes out).
    Raises AuthenticationFailed for a key that is not a usable Curve25519 point."""
    try:
        from cryptography.hazmat.primitives.asymmetric.x25519 import (  # noqa: PLC0415
            X25519PrivateKey,
            X25519PublicKey,
        )
    except ImportError as e:
        raise ImportError("authenticated ucx:// links need the 'cryptography' package: "
                          "pip install 'kvd[ucx]'") from e
    try:
        shared = X25519PrivateKey.from_private_bytes(z85.decode(own_secret)).exchange(
            X25519PublicKey.from_public_bytes(z85.decode(peer_public)))
    except ValueError as e:          # a bad length, or a low-order point (all-zero secret)
        raise AuthenticationFailed(f"unusable key: {e}") from None
    return hmac.new(shared, _KDF_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, label + transcript, hashlib.sha256).digest()


async def accept(ep: Any, keys: CurveServer) -> str:
    """Server side, on a fresh endpoint: the client's name once it proved
    its key. Raises AuthenticationFailed (or a UCX error); the caller sets
    the deadline and closes the endpoint on failure."""
    hello = bytearray(HELLO_SIZE)
    await ep.recv(hello)
    if bytes(hello[:len(MAGIC)]) != MAGIC:
        raise AuthenticationFailed("not a kvd handshake")
    client_raw, nonce_c = bytes(hello[len(MAGIC):len(MAGIC) + KEY]), bytes(hello[len(MAGIC) + KEY:])
    client_pub = z85.encode(client_raw)
    name = keys.name_of(client_pub)
    if not name:
        raise AuthenticationFailed("client key not authorized")
    key = link_key(keys.secret_key, client_pub)
    nonce_s = os.urandom(NONCE)
    transcript = client_raw + z85.decode(keys.public_key) + nonce_c + nonce_s
    await ep.send(bytearray(nonce_s + _mac(key, b"server", transcript)))
    proof = bytearray(MAC)
    await ep.recv(proof)
    if not hmac.compare_digest(bytes(proof), _mac(key, b"client", transcript)):
        raise AuthenticationFailed(f"client {name!r} did not prove its key")
    await ep.send(bytearray(OK))
    return name


async def authenticate(ep: Any, keys: CurveClient) -> None:
    """Client side, on a fresh endpoint: prove our key and check the
    server's. Raises AuthenticationFailed (or a UCX error when the server
    closed on us: our key is not authorized there)."""
    client_raw = z85.decode(keys.public_key)
    nonce_c = os.urandom(NONCE)
    await ep.send(bytearray(MAGIC + client_raw + nonce_c))
    challenge = bytearray(CHALLENGE_SIZE)
    await ep.recv(challenge)
    nonce_s, server_mac = bytes(challenge[:NONCE]), bytes(challenge[NONCE:])
    key = link_key(keys.secret_key, keys.server_key)
    transcript = client_raw + z85.decode(keys.server_key) + nonce_c + nonce_s
    if not hmac.compare_digest(server_mac, _mac(key, b"server", transcript)):
        raise AuthenticationFailed("the server did not prove the key we expect of it")
    await ep.send(bytearray(_mac(key, b"client", transcript)))
    ok = bytearray(len(OK))
    await ep.recv(ok)
    if bytes(ok) != OK:
        raise AuthenticationFailed("the server refused the handshake")


__all__ = ["accept", "authenticate", "link_key"]
