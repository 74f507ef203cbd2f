"""MemPool is the only door to KV memory: no module outside engine/ reaches
the radix tree (``pool.tree``), the block pools (``pool.pools``) or the KV
tensors (``engine.kv``); what transfers and the daemons need are MemPool's
verbs (engine/memory/mempool.py, "KV movement"). A lint over the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"tree", "pools", "kv"}
OUTSIDE_ENGINE = ["kvd", "tools", "transports"]


def reach_ins(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every ``x.tree``, ``x.pools`` or ``x.kv`` in ``source``."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN]


def test_the_lint_sees_a_reach_in():
    assert reach_ins("def f(engine):\n    engine.pool.tree.unlock(h)\n    engine.kv.gather(1)\n") == [
        (2, "tree"), (3, "kv")]
    assert reach_ins("pool = engine.pool\nfree = pool.pools['device']\n") == [(2, "pools")]
    assert reach_ins("engine.pool.flush()\nlayout = engine.pool.kv_layout()\n") == []


@pytest.mark.parametrize("folder", OUTSIDE_ENGINE)
def test_nothing_outside_engine_reaches_past_mempool(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no sources under {folder}/"
    found = [f"{path.relative_to(ROOT)}:{line}: .{attr}"
             for path in files for line, attr in reach_ins(path.read_text())]
    assert not found, "KV memory reached past MemPool (use its verbs):\n" + "\n".join(found)
