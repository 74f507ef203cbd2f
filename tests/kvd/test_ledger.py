"""The global debt ledger (gManager) and DGFM's recall-and-swap, on hand-built nodes and graphs."""

import pytest
from hypothesis import given, settings, strategies as st

from kvd import protocol
from kvd.coordinator import dgfm
from kvd.coordinator.ledger import DebtLedger, same_host_cost


def beat(node: str, free: int, cap: int = 0, lent=None, borrowed=None) -> protocol.Heartbeat:
    return protocol.Heartbeat(node=node, seq=1, load=0.0, running=0, waiting=0, free_blocks={"device": free},
                              lend_cap=cap, lent=lent or {}, borrowed=borrowed or {})


def ledger(*beats, hosts=None) -> DebtLedger:
    led = DebtLedger()
    for hb in beats:
        led.update(f"zmq+tcp://{(hosts or {}).get(hb.node, '10.0.0.1')}:5000", hb)
    return led


def names(entries) -> list[str]:
    return [e.node for e in entries]


def test_candidates_most_lendable_first_never_the_debtor_nor_one_short():
    led = ledger(beat("a", 0, 0), beat("b", 50, 40), beat("c", 100, 100), beat("d", 100, 10),
                 beat("e", 5, 100), beat("f", 70, 80, lent={"x": 60}))
    # c: 100, b: 40 (cap), f: 20 (cap less lent), d: 10 (cap), e: 5 (free)
    assert names(led.candidates("a", 8)) == ["c", "b", "f"]
    assert names(led.candidates("c", 8)) == ["b", "f", "d"]          # never the debtor itself
    assert names(led.candidates("a", 30)) == ["c", "b"]
    assert led.candidates("a", 200) == [] and led.unanswered == 1


def test_cheapest_link_first():
    led = ledger(beat("a", 0), beat("near", 20, 20), beat("far", 90, 90),
                 hosts={"a": "10.0.0.1", "near": "10.0.0.1", "far": "10.0.0.9"})
    assert names(led.candidates("a", 4)) == ["near", "far"]
    assert same_host_cost("zmq+tcp://h:1", "zmq+tcp://h:2") == 0 < same_host_cost("zmq+tcp://h:1", "ucx://g:2")


def test_a_creditor_that_said_no_is_paused_until_its_next_beat_and_dead_ones_leave():
    led = ledger(beat("a", 0), beat("b", 50, 40), beat("c", 30, 30))
    assert names(led.candidates("a", 8, exclude=("b",))) == ["c"]
    assert names(led.candidates("a", 8)) == ["c"]                     # b still paused
    led.update("zmq+tcp://10.0.0.1:5000", beat("b", 50, 40))          # b beat again
    assert names(led.candidates("a", 8)) == ["b", "c"]
    led.remove("b")
    assert names(led.candidates("a", 8)) == ["c"]


def test_describe_shows_lines_and_the_debt_graph():
    led = ledger(beat("a", 10, 0, borrowed={"b": 8}), beat("b", 40, 64, lent={"a": 8}))
    out = led.describe()
    assert out["debts"] == [{"debtor": "a", "creditor": "b", "blocks": 8}]
    line = {n["node"]: n for n in out["nodes"]}
    assert line["b"]["lent"] == {"a": 8} and line["b"]["lendable"] == 40 and line["a"]["borrowed"] == {"b": 8}


# ------------------------------------------------------------------ DGFM

def test_two_cycle_resolved_by_its_smaller_edge():
    moves = dgfm.plan({("a", "b"): 10, ("b", "a"): 6}, min_blocks=4)
    assert {(m.debtor, m.creditor, m.blocks) for m in moves} == {("a", "b", 6), ("b", "a", 6)}
    assert dgfm.apply({("a", "b"): 10, ("b", "a"): 6}, moves) == {("a", "b"): 4}


def test_three_cycle():
    g = {("a", "b"): 8, ("b", "c"): 5, ("c", "a"): 9, ("c", "d"): 7}
    moves = dgfm.plan(g, min_blocks=2)
    assert len(moves) == 3 and {m.blocks for m in moves} == {5} and moves[0].cycle == ("a", "b", "c")
    assert dgfm.apply(g, moves) == {("a", "b"): 3, ("c", "a"): 4, ("c", "d"): 7}


def test_nested_cycles_all_resolved():
    # a<->b inside a->b->c->a
    g = {("a", "b"): 10, ("b", "a"): 4, ("b", "c"): 6, ("c", "a"): 6}
    left = dgfm.apply(g, dgfm.plan(g, min_blocks=1))
    assert dgfm.find_cycle(left, 1) is None
    assert sum(left.values()) < sum(g.values())


def test_below_the_minimum_and_no_cycle_mean_no_moves():
    assert dgfm.plan({("a", "b"): 10, ("b", "a"): 3}, min_blocks=4) == []
    assert dgfm.plan({("a", "b"): 10, ("b", "c"): 10, ("a", "c"): 5}, min_blocks=1) == []
    assert dgfm.plan({}, min_blocks=1) == []
    with pytest.raises(ValueError):
        dgfm.plan({}, min_blocks=0)


NODES = st.sampled_from(["a", "b", "c", "d", "e"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.tuples(NODES, NODES).filter(lambda e: e[0] != e[1]), st.integers(1, 50), max_size=14),
       st.integers(1, 20))
def test_moves_never_raise_debt_nor_lend_beyond_a_cap(graph, min_blocks):
    # each creditor's cap: exactly what it lends now (the tightest cap the graph allows)
    caps: dict[str, int] = {}
    for (_, c), n in graph.items():
        caps[c] = caps.get(c, 0) + n
    moves = dgfm.plan(graph, min_blocks)
    after = dgfm.apply(graph, moves)
    assert all(n > 0 for n in after.values()) and set(after) <= set(graph)
    assert all(after[e] <= graph[e] for e in after)
    assert sum(after.values()) == sum(graph.values()) - sum(m.blocks for m in moves)
    lent: dict[str, int] = {}
    for (_, c), n in after.items():
        lent[c] = lent.get(c, 0) + n
    assert all(n <= caps[c] for c, n in lent.items())
    assert all(m.blocks >= min_blocks for m in moves)
    assert dgfm.find_cycle(after, min_blocks) is None


def test_kvctl_ledger_request_and_its_bad_input(capsys):
    from kvd import ctl

    parser = ctl.build_parser()
    assert ctl.to_request(parser.parse_args(["ledger"]), parser) == {"cmd": "ledger"}
    assert ctl.to_request(parser.parse_args(["ledger", "--min-blocks", "4"]), parser) == {"cmd": "ledger",
                                                                                           "min_blocks": 4}
    for bad in (["ledger", "--min-blocks", "0"], ["ledger", "--min-blocks", "x"]):
        with pytest.raises(SystemExit) as exited:
            ctl.main(["--socket", "/nonexistent.sock", *bad])
        assert exited.value.code == 2
        assert "min-blocks" in capsys.readouterr().err
