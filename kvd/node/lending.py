"""Borrowed KV memory, the node's side of Infinite-LLM's contract protocol
(§4.4): this node lends blocks as a creditor (``Lender``) and borrows them
as a debtor (``Borrower``). The blocks' bookkeeping is the rManager's
(engine/memory/rmanager.py); each loan is a LENT region of the node's one
KV inbox, whose door these messages come through (kvd/node/inbox.py)::

    debtor A                      coordinator (ledger.py)          creditor B
    CreditorQuery(A, n) ────────▶ candidates: up to 3, best first
                        ◀──────── Creditors(B, C, ...)
    BorrowRequest(A, n) ─────────────────────────────────────────▶ rManager.lend: FCFS, cap, free
                        ◀───────────────────────────────────────── BorrowReply(loan | reason)   (at once)
    (all say no: ask the coordinator once more, excluding them; then the caller preempts)
    LoanWrite(A, loan, KV) ──────────────────────────────────────▶ into the loan's blocks (A's only)
    LeaseRenew(A, loans)   ── every heartbeat interval ──────────▶ leases run on; a silent A's lapse
    ReturnLoan(A, loan)    ──────────────────────────────────────▶ blocks freed

The trust gate (kvd/trust.py) has already checked that a lending
message's ``debtor`` is its sender's key; the rManager then serves a
loan's blocks to that debtor only. A refusal is counted and changes
nothing. Every wait has a deadline (``timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time

import zmq
from collections.abc import Awaitable, Callable
from typing import Any

from engine.borrowing import KVBorrowing, Loan as EngineLoan
from engine.memory.rmanager import Borrowed, Loan, RManager
from kvd import protocol
from kvd.config import ConfigError
from kvd.node.engine_driver import EngineDriver
from kvd.node.attention_channel import ChannelClient, ChannelServer, channel_host, check_channel_url
from kvd.node.attention_ring import RingPolicy
from kvd.node.recall import RecallServer
from kvd.node.remote_attention import AttentionServer, ChannelLender, WireLender
from transports import Connection, TransportError

log = logging.getLogger("kvd.lending")

MESSAGES = protocol.LENDING_MESSAGES
ROUNDS = 2          # a debtor asks the coordinator this many times before it gives up (then: preemption)
RING_OPEN_S = 5.0   # the longest a debtor's engine thread waits for a creditor's shared-memory ring


class Lender:
    """The creditor's answers to ``MESSAGES``. Every call on the rManager
    runs on the engine thread (``driver``), but a ``RemoteAttend``'s, which
    runs on the attention server's worker (remote_attention.py); ``lock``
    keeps the two apart. ``lent`` is a copy of its blocks lent per debtor,
    safe to read from the event loop."""

    def __init__(self, driver: EngineDriver, rmanager: RManager, *, authenticated: bool) -> None:
        self.driver = driver
        self.rmanager = rmanager
        self.authenticated = authenticated
        self.lent: dict[str, int] = {}
        self.lock = threading.Lock()
        model = driver.engine.model
        self.attention = AttentionServer(
            rmanager, model.attention_kernel, model.scale,
            [model.config.layer_window(i) for i in range(model.num_local_layers)],
            (model.config.num_heads, model.config.num_kv_heads, model.config.head_dim), self.lock,
            max_ctx=driver.engine.max_model_len)
        self.channel: ChannelServer | None = None     # RemoteAttend without the event loop (open_channel)
        self.recall = RecallServer(rmanager, self.lock, self.attention.executor)   # RecallKV (recall.py)

    def open_channel(self, address: str, curve: Any) -> None:
        """Serve RemoteAttend on a remote-attention channel beside the node's listener at
        ``address`` (a ``zmq+tcp`` one; others have none), CURVE with the listener's keys
        ``curve`` (None: insecure), where this node lends. Its address goes to each debtor
        with its loan; without one (another scheme, a wildcard host, a bind that fails)
        debtors ask over their peer links."""
        if self.rmanager.lend_cap > 0 and (host := channel_host(address)) is not None:
            try:
                self.channel = ChannelServer(host, self.attention.serve, curve,
                                             RingPolicy(self._may_ring, lambda debtor: debtor in self.lent,
                                                        lambda: self.driver.idle), self.attention.lane)
            except zmq.ZMQError as exc:         # the interface takes no second port: the peer link serves
                log.warning("no remote-attention channel on %s: %s", host, exc)

    def _may_ring(self, loan_id: str, debtor: str) -> str | None:
        """Why ``debtor`` may not have a shared-memory ring here (no loan ``loan_id`` of its),
        or None. The channel's thread."""
        with self.lock:
            loan = self.rmanager.access(loan_id, debtor)
        return loan if isinstance(loan, str) else None

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.attention.close()

    def answer_now(self, msg: protocol.Message, incoming: Any) -> protocol.Message | None:
        """The reply when the engine is idle (answered inline), else None: await ``answer``."""
        if isinstance(msg, (protocol.RemoteAttend, protocol.RecallKV)):
            return None                     # computed (read) on the attention server's worker
        done, reply = self.driver.try_call(lambda engine: self._answer(msg, incoming))
        return reply if done else None

    async def answer(self, msg: protocol.Message, incoming: Any) -> protocol.Message:
        if isinstance(msg, protocol.RemoteAttend):
            return await self.attention.answer(msg, self._debtor(msg, incoming))
        if isinstance(msg, protocol.RecallKV):
            return await self.recall.answer(msg, self._debtor(msg, incoming))
        return await self.driver.call(lambda engine: self._answer(msg, incoming))

    def _debtor(self, msg: Any, incoming: Any) -> str | None:
        """Who asks: the sender's key (the trust gate made ``msg.debtor``
        equal to it); on an insecure listener, whom the message names."""
        return incoming.identity if self.authenticated else msg.debtor

    def _answer(self, msg: protocol.Message, incoming: Any) -> protocol.Message:
        """Engine thread: one lending message's reply."""
        rm, debtor = self.rmanager, self._debtor(msg, incoming)
        with self.lock:
            return self._answer_locked(msg, rm, debtor)

    def _answer_locked(self, msg: protocol.Message, rm: RManager, debtor: str | None) -> protocol.Message:
        try:
            if isinstance(msg, protocol.BorrowRequest):
                loan = rm.lend(debtor, msg.blocks, secrets.token_hex(8), time.monotonic())
                if isinstance(loan, str):
                    return protocol.BorrowReply(id=msg.id, ok=False, reason=loan)
                return protocol.BorrowReply(id=msg.id, ok=True, loan_id=loan.loan_id, blocks=loan.blocks,
                                            lease_s=rm.lease_s, channel=self.channel.url if self.channel else "")
            if isinstance(msg, protocol.LeaseRenew):
                n = rm.renew(debtor, msg.loan_ids, time.monotonic())
                gone = tuple(i for i in msg.loan_ids if i not in rm.loans or rm.loans[i].debtor != debtor)
                return protocol.LoanAck(id=msg.id, ok=not gone, renewed=n, gone=gone,
                                        reason="loans expired or unknown here" if gone else "")
            if isinstance(msg, protocol.ReturnLoan):
                why = rm.give_back(debtor, msg.loan_id)
            else:
                payload = msg.tensors[0].to_torch()
                why = rm.write(msg.loan_id, debtor, msg.start, payload, (msg.layer_start, msg.layer_end))
            return protocol.LoanAck(id=msg.id, ok=why is None, loan_id=msg.loan_id, reason=why or "")
        finally:
            self.lent = rm.lent_per_debtor()

    async def expire(self) -> list[Loan]:
        """Free the loans whose debtor stopped renewing them; a debtor left with no loan
        here is gone, and its shared-memory ring with it (attention_ring.py)."""
        def reap(engine) -> list[Loan]:
            with self.lock:
                dead = self.rmanager.expire(time.monotonic())
            self.lent = self.rmanager.lent_per_debtor()
            return dead
        if not self.lent:
            return []
        dead = await self.driver.call(reap)
        if self.channel is not None:
            for debtor in {loan.debtor for loan in dead} - set(self.lent):
                self.channel.close_ring(debtor)
        return dead

    def stats(self) -> dict[str, Any]:
        rm = self.rmanager
        return {"lend_cap": rm.lend_cap, "lent": dict(self.lent), "counts": dict(rm.counts),
                "attention": dict(self.attention.counts), "recall": dict(self.recall.counts),
                "channel": {**self.channel.counts, "refused_keys": self.channel.refused_keys} if self.channel else {}}


