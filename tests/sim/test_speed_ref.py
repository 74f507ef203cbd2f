"""The host's speed reference (tools/sim/speed_ref.py), a profile brought to
another speed (kvd.sim.profile_file.at_speed) and validate's use of both
(tools/bench/sim/validate.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.sim.profile_file import DECODE_COSTS, PREFILL_COSTS, ProfileError, at_speed, load_profile
from tests.sim.conftest import toy_profile_doc
from tools.bench.sim.validate import METRICS, speed_of

ROOT = Path(__file__).resolve().parents[2]


def test_readings_come_from_one_engine_one_per_line_on_stdin():
    proc = subprocess.run([sys.executable, "-m", "tools.sim.speed_ref", "--model", "tiny", "--repeat"],
                          cwd=ROOT, input="\n", capture_output=True, text=True, timeout=300, check=True)
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(lines) == 2
    for r in lines:
        assert r["prefill_s"] > 0 and r["decode_s"] > 0 and r["threads"] >= 1


def test_a_profile_at_another_speed_scales_prefill_and_decode_apart():
    doc = toy_profile_doc(costs={**toy_profile_doc()["costs"], "decode_batch_s": [[1, 0.004], [2, 0.006]]},
                          wake=[[0.5, 0.002]], cache={"decode_cold_s": 0.001, "warm_steps": 4.0},
                          serving={"first_token_s": 0.01, "token_s": 0.001},
                          reference={"prefill_s": 0.1, "decode_s": 0.005})
    out = at_speed(doc, 1.5, 0.5)
    for k in PREFILL_COSTS:
        assert out["costs"][k] == pytest.approx(doc["costs"][k] * 1.5)
    for k in DECODE_COSTS:
        assert out["costs"][k] == pytest.approx(doc["costs"][k] * 0.5)
    assert out["costs"]["decode_batch_s"] == [[1, 0.002], [2, 0.003]]
    assert out["costs"]["transfer_byte_s"] == doc["costs"]["transfer_byte_s"]
    assert out["wake"] == [[0.5, 0.001]] and out["cache"]["decode_cold_s"] == pytest.approx(0.0005)
    assert out["serving"]["first_token_s"] == pytest.approx(0.01) and out["reference"]["prefill_s"] == pytest.approx(0.15)
    assert at_speed(doc, 1.0, 1.0) == doc and doc["costs"]["prefill_token_s"] == 2e-4      # a copy
    with pytest.raises(ValueError, match="speed ratios"):
        at_speed(doc, 0.0, 1.0)


@pytest.mark.parametrize("ref", [{"prefill_s": 0.1}, {"prefill_s": -1, "decode_s": 0.1}, [0.1, 0.1],
                                 {"prefill_s": True, "decode_s": 0.1}])
def test_a_profile_with_a_malformed_reference_is_refused(write_profile, ref):
    with pytest.raises(ProfileError, match="reference"):
        load_profile(write_profile(reference=ref))


def test_speed_is_the_readings_median_against_the_profile_reference(write_profile):
    doc = json.loads(write_profile(reference={"prefill_s": 0.1, "decode_s": 0.01}).read_text())
    readings = [{"prefill_s": p, "decode_s": d, "threads": 2} for p, d in ((0.11, 0.012), (0.12, 0.011),
                                                                           (0.5, 0.5))]
    speed = speed_of(doc, readings)
    assert speed["prefill"] == pytest.approx(1.2) and speed["decode"] == pytest.approx(1.2)
    assert speed_of(doc, [dict(r, threads=1) for r in readings]) is None       # another thread count
    assert speed_of(json.loads(write_profile("plain.json").read_text()), readings) is None     # no reference


def test_validate_simulates_on_the_profile_at_its_runs_speed(tmp_path, write_profile):
    profile = write_profile(reference={"prefill_s": 0.1, "decode_s": 0.01})

    def saved(factor: float) -> Path:
        run = {**{k: 10.0 for k in METRICS}, "slo_attainment": 1.0, "request_goodput": 1.0,
               "reference": {"prefill_s": 0.1 * factor, "decode_s": 0.01 * factor, "threads": 2}}
        path = tmp_path / f"m{factor}.json"
        path.write_text(json.dumps({"rows": [{"config": "one", "trace": "random", "rate": 1.0,
                                              "measured_runs": [run]}]}))
        return path

    def row(factor: float, *extra: str) -> dict:
        out = tmp_path / "v.json"
        subprocess.run([sys.executable, "-m", "tools.bench.sim.validate", "--profile", str(profile), "--configs",
                        "one", "--traces", "random", "--rates", "1", "--num-prompts", "4", "--out", str(out),
                        "--measured", str(saved(factor)), *extra], cwd=ROOT, check=True, capture_output=True,
                       timeout=120)
        (r,) = json.loads(out.read_text())["rows"]
        return r

    slow = row(2.0)
    assert slow["speed"]["prefill"] == pytest.approx(2.0) and slow["speed"]["decode"] == pytest.approx(2.0)
    for k in METRICS:
        assert slow["simulated"][k] > 1.5 * slow["simulated_plain"][k]
    assert slow["errors_plain"]["median_ttft_ms"] != slow["errors"]["median_ttft_ms"]
    same = row(1.0)
    assert same["simulated"] == same["simulated_plain"]
    off = row(2.0, "--no-reference")
    assert off["speed"] is None and off["simulated"] == off["simulated_plain"]
