"""``kvd-loadgen compare A.json B.json [C.json ...]``: every metric side by side.

Each column after the first is followed by its ratio to the first result
(B/A), so "feature on vs off" reads directly: a TTFT ratio of 0.60 means 40%
lower.  Metrics missing or null in a result print as ``n/a``.

``--outputs``: the runs' generated texts, request by request (``(session,
turn)`` keys: the same trace sent twice has the same keys), each run against
the first: identical, different, failed in either, missing from either.
Results must be saved with ``--save-outputs``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from tools.loadgen.report import load_result


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def _ratio(base, value) -> str:
    if not isinstance(base, (int, float)) or not isinstance(value, (int, float)):
        return "n/a"
    if base == 0:
        return "=" if value == 0 else "inf"
    return f"{value / base:.3f}"


def compare_table(results: Sequence[dict], names: Sequence[str]) -> str:
    """A fixed-width table: metric, the first result, then value and ratio per other."""
    keys: list[str] = []
    for res in results:
        keys += [k for k, v in res["metrics"].items()
                 if k not in keys and (v is None or isinstance(v, (int, float)))]
    header = ["metric", names[0]]
    for name in names[1:]:
        header += [name, f"{name}/{names[0]}"]
    rows = [header]
    for key in keys:
        base = results[0]["metrics"].get(key)
        row = [key, _fmt(base)]
        for res in results[1:]:
            value = res["metrics"].get(key)
            row += [_fmt(value), _ratio(base, value)]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compare_files(paths: Sequence[str]) -> str:
    """Load the result files and build the table; ValueError for a bad file."""
    results = [load_result(p) for p in paths]
    names = _short_names(paths)
    return compare_table(results, names)


def _short_names(paths: Sequence[str]) -> list[str]:
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) == len(stems) and all(len(s) <= 24 for s in stems):
        return stems
    return [chr(ord("A") + i) if i < 26 else f"R{i}" for i in range(len(paths))]


def compare_outputs(base: dict, other: dict) -> dict:
    """Texts of ``other``'s requests against ``base``'s, by (session, turn):
    counts of ``same``, ``different``, ``failed`` (in either run) and
    ``missing`` (in either), and up to 5 keys that differ."""
    def by_key(res: dict) -> dict:
        reqs = res.get("requests")
        if reqs is None or any("text" not in r for r in reqs):
            raise ValueError("a result has no generated texts: run kvd-loadgen with --save-outputs")
        return {(r["session"], r["turn"]): r for r in reqs}
    a, b = by_key(base), by_key(other)
    out = {"same": 0, "different": 0, "failed": 0, "missing": len(a.keys() ^ b.keys()), "examples": []}
    for key in sorted(a.keys() & b.keys()):
        ra, rb = a[key], b[key]
        if not (ra["success"] and rb["success"]):
            out["failed"] += 1
        elif ra["text"] == rb["text"]:
            out["same"] += 1
        else:
            out["different"] += 1
            if len(out["examples"]) < 5:
                out["examples"].append(list(key))
    return out


def compare_output_files(paths: Sequence[str]) -> tuple[str, bool]:
    """(a report, True when every run matched the first request by request)."""
    results = [load_result(p) for p in paths]
    names = _short_names(paths)
    lines, same = [], True
    for name, res in zip(names[1:], results[1:]):
        c = compare_outputs(results[0], res)
        same = same and c["different"] == c["failed"] == c["missing"] == 0
        lines.append(f"{name} vs {names[0]}: {c['same']} identical, {c['different']} different, "
                     f"{c['failed']} failed, {c['missing']} missing"
                     + (f"; differing (session, turn): {c['examples']}" if c["examples"] else ""))
    return "\n".join(lines), same
