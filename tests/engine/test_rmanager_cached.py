"""rManager over a pool full of cached prefixes: a loan evicts unlocked
cached blocks through MemPool, least recently used first, and never takes
a running request's blocks or pinned ones."""

from engine.memory.mempool import MemPool
from engine.memory.rmanager import Loan, RManager

LEASE = 3.0
BS = 4


def prefix(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BS))


def cached_pool(prompts: list[list[int]], blocks: int) -> MemPool:
    """A pool of ``blocks`` whose blocks hold ``prompts``' KV, finished and
    cached (the first prompt the least recently used)."""
    p = MemPool(blocks, 0, block_size=BS)
    for tokens in prompts:
        p.insert(tokens, p.alloc_mem(len(tokens) // BS))
    return p


def test_a_pool_full_of_cached_blocks_lends_by_evicting_lru_first():
    old, new = prefix(0, 3), prefix(100, 3)
    p = cached_pool([old, new], 8)
    p.cached_tokens(new)                             # a peek: not a use
    p.release(p.match(new))                          # `new` used again: `old` is the LRU
    rm = RManager(p, lend_cap=6, lease_s=LEASE)
    assert p.free_blocks() == 2 and p.lendable() == 8 and rm.can_lend() == 6
    assert rm.report()["free"] == 8
    loan = rm.lend("a", 5, "l1", now=0.0)
    assert isinstance(loan, Loan) and loan.blocks == 5
    assert p.cached_tokens(old) == 0 and p.cached_tokens(new) == len(new)
    assert p.free_blocks() == 0 and p.lendable() == 3 and rm.can_lend() == 1
    assert rm.give_back("a", "l1") is None and p.free_blocks() == 5
    p.check_integrity()


def test_blocks_of_a_running_request_or_pinned_are_never_lent():
    running, pinned, idle = prefix(0, 2), prefix(100, 2), prefix(200, 2)
    p = cached_pool([running, pinned, idle], 8)
    hit = p.match(running)                           # a running request reads its cached prefix
    pin = p.lock_prefix(pinned)                      # pinned (a region's prefix, an operator's lock)
    mine = p.alloc_mem(1)                            # a request's private block
    rm = RManager(p, lend_cap=8, lease_s=LEASE)
    assert p.lendable() == 1 + 2 and rm.can_lend() == 3
    before = p.stats()
    why = rm.lend("a", 4, "l1", now=0.0)
    assert isinstance(why, str) and "3 lendable" in why
    assert p.stats() == before and p.cached_tokens(idle) == len(idle)   # a refusal evicts nothing
    loan = rm.lend("a", 3, "l2", now=0.0)
    assert isinstance(loan, Loan)
    assert p.cached_tokens(running) == len(running) and p.cached_tokens(pinned) == len(pinned)
    assert p.cached_tokens(idle) == 0 and not set(mine) & set(loan.region.block_ids)
    assert p.lendable() == 0 and isinstance(rm.lend("b", 1, "l3", now=0.0), str)
    p.release(hit)
    p.unlock(pin)
    assert p.lendable() == 4                         # released: reclaimable again
    p.check_integrity()


def test_the_cap_still_bounds_what_the_cache_can_give():
    p = cached_pool([prefix(0, 8)], 8)
    rm = RManager(p, lend_cap=3, lease_s=LEASE)
    assert rm.can_lend() == 3 and "cap" in rm.lend("a", 4, "l1", now=0.0)
    assert p.cached_tokens(prefix(0, 8)) == 8 * BS
    assert isinstance(rm.lend("a", 3, "l2", now=0.0), Loan)
    assert p.cached_tokens(prefix(0, 8)) == 5 * BS   # the deepest blocks (leaves) went first
    p.check_integrity()
