"""The summary table (vLLM's layout) and the JSON result file.

A result file holds everything a later ``plot`` or ``compare`` needs::

    {"tool": "kvd-loadgen", "version": ..., "date": ..., "started_at": ...,
     "config":  {every run option},
     "machine": {host, cpu, memory, python, git commit},
     "metrics": {flat dict from metrics.compute_metrics},
     "errors":  {message: count},
     "faults":  [{node, mode, at_s, sent_s, ok, reply, error}],
     "requests": [per-request records]          # only with --save-detailed
    }
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import re
import socket
import subprocess
from pathlib import Path
from typing import Sequence

from engine.cpus import cpu_model  # noqa: F401  (re-exported: the benchmarks import it from here)

import orjson

from tools.loadgen import __version__
from tools.loadgen.client import RequestRecord
from tools.loadgen.metrics import LATENCY_TITLES, percentile_label

WIDTH = 50


def _row(label: str, value, fmt: str = "") -> str:
    if value is None:
        return "{:<40} {:<10}".format(label, "n/a")
    return ("{:<40} {:<10" + fmt + "}").format(label, value)


def summary_table(metrics: dict, *, selected: Sequence[str], percentiles: Sequence[float],
                  max_concurrency: int | None, request_rate: float,
                  errors: dict[str, int] | None = None, faults: Sequence[dict] = ()) -> str:
    """vLLM's "Serving Benchmark Result" block, plus failures and faults."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="=")]
    lines.append(_row("Successful requests:", metrics["completed"]))
    lines.append(_row("Failed requests:", metrics["failed"]))
    if metrics.get("empty"):
        lines.append(_row("Empty responses:", metrics["empty"]))
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_row("Request rate configured (RPS):", request_rate, ".2f"))
    lines.append(_row("Benchmark duration (s):", metrics["duration"], ".2f"))
    lines.append(_row("Total input tokens:", metrics["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", metrics["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", metrics["request_throughput"], ".2f"))
    if metrics.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", metrics["request_goodput"], ".2f"))
    if metrics.get("slo_attainment") is not None:
        lines.append(_row("SLO attainment (%):", 100 * metrics["slo_attainment"], ".1f"))
    lines.append(_row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f"))
    lines.append(_row("Total Token throughput (tok/s):", metrics["total_token_throughput"], ".2f"))
    for name in selected:
        short, header = LATENCY_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=WIDTH, c="-"))
        lines.append(_row(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"], ".2f"))
        lines.append(_row(f"Median {short} (ms):", metrics[f"median_{name}_ms"], ".2f"))
        for p in percentiles:
            label = percentile_label(p)
            lines.append(_row(f"P{label} {short} (ms):", metrics[f"p{label}_{name}_ms"], ".2f"))
    if errors:
        lines.append("{s:{c}^{n}}".format(s="Errors", n=WIDTH, c="-"))
        lines.extend(f"{count:>6} x {message}" for message, count in errors.items())
    if faults:
        lines.append("{s:{c}^{n}}".format(s="Faults injected", n=WIDTH, c="-"))
        for ev in faults:
            status = "ok" if ev["ok"] else f"FAILED: {ev['error']}"
            lines.append(f"{ev['node']}@{ev['at_s']:g}s ({ev['mode']}): {status}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def machine_info() -> dict:
    """Where the numbers were taken: enough to know whether two runs compare."""
    info = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_gib": _memory_gib(),
        "kvd_loadgen": __version__,
        "git_commit": _git_commit(),
    }
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return info




def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def build_result(*, config: dict, metrics: dict, errors: dict, faults: Sequence[dict],
                 records: Sequence[RequestRecord] | None, started_at: float,
                 with_text: bool = False) -> dict:
    """The JSON result document (``records`` only with --save-detailed; their
    generated text only ``with_text``, --save-outputs)."""
    result = {
        "tool": "kvd-loadgen",
        "version": __version__,
        "date": _dt.datetime.fromtimestamp(started_at).astimezone().isoformat(timespec="seconds"),
        "started_at": started_at,
        "config": config,
        "machine": machine_info(),
        "metrics": metrics,
        "errors": errors,
        "faults": list(faults),
    }
    if records is not None:
        result["requests"] = [r.to_json(with_text) for r in records]
    return result


def rate_to_json(rate: float) -> float | str:
    """A request rate as a result file's config holds it: the number, or the
    string "inf" (JSON has no infinity; vLLM saves it the same way)."""
    return "inf" if math.isinf(rate) else rate


def rate_from_json(value) -> float:
    """The inverse of ``rate_to_json``; a missing rate (None) is inf, the default.
    Raises ValueError for anything else."""
    if value is None or value == "inf":
        return math.inf
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ValueError(f"request_rate {value!r} is neither a positive number nor \"inf\"")


def default_filename(config: dict, started_at: float) -> str:
    """``kvd-loadgen-random-10qps-c8-tiny-20250101-120000.json`` (vLLM's naming, adapted;
    ``--label`` replaces the leading ``kvd-loadgen``).
    ``config`` is the saved config (``request_rate`` as ``rate_to_json`` writes it)."""
    rate = rate_from_json(config.get("request_rate"))
    rate_s = "inf" if math.isinf(rate) else f"{rate:g}"
    conc = config.get("max_concurrency")
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", str(config.get("model") or "model"))[-40:]
    stamp = _dt.datetime.fromtimestamp(started_at).strftime("%Y%m%d-%H%M%S")
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", str(config.get("label") or "kvd-loadgen"))
    parts = [label, str(config.get("dataset_name")), f"{rate_s}qps"]
    if conc:
        parts.append(f"c{conc}")
    parts += [model, stamp]
    return "-".join(parts) + ".json"


def write_result(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def load_result(path: str | Path) -> dict:
    """A result file; raises ValueError with a one-line reason if it is not one."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise ValueError(f"{path} is not a kvd-loadgen result (no 'metrics')")
    return data


def markdown_table(results: Sequence[dict]) -> str:
    """One markdown row per result file: the serving table of docs/benchmarks.md."""
    head = ("| date | model | endpoint | dataset | requests | rate (req/s) | concurrency | failed "
            "| req/s | out tok/s | TTFT mean / p99 (ms) | TPOT mean / p99 (ms) "
            "| ITL mean / p99 (ms) | E2EL mean / p99 (ms) | goodput (req/s) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]

    def ms(m: dict, name: str) -> str:
        mean, p99 = m.get(f"mean_{name}_ms"), m.get(f"p99_{name}_ms")
        return "n/a" if mean is None else f"{mean:.1f} / {p99:.1f}" if p99 is not None else f"{mean:.1f}"

    for res in results:
        c, m = res.get("config", {}), res["metrics"]
        goodput = m.get("request_goodput")
        rate = c.get("request_rate", "")
        rate = f"{rate:g}" if isinstance(rate, (int, float)) else rate
        lines.append(
            f"| {str(res.get('date', ''))[:10]} | {c.get('model', '')} | {c.get('endpoint', '')} "
            f"| {c.get('dataset_name', '')} | {m['num_requests']} | {rate} "
            f"| {c.get('max_concurrency') or '-'} | {m['failed']} | {m['request_throughput']:.2f} "
            f"| {m['output_throughput']:.1f} | {ms(m, 'ttft')} | {ms(m, 'tpot')} | {ms(m, 'itl')} "
            f"| {ms(m, 'e2el')} | {'-' if goodput is None else f'{goodput:.2f}'} |")
    return "\n".join(lines)
