"""CURVE: key files, an allowed client gets through, everyone else gets nothing through."""

from __future__ import annotations

import asyncio
import stat

import pytest
import zmq

import transports
from transports import AuthenticationFailed, PeerGone, RequestTimeout, TransportOptions
from transports.zmq import CurveClient, CurveServer, generate_keypair, load_keypair, load_public_keys

pytestmark = pytest.mark.timeout(60)

OPTIONS = TransportOptions(send_timeout=0.5, request_timeout=0.5)


@pytest.fixture
def keys(tmp_path):
    """server, good client and an intruder keypair, as (public, secret)."""
    made = {}
    for name in ("server", "client", "intruder"):
        public_path, secret_path = generate_keypair(tmp_path / "keys", name)
        public, _ = load_keypair(public_path)
        public_again, secret = load_keypair(secret_path)
        assert public == public_again and secret is not None
        made[name] = (public, secret)
    return made


async def start_server(keys, *allowed: str):
    curve = CurveServer(*keys["server"], allowed_clients=frozenset(keys[a][0] for a in allowed))
    listener = await transports.listen("zmq+tcp://127.0.0.1:0", options=OPTIONS, curve=curve)
    return listener


async def echo_forever(listener):
    while True:
        incoming = await listener.recv()
        await listener.reply(incoming, b'{"ok":true}')


def test_generate_keypair_modes_and_no_overwrite(tmp_path):
    public_path, secret_path = generate_keypair(tmp_path, "n1")
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(public_path.stat().st_mode) == 0o644
    assert load_keypair(public_path)[1] is None  # the public file holds no secret
    assert zmq.auth.load_certificate(str(secret_path))[1] is not None  # pyzmq reads it too
    assert load_public_keys([public_path]) == {load_keypair(public_path)[0]}
    with pytest.raises(FileExistsError):
        generate_keypair(tmp_path, "n1")


async def test_allowed_client_round_trips(keys):
    listener = await start_server(keys, "client")
    server = asyncio.create_task(echo_forever(listener))
    curve = CurveClient(*keys["client"], server_key=keys["server"][0])
    conn = await transports.connect(listener.url, options=OPTIONS, curve=curve)
    try:
        reply = await conn.request({"q": 1}, timeout=5)
        assert reply.header_dict() == {"ok": True}
    finally:
        server.cancel()
        await conn.close()
        await listener.close()


@pytest.mark.parametrize("who", ["unknown_client_key", "wrong_server_key", "no_curve_at_all"])
async def test_bad_or_missing_keys_cannot_send(keys, who):
    listener = await start_server(keys, "client")
    if who == "unknown_client_key":
        curve = CurveClient(*keys["intruder"], server_key=keys["server"][0])
    elif who == "wrong_server_key":
        curve = CurveClient(*keys["client"], server_key=keys["intruder"][0])
    else:
        curve = None
    conn = await transports.connect(listener.url, options=OPTIONS, curve=curve)
    try:
        # The client learns of the failed handshake (libzmq retries it), so the
        # request ends in AuthenticationFailed rather than at its deadline.
        with pytest.raises(AuthenticationFailed):
            await conn.request({"q": 1}, timeout=5)
        with pytest.raises((RequestTimeout, PeerGone)):
            await conn.send({"q": 2})
        with pytest.raises(TimeoutError):  # nothing ever reached the listener
            await asyncio.wait_for(listener.recv(), 0.5)
        assert listener.stats.received == 0
        # a key the ZAP handler turned away is counted (a wrong server key or
        # no CURVE at all fails before the ZAP handler is asked)
        assert (listener.stats.refused > 0) == (who == "unknown_client_key")
    finally:
        await conn.close()
        await listener.close()


async def test_curve_is_refused_off_zmq(keys, registry):
    curve = CurveServer(*keys["server"], allowed_clients=frozenset())
    with pytest.raises(ValueError, match="CURVE"):
        await transports.listen("inproc://x", registry=registry, curve=curve)


async def test_each_message_carries_the_name_of_its_senders_key(keys):
    """The listener reports who sent what: the name its key set gives the
    client's key (the ZAP User-Id of the connection), on every message."""
    curve = CurveServer(*keys["server"], allowed_clients={keys["client"][0]: "n7",
                                                          keys["intruder"][0]: "coordinator"})
    listener = await transports.listen("zmq+tcp://127.0.0.1:0", options=OPTIONS, curve=curve)
    assert listener.authenticated
    conns = []
    try:
        for who in ("client", "intruder"):
            conn = await transports.connect(listener.url, options=OPTIONS,
                                            curve=CurveClient(*keys[who], server_key=keys["server"][0]))
            conns.append(conn)
            await conn.send({"from": who})
            incoming = await asyncio.wait_for(listener.recv(), 5)
            assert incoming.header_dict() == {"from": who}
            assert incoming.identity == {"client": "n7", "intruder": "coordinator"}[who]
    finally:
        for conn in conns:
            await conn.close()
        await listener.close()


async def test_a_keyless_listener_names_nobody(kind, endpoints):
    listener, conn = await endpoints(kind)
    await conn.send({"x": 1})
    incoming = await asyncio.wait_for(listener.recv(), 5)
    assert incoming.identity is None
    assert listener.authenticated == (kind == "inproc")


async def test_an_inproc_connection_speaks_under_the_name_it_connected_as(registry):
    listener = await transports.listen("inproc://n", registry=registry)
    conn = await transports.connect("inproc://n", registry=registry, identity="coordinator")
    try:
        await conn.send({"x": 1})
        assert (await asyncio.wait_for(listener.recv(), 5)).identity == "coordinator"
        with pytest.raises(ValueError, match="keys"):
            await transports.connect("zmq+tcp://127.0.0.1:1", identity="coordinator")
    finally:
        await conn.close()
        await listener.close()


async def test_a_key_directory_admits_keys_added_later_and_drops_removed_ones(tmp_path):
    """KeyDirectory re-reads its directory when it changes: a node key made
    with `kvctl keys` after the listener started is accepted, under its
    file's name; a removed key is refused for new connections."""
    from transports.keys import KeyDirectory

    keys_dir = tmp_path / "keys"
    generate_keypair(keys_dir, "server")
    server = load_keypair(keys_dir / "server.key_secret")
    ring = KeyDirectory(keys_dir, recheck=0.0)
    listener = await transports.listen("zmq+tcp://127.0.0.1:0", options=OPTIONS,
                                       curve=CurveServer(*server, allowed_clients=ring))
    try:
        generate_keypair(keys_dir, "late")                    # after the listener started
        late = CurveClient(*load_keypair(keys_dir / "late.key_secret"), server_key=server[0])
        conn = await transports.connect(listener.url, options=OPTIONS, curve=late)
        try:
            await conn.send({"hi": 1})
            assert (await asyncio.wait_for(listener.recv(), 5)).identity == "late"
        finally:
            await conn.close()
        (keys_dir / "late.key").unlink()                      # revoked
        conn = await transports.connect(listener.url, options=OPTIONS, curve=late)
        try:
            with pytest.raises(AuthenticationFailed):
                await conn.request({"q": 1}, timeout=5)
        finally:
            await conn.close()
    finally:
        await listener.close()


def test_a_secret_key_readable_by_others_is_refused(tmp_path):
    from transports.keys import load_secret_keypair

    _, secret_path = generate_keypair(tmp_path, "n1")
    assert load_secret_keypair(secret_path)[1] is not None
    secret_path.chmod(0o640)
    with pytest.raises(ValueError, match="readable by others"):
        load_secret_keypair(secret_path)
