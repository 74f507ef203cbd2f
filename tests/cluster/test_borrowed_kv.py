"""Borrowed KV on the serving path over real daemons (ZeroMQ with CURVE on loopback, the
tiny model): every node holds N = 768 tokens (``--kv-blocks 48``), lends and borrows. A
request of about 1.8 N tokens, sent with the ``openai`` client, is served to completion by
whichever node the coordinator picks, its sequence's tail in blocks another node lends and
attention over them computed there; its text is the single-node engine's (given enough
blocks), greedy and seeded.

Then the faults, each followed by every node's free blocks back where they started:

- the creditor killed (-9) mid-stream: the debtor computes the lost positions again, into
  a loan from the third node, and the stream goes on with the same text;
- the debtor killed mid-stream: its creditor frees the loan at lease end.

A micro-attention on a loan is served to the loan's debtor only.
"""

from __future__ import annotations

import concurrent.futures
import glob
import random
import time

import pytest

from .conftest import MODEL, SEEDED, Cluster, admin, body_of
from .test_engine_death import long_reference  # noqa: F401 -- the fixture
from .test_lending import LEASE_S, ledger_line, wait_for

pytestmark = pytest.mark.timeout(600)
NODES = ["a", "b", "c"]
BLOCKS, LEND, BORROW = 48, 40, 48             # N = 48 * 16 = 768 tokens per node
PROMPT, MAX_TOKENS = 1300, 80                 # 1380 tokens ~ 1.8 N: 87 blocks, 39 of them borrowed


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("borrowed-kv"), "zmq+tcp")
    for n in NODES:
        start(c, n)
    try:
        c.wait_nodes(NODES)
        wait_for(lambda: all(ledger_line(c, n).get("lendable") == LEND for n in NODES), "the caps in the ledger")
        yield c
    finally:
        c.stop()
    assert not glob.glob("/dev/shm/kvd-ring-*")               # no shared-memory ring outlives its nodes


def start(c: Cluster, name: str, make_key: bool = True) -> None:
    c.start_node(name, "--kv-blocks", str(BLOCKS), "--lend-kv-blocks", str(LEND), "--borrow-kv-blocks", str(BORROW),
                 make_key=make_key)


@pytest.fixture(scope="module")
def reference(long_reference):
    """The plain single-node engine with blocks for the whole sequence."""
    return long_reference


def prompt(seed: int, length: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(length)]


def want_text(reference, ids: list[int], sampling: dict | None, max_tokens: int = MAX_TOKENS) -> str:
    from engine.request import SamplingParams

    out = reference.generate([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                   **(sampling or {"temperature": 0.0})))[0]
    return reference.tokenizer.decode(out)


def stream(c: Cluster, ids: list[int], sampling: dict | None, on_chunk=None) -> str:
    text = []
    client = c.client(timeout=120)
    for i, chunk in enumerate(client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, stream=True,
                                                        **body_of(sampling))):
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if on_chunk is not None:
            on_chunk(i)
    return "".join(text)


def free_blocks(c: Cluster, nodes: list[str]) -> dict[str, int]:
    """Each node's free device blocks once its prefix cache is flushed (its heartbeat's)."""
    for n in nodes:
        admin(c.node_admin(n), "cache flush")
    time.sleep(1.2)                                 # a heartbeat or two carry it to the ledger
    return {n: ledger_line(c, n)["free"] for n in nodes}


def borrowing(c: Cluster, node: str) -> dict:
    return admin(c.node_admin(node), "loans")["debtor"]["borrowed"]


def test_a_request_past_one_node_is_served_with_the_single_node_text(trio, reference):
    c = trio
    start_free = free_blocks(c, NODES)
    assert start_free == dict.fromkeys(NODES, BLOCKS)
    for seed, sampling in ((1, None), (2, SEEDED[1])):
        ids = prompt(seed)
        assert stream(c, ids, sampling) == want_text(reference, ids, sampling), sampling
    served = {n: admin(c.node_admin(n), "loans") for n in NODES}
    assert sum(s["creditor"]["attention"]["served"] for s in served.values()) > 0
    assert sum(s["creditor"]["counts"]["returned"] for s in served.values()) == 2
    assert all(s["creditor"]["attention"]["refused"] == 0 for s in served.values())
    # every remote part went over the creditors' remote-attention channels, not the peer links,
    # the decode steps' through the same host's shared-memory rings, whose names are gone
    assert (sum(s["creditor"]["channel"]["served"] for s in served.values())
            == sum(s["creditor"]["attention"]["served"] for s in served.values()))
    assert sum(s["creditor"]["channel"]["ring_served"] for s in served.values()) >= MAX_TOKENS
    assert not glob.glob("/dev/shm/kvd-ring-*")
    assert free_blocks(c, NODES) == start_free


