"""MemPool is the only door to KV memory: no module outside engine/ reaches
a MemPool's private parts -- the radix tree (``pool.tree``), the block
pools (``pool.pools``), the KV storage (``pool.storage``), any ``_``-named
member -- or the engine's KV tensors (``engine.kv``); what transfers, the
daemons and the tools need are MemPool's verbs (engine/memory/mempool.py,
"KV movement") and its ``Region``s. A lint over the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.memory.mempool import MemPool

ROOT = Path(__file__).resolve().parents[2]
# the pool's state that is not a verb: what its constructor sets, less its counters and names
PRIVATE = {"tree", "pools", "storage"} | {n for n in vars(MemPool) if n.startswith("_") and not n.endswith("__")}
FORBIDDEN = PRIVATE | {"kv"}
OUTSIDE_ENGINE = ["kvd", "tools", "transports"]


def reach_ins(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every ``x.tree``, ``x.pools``, ``x.storage``,
    ``x.kv`` or ``x._<a MemPool private member>`` in ``source`` (an
    object's own ``self._x`` is its business, not the pool's)."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN
            and not (node.attr.startswith("_") and isinstance(node.value, ast.Name) and node.value.id == "self")]


def test_the_private_set_is_every_attribute_a_pool_sets_that_is_not_public():
    pool = MemPool(2, 2, 4)
    public = {"block_size", "node_id", "hit_tokens", "miss_tokens", "live_hits", "reclaimer"}
    assert set(vars(pool)) - public == {"tree", "pools", "storage"}
    assert {"_storage", "_pool", "_index_region"} <= PRIVATE


def test_the_lint_sees_a_reach_in():
    assert reach_ins("def f(engine):\n    engine.pool.tree.unlock(h)\n    engine.kv.gather(1)\n") == [
        (2, "tree"), (3, "kv")]
    assert reach_ins("pool = engine.pool\nfree = pool.pools['device']\n") == [(2, "pools")]
    assert reach_ins("b = src.storage.bytes_per_block\nkv = pool._storage()\n") == [(1, "storage"), (2, "_storage")]
    assert reach_ins("self._pool.shutdown()\n") == []
    assert reach_ins("engine.pool.flush()\nlayout = engine.pool.kv_layout()\n") == []


@pytest.mark.parametrize("folder", OUTSIDE_ENGINE)
def test_nothing_outside_engine_reaches_past_mempool(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no sources under {folder}/"
    found = [f"{path.relative_to(ROOT)}:{line}: .{attr}"
             for path in files for line, attr in reach_ins(path.read_text())]
    assert not found, "KV memory reached past MemPool (use its verbs):\n" + "\n".join(found)
