"""DGFM, debt-graph-based fragmented memory management (Infinite-LLM §4.5,
Algorithm 1): find the cycles of the debt graph and resolve them by
recall-and-swap, so that borrowed KV comes home over time.

A pure function of the ledger's debt graph (ledger.py): edges
debtor -> creditor weighted by the blocks lent. A directed cycle::

    A ──m_ab──▶ B ──m_bc──▶ C ──m_ca──▶ A        (A owes B, B owes C, C owes A)

means every node on it holds KV of the node before it and keeps KV on the
node after it. With m = the cycle's smallest edge, each node recalls m
blocks of its own KV from its creditor into the m blocks its debtor's KV
frees, as that debtor does the same: every edge drops by m (the smallest
to zero), every node's used memory stays the same, so no node lends more
than before (no cap is ever passed), and total debt falls by m per edge.

A cycle is resolved only when m >= ``min_blocks`` (the paper's threshold:
recall-and-swap of a few blocks costs more than it saves); edges below it
are left alone. Each round removes at least one edge from the graph of
edges >= ``min_blocks``, so the search ends. The paper starts each search
at a random node; here the nodes are visited in sorted order, so the moves
are a deterministic function of the graph.

``cycles`` and ``ordered`` say in which order a cycle's moves are carried out
(kvd/coordinator/dgfm_rounds.py runs them): each recall lands in the room the
one before it freed.
"""

from __future__ import annotations

from dataclasses import dataclass

Graph = dict[tuple[str, str], int]      # (debtor, creditor) -> blocks


@dataclass(frozen=True)
class Move:
    """``debtor`` recalls ``blocks`` of its KV from ``creditor`` (the blocks
    its own debtor on the cycle frees make the room); ``cycle`` names the
    cycle's nodes in debt order, for the operator."""

    debtor: str
    creditor: str
    blocks: int
    cycle: tuple[str, ...]


def find_cycle(graph: Graph, min_blocks: int) -> list[str] | None:
    """A directed cycle through edges of at least ``min_blocks`` blocks, as
    its nodes in debt order (each owes the next, the last the first), or
    None. Depth-first search from each node in sorted order, three colours
    (Algorithm 1, for directed edges: a back edge to a node on the path)."""
    succ: dict[str, list[str]] = {}
    for (d, c), n in graph.items():
        if n >= min_blocks and d != c:
            succ.setdefault(d, []).append(c)
    for nexts in succ.values():
        nexts.sort()
    done: set[str] = set()
    for start in sorted(succ):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(succ.get(start, ()))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                node = path.pop()
                on_path.discard(node)
                done.add(node)
                continue
            if nxt in on_path:
                return path[path.index(nxt):]
            if nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(succ.get(nxt, ())))
    return None


def plan(graph: Graph, min_blocks: int) -> list[Move]:
    """The recall-and-swap moves that resolve every cycle of ``graph`` whose
    smallest edge has at least ``min_blocks`` blocks (module docstring).
    ``graph`` is not changed."""
    if min_blocks < 1:
        raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
    left = {e: n for e, n in graph.items() if n > 0}
    moves: list[Move] = []
    while (cycle := find_cycle(left, min_blocks)) is not None:
        edges = list(zip(cycle, cycle[1:] + cycle[:1]))
        m = min(left[e] for e in edges)
        for d, c in edges:
            moves.append(Move(d, c, m, tuple(cycle)))
            left[(d, c)] -= m
            if not left[(d, c)]:
                del left[(d, c)]
    return moves


def apply(graph: Graph, moves: list[Move]) -> Graph:
    """``graph`` after ``moves`` (a new graph; edges at zero dropped)."""
    out = dict(graph)
    for mv in moves:
        out[(mv.debtor, mv.creditor)] = out.get((mv.debtor, mv.creditor), 0) - mv.blocks
        if not out[(mv.debtor, mv.creditor)]:
            del out[(mv.debtor, mv.creditor)]
    return out


def cycles(moves: list[Move]) -> list[list[Move]]:
    """``plan``'s moves cut into their cycles (each cycle's moves in debt order)."""
    out: list[list[Move]] = []
    i = 0
    while i < len(moves):
        n = len(moves[i].cycle)
        out.append(moves[i:i + n])
        i += n
    return out


def ordered(cycle: list[Move], free: dict[str, int]) -> list[Move]:
    """The order to carry out one cycle's moves so that each recall lands where room
    is: a recall by D from C takes blocks on D and frees as many on C, so C's own
    recall (from the next node) can land next, and so on around the cycle. It starts
    at the debtor with the most ``free`` blocks beyond its move's (a node the caller
    knows nothing of counts as none free), the name breaking ties."""
    first = min(range(len(cycle)), key=lambda i: (cycle[i].blocks - free.get(cycle[i].debtor, 0), cycle[i].debtor))
    return cycle[first:] + cycle[:first]
