"""Recall: a debtor brings the KV of its loans on one creditor home (Infinite-LLM
§4.5; the move DGFM orders, kvd/coordinator/dgfm_rounds.py), both sides::

    debtor (Recaller)                                           creditor (RecallServer)
    engine: begin  -- the part's writes recorded from now on
    RecallKV(debtor, loan, start, blocks) ────────────────────▶ access(loan, sender): the
                   ◀──────────────────── LoanKV(KV frame) ───── loan's debtor only; its blocks
    ... (pieces of at most PIECE_BYTES)                         gathered on the attention worker
    engine: finish -- local blocks written, block table switched
    ReturnLoan(debtor, loan) ─────────────────────────────────▶ the loan's blocks freed

(engine/recall.py has the engine's half.) The creditor reads the loan's blocks on
its attention worker, never on its engine thread: in a debt cycle every node
recalls from the next one, and an engine thread waiting on its peer's engine
thread could wait on itself. A RecallKV for a loan that is not the sender's is
refused, counted (``counts["refused"]``, and the rManager's ``forbidden``) and
changes nothing.

A recall that fails (the creditor refuses, dies or is silent past the deadline;
no room here) leaves the request on its remote part as it was: a dead
creditor's loss is then the step's (engine/borrowing.py ``lost``: the
positions are computed again), and DGFM tries again on a later round.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
from typing import Any

import torch

from engine import recall as engine_recall
from engine.memory.rmanager import RManager
from kvd import protocol
from transports import TransportError

log = logging.getLogger("kvd.recall")

PIECE_BYTES = 32 << 20      # the most KV one LoanKV carries (a recall of more comes in pieces)


class RecallServer:
    """The creditor's answers to ``RecallKV``, on ``executor`` (the attention server's
    one worker), under ``lock`` (the lender's: a loan freed meanwhile is never read)."""

    def __init__(self, rmanager: RManager, lock: threading.Lock, executor: concurrent.futures.Executor) -> None:
        self.rmanager, self.lock, self.executor = rmanager, lock, executor
        self.counts = {"served": 0, "refused": 0, "blocks": 0}

    async def answer(self, msg: protocol.RecallKV, debtor: str | None) -> protocol.LoanKV:
        return await asyncio.wrap_future(self.executor.submit(self.serve, msg, debtor))

    def serve(self, msg: protocol.RecallKV, debtor: str | None) -> protocol.LoanKV:
        """The KV of the loan's blocks [start, start + blocks), or the reason not."""
        with self.lock:
            loan = self.rmanager.access(msg.loan_id, debtor)
            if isinstance(loan, str):
                return self._refuse(msg, loan)
            ids = loan.region.block_ids
            if msg.start + msg.blocks > len(ids):
                return self._refuse(msg, f"blocks [{msg.start}, {msg.start + msg.blocks}) of a loan of {len(ids)}")
            pool = self.rmanager.pool
            layout = pool.kv_layout()
            if msg.blocks * layout.bytes_per_block > PIECE_BYTES and msg.blocks > 1:
                return self._refuse(msg, f"{msg.blocks} blocks are more than one answer carries ({PIECE_BYTES} bytes)")
            L, two, bs, kvh, hd = layout.block_shape
            out = torch.empty(L, two, msg.blocks, bs, kvh, hd, dtype=layout.dtype)
            pool.gather_blocks(ids[msg.start:msg.start + msg.blocks], out, (0, L), self.rmanager.tier)
        self.counts["served"] += 1
        self.counts["blocks"] += msg.blocks
        return protocol.LoanKV(id=msg.id, ok=True, tensors=(out,))

    def _refuse(self, msg: protocol.RecallKV, why: str) -> protocol.LoanKV:
        self.counts["refused"] += 1
        return protocol.LoanKV(id=msg.id, ok=False, reason=why)


class Recaller:
    """The debtor's recalls: ``driver`` (the engine's), ``borrower`` (lending.py: the
    loans' book and the link to each creditor), ``timeout``: each message's deadline."""

    def __init__(self, driver, borrower, timeout: float) -> None:
        self.driver, self.borrower, self.timeout = driver, borrower, timeout
        self.counts = {"recalled": 0, "failed": 0, "blocks_home": 0}
        self.busy = asyncio.Lock()          # one recall at a time: each takes this node's free blocks

    async def recall(self, creditor: str, blocks: int) -> dict[str, Any]:
        """Bring home whole loans from ``creditor`` that requests hold, smallest first,
        until at least ``blocks`` loan blocks are recalled (or none is left). What came
        home; ValueError when nothing did (the reason)."""
        if not isinstance(creditor, str) or not creditor:
            raise ValueError(f"creditor must be a node name, got {creditor!r}")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
            raise ValueError(f"blocks must be an int >= 1, got {blocks!r}")
        async with self.busy:
            held = await self.driver.call(engine_recall.loans_of, timeout=self.timeout)
            mine = set(self.borrower.rmanager.loans_from(creditor))
            loans = sorted(((n, loan_id) for loan_id, (_, n) in held.items() if loan_id in mine))
            if not loans:
                raise ValueError(f"no request here holds a loan from {creditor!r}")
            done: list[dict[str, Any]] = []
            why = ""
            for n, loan_id in loans:
                if sum(d["loan_blocks"] for d in done) >= blocks:
                    break
                got = await self.recall_loan(creditor, loan_id)
                if isinstance(got, str):
                    why = got
                    break
                done.append({"loan": loan_id, "loan_blocks": n, "blocks_home": got})
            if not done:
                raise ValueError(f"recall from {creditor!r} failed: {why}")
            return {"creditor": creditor, "recalled": done, "loan_blocks": sum(d["loan_blocks"] for d in done),
                    "blocks_home": sum(d["blocks_home"] for d in done), "stopped": why}

    async def recall_loan(self, creditor: str, loan_id: str) -> int | str:
        """Bring loan ``loan_id`` home and return it: the local blocks it took, or why not."""
        plan = await self.driver.call(lambda engine: engine_recall.begin(engine, loan_id), timeout=self.timeout)
        if isinstance(plan, str):
            return self._failed(plan)
        try:
            fetched = await self._fetch(creditor, plan)
        except (TransportError, TimeoutError, ValueError) as exc:
            await self.driver.call(lambda engine: engine_recall.abort(engine, plan), timeout=self.timeout)
            return self._failed(f"fetching loan {loan_id!r} from {creditor}: {str(exc) or type(exc).__name__}")

        def finish(engine) -> int | str:
            return engine_recall.finish(engine, plan, fetched, spare=len(engine.scheduler.running))
        got = await self.driver.call(finish, timeout=self.timeout)
        if isinstance(got, str):
            return self._failed(got)
        await self.borrower.give_back(loan_id)          # the creditor frees the loan's blocks
        self.counts["recalled"] += 1
        self.counts["blocks_home"] += got
        return got

    async def _fetch(self, creditor: str, plan: engine_recall.RecallPlan) -> torch.Tensor | None:
        """The loan's first ``plan.fetch_blocks`` blocks from ``creditor``, in pieces."""
        if not plan.fetch_blocks:
            return None
        layout = await self.driver.call(lambda engine: engine.pool.kv_layout(), timeout=self.timeout)
        per_piece = max(1, PIECE_BYTES // layout.bytes_per_block)
        pieces = []
        for start in range(0, plan.fetch_blocks, per_piece):
            n = min(per_piece, plan.fetch_blocks - start)
            reply = await self.borrower.call(creditor, protocol.RecallKV(
                id=secrets.token_hex(6), debtor=self.borrower.name, loan_id=plan.loan_id, start=start, blocks=n,
                deadline=time.time() + self.timeout))
            if not isinstance(reply, protocol.LoanKV) or not reply.ok:
                raise ValueError(getattr(reply, "reason", None) or getattr(reply, "message", None) or repr(reply))
            kv = reply.tensors[0].to_torch()
            if tuple(kv.shape) != (layout.block_shape[0], 2, n, *layout.block_shape[2:]) or kv.dtype != layout.dtype:
                raise ValueError(f"the creditor sent KV of shape {tuple(kv.shape)} {kv.dtype}")
            pieces.append(kv)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)

    def _failed(self, why: str) -> str:
        self.counts["failed"] += 1
        log.warning("recall: %s", why)
        return why

    def stats(self) -> dict[str, int]:
        return dict(self.counts)


def admin_commands(recaller: Recaller) -> dict[str, tuple[Any, str, dict | None]]:
    """The node's ``recall`` admin command (its admin socket, and the coordinator's
    AdminCommand: DGFM's moves)."""
    async def recall(args: dict) -> dict:
        return await recaller.recall(args["creditor"], args["blocks"])

    return {"recall": (recall, "bring home the KV of this node's loans from `creditor` (whole loans, smallest "
                       "first, at least `blocks` loan blocks) and return them", {"creditor": (str, True),
                                                                               "blocks": (int, True)})}
