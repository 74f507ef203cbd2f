"""One KV inbox per node: every way KV arrives at this node is one
receiving object, each arrival a ``Region`` of the engine's MemPool
(engine/memory/region.py) with a ``Purpose``:

- ``PREFIX``: a peer sends a cached prefix (MemServe §4.3, the sender in
  transfer.py). A ``KVTransferRequest`` reserves the region, bound to the
  link that asked; its last layer commits it into the prefix cache.
- ``PROMPT``: another node computes a prompt whose decode leg runs here
  (disaggregated prefill, the sender in disagg.py). The decode leg opens
  the region (``open_prompt``); the prefill node's ``KVCommit`` ends it and
  the engine takes its blocks (``release``).
- ``REPLICA``: a peer's replica of a request it runs (DéjàVu §4.2.3, the
  sender in replication.py). Each ``ReplicaData`` round appends to the
  replica's region, private until a recovery commits it (``replicas``,
  replica_store.py: tickets, budget, adoption).
- ``LENT``: blocks this node lends to a peer's request (Infinite-LLM §4.3,
  the debtor in lending.py). A ``BorrowRequest`` reserves the loan's
  region, ``LoanWrite`` fills it from the debtor only, ``ReturnLoan``
  commits it (freed), a lease its debtor stops renewing cancels it
  (``lending``, lending.py and engine/memory/rmanager.py).

A new way for KV to arrive is a new purpose here, not a new receive path.
Every KV message enters through one door: ``answer_now`` (the reply at
once when it needs no task: a commit, a refusal, an idle engine) else
``answer`` (awaited from a task). A transfer's region goes through one
lifecycle, with the transfer's state (``TransferState``, shared with the
sender, kvmove.py) beside it::

    KVTransferRequest ─▶ reserve_region(PREFIX) ─┐      decode leg ─▶ reserve_region(PROMPT)
      (bound to the asking link; a peer's       │        open_prompt (bound to the prefill
       share of blocks <= kv_grant_share)       ▼        node's key)  │
                                    KVReceiver: pending ◀─────────────┘
                          KVData ─▶ receiving: fill layers [l0, l1)   (from the bound link only)
            last layer (PREFIX) ─▶ done: commit ─▶ indexed, prefix unlocked
              KVCommit (PROMPT) ─▶ done | finished | failed: release ─▶ the engine's, or cancel
           deadline (the reaper) ─▶ timed_out: cancel
                       any error ─▶ failed: cancel

Every call that touches a region runs on the engine thread
(``EngineDriver``), so imports, completion and the reaper never race.
"""

from __future__ import annotations

import time
from typing import Any

from engine.memory.region import Purpose
from kvd import protocol
from kvd.node.engine_driver import EngineDriver
from kvd.node.kvmove import FINAL, KVReceiver, TransferState, new_transfer_id
from kvd.node.lending import Lender
from kvd.node.replica_store import ReplicaStore

MESSAGES = (protocol.KVTransferRequest, protocol.KVData, protocol.KVCommit, protocol.ReplicaData,
            *protocol.LENDING_MESSAGES)


def grant_seconds(deadline: float | None, limit: float, now: float | None = None) -> float:
    """How long a PREFIX region waits for its data: until the sender's
    wall-clock ``deadline`` (None: ``limit``), never longer than ``limit``
    (this node's ``kv_transfer_timeout``), never shorter than a second."""
    now = time.time() if now is None else now
    want = limit if deadline is None else deadline - now
    return min(max(want, 1.0), limit)


def _sender(incoming: Any) -> tuple[bytes, str | None]:
    """Who a region is bound to: the link a message came over and that
    link's authenticated identity."""
    return incoming.peer, incoming.identity


