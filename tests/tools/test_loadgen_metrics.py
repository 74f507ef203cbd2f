"""Metrics against hand-computed values on a synthetic timeline.

Timeline (seconds; start is relative to the run, the rest to the start):

    A  start 0.0  ttft 0.1  chunks at +0.1 +0.12 +0.15 +0.2  done 0.2   4 tokens  prompt usage 10
    B  start 0.5  ttft 0.3  chunks at +0.3 +0.4              done 0.5   2 tokens  prompt (dataset) 20
    C  start 0.2  empty answer: no text, done 0.05 (ttft = e2el)         prompt usage 5
    D  failed: HTTP 500: boom
    E  failed: HTTP 500: boom
    F  failed mid-stream after 2 tokens (its tokens do not count)

Run duration 2.0 s.
"""

import math

import pytest

from tools.loadgen.client import RequestRecord
from tools.loadgen.metrics import (Slo, compute_metrics, error_counts, percentile_label,
                                   request_tpot, summarize, throughput_series, token_arrivals)


def timeline() -> list[RequestRecord]:
    a = RequestRecord(index=0, success=True, start=0.0, ttft=0.1, itl=[0.02, 0.03, 0.05], e2el=0.2,
                      chunks=4, output_tokens=4, prompt_len=9, prompt_tokens=10, usage_reported=True)
    b = RequestRecord(index=1, success=True, start=0.5, ttft=0.3, itl=[0.1], e2el=0.5,
                      chunks=2, output_tokens=2, prompt_len=20)
    c = RequestRecord(index=2, success=True, start=0.2, ttft=0.05, e2el=0.05, chunks=0,
                      output_tokens=0, prompt_len=4, prompt_tokens=5, usage_reported=True)
    d = RequestRecord(index=3, error="HTTP 500: boom", start=0.3, e2el=0.01, prompt_len=7)
    e = RequestRecord(index=4, error="HTTP 500: boom", start=0.4, e2el=0.01, prompt_len=7)
    f = RequestRecord(index=5, error="stream ended before data: [DONE]", start=0.6, ttft=None,
                      e2el=0.3, chunks=2, output_tokens=2, prompt_len=7)
    return [a, b, c, d, e, f]


def test_counts_and_throughputs():
    m = compute_metrics(timeline(), 2.0)
    assert (m["num_requests"], m["completed"], m["failed"], m["empty"]) == (6, 3, 3, 1)
    # input: usage when reported (10, 5), the dataset's count otherwise (20)
    assert m["total_input_tokens"] == 35
    assert m["total_output_tokens"] == 6          # F's partial tokens are not counted
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(20.5)
    assert m["request_goodput"] is None           # no SLO given
    assert m["slo_attainment"] is None
    assert m["duration"] == 2.0


def test_ttft_includes_the_empty_response():
    m = compute_metrics(timeline(), 2.0, percentiles=[50, 99])
    # samples 100, 300, 50 ms
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((50**2 + 150**2 + 100**2) / 3))
    assert m["p50_ttft_ms"] == pytest.approx(100.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.98 * 200)   # linear interpolation


def test_tpot_per_request_skips_single_and_empty():
    recs = timeline()
    assert request_tpot(recs[0]) == pytest.approx(0.1 / 3)
    assert request_tpot(recs[1]) == pytest.approx(0.2)
    assert request_tpot(recs[2]) is None
    one = RequestRecord(index=9, success=True, ttft=0.1, e2el=0.1, chunks=1, output_tokens=1)
    assert request_tpot(one) is None
    m = compute_metrics(recs, 2.0)
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 200) / 2)
    assert m["median_tpot_ms"] == pytest.approx((100 / 3 + 200) / 2)
    assert m["p99_tpot_ms"] == pytest.approx(100 / 3 + 0.99 * (200 - 100 / 3))


def test_tpot_uses_usage_tokens_not_chunks():
    # 3 chunks carried 7 tokens: TPOT divides by tokens - 1, ITL stays per chunk.
    r = RequestRecord(index=0, success=True, ttft=0.1, itl=[0.2, 0.3], e2el=0.6, chunks=3,
                      output_tokens=7, usage_reported=True)
    assert request_tpot(r) == pytest.approx(0.5 / 6)
    m = compute_metrics([r], 1.0)
    assert m["mean_itl_ms"] == pytest.approx(250.0)