def test_micro_attention_only_for_the_loans_debtor(trio):
    """A RemoteAttend on a's loan: a's is served; c's in its own name is refused and
    counted, c's in a's name is the trust gate's; the loan's blocks take nothing else."""
    import torch

    from engine.model.config import tiny_config
    from kvd import protocol

    from .test_lending import as_

    c = trio
    loan = as_(c, "b", "a", protocol.BorrowRequest(debtor="a", blocks=16))
    assert loan.ok
    cfg = tiny_config()

    def attend(debtor: str) -> protocol.RemoteAttend:
        return protocol.RemoteAttend(debtor=debtor, loan_id=loan.loan_id, request_id="r", lo=1, layer=0, ctx=200,
                                     first=199, tensors=(torch.randn(1, cfg.num_heads, cfg.head_dim),
                                                         torch.randn(1, cfg.num_kv_heads, cfg.head_dim),
                                                         torch.randn(1, cfg.num_kv_heads, cfg.head_dim)))
    before = admin(c.node_admin("b"), "loans")["creditor"]
    got = as_(c, "b", "a", attend("a"))
    assert got.ok and got.tensors[0].shape == (1, 1, cfg.num_heads)
    stolen = as_(c, "b", "c", attend("c"))
    assert not stolen.ok and "no loan" in stolen.reason
    forged = as_(c, "b", "c", attend("a"))
    assert isinstance(forged, protocol.Error) and forged.code == "forbidden"
    after = admin(c.node_admin("b"), "loans")["creditor"]
    assert after["attention"]["served"] == before["attention"]["served"] + 1
    assert after["attention"]["refused"] == before["attention"]["refused"] + 1
    assert after["counts"]["forbidden"] == before["counts"]["forbidden"] + 1
    assert as_(c, "b", "a", protocol.ReturnLoan(debtor="a", loan_id=loan.loan_id)).ok