class Borrower:
    """The debtor's side: ask the coordinator for creditors, ask them in
    turn, keep the loans' leases alive, give loans back. Runs on the event
    loop; the rManager's ``borrowed`` book is touched only here.

    ``ask_coordinator``: sends a CreditorQuery, returns the reply.
    ``connect``: a link to a node (name, URL), the node's peer links."""

    def __init__(self, name: str, rmanager: RManager,
                 ask_coordinator: Callable[[protocol.CreditorQuery], Awaitable[protocol.Message]],
                 connect: Callable[[str, str], Awaitable[Connection]], timeout: float) -> None:
        self.name = name
        self.rmanager = rmanager
        self._ask = ask_coordinator
        self._connect = connect
        self.timeout = timeout
        self.addresses: dict[str, str] = {}       # creditor -> its URL
        self.lease_s: dict[str, float] = {}       # creditor -> its loans' lease
        self.renewed_at: dict[str, float] = {}    # creditor -> when it last answered a renewal (monotonic)
        self.channels: dict[str, str] = {}        # creditor -> its remote-attention channel's URL
        self.counts = {"borrowed": 0, "refused": 0, "gave_up": 0, "lost": 0}
        self.requests: KVBorrowing | None = None   # the engine's requests on borrowed blocks (serve_borrowing)

    async def borrow(self, blocks: int) -> Borrowed | None:
        """``blocks`` blocks on some creditor, or None when no one lends
        them (after ``ROUNDS`` questions to the coordinator): the caller
        then preempts, as without borrowing."""
        tried: list[str] = []
        for _ in range(ROUNDS):
            try:
                reply = await self._ask(protocol.CreditorQuery(id=secrets.token_hex(6), node=self.name,
                                                               blocks=blocks, exclude=tuple(tried),
                                                               deadline=time.time() + self.timeout))
            except (TransportError, TimeoutError) as exc:
                log.warning("no creditor candidates: %s", exc)
                break
            if not isinstance(reply, protocol.Creditors) or not reply.candidates:
                break
            for creditor, address in zip(reply.candidates, reply.addresses):
                tried.append(creditor)
                loan = await self._ask_creditor(creditor, address, blocks)
                if loan is not None:
                    return loan
        self.counts["gave_up"] += 1
        return None

    async def _ask_creditor(self, creditor: str, address: str, blocks: int) -> Borrowed | None:
        msg = protocol.BorrowRequest(id=secrets.token_hex(6), debtor=self.name, blocks=blocks,
                                     deadline=time.time() + self.timeout)
        try:
            reply = await protocol.call(await self._connect(creditor, address), msg, timeout=self.timeout)
        except (TransportError, TimeoutError):
            return None
        if not isinstance(reply, protocol.BorrowReply) or not reply.ok:
            self.counts["refused"] += 1
            return None
        self.addresses[creditor] = address
        self.lease_s[creditor] = reply.lease_s
        self.channels.pop(creditor, None)
        with contextlib.suppress(ValueError):       # none or a bad one: its parts go over the peer link
            check_channel_url(reply.channel)
            self.channels[creditor] = reply.channel
        self.renewed_at[creditor] = time.monotonic()
        self.rmanager.note_borrowed(creditor, reply.loan_id, reply.blocks)
        self.counts["borrowed"] += 1
        return self.rmanager.borrowed[reply.loan_id]

    async def call(self, creditor: str, msg: protocol.Message) -> protocol.Message:
        """``creditor``'s reply to ``msg`` (a creditor this node borrowed from)."""
        conn = await self._connect(creditor, self.addresses[creditor])
        return await protocol.call(conn, msg, timeout=self.timeout)

    async def write(self, loan_id: str, start: int, payload: Any, layers: tuple[int, int]) -> bool:
        """Write KV ``payload`` [l1-l0, 2, n, bs, kvh, hd] into blocks
        ``[start, start + n)`` of loan ``loan_id``. False: refused or lost."""
        b = self.rmanager.borrowed.get(loan_id)
        if b is None:
            return False
        msg = protocol.LoanWrite(id=secrets.token_hex(6), debtor=self.name, loan_id=loan_id, start=start,
                                 layer_start=layers[0], layer_end=layers[1], tensors=(payload,),
                                 deadline=time.time() + self.timeout)
        try:
            reply = await self.call(b.creditor, msg)
        except (TransportError, TimeoutError):
            return False
        return isinstance(reply, protocol.LoanAck) and reply.ok

    async def give_back(self, loan_id: str) -> bool:
        """Return ``loan_id`` to its creditor (booked as returned whatever
        the creditor answers: an unreachable creditor frees it at lease end)."""
        b = self.rmanager.note_returned(loan_id)
        if b is None:
            return False
        try:
            reply = await self.call(b.creditor, protocol.ReturnLoan(id=secrets.token_hex(6), debtor=self.name,
                                                                     loan_id=loan_id,
                                                                     deadline=time.time() + self.timeout))
        except (TransportError, TimeoutError):
            return False
        return isinstance(reply, protocol.LoanAck) and reply.ok

    async def renew(self) -> list[Borrowed]:
        """Renew every loan's lease at its creditor, creditors in parallel.
        A loan its creditor no longer has (it restarted) or a creditor that
        does not answer within the lease is dropped from the book: those
        loans are returned, lost (their KV must be computed again)."""
        creditors = {b.creditor for b in self.rmanager.borrowed.values()}
        lost: list[Borrowed] = []
        results = await asyncio.gather(*(self._renew_at(c) for c in creditors))
        for group in results:
            lost.extend(group)
        self.counts["lost"] += len(lost)
        return lost

    async def _renew_at(self, creditor: str) -> list[Borrowed]:
        ids = tuple(self.rmanager.loans_from(creditor))
        msg = protocol.LeaseRenew(id=secrets.token_hex(6), debtor=self.name, loan_ids=ids,
                                  deadline=time.time() + self.timeout)
        try:
            reply = await self.call(creditor, msg)
        except (TransportError, TimeoutError):
            reply = None
        now = time.monotonic()
        if isinstance(reply, protocol.LoanAck):
            self.renewed_at[creditor] = now
            gone = reply.gone
        elif now - self.renewed_at.get(creditor, now) > self.lease_s.get(creditor, 0.0):
            gone = ids          # silent past the lease: the creditor is gone, or has freed them
        else:
            return []           # one missed renewal is not a loss
        return [b for i in gone if (b := self.rmanager.note_returned(i)) is not None]

    def stats(self) -> dict[str, Any]:
        return {"borrowed": self.rmanager.borrowed_per_creditor(), "counts": dict(self.counts),
                "requests": self.requests.stats() if self.requests is not None else {}}


