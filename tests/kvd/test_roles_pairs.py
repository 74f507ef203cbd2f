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


# ------------------------------------------------------------ prompts to pairs
def _node(name: str, free: int, in_flight: int = 0):
    from kvd.coordinator.membership import NodeInfo

    return NodeInfo(name, f"inproc://{name}", "i", "m", 512, 16, {"device": free, "host": 0}, 0.0,
                    in_flight={f"{name}-{i}" for i in range(in_flight)})


def _pair_router(*pairs: tuple[str, str]):
    from kvd.coordinator.pairs import PairRouter
    from kvd.coordinator.roles import PairBook
    from kvd.coordinator.router import LeastLoadRouter

    book = PairBook()
    for a, b in pairs:
        book.announce(a, b)
        book.announce(b, a)
    clock = [0.0]
    return PairRouter(book, LeastLoadRouter(0), clock=lambda: clock[0]), clock


def test_a_prompt_goes_to_the_pair_with_most_free_memory_then_its_node_with_fewer_decodes():
    router, _ = _pair_router(("a", "b"), ("c", "d"))
    nodes = [_node("a", 100, 3), _node("b", 100, 1), _node("c", 60, 0), _node("d", 60, 0)]
    assert router.pick(nodes, list(range(32))).name == "b"          # a+b: 200 free blocks, c+d 120
    router, _ = _pair_router(("a", "b"), ("c", "d"))
    nodes = [_node("a", 50, 0), _node("b", 50, 0), _node("c", 100, 2), _node("d", 100, 1)]
    assert router.pick(nodes, list(range(32))).name == "d"


def test_prompts_arriving_together_are_spread_over_pairs_and_unpaired_nodes_route_as_before():
    router, clock = _pair_router(("a", "b"), ("c", "d"))
    nodes = [_node("a", 100), _node("b", 100), _node("c", 100), _node("d", 96)]
    picks = [router.pick(nodes, list(range(160))).name for _ in range(4)]   # 10 blocks each
    assert {p in "ab" for p in picks} == {True, False} and picks[0] in "ab"
    clock[0] += 10                                     # their blocks show in the heartbeats by now
    assert router.pick(nodes, list(range(160))).name in "ab"
    alone = [_node("x", 10, 2), _node("y", 10, 0)]
    assert router.pick(alone, [1, 2, 3]).name == "y"   # no pair among them: the wrapped router's choice


def test_a_prompt_routed_into_a_pair_wakes_the_scheduler_with_its_node_and_a_lone_one_does_not():
    router, _ = _pair_router(("a", "b"))
    woken: list[str] = []
    router.on_pick = woken.append
    assert router.pick([_node("a", 100, 2), _node("b", 100, 0)], list(range(32))).name == "b"
    assert router.pick([_node("x", 500, 0)], list(range(32))).name == "x"          # unpaired: the inner router
    assert router.pick([_node("a", 100, 0), _node("x", 500, 0)], list(range(32))).name == "x"  # a pair of one
    assert woken == ["b"]


def test_a_node_set_to_decode_takes_no_prompt_while_its_partner_does():
    import dataclasses

    router, _ = _pair_router(("a", "b"))
    a, b = _node("a", 100, 5), dataclasses.replace(_node("b", 100, 0), role="decode")
    assert router.pick([a, b], list(range(32))).name == "a"         # fewer in flight would say b
    a, b = dataclasses.replace(_node("a", 100, 0), role="decode"), _node("b", 100, 5)
    assert router.pick([a, b], list(range(32))).name == "b"
    both = [dataclasses.replace(_node(n, 100, k), role="decode") for n, k in (("a", 2), ("b", 1))]
    assert router.pick(both, list(range(32))).name == "b"       # both decode: fewer in flight, as before


def test_a_prompt_does_not_queue_behind_a_longer_one_while_the_partner_could_start_it():
    from kvd.coordinator.pairs import PairRouter
    from kvd.coordinator.router import LeastLoadRouter

    router, _ = _pair_router(("a", "b"))
    router = PairRouter(router.pairs, LeastLoadRouter(0), queue_factor=4.0)
    queue = {"a": 1500, "b": 0}
    router.queued = lambda n: queue[n.name]
    nodes = [_node("a", 100, 1), _node("b", 100, 3)]          # a computes a long prompt, b decodes three
    assert router.pick(nodes, list(range(100))).name == "b"   # 1500 > 4 * 100: b starts it
    assert router.pick(nodes, list(range(1500))).name == "a"  # within 4 * 1500: fewer in flight
    queue["b"] = 900
    assert router.pick(nodes, list(range(100))).name == "b"   # neither within the bound: the shorter queue
    router.queue_factor = 0.0
    assert router.pick(nodes, list(range(100))).name == "a"   # no bound: fewer in flight


def test_a_copys_new_tokens_travel_as_rows_and_a_bad_rows_message_is_refused():
    import pytest

    from kvd import protocol as P

    frame = P.RawTensor("int8", (1, 2, 3, 1, 2), memoryview(b"x" * 12))        # 3 rows of [kvh 1, hd 2]
    ok = P.ReplicaData(source="n1", block_size=2, request_ids=("r", "s"), starts=(5, 0), counts=(1, 2),
                       token_ids=(7, 8, 9), tensors=(frame,), rows=True)
    header, frames = P.encode(ok)
    back = P.decode(header, frames)
    assert back.rows and back.starts == (5, 0) and back.tensors[0].shape == (1, 2, 3, 1, 2)
    base = dict(source="n1", block_size=2, request_ids=("r", "s"), starts=(5, 0), counts=(1, 2), token_ids=(7, 8, 9),
                tensors=(frame,), rows=True)
    for bad, match in ((dict(token_ids=(7, 8)), "one token id"), (dict(counts=(1, 0)), "counts > 0"),
                       (dict(starts=(-1, 0)), "starts must be >= 0"), (dict(counts=(2, 2), token_ids=(7, 8, 9, 10)), "rows frame"),
                       (dict(rows=False), "starts must be whole blocks")):
        with pytest.raises(ValueError, match=match):
            P.ReplicaData(**(base | bad))
