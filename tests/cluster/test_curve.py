"""CURVE on: nodes with a wrong or missing key cannot join, nor send anything."""

from __future__ import annotations

import asyncio
import time

import pytest

import transports
from kvd import protocol
from transports.zmq import CurveClient, generate_keypair, load_keypair

from .conftest import Cluster, admin


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("curve")
    rogue = tmp / "rogue"
    c = Cluster(tmp, "zmq+tcp")                                          # keys in tmp/keys
    keys = c.keys_dir
    generate_keypair(rogue, "evil")                                    # a key nobody authorized
    (rogue / "coordinator.key").write_text((keys / "coordinator.key").read_text())
    c.start_node("good")
    c.start_node("evil", "--curve-keys-dir", str(rogue), make_key=False)  # wrong key
    c.start_node("plain", "--curve-keys-dir", "", "--insecure", make_key=False)   # no key at all
    c.start_node("open", "--curve-keys-dir", "", make_key=False)         # no key, not insecure
    try:
        c.wait_nodes(["good"])
        yield c, keys, rogue
    finally:
        c.stop()


def test_only_the_node_with_an_authorized_key_joins(secure):
    c, _, _ = secure
    time.sleep(3)                                  # several registration attempts of the others
    assert c.nodes_up() == ["good"]
    assert c.nodes["evil"].alive() and c.nodes["plain"].alive()     # refused, not crashed
    r = c.client(timeout=30).completions.create(model="tiny", prompt="secure", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_a_node_without_keys_refuses_to_open_its_port_unless_told_insecure(secure):
    c, _, _ = secure
    assert c.nodes["open"].proc.wait(30) == 2                        # before loading the model
    log = c.nodes["open"].log_text()
    assert "refusing to listen" in log and "--insecure" in log and "curve_keys_dir" in log
    assert "insecure:" in c.nodes["plain"].log_text()                # the insecure one says so


def test_a_wrong_or_missing_key_cannot_send(secure):
    c, keys, rogue = secure
    before = admin(c.admin_socket, "status")

    async def attempt(curve) -> str:
        conn = await transports.connect(c.coordinator_url, curve=curve,
                                        options=transports.TransportOptions(request_timeout=1.5))
        try:
            await protocol.call(conn, protocol.Hello(node="intruder", address="zmq+tcp://127.0.0.1:1",
                                                     blocks_per_tier={}, block_size=16), timeout=1.5)
            return "answered"
        except transports.TransportError as exc:
            return type(exc).__name__
        finally:
            await conn.close()

    pub, sec = load_keypair(rogue / "evil.key_secret")
    wrong = CurveClient(pub, sec, load_keypair(keys / "coordinator.key")[0])
    assert asyncio.run(attempt(wrong)) in ("AuthenticationFailed", "RequestTimeout")
    assert asyncio.run(attempt(None)) in ("AuthenticationFailed", "RequestTimeout", "PeerGone")
    after = admin(c.admin_socket, "status")
    assert after["nodes"] == ["good"] and after["joins"] == before["joins"]