def serve_borrowing(engine, borrower: Borrower, loop: asyncio.AbstractEventLoop, deadline_s: float,
                    channel_keys: Callable[[str], Any] | None = None) -> KVBorrowing:
    """Let ``engine``'s requests borrow KV through ``borrower`` (engine/borrowing.py), its
    remote parts computed on the creditors: over a creditor's remote-attention channel
    where it has one and ``channel_keys(creditor)`` gives this node's CURVE keys toward it
    (a ``CurveClient``, None when insecure; attention_channel.py), through its shared-memory
    ring where it offers one (the same host: attention_ring.py), else over the node's
    peer link (remote_attention.py). The engine thread waits at most ``deadline_s`` for a
    loan (a loan granted later is given back) and for each layer's remote results. Call
    on the event loop before the first request."""
    clients: dict[str, ChannelClient] = {}          # creditor -> the engine thread's socket to its channel
    context: list[zmq.Context] = []

    def channel_to(creditor: str, loan_id: str) -> ChannelClient | None:      # engine thread
        client = _client_of(creditor)
        if client is not None:                  # the same host: a shared-memory ring, while it lasts
            client.open_ring(borrower.name, loan_id, min(deadline_s, RING_OPEN_S))
        return client

    def _client_of(creditor: str) -> ChannelClient | None:
        url = borrower.channels.get(creditor)
        if url is None or channel_keys is None:
            return None
        client = clients.get(creditor)
        if client is None or client.url != url:                     # first loan, or a restarted creditor
            try:
                keys = channel_keys(creditor)
            except ValueError as exc:                               # its public key is not here
                log.warning("no channel to %s: %s", creditor, exc)
                return None
            if client is not None:
                client.close()
            context or context.append(zmq.Context())
            client = clients[creditor] = ChannelClient(context[0], url, keys)
        return client

    def borrow(blocks: int) -> EngineLoan | None:                  # engine thread
        future = asyncio.run_coroutine_threadsafe(borrower.borrow(blocks), loop)
        try:
            got = future.result(timeout=deadline_s)
        except Exception:  # noqa: BLE001 -- too late, or the loop is gone: none, and a late loan goes back
            future.add_done_callback(lambda f: _give_back_late(f, borrower, loop))
            return None
        if got is None:
            return None

        client = channel_to(got.creditor, got.loan_id)

        def lender(request_id: str, lo: int) -> ChannelLender | WireLender:
            if client is not None:
                return ChannelLender(client, borrower.name, got.loan_id, request_id, lo, deadline_s)
            return WireLender(lambda msg: borrower.call(got.creditor, msg), loop, borrower.name, got.loan_id,
                              request_id, lo, deadline_s)
        return EngineLoan(got.loan_id, got.blocks, lender)

    def give_back(loan_id: str) -> None:                              # engine thread, or the loop's
        if not loop.is_closed():
            asyncio.run_coroutine_threadsafe(borrower.give_back(loan_id), loop)

    try:
        borrower.requests = engine.enable_borrowing(borrow, give_back, deadline_s)
    except ValueError as exc:               # borrow_kv_blocks with a model the config resolved otherwise
        raise ConfigError(str(exc)) from None
    return borrower.requests


