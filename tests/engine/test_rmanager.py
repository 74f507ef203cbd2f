"""rManager: lending a MemPool's blocks to other nodes, with a cap and leases."""

import pytest
import torch

from engine.config import EngineConfig
from engine.memory.kv_cache import KVCache
from engine.memory.mempool import MemPool
from engine.memory.region import Purpose
from engine.memory.rmanager import Loan, RManager

LEASE = 3.0


def pool(blocks: int = 16, storage: bool = False) -> MemPool:
    kv = KVCache(2, 1, 4, block_size=4, device_blocks=blocks, host_blocks=0) if storage else None
    return MemPool(blocks, 0, block_size=4, storage=kv)


def snapshot(p: MemPool) -> dict:
    return {t: {k: v for k, v in s.items()} for t, s in p.stats().items() if isinstance(s, dict)}


def test_cap_and_fcfs():
    p = pool(16)
    rm = RManager(p, lend_cap=8, lease_s=LEASE)
    a = rm.lend("a", 5, "l1", now=0.0)
    assert isinstance(a, Loan) and a.blocks == 5 and a.region.purpose is Purpose.LENT
    # first come, first served: b asked after a and gets only what the cap leaves
    assert isinstance(rm.lend("b", 4, "l2", now=0.0), str)
    b = rm.lend("b", 3, "l3", now=0.0)
    assert isinstance(b, Loan)
    assert rm.lent_per_debtor() == {"a": 5, "b": 3} and rm.can_lend() == 0
    assert "cap" in rm.lend("c", 1, "l4", now=0.0)
    assert rm.counts["granted"] == 2 and rm.counts["refused"] == 2
    assert p.free_blocks() == 8
    p.check_integrity()


def test_refusal_changes_nothing():
    p = pool(8)
    p.alloc_mem(6)                                   # the node's own requests hold 6
    rm = RManager(p, lend_cap=8, lease_s=LEASE)
    before = snapshot(p)
    why = rm.lend("a", 3, "l1", now=0.0)
    assert "lendable blocks" in why
    assert snapshot(p) == before and rm.loans == {}
    off = RManager(p, lend_cap=0, lease_s=LEASE)
    assert "off" in off.lend("a", 1, "l2", now=0.0) and snapshot(p) == before


def test_lease_expiry_frees_every_block_and_renewal_keeps_it():
    p = pool(16)
    start = p.free_blocks()
    rm = RManager(p, lend_cap=12, lease_s=LEASE)
    rm.lend("a", 4, "la", now=0.0)
    rm.lend("b", 6, "lb", now=0.0)
    assert rm.renew("a", ["la"], now=2.0) == 1
    assert rm.renew("b", ["la"], now=2.0) == 0      # not b's loan: b cannot keep it alive
    assert rm.expire(now=3.5) and list(rm.loans) == ["la"]
    assert rm.expire(now=4.9) == []
    assert [loan.loan_id for loan in rm.expire(now=5.1)] == ["la"]
    assert p.free_blocks() == start and rm.lent_blocks() == 0 and rm.counts["expired"] == 2
    p.check_integrity()


def test_debtor_returns_a_loan_and_only_its_debtor_may():
    p = pool(16)
    start = p.free_blocks()
    rm = RManager(p, lend_cap=8, lease_s=LEASE)
    rm.lend("a", 4, "la", now=0.0)
    before = snapshot(p)
    assert "no loan" in rm.give_back("b", "la")      # another peer: refused, counted, nothing changed
    assert "no loan" in rm.give_back("a", "nope")
    assert snapshot(p) == before and rm.counts["forbidden"] == 2
    assert rm.give_back("a", "la") is None
    assert p.free_blocks() == start and rm.counts["returned"] == 1
    assert "no loan" in rm.give_back("a", "la")      # twice: the loan is gone
    p.check_integrity()


def test_writes_only_from_the_debtor_into_its_own_blocks():
    p = pool(8, storage=True)
    rm = RManager(p, lend_cap=4, lease_s=LEASE)
    loan = rm.lend("a", 2, "la", now=0.0)
    payload = torch.ones(2, 2, 1, 4, 1, 4)           # layers 0..2, K|V, 1 block, bs 4, 1 head, dim 4
    assert rm.write("la", "b", 0, payload, (0, 2)) is not None
    assert rm.write("la", None, 0, payload, (0, 2)) is not None
    out = torch.zeros(2, 2, 2, 4, 1, 4)
    p.gather_blocks(loan.region.block_ids, out, (0, 2))
    assert torch.count_nonzero(out) == 0             # refused writes wrote nothing
    assert "fill_blocks" in rm.write("la", "a", 2, payload, (0, 2))   # past the loan's blocks
    assert rm.write("la", "a", 1, payload, (0, 2)) is None
    out = torch.zeros(2, 2, 1, 4, 1, 4)
    p.gather_blocks([loan.region.block_ids[1]], out, (0, 2))
    assert torch.equal(out, payload)
    assert rm.counts["forbidden"] == 2


def test_report_and_owned_blocks():
    p = pool(16)
    p.alloc_mem(3)
    rm = RManager(p, lend_cap=8, lease_s=LEASE)
    rm.lend("a", 2, "la", now=0.0)
    rm.note_borrowed("c", "x1", 5)
    rm.note_borrowed("c", "x2", 1)
    r = rm.report()
    assert r["lent"] == {"a": 2} and r["borrowed"] == {"c": 6} and r["owned"] == 3 and r["free"] == 11
    assert rm.loans_from("c") == ["x1", "x2"] and rm.note_returned("x1").blocks == 5
    assert rm.borrowed_per_creditor() == {"c": 1}


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_cap(bad):
    with pytest.raises(ValueError):
        RManager(pool(), lend_cap=bad, lease_s=LEASE)


def test_config_validates_lend_kv_blocks():
    assert EngineConfig(lend_kv_blocks=16).lend_kv_blocks == 16
    for bad in (-1, 4096):
        with pytest.raises(ValueError, match="lend_kv_blocks"):
            EngineConfig(kv_blocks=2048, lend_kv_blocks=bad)


@pytest.mark.parametrize("value, message", [("-3", "between 0 and kv_blocks"), ('"x"', "must be int")])
def test_config_file_refuses_a_bad_lend_kv_blocks(tmp_path, value, message):
    from kvd.config import ConfigError, load_config

    path = tmp_path / "kvd.toml"
    path.write_text(f"[engine]\nlend_kv_blocks = {value}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)