def test_itl_pools_every_gap():
    m = compute_metrics(timeline(), 2.0)
    # gaps 20, 30, 50 (A) and 100 (B) ms
    assert m["mean_itl_ms"] == pytest.approx(50.0)
    assert m["median_itl_ms"] == pytest.approx(40.0)
    assert m["p99_itl_ms"] == pytest.approx(50 + 0.97 * 50)


def test_e2el():
    m = compute_metrics(timeline(), 2.0)
    assert m["mean_e2el_ms"] == pytest.approx(250.0)
    assert m["median_e2el_ms"] == pytest.approx(200.0)
    assert m["p99_e2el_ms"] == pytest.approx(200 + 0.98 * 300)


def test_goodput_requires_every_slo():
    # A: ttft 100 ok, tpot 33 ok -> good; B: ttft 300 misses; C: ttft 50, tpot counts as 0 -> good
    m = compute_metrics(timeline(), 2.0, slo=Slo(ttft_ms=150, tpot_ms=50))
    assert m["request_goodput"] == pytest.approx(1.0)
    assert m["slo_attainment"] == pytest.approx(2 / 6)      # A and C; the failed ones count too
    m = compute_metrics(timeline(), 2.0, slo=Slo(e2el_ms=100))
    assert m["request_goodput"] == pytest.approx(0.5)      # only C
    m = compute_metrics(timeline(), 2.0, slo=Slo(tpot_ms=10))
    assert m["request_goodput"] == pytest.approx(0.5)      # only C (no TPOT)
    m = compute_metrics(timeline(), 2.0, slo=Slo(ttft_ms=300, tpot_ms=200, e2el_ms=500))
    assert m["request_goodput"] == pytest.approx(1.5)      # boundaries are inclusive


def test_all_failed_reports_none_not_zero():
    recs = [RequestRecord(index=i, error="ClientConnectorError: refused") for i in range(3)]
    m = compute_metrics(recs, 1.0, percentiles=[90], slo=Slo(ttft_ms=1))
    assert (m["completed"], m["failed"]) == (0, 3)
    assert m["request_throughput"] == 0 and m["request_goodput"] == 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert m[f"mean_{name}_ms"] is None and m[f"p90_{name}_ms"] is None
    assert error_counts(recs) == {"ClientConnectorError: refused": 3}


def test_errors_grouped_most_frequent_first():
    assert error_counts(timeline()) == {"HTTP 500: boom": 2, "stream ended before data: [DONE]": 1}
    assert list(error_counts(timeline())) == ["HTTP 500: boom", "stream ended before data: [DONE]"]


def test_percentile_labels_and_summary_keys():
    assert percentile_label(99) == "99" and percentile_label(99.9) == "99.9"
    out = summarize("ttft", [0.001, 0.002], [99.9, 50])
    assert set(out) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99.9_ttft_ms", "p50_ttft_ms"}
    assert out["p50_ttft_ms"] == pytest.approx(1.5)


def test_slo_parse():
    assert Slo.parse(["ttft:500", "tpot:50", "e2el:2000"]) == Slo(500, 50, 2000)
    assert Slo.parse(["tpot:5"]).as_dict() == {"tpot": 5.0}
    for bad in (["ttft"], ["latency:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_duration_must_be_positive():
    with pytest.raises(ValueError):
        compute_metrics(timeline(), 0.0)


def test_token_arrivals_and_throughput_series():
    a, b, c = timeline()[:3]
    times, tokens = zip(*token_arrivals(a))
    assert times == pytest.approx((0.1, 0.12, 0.15, 0.2)) and tokens == (1, 1, 1, 1)
    assert token_arrivals(c) == []
    spread = RequestRecord(index=0, success=True, start=1.0, ttft=0.5, itl=[0.5], e2el=1.0,
                           chunks=2, output_tokens=6)
    assert token_arrivals(spread) == [(1.5, 3.0), (2.0, 3.0)]
    starts, tokens, done = throughput_series(timeline(), bin_s=0.5)
    # tokens: A's 4 in [0, 0.5), B's 2 at 0.8 and 0.9; ends: A 0.2, C 0.25, B 1.0
    assert starts.tolist() == [0.0, 0.5, 1.0]
    assert tokens.tolist() == pytest.approx([8.0, 4.0, 0.0])
    assert done.tolist() == pytest.approx([4.0, 0.0, 2.0])
