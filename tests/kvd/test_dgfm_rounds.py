"""DGFM carried out (kvd/coordinator/dgfm_rounds.py): the order of a cycle's moves, a
round over a hand-built ledger whose debtors answer through a plain function (the
node's ``recall`` command is tested over real daemons, tests/cluster/test_dgfm.py), and
the config's validation."""

import asyncio

import pytest

from kvd.cluster_config import ClusterConfig, ConfigError
from kvd.coordinator import dgfm
from kvd.coordinator.dgfm_rounds import DGFMRounds

from .test_ledger import beat, ledger

CYCLE3 = {("a", "b"): 20, ("b", "c"): 20, ("c", "a"): 20}


def three_cycle_ledger(free: dict[str, int]):
    lent = {"b": {"a": 20}, "c": {"b": 20}, "a": {"c": 20}}         # creditor -> debtor -> blocks
    return ledger(*(beat(n, free[n], 40, lent=lent[n]) for n in "abc"))


def test_cycles_cut_plan_into_its_cycles_in_debt_order():
    g = {**CYCLE3, ("x", "y"): 30, ("y", "x"): 30}
    parts = dgfm.cycles(dgfm.plan(g, min_blocks=16))
    assert [[(m.debtor, m.creditor) for m in p] for p in parts] == [[("a", "b"), ("b", "c"), ("c", "a")],
                                                                     [("x", "y"), ("y", "x")]]


def test_a_cycle_starts_where_room_is_and_follows_the_debts():
    cycle = dgfm.plan(CYCLE3, min_blocks=16)
    assert [m.debtor for m in dgfm.ordered(cycle, {"a": 2, "b": 30, "c": 5})] == ["b", "c", "a"]
    assert [m.debtor for m in dgfm.ordered(cycle, {"a": 8, "b": 8, "c": 8})] == ["a", "b", "c"]   # ties: the name
    assert [m.debtor for m in dgfm.ordered(cycle, {"c": 1})] == ["c", "a", "b"]     # unknown nodes: none free


def test_a_round_carries_the_moves_out_in_order():
    led = three_cycle_ledger({"a": 4, "b": 4, "c": 25})
    asked = []

    async def recall(debtor, creditor, blocks):
        asked.append((debtor, creditor, blocks))
        return {"loan_blocks": blocks, "blocks_home": 3}
    rounds = DGFMRounds(led, recall, lambda: {"a", "b", "c"}, 1.0, 16)
    got = asyncio.run(rounds.round())
    assert asked == [("c", "a", 20), ("a", "b", 20), ("b", "c", 20)]
    assert all(m["ok"] for m in got)
    assert led.describe()["dgfm_counts"] == {"rounds": 1, "moves_done": 3, "moves_failed": 0, "loan_blocks": 60,
                                             "blocks_home": 9}


def test_a_failed_move_stops_its_cycle_for_the_round():
    led = three_cycle_ledger({"a": 30, "b": 4, "c": 4})
    asked = []

    async def recall(debtor, creditor, blocks):
        asked.append(debtor)
        if debtor == "b":
            raise ValueError("node b: 3 free blocks here, the recall needs 5")
        return {"loan_blocks": blocks, "blocks_home": 2}
    rounds = DGFMRounds(led, recall, lambda: {"a", "b", "c"}, 1.0, 16)
    got = asyncio.run(rounds.round())
    assert asked == ["a", "b"]                          # c's move would land in b's room: not tried
    assert [m["ok"] for m in got] == [True, False, False] and "skipped" in got[2]["reason"]
    assert led.dgfm_counts["moves_done"] == 1 and led.dgfm_counts["moves_failed"] == 1
    assert rounds.last == got


def test_below_the_threshold_nothing_moves_and_dead_nodes_are_forgotten():
    led = three_cycle_ledger({"a": 30, "b": 30, "c": 30})
    rounds = DGFMRounds(led, None, lambda: {"a", "b", "c"}, 1.0, 21)
    assert asyncio.run(rounds.round()) == []
    rounds = DGFMRounds(led, None, lambda: {"a", "b"}, 1.0, 16)       # c gone: its line (and a's debt) with it
    assert asyncio.run(rounds.round()) == [] and "c" not in led.entries


@pytest.mark.parametrize("bad", [{"dgfm_interval_s": -1.0}, {"dgfm_interval_s": float("inf")},
                                 {"dgfm_min_blocks": 0}])
def test_config_is_validated(bad):
    with pytest.raises(ConfigError, match="dgfm_"):
        ClusterConfig(**bad)
    with pytest.raises(ValueError):
        DGFMRounds(three_cycle_ledger({"a": 1, "b": 1, "c": 1}), None, set, bad.get("dgfm_interval_s", 1.0),
                   bad.get("dgfm_min_blocks", 16))


def test_off_runs_no_round():
    rounds = DGFMRounds(three_cycle_ledger({"a": 30, "b": 30, "c": 30}), None, set, 0.0, 16)
    asyncio.run(asyncio.wait_for(rounds.run(), 1.0))    # returns at once
    assert rounds.counts["rounds"] == 0