def _give_back_late(future, borrower: Borrower, loop: asyncio.AbstractEventLoop) -> None:
    if not future.cancelled() and future.exception() is None and future.result() is not None:
        loop.call_soon_threadsafe(loop.create_task, borrower.give_back(future.result().loan_id))


async def keep_leases(lender: Lender, borrower: Borrower, interval: float) -> None:
    """Until cancelled, every ``interval`` (the heartbeat's): renew this
    node's loans at their creditors, free the loans made here whose
    debtor went silent. A failed round is logged; the next one runs."""
    while True:
        await asyncio.sleep(interval)
        try:
            if lost := await borrower.renew():
                log.warning("lost %d borrowed KV loan(s): their creditor is gone", len(lost))
            if dead := await lender.expire():
                log.warning("freed %d lent KV loan(s) whose debtor stopped renewing them", len(dead))
        except Exception as exc:  # noqa: BLE001 -- an engine call that failed: the next round retries
            log.warning("lease round failed: %s", exc)


def admin_commands(lender: Lender, borrower: Borrower) -> dict[str, tuple[Any, str, dict | None]]:
    """The node's admin commands of borrowed KV memory (its admin socket):
    ``loans`` shows both sides; ``borrow`` and ``return`` drive the debtor's
    side by hand (an operator probing the cluster's spare blocks, a test)."""
    async def loans(args: dict) -> dict:
        return {"creditor": lender.stats(), "debtor": borrower.stats(),
                "borrowed": [vars(b) for b in borrower.rmanager.borrowed.values()]}

    async def borrow(args: dict) -> dict:
        blocks = args["blocks"]
        if not isinstance(blocks, int) or blocks < 1:
            raise ValueError(f"blocks must be an int >= 1, got {blocks!r}")
        loan = await borrower.borrow(blocks)
        if loan is None:
            raise ValueError(f"no creditor lends {blocks} blocks now")
        return vars(loan)

    async def give_back(args: dict) -> dict:
        loan_id = args["loan"]
        if loan_id not in borrower.rmanager.borrowed:
            raise ValueError(f"this node holds no loan {loan_id!r}")
        return {"returned": await borrower.give_back(loan_id)}

    return {
        "loans": (loans, "borrowed KV memory: blocks lent here per debtor, borrowed per creditor, counts", None),
        "borrow": (borrow, "borrow `blocks` device KV blocks from a creditor the coordinator recommends",
                   {"blocks": (int, True)}),
        "return": (give_back, "give borrowed loan `loan` back to its creditor", {"loan": (str, True)}),
    }
