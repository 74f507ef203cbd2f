"""The step-time model (kvd/sim/costs.py): the decode table by batch size, its
fit from profile samples, and bad tables refused."""

from __future__ import annotations

import pytest

from kvd.sim.costs import StepCosts
from tests.sim.conftest import TOY_COSTS
from tools.sim.profile import fit_costs


def test_decode_table_interpolates_between_batch_sizes_and_extends_with_the_slope():
    c = StepCosts.from_dict({**TOY_COSTS, "decode_batch_s": [[1, 0.004], [2, 0.008], [4, 0.016], [8, 0.020]]})
    assert c.decode_seconds(1, 0) == pytest.approx(0.004)
    assert c.decode_seconds(3, 0) == pytest.approx(0.012)            # between 2 and 4
    assert c.decode_seconds(6, 0) == pytest.approx(0.018)            # between 4 and 8: not linear overall
    assert c.decode_seconds(10, 0) == pytest.approx(0.020 + 2 * TOY_COSTS["decode_seq_s"])
    assert c.decode_seconds(2, 1000) == pytest.approx(0.008 + 1000 * TOY_COSTS["decode_context_s"])
    assert c.decode_seconds(0, 0) == 0.0
    assert StepCosts.from_dict(c.as_dict()) == c                      # round-trips through a profile


def test_a_profile_without_the_table_decodes_linearly():
    c = StepCosts.from_dict(TOY_COSTS)
    assert c.decode_batch_s == ()
    assert c.decode_seconds(3, 100) == pytest.approx(0.003 + 3 * 2e-4 + 100 * 1e-7)


@pytest.mark.parametrize("table, why", [
    ([[2, 0.01], [1, 0.005]], "must rise"),
    ([[0, 0.01]], "batch >= 1"),
    ([[1, -0.01]], "seconds >= 0"),
    ([[1, float("nan")]], "seconds >= 0"),
    ([[1.5, 0.01]], "batch >= 1"),
    ([[1, 0.01, 3]], "pairs"),
    ("fast", "pairs"),
])
def test_a_bad_decode_table_is_refused(table, why):
    with pytest.raises(ValueError, match=why):
        StepCosts.from_dict({**TOY_COSTS, "decode_batch_s": table})


def test_the_fit_recovers_each_batch_sizes_own_cost_and_one_context_slope():
    truth = {1: 0.004, 2: 0.0078, 4: 0.0159, 8: 0.0221}              # not linear in the batch
    per_token = 6e-6
    # contexts in whole blocks: the fit groups a point's contexts by 16 tokens
    decode = [[b, ctx, truth[b] + per_token * ctx] for b in truth for ctx in (32 * b, 32 * b + 16, 128 * b)]
    prefill = [[n, 0, 0.01 + 1e-3 * n] for n in (16, 64, 128)]
    costs, fit = fit_costs(prefill, decode, [[8, 1e-3]], [[4096, 1e-4], [1 << 20, 1e-3]])
    assert dict(costs.decode_batch_s) == pytest.approx(truth, rel=1e-6)
    assert costs.decode_context_s == pytest.approx(per_token, rel=1e-6)
    assert fit["decode_median_error"] < 1e-6
