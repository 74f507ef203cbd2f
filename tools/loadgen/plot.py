"""``kvd-loadgen plot RESULT...``: latency CDFs and throughput over time.

Two PNG files per call, one line per result file:

- ``<prefix>-cdf.png``         CDFs of TTFT, TPOT, ITL and E2EL (ms)
- ``<prefix>-throughput.png``  output tokens/s and completed requests/s in
                               1-second bins, with injected faults marked

Needs results saved with ``--save-detailed`` (per-request records).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from tools.loadgen.client import RequestRecord
from tools.loadgen.metrics import LATENCIES, LATENCY_TITLES, request_tpot, throughput_series
from tools.loadgen.report import load_result


def _records(result: dict, path: str) -> list[RequestRecord]:
    if "requests" not in result:
        raise ValueError(f"{path} has no per-request records; rerun with --save-detailed")
    return [RequestRecord.from_json(r) for r in result["requests"]]


def latency_samples(records: Sequence[RequestRecord], name: str) -> np.ndarray:
    """Samples of one latency in ms over the successful requests."""
    ok = [r for r in records if r.success]
    if name == "ttft":
        values = [r.ttft if r.ttft is not None else r.e2el for r in ok]
    elif name == "tpot":
        values = [t for t in (request_tpot(r) for r in ok) if t is not None]
    elif name == "itl":
        values = [g for r in ok for g in r.itl]
    else:
        values = [r.e2el for r in ok]
    return np.sort(np.asarray(values, dtype=np.float64) * 1e3)


def plot_results(paths: Sequence[str], prefix: str | Path, bin_s: float = 1.0) -> list[Path]:
    """Draw both figures; returns the files written.  ValueError for a bad input."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [(Path(p).stem, load_result(p), p) for p in paths]
    runs = [(label, res, _records(res, p)) for label, res, p in loaded]
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, name in zip(axes.flat, LATENCIES):
        short, title = LATENCY_TITLES[name]
        for label, _, records in runs:
            xs = latency_samples(records, name)
            if xs.size:
                ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)
        ax.set_title(title)
        ax.set_xlabel(f"{short} (ms)")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    cdf_path = prefix.with_name(prefix.name + "-cdf.png")
    fig.savefig(cdf_path, dpi=110)
    plt.close(fig)

    fig, (ax_tok, ax_req) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for label, result, records in runs:
        starts, tokens, done = throughput_series(records, bin_s)
        # steps-post draws bin i from starts[i] to starts[i+1]: close the last bin too
        edges = np.append(starts, starts[-1] + bin_s)
        ax_tok.plot(edges, np.append(tokens, tokens[-1]), drawstyle="steps-post", label=label)
        ax_req.plot(edges, np.append(done, done[-1]), drawstyle="steps-post", label=label)
        for ev in result.get("faults") or ():
            if ev.get("sent_s") is not None:
                for ax in (ax_tok, ax_req):
                    ax.axvline(ev["sent_s"], color="red", linestyle="--", alpha=0.7)
                ax_tok.annotate(f"{ev['node']} {ev['mode']}", (ev["sent_s"], 0),
                                textcoords="offset points", xytext=(3, 5), color="red", fontsize=8)
    ax_tok.set_ylabel("output tokens/s")
    ax_req.set_ylabel("completed requests/s")
    ax_req.set_xlabel(f"time since start (s), {bin_s:g}-s bins")
    for ax in (ax_tok, ax_req):
        ax.grid(alpha=0.3)
    ax_tok.legend(fontsize=8)
    fig.tight_layout()
    tput_path = prefix.with_name(prefix.name + "-throughput.png")
    fig.savefig(tput_path, dpi=110)
    plt.close(fig)
    return [cdf_path, tput_path]