class KVInbox:
    """The node's open KV regions, by transfer id whatever their purpose,
    and the answers to the messages that fill them (module docstring).

    ``authenticated``: the listener names its peers (a prompt's region is
    then filled by the prefill node's key only; a prefix's is always bound
    to the asking link's identity, None when unnamed). What one peer may
    hold is this node's to bound: its open PREFIX regions cover at most
    ``max_peer_blocks`` blocks (its key's, or its link's when unnamed;
    past that a request is refused, ``peer_refused``), each lives at most
    ``transfer_timeout`` seconds (``grant_seconds``), then ``expire``
    frees it; a PROMPT region lives ``transfer_timeout`` from its opening."""

    def __init__(self, driver: EngineDriver, *, authenticated: bool = False, max_peer_blocks: int | None = None,
                 transfer_timeout: float = 30.0, request_timeout: float = 30.0, replica_blocks: int = 0,
                 tier: str = "device") -> None:
        self.driver = driver
        self.authenticated = authenticated
        self.max_peer_blocks = max_peer_blocks   # None: no bound per peer
        self.transfer_timeout = transfer_timeout
        self.request_timeout = request_timeout
        self.tier = tier                         # where PREFIX regions are reserved
        self.receivers: dict[str, KVReceiver] = {}   # every open transfer, any purpose, by transfer id
        self.replicas = ReplicaStore(driver, replica_blocks, request_timeout)
        self.lending: Lender | None = None       # LENT regions: set by the daemon (lending.py)
        self.received_bytes = 0                  # PREFIX KV committed
        # PREFIX: refused = KVData for no region of its sender (forged, late or stray)
        self.prefix_counts = {"received": 0, "failed": 0, "refused": 0, "peer_refused": 0}
        # PROMPT: local = below_threshold + no_blocks: prompts this node computed itself
        self.prompt_counts = {"remote": 0, "local": 0, "below_threshold": 0, "no_blocks": 0, "failed": 0,
                              "timed_out": 0, "refused": 0}

    # ------------------------------------------------------------- the door
    def answer_now(self, msg: protocol.Message, incoming: Any) -> protocol.Message | None:
        """The reply to a KV message (``MESSAGES``) when it needs no task:
        a commit, a refusal, or a prefix's allocation or import while the
        engine is idle; None: await ``answer``."""
        if isinstance(msg, protocol.LENDING_MESSAGES):
            return self._no_lending(msg) if self.lending is None else self.lending.answer_now(msg, incoming)
        if isinstance(msg, protocol.KVCommit):
            return self._on_commit(msg, incoming)
        if isinstance(msg, protocol.KVTransferRequest):
            if msg.transfer_id in self.receivers:
                return _duplicate(msg)
            done, reply = self.driver.try_call(self._reserve_fn(msg, _sender(incoming)))
            return reply if done else None
        if isinstance(msg, protocol.KVData):
            rx = self.receivers.get(msg.transfer_id)
            if rx is None or rx.purpose is not Purpose.PREFIX:
                return self._no_region(msg) if rx is None else None
            done, reply = self.driver.try_call(lambda engine: self._fill(engine, msg, incoming))
            return reply if done else None
        return None

    async def answer(self, msg: protocol.Message, incoming: Any) -> protocol.Message:
        """The reply to a KV message (``MESSAGES``), from a task."""
        if isinstance(msg, protocol.ReplicaData):
            return await self.replicas.on_data(msg)
        if isinstance(msg, protocol.LENDING_MESSAGES):
            return self._no_lending(msg) if self.lending is None else await self.lending.answer(msg, incoming)
        if isinstance(msg, protocol.KVCommit):
            return self._on_commit(msg, incoming)
        if isinstance(msg, protocol.KVTransferRequest):
            if msg.transfer_id in self.receivers:
                return _duplicate(msg)
            return await self.driver.call(self._reserve_fn(msg, _sender(incoming)))
        return await self.driver.call(lambda engine: self._fill(engine, msg, incoming))

    # ---------------------------------------------------------------- PREFIX
    def _reserve_fn(self, msg: protocol.KVTransferRequest, sender: tuple[bytes, str | None]):
        """Engine thread: a PREFIX region for ``sender``, released at its
        deadline unless its data completes; the reply names its blocks."""
        def reserve(engine) -> protocol.KVAllocReply:
            def refuse(reason: str) -> protocol.KVAllocReply:
                return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False, reason=reason)
            pool = engine.pool
            tokens = tuple(msg.token_ids[:msg.num_blocks * pool.block_size])
            if len(tokens) != msg.num_blocks * pool.block_size:
                return refuse("token_ids shorter than num_blocks")
            layout = pool.kv_layout()
            if msg.num_layers != layout.num_layers or msg.dtype != protocol.dtype_name(layout.dtype):
                return refuse("layout mismatch (layers or dtype)")
            if msg.transfer_id in self.receivers:
                return _duplicate(msg)
            if self.max_peer_blocks is not None:
                held = self.peer_blocks(*sender)
                if held + msg.num_blocks > self.max_peer_blocks:
                    self.prefix_counts["peer_refused"] += 1
                    return refuse(f"over this sender's share of KV grants: it holds {held} blocks, asked for "
                                  f"{msg.num_blocks}, at most {self.max_peer_blocks} (kv_grant_share)")
            seconds = grant_seconds(msg.deadline or time.time() + self.request_timeout, self.transfer_timeout)
            region = pool.reserve_region(tokens, msg.num_blocks, self.tier, Purpose.PREFIX,
                                         deadline=time.monotonic() + seconds)
            if region is None:
                return refuse("out of KV blocks")
            peer, identity = sender
            self.receivers[msg.transfer_id] = KVReceiver(
                transfer_id=msg.transfer_id, region=region, num_layers=msg.num_layers,
                sender_node=identity, link=peer, on_complete=lambda engine: region.commit() or len(region.tokens))
            return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=True,
                                         block_ids=tuple(region.block_ids), have_blocks=region.have_blocks)
        return reserve

    def peer_blocks(self, link: bytes, identity: str | None) -> int:
        """Blocks the open PREFIX regions of this peer cover (its key's, or
        its link's when it has no name)."""
        return sum(rx.region.have_blocks + len(rx.region.block_ids) for rx in self.receivers.values()
                   if rx.purpose is Purpose.PREFIX and rx.sender_node == identity
                   and (identity is not None or rx.link == link))

    async def expire(self) -> int:
        """End (``timed_out``) and release the PREFIX regions whose data did
        not all come by their deadline. Returns how many."""
        def reap(engine) -> int:
            dead = [rx for rx in self.receivers.values() if rx.purpose is Purpose.PREFIX and rx.expired]
            for rx in dead:
                rx.end(TransferState.TIMED_OUT, "no KV before the deadline")
                self._close_prefix(rx)
            return len(dead)
        if not any(rx.purpose is Purpose.PREFIX for rx in self.receivers.values()):
            return 0
        return await self.driver.call(reap)

    def _close_prefix(self, rx: KVReceiver) -> None:
        """Forget a PREFIX transfer that ended; unless ``done`` (committed),
        cancel its region (engine thread)."""
        del self.receivers[rx.transfer_id]
        if rx.state is TransferState.DONE:
            self.prefix_counts["received"] += 1
            self.received_bytes += rx.bytes
        else:
            rx.region.cancel()
            self.prefix_counts["failed"] += 1

    # ---------------------------------------------------------------- PROMPT
    def open_prompt(self, request_id: str, region: Any, prefill_node: str, num_layers: int) -> KVReceiver:
        """The decode leg of ``request_id`` reserved ``region`` (PROMPT) for
        the KV ``prefill_node`` computes: open it for ``transfer_timeout``
        seconds; the leg waits on the returned receiver, then ``release``s it."""
        region.deadline = time.monotonic() + self.transfer_timeout
        rx = KVReceiver(transfer_id=new_transfer_id(), request_id=request_id, region=region,
                        sender_node=prefill_node, num_layers=num_layers)
        self.receivers[rx.transfer_id] = rx
        return rx

    def count_local(self, why: str) -> None:
        """A decode leg computes its prompt here (``below_threshold`` or ``no_blocks``)."""
        self.prompt_counts["local"] += 1
        self.prompt_counts[why] += 1

    def abort_prompt(self, request_id: str, reason: str) -> None:
        """The prompt of ``request_id`` will not come: its region's wait ends ``failed``."""
        for rx in list(self.receivers.values()):
            if rx.purpose is Purpose.PROMPT and rx.request_id == request_id:
                rx.end(TransferState.FAILED, reason)

    async def release(self, rx: KVReceiver, handed_to_engine: bool) -> None:
        """Forget a PROMPT transfer; unless the engine took its region,
        cancel it (engine thread). Counts its outcome."""
        self.receivers.pop(rx.transfer_id, None)
        key = {TransferState.DONE: "remote", TransferState.TIMED_OUT: "timed_out",
               TransferState.FINISHED: "remote"}.get(rx.state, "failed")
        self.prompt_counts[key] += 1
        if not handed_to_engine:
            await self.driver.call(lambda engine: rx.region.cancel())

    def _on_commit(self, msg: protocol.KVCommit, incoming: Any) -> protocol.Message:
        rx = self.receivers.get(msg.transfer_id)
        if rx is None or rx.purpose is not Purpose.PROMPT:
            self.prompt_counts["refused"] += 1
            return protocol.Error(id=msg.id, code="no_grant", message=f"no reservation {msg.transfer_id!r}")
        if msg.request_id != rx.request_id:
            return self._refuse_prompt(msg, "the commit names another request")
        if why := rx.refusal(incoming.peer, incoming.identity, self.authenticated):
            return self._refuse_prompt(msg, why)
        if msg.status == "done" and not rx.complete:
            rx.end(TransferState.FAILED, f"commit after {len(rx.layers_done)} of {rx.num_layers} layers")
            return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=False, reason=rx.reason)
        rx.first_token, rx.cached_tokens, rx.replica_to = msg.first_token, msg.cached_tokens, msg.replica_to
        rx.end(TransferState(msg.status), msg.reason)
        return protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=True)

    def _refuse_prompt(self, msg: protocol.Message, why: str) -> protocol.Error:
        self.prompt_counts["refused"] += 1
        return protocol.Error(id=msg.id, code="no_grant", message=why)

    # ------------------------------------------------------------------ fill
    def _fill(self, engine: Any, msg: protocol.KVData, incoming: Any) -> protocol.Message:
        """Engine thread: one chunk of layers into its region. A KVData
        that is not for a region of its sender changes nothing; a PREFIX
        region's last layer commits it, one that ends otherwise is cancelled."""
        rx = self.receivers.get(msg.transfer_id)
        if rx is None:
            return self._no_region(msg)
        prefix = rx.purpose is Purpose.PREFIX
        # a prefix's link and identity were both bound when it was reserved: both must match
        if why := rx.refusal(incoming.peer, incoming.identity, prefix or self.authenticated):
            return self._no_region(msg) if prefix else self._refuse_prompt(msg, why)
        try:
            ack = rx.import_fn(msg)(engine)
        except (TypeError, ValueError, IndexError) as exc:
            rx.end(TransferState.FAILED, str(exc) if prefix else f"bad KV from the prefill node: {exc}")
            ack = protocol.KVAck(id=msg.id, transfer_id=msg.transfer_id, ok=False, reason=str(exc))
        if prefix and rx.state in FINAL:
            self._close_prefix(rx)
        return ack

    def _no_region(self, msg: protocol.KVData) -> protocol.Error:
        self.prefix_counts["refused"] += 1
        return protocol.Error(id=msg.id, code="no_grant",
                              message=f"transfer {msg.transfer_id!r}: no KV allocation of this node "
                                      "for this sender (unknown, expired, or granted to another link)")

    # ----------------------------------------------------------------- stats
    def prompt_stats(self) -> dict[str, Any]:
        """PROMPT outcome counts, and each open region: request, transfer
        id, prefill node, state, layers landed."""
        return {**self.prompt_counts, "open": [
            {"request_id": rx.request_id, "transfer_id": tid, "prefill_node": rx.sender_node,
             "state": rx.state.value, "layers": len(rx.layers_done), "blocks": len(rx.region.block_ids)}
            for tid, rx in self.receivers.items() if rx.purpose is Purpose.PROMPT]}


    def _no_lending(self, msg: protocol.Message) -> protocol.Error:
        return protocol.Error(id=msg.id, code="no_grant", message="this node lends no KV blocks")


def _duplicate(msg: protocol.KVTransferRequest) -> protocol.KVAllocReply:
    return protocol.KVAllocReply(id=msg.id, transfer_id=msg.transfer_id, ok=False, reason="duplicate transfer id")
