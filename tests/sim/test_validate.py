"""tools/bench/sim/validate.py's pooling of repeated measured runs (the
simulated side on the toy profile; the measured runs are given, as
``--measured`` reuses a validate JSON's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.sim.validate import METRICS, pooled, spread, summary

ROOT = Path(__file__).resolve().parents[2]


def run(**metrics) -> dict:
    return {**{k: metrics.get(k, 10.0) for k in METRICS}, "slo_attainment": 1.0, "request_goodput": 1.0}


def test_runs_pool_to_their_median_and_their_spread_is_the_largest_stray():
    runs = [run(median_ttft_ms=100.0), run(median_ttft_ms=130.0), run(median_ttft_ms=110.0)]
    assert pooled(runs)["median_ttft_ms"] == 110.0
    assert spread(runs)["median_ttft_ms"] == pytest.approx(20 / 110, abs=1e-3)
    assert spread(runs[:1])["median_ttft_ms"] is None           # one run: no spread to speak of


def test_the_summary_counts_cells_whose_own_runs_disagree():
    rows = [{"config": "one", "errors": {**{k: 0.0 for k in METRICS}, "attainment_points": 0.0},
             "measured_runs": [run(), run(p99_ttft_ms=15.0)], "spread": {**{k: 0.0 for k in METRICS},
                                                                         "p99_ttft_ms": 0.2}}]
    text = summary(rows)
    assert "latency cells within target: 4 of 4" in text
    assert "2 measured runs stray from their own median by more than the target: 0 of 4" in text
    rows[0]["spread"]["median_tpot_ms"] = 0.11
    assert "target: 1 of 4" in summary(rows)


def test_measured_files_are_pooled_cell_by_cell(tmp_path, toy_profile):
    def saved(name: str, ttft: float) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"rows": [{"config": "one", "trace": "random", "rate": 1.0,
                                              "measured": run(median_ttft_ms=ttft)}]}))
        return path
    out = tmp_path / "v.json"
    cmd = [sys.executable, "-m", "tools.bench.sim.validate", "--profile", str(toy_profile), "--configs", "one",
           "--traces", "random", "--rates", "1", "--num-prompts", "4", "--out", str(out),
           "--measured", str(saved("a.json", 100.0)), str(saved("b.json", 140.0)), str(saved("c.json", 120.0))]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=120)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["measured"]["median_ttft_ms"] == 120.0 and len(row["measured_runs"]) == 3
    assert row["spread"]["median_ttft_ms"] == pytest.approx(20 / 120, abs=1e-3)
    sim = row["simulated"]["median_ttft_ms"]
    assert row["errors"]["median_ttft_ms"] == pytest.approx((sim - 120.0) / 120.0, abs=1e-3)
    missing = subprocess.run([*cmd, "--rates", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "no run of one random 2" in missing.stderr


def test_a_measured_run_against_a_real_server_keeps_its_records(tmp_path, toy_profile):
    out, keep = tmp_path / "v.json", tmp_path / "kept"
    subprocess.run([sys.executable, "-m", "tools.bench.sim.validate", "--profile", str(toy_profile), "--configs",
                    "one", "--traces", "random", "--rates", "8", "--num-prompts", "3", "--input-len", "16",
                    "--output-len", "4", "--out", str(out), "--keep", str(keep)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["measured_runs"]) == 1 and row["measured"]["median_ttft_ms"] > 0
    assert row["measured_runs"][0]["reference"]["decode_s"] > 0         # the host's speed before the run
    (kept,) = keep.glob("one-random-8-0.json")
    records = json.loads(kept.read_text())["requests"]
    assert len(records) == 3 and all(r["success"] for r in records)


def test_the_paired_configuration_is_measured_on_a_real_pair_and_simulated_as_one(tmp_path, toy_profile):
    out = tmp_path / "v.json"
    subprocess.run([sys.executable, "-m", "tools.bench.sim.validate", "--profile", str(toy_profile), "--configs",
                    "pair2", "--traces", "random", "--rates", "8", "--num-prompts", "4", "--input-len", "16",
                    "--output-len", "6", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["config"] == "pair2"
    assert row["measured"]["median_ttft_ms"] > 0 and row["simulated"]["median_ttft_ms"] > 0