def test_the_attention_channel_serves_the_loans_debtor_only(trio, tmp_path):
    """b's remote-attention channel (its address in the loan's reply): a's RemoteAttend on
    a's loan is answered; c's key asking for a's loan is refused (no loan of c's), c's key
    in a's name is the trust gate's; another message type is rejected; a key outside the
    cluster never completes the handshake: the send ends at its deadline."""
    import torch
    import zmq

    from engine.dist_attention import RemoteKVError
    from engine.model.config import tiny_config
    from kvd import protocol
    from kvd.node.attention_channel import ChannelClient
    from transports.keys import CurveClient, generate_keypair, load_keypair

    from .test_lending import as_

    c = trio
    loan = as_(c, "b", "a", protocol.BorrowRequest(debtor="a", blocks=16))
    assert loan.ok and loan.channel.startswith("tcp://127.0.0.1:")
    cfg = tiny_config()

    def attend(debtor: str) -> protocol.RemoteAttend:
        return protocol.RemoteAttend(id=f"m-{debtor}-{time.monotonic_ns()}", debtor=debtor, loan_id=loan.loan_id,
                                     request_id="r", lo=1, layer=0, ctx=200, first=199,
                                     tensors=(torch.randn(1, cfg.num_heads, cfg.head_dim),
                                              torch.randn(1, cfg.num_kv_heads, cfg.head_dim),
                                              torch.randn(1, cfg.num_kv_heads, cfg.head_dim)))

    def ask(client: ChannelClient, msg: protocol.Message, timeout: float = 10.0, reply_bytes: int = 0
            ) -> protocol.Message:
        client.send(msg, timeout, reply_bytes)
        return client.wait(msg.id, timeout)

    generate_keypair(tmp_path, "stranger")
    stranger = CurveClient(*load_keypair(tmp_path / "stranger.key_secret"),
                           server_key=load_keypair(c.keys_dir / "b.key")[0])
    ctx = zmq.Context()
    clients = [ChannelClient(ctx, loan.channel, keys)
               for keys in (c.client_keys("b", "a"), c.client_keys("b", "c"), stranger)]
    try:
        before = admin(c.node_admin("b"), "loans")["creditor"]
        got = ask(clients[0], attend("a"))
        assert got.ok and got.tensors[0].shape == (1, 1, cfg.num_heads)
        stolen = ask(clients[1], attend("c"))
        assert not stolen.ok and "no loan" in stolen.reason
        forged = ask(clients[1], attend("a"))
        assert not forged.ok and forged.reason.startswith("forbidden: debtor 'a' is not the sender's key 'c'")
        # a shared-memory ring: for the loan's debtor alone, in its own name
        assert not clients[1].open_ring("c", loan.loan_id, 10.0)
        posing = ask(clients[1], protocol.RingOpen(id="m-open", debtor="a", loan_id=loan.loan_id, host="h"))
        assert not posing.ok and posing.reason.startswith("forbidden: debtor 'a' is not the sender's key 'c'")
        assert clients[0].open_ring("a", loan.loan_id, 10.0)
        on_ring = ask(clients[0], attend("a"), reply_bytes=4096)
        assert on_ring.ok and clients[0].counts["ring"] == 1
        assert not ask(clients[0], attend("c"), reply_bytes=4096).ok               # a's ring, in c's name
        other = protocol.ReturnLoan(id="m-return", debtor="a", loan_id=loan.loan_id)   # not the channel's
        clients[0].send(other, 10.0)
        wrong = clients[0].wait(other.id, 10.0)
        assert not wrong.ok and wrong.reason == "ReturnLoan on the attention channel"
        with pytest.raises(RemoteKVError, match="within 1.0 s"):
            ask(clients[2], attend("a"), timeout=1.0)
        after = admin(c.node_admin("b"), "loans")["creditor"]
        assert after["attention"]["served"] == before["attention"]["served"] + 2
        assert after["attention"]["refused"] == before["attention"]["refused"] + 1
        assert after["channel"]["forbidden"] == before["channel"]["forbidden"] + 3
        assert after["channel"]["rejected"] == before["channel"]["rejected"] + 1
        assert after["channel"]["refused_keys"] > before["channel"]["refused_keys"]
        assert after["channel"]["ring_refused"] == before["channel"]["ring_refused"] + 1
        assert after["channel"]["ring_served"] == before["channel"]["ring_served"] + 1
    finally:
        for client in clients:
            client.close()
        ctx.term()
    assert as_(c, "b", "a", protocol.ReturnLoan(debtor="a", loan_id=loan.loan_id)).ok


def test_a_creditor_killed_mid_stream_and_then_a_debtor(trio, reference):
    c = trio
    ids, sampling = prompt(3), SEEDED[0]
    want = want_text(reference, ids, sampling)
    killed: list[str] = []

    def kill_the_creditor(i: int) -> None:
        if i == 10 and not killed:
            debtor = next(n for n in NODES if borrowing(c, n))
            creditor = next(iter(borrowing(c, debtor)))
            c.nodes[creditor].kill9()
            killed.extend([creditor, debtor])
    assert stream(c, ids, sampling, kill_the_creditor) == want
    creditor, debtor = killed
    assert admin(c.node_admin(debtor), "loans")["debtor"]["requests"]["lost"] == 1
    live = [n for n in NODES if n != creditor]
    c.wait_gone(creditor, timeout=30)
    assert free_blocks(c, live) == dict.fromkeys(live, BLOCKS)
    assert not glob.glob("/dev/shm/kvd-ring-*")              # the killed creditor's rings: unnamed since mapped
    start(c, creditor, make_key=False)              # back for the next fault
    c.wait_nodes(NODES)
    wait_for(lambda: ledger_line(c, creditor).get("lendable") == LEND, "the restarted node's cap")

    # the debtor killed mid-stream: its creditor frees the loan at lease end
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gone = pool.submit(stream, c, prompt(4), None)
        debtor = wait_for(lambda: next((n for n in NODES if borrowing(c, n)), None), "a debtor", timeout=60)
        lender = next(iter(borrowing(c, debtor)))
        c.nodes[debtor].kill9()
        with pytest.raises(Exception):
            gone.result(timeout=60)
    live = [n for n in NODES if n != debtor]
    wait_for(lambda: admin(c.node_admin(lender), "loans")["creditor"]["lent"] == {}, "the lapsed loan",
             timeout=LEASE_S + 10)
    assert free_blocks(c, live) == dict.fromkeys(live, BLOCKS)
