"""The pair scheduler's plan (kvd/coordinator/pairs.py ``plan_moves``): a
prefilling node hands its decodes to its partner, a balanced pair stays put,
an unbalanced one moves half the difference, longest first."""

from __future__ import annotations

from kvd.coordinator.pairs import Running, plan_moves


def r(rid: str, node: str, decoding: bool = True, left: int = 10) -> Running:
    return Running(rid, node, decoding, not decoding, left)


def test_a_prefilling_node_hands_every_decode_to_its_partner():
    running = [r("p", "a", decoding=False), r("d1", "a"), r("d2", "a"), r("d3", "b")]
    assert sorted(plan_moves("a", "b", running, {})) == [("d1", "a", "b"), ("d2", "a", "b")]
    assert sorted(plan_moves("b", "a", running, {})) == [("d1", "a", "b"), ("d2", "a", "b")]


def test_both_prefilling_or_no_decoding_partner_moves_nothing():
    both = [r("p", "a", decoding=False), r("q", "b", decoding=False), r("d1", "a")]
    assert plan_moves("a", "b", both, {}) == []
    one = [r("p", "a", decoding=False), r("d1", "a")]
    assert plan_moves("a", "b", one, {"a": True, "b": False}) == []


def test_a_request_waiting_for_a_prefill_node_is_neither():
    running = [Running("w", "a", False, False, 10), r("d1", "a"), r("d2", "a"), r("d3", "a"), r("e1", "b")]
    assert plan_moves("a", "b", running, {}) == [("d1", "a", "b")]


def test_a_prefill_role_counts_as_prefilling():
    running = [r("d1", "a"), r("d2", "a"), r("d3", "a")]
    assert len(plan_moves("a", "b", running, {"a": False, "b": True})) == 3
    assert plan_moves("a", "b", running, {"a": True, "b": False}) == []


def test_balance_moves_half_the_difference_longest_first():
    running = [r("d1", "a", left=5), r("d2", "a", left=50), r("d3", "a", left=20), r("d4", "a", left=1),
               r("e1", "b")]
    assert plan_moves("a", "b", running, {}) == [("d2", "a", "b")]
    running += [r("d5", "a", left=30)]
    assert plan_moves("a", "b", running, {}) == [("d2", "a", "b"), ("d5", "a", "b")]
    assert plan_moves("a", "b", [r("d1", "a"), r("e1", "b")], {}) == []
    assert plan_moves("a", "b", [r("d1", "a")], {}) == []
    assert plan_moves("a", "b", [], {}) == []
