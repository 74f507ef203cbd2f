"""UCX links authenticate with the CURVE keypairs before any message is delivered."""

from __future__ import annotations

import asyncio

import pytest
from zmq.utils import z85

import transports
from transports import AuthenticationFailed, TransportError, TransportOptions
from transports.keys import CurveClient, CurveServer, generate_keypair, load_keypair
from transports.ucx_auth import link_key

from .conftest import HAVE_UCXX

pytestmark = pytest.mark.timeout(60)
OPTIONS = TransportOptions(send_timeout=3.0, request_timeout=3.0)
needs_ucx = pytest.mark.skipif(not HAVE_UCXX, reason="ucxx not installed (pip install 'kvd[ucx]')")


@pytest.fixture
def keys(tmp_path):
    made = {}
    for name in ("server", "n1", "stranger"):
        generate_keypair(tmp_path, name)
        made[name] = load_keypair(tmp_path / f"{name}.key_secret")
    return made


def test_the_link_key_is_the_same_at_both_ends_and_only_there(keys):
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    (spub, ssec), (cpub, csec), (xpub, xsec) = keys["server"], keys["n1"], keys["stranger"]
    # zmq's CURVE keys are X25519 keys: the public key is the secret times the base point
    assert X25519PrivateKey.from_private_bytes(z85.decode(csec)).public_key().public_bytes_raw() \
        == z85.decode(cpub)
    assert link_key(ssec, cpub) == link_key(csec, spub)
    assert link_key(xsec, spub) != link_key(csec, spub)
    with pytest.raises(AuthenticationFailed):
        link_key(ssec, z85.encode(bytes(32)))          # a low-order point gives no shared key


async def _server(keys, allowed):
    curve = CurveServer(*keys["server"], allowed_clients={keys[n][0]: n for n in allowed})
    return await transports.listen("ucx://127.0.0.1:0", options=OPTIONS, curve=curve)


@needs_ucx
async def test_an_authorized_key_round_trips_under_its_name(keys):
    listener = await _server(keys, ["n1"])
    assert listener.authenticated
    conn = await transports.connect(listener.url, options=OPTIONS,
                                    curve=CurveClient(*keys["n1"], server_key=keys["server"][0]))
    try:
        async def echo():
            incoming = await listener.recv()
            assert incoming.identity == "n1"
            await listener.reply(incoming, incoming.header)
        server = asyncio.create_task(echo())
        reply = await conn.request({"q": 1}, timeout=5)
        assert reply.header_dict() == {"q": 1}
        await server
    finally:
        await conn.close()
        await listener.close()


@needs_ucx
@pytest.mark.parametrize("who", ["unknown_client_key", "wrong_server_key", "no_keys_at_all"])
async def test_a_bad_or_missing_key_gets_nothing_delivered(keys, who):
    listener = await _server(keys, ["n1"])
    try:
        if who == "no_keys_at_all":
            # a plain ucx client: its first message is not a handshake
            conn = await transports.connect(listener.url, options=OPTIONS)
            try:
                with pytest.raises(TransportError):
                    await conn.request({"type": "AdminCommand", "command": "fail"}, timeout=3)
            finally:
                await conn.close()
        else:
            client, server_key = (("stranger", keys["server"][0]) if who == "unknown_client_key"
                                  else ("n1", keys["stranger"][0]))
            with pytest.raises(AuthenticationFailed):
                await transports.connect(listener.url, options=OPTIONS,
                                         curve=CurveClient(*keys[client], server_key=server_key))
        with pytest.raises(TimeoutError):                      # nothing reached the listener
            await asyncio.wait_for(listener.recv(), 0.5)
        assert listener.stats.received == 0
        deadline = asyncio.get_running_loop().time() + 5
        while listener.stats.refused == 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert listener.stats.refused >= 1
    finally:
        await listener.close()
