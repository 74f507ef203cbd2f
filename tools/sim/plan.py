"""``kvd plan``: pick a cluster's shape for a workload and SLOs, in the simulator.

    kvd plan --profile PROFILE.json --slo-ttft MS --slo-tpot MS --max-nodes N [--percentile 90]
             [-c BASE.toml] [--output CONFIG.toml] [--top K] [kvd-loadgen workload flags]

It starts from DéjàVu's closed form (§4.2.1, App. D). With ``Y`` the prompt
time of a mean request, ``t`` its share of a decode step at a full batch,
``N`` its output tokens and ``m = (Y + KV transfer) / Y`` the streaming
overhead, equation 1 splits ``D`` machines into::

    D_p = D*m*Y / (m*Y + N*t)    prompt machines,  D_t = D - D_p   token machines

and the memory bound (eqs. 2-3, per node rather than per pipeline stage)
says how many nodes' KV blocks the requests in flight need (Little's law:
rate x the unloaded latency x tokens per request). The candidates are every
node count up to ``--max-nodes`` (from that bound), mixed with each routing
policy, and disaggregated with the split of eq. 1 and its neighbours, each
with and without chunked prefill; each is simulated on the workload
(tools/sim/run.py) and ranked by goodput per node (kvd-loadgen's goodput: the
requests meeting both SLOs, per second) among those whose ``--percentile``
TTFT and TPOT meet the SLOs. The top candidates are printed with their
predicted metrics and the best is written as a kvd config. When none meets
the SLOs it says which constraint binds (one line, exit 2): the unloaded
floor of TTFT or TPOT (no cluster meets it), the KV memory, or the node budget.
With ``--fail NODE@SECONDS`` (kvd simulate's faults, applied to every
candidate that has that node) each candidate is tried with ``replicas`` 0
and 1 (``recovery = "replica"``): replication's per-step cost against the
requests it saves.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from kvd.cluster_config import with_overrides
from tools.sim.run import SimUsageError, Shape, load_shape, parse, roles_for, simulate, workload_of

PROG = "kvd plan"
CHUNKS = (0, 256)


@dataclass
class Candidate:
    nodes: int
    prefill: int
    routing: str
    chunk: int
    metrics: dict | None = None
    replicas: int | None = None       # None: the base config's (weighed only with --fail)

    @property
    def label(self) -> str:
        shape = f"{self.prefill}P:{self.nodes - self.prefill}D" if self.prefill else "mixed"
        extra = "" if self.replicas is None else f", replicas {self.replicas}"
        return f"{shape}, {self.routing}, chunk {self.chunk or 'off'}{extra}"


@dataclass(frozen=True)
class ClosedForm:
    """DéjàVu's eq. 1 inputs and the memory bound, for one workload."""

    prompt_s: float          # Y
    token_s: float           # t: one request's share of a decode step at the planned batch
    output_tokens: float     # N
    overhead: float          # m
    min_nodes_memory: int

    def prefill_share(self) -> float:
        """D_p / D of eq. 1."""
        y, n, t, m = self.prompt_s, self.output_tokens, self.token_s, self.overhead
        return m * y / (m * y + n * t)


def closed_form(shape: Shape, prompt_len: float, output_len: float, rate: float) -> ClosedForm:
    c, e = shape.profile.costs, shape.engine
    y = c.prefill_seconds([(int(prompt_len), 0)])
    batch = max(1, min(e.max_num_seqs, 16))
    t = c.decode_seconds(batch, int(batch * (prompt_len + output_len / 2))) / batch
    kv = c.transfer_seconds(int(prompt_len * shape.profile.kv_bytes_per_token))
    m = (y + kv) / y if y > 0 else 1.0
    in_flight = (rate if math.isfinite(rate) else 0.0) * (y + output_len * t * batch)
    tokens = in_flight * (prompt_len + output_len)
    min_nodes = max(1, math.ceil(tokens / (e.kv_blocks * e.block_size)))
    return ClosedForm(y, t, output_len, m, min_nodes)


def candidates(max_nodes: int, form: ClosedForm, routings: list[str]) -> list[Candidate]:
    """Mixed shapes with each routing and eq. 1's splits (and neighbours), each chunked or not."""
    out = []
    for d in range(min(form.min_nodes_memory, max_nodes), max_nodes + 1):
        for chunk in CHUNKS:
            for routing in routings:
                out.append(Candidate(d, 0, routing, chunk))
            if d >= 2:
                ideal = d * form.prefill_share()
                for p in sorted({max(1, min(d - 1, round(ideal) + k)) for k in (-1, 0, 1)}):
                    out.append(Candidate(d, p, routings[0], chunk))
    return out


def meets(m: dict, pct: str, slo_ttft: float, slo_tpot: float) -> bool:
    """Its percentiles meet both SLOs (a run where no request completed meets none)."""
    ttft = m.get(f"p{pct}_ttft_ms")
    return ttft is not None and ttft <= slo_ttft and (m.get(f"p{pct}_tpot_ms") or 0) <= slo_tpot


def binding(best: list[Candidate], form: ClosedForm, shape: Shape, pct: str, slo_ttft: float,
            slo_tpot: float, max_nodes: int, prompt_len: float, output_len: float) -> str:
    """Which constraint keeps every candidate from the SLOs, in one line."""
    c = shape.profile.costs
    floor_ttft = 1e3 * c.prefill_seconds([(int(prompt_len), 0)])
    floor_tpot = 1e3 * c.decode_seconds(1, int(prompt_len + output_len / 2))
    if floor_ttft > slo_ttft:
        return (f"TTFT binds: an unloaded prefill of a mean prompt ({prompt_len:.0f} tokens) takes "
                f"{floor_ttft:.1f} ms on this profile, above --slo-ttft {slo_ttft:g}; no cluster meets it")
    if floor_tpot > slo_tpot:
        return (f"TPOT binds: a decode step of one request takes {floor_tpot:.1f} ms on this profile, "
                f"above --slo-tpot {slo_tpot:g}; no cluster meets it")
    if form.min_nodes_memory > max_nodes:
        return (f"KV memory binds: the requests in flight need about {form.min_nodes_memory} nodes' KV "
                f"blocks, the budget is --max-nodes {max_nodes}")
    top = min(best, key=lambda k: max((k.metrics[f"p{pct}_ttft_ms"] or math.inf) / slo_ttft,
                                      (k.metrics.get(f"p{pct}_tpot_ms") or 0) / slo_tpot))
    ttft, tpot = top.metrics[f"p{pct}_ttft_ms"] or math.inf, top.metrics.get(f"p{pct}_tpot_ms") or 0
    which = "TTFT" if ttft / slo_ttft >= tpot / slo_tpot else "TPOT"
    return (f"the node budget binds ({which} under load): the closest, {top.label} on {top.nodes} node(s), "
            f"has p{pct} TTFT {ttft:.0f} ms and TPOT {tpot:.1f} ms against {slo_ttft:g} / {slo_tpot:g} ms; "
            f"allow more than --max-nodes {max_nodes}")


def config_toml(best: Candidate, pct: str, cmd: str) -> str:
    m = best.metrics
    serve = f"kvd serve -c CONFIG.toml --nodes {best.nodes}" + (f" --prefill {best.prefill}" if best.prefill else "")
    return (f"# written by {cmd}\n"
            f"# {best.label} on {best.nodes} node(s); predicted: goodput {m['request_goodput']:.2f} req/s, "
            f"p{pct} TTFT {m[f'p{pct}_ttft_ms']:.0f} ms, p{pct} TPOT {m[f'p{pct}_tpot_ms'] or 0:.1f} ms\n"
            f"# serve with: {serve}\n\n"
            f"[engine]\nprefill_chunk_tokens = {best.chunk}\n\n"
            f"[cluster]\nrouting = \"{best.routing}\"\n"
            + (f"replicas = {best.replicas}\nrecovery = \"replica\"\n" if best.replicas is not None else ""))


def _extra(p) -> None:
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO, ms")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO, ms")
    p.add_argument("--percentile", type=float, default=90.0, help="the percentile the SLOs hold at (default 90)")
    p.add_argument("--max-nodes", type=int, default=None, help="the node budget")
    p.add_argument("--output", default=None, help="write the best configuration here (TOML)")
    p.add_argument("--top", type=int, default=5, help="candidates to print (default 5)")


@dataclass
class Plan:
    """What a search considered: every candidate with its simulated metrics,
    those meeting the SLOs, the ranking (best first) and its inputs."""

    tried: list[Candidate]
    good: list[Candidate]
    ranked: list[Candidate]
    form: ClosedForm
    base: Shape
    pct: str
    prompt_len: float
    output_len: float


def search(own, args) -> Plan:
    """Simulate every candidate for ``kvd plan``'s parsed flags (``parse(argv,
    PROG, _extra)``); raises SimUsageError (one line) for a bad flag."""
    from tools.loadgen import metrics
    from tools.loadgen.metrics import Slo, percentile_label

    if own.slo_ttft is None or own.slo_tpot is None or own.max_nodes is None:
        raise SimUsageError("--slo-ttft MS, --slo-tpot MS and --max-nodes N are required")
    if not (own.slo_ttft > 0 and own.slo_tpot > 0 and math.isfinite(own.slo_ttft + own.slo_tpot)):
        raise SimUsageError("--slo-ttft and --slo-tpot must be positive numbers of milliseconds")
    if not 1 <= own.max_nodes <= 64:
        raise SimUsageError("--max-nodes must be in 1..64")
    if not 0 < own.percentile < 100 or own.top < 1:
        raise SimUsageError("--percentile must be in (0, 100) and --top >= 1")
    base = load_shape(own.config, own.profile, 1, 0, own.routing, own.colocated, own.host_cores)
    conversations, opts, encode, _ = workload_of(args)
    pct = percentile_label(own.percentile)
    slo = Slo.parse([f"ttft:{own.slo_ttft:g}", f"tpot:{own.slo_tpot:g}"])
    turns = [t for c in conversations for t in c.turns]
    prompt_len = sum(len(encode(t.text)) for t in turns) / len(turns)
    output_len = sum(t.output_len for t in turns) / len(turns)
    form = closed_form(base, prompt_len, output_len, args.request_rate)
    print(f"{PROG}: eq. 1: Y = {form.prompt_s * 1e3:.1f} ms, t = {form.token_s * 1e3:.2f} ms, N = {output_len:.0f}, "
          f"m = {form.overhead:.2f}: prefill share D_p/D = {form.prefill_share():.2f}; memory bound "
          f">= {form.min_nodes_memory} node(s)", file=sys.stderr)
    routings = [own.routing] if own.routing else ["prompt-tree", "least-load"]
    tried = [k for k in candidates(own.max_nodes, form, routings)
             if k.chunk == 0 or base.profile.doc.get("chunked_prefill") is not False]
    if own.faults:                    # with faults, replication is worth its cost or not: both are tried
        tried = [replace(k, replicas=r) for k in tried for r in (0, 1)]
    percentiles = sorted({own.percentile, 50.0, 99.0})
    for k in tried:
        engine = replace(base.engine, prefill_chunk_tokens=k.chunk)
        cluster = with_overrides(base.cluster, routing=k.routing, pairs=False)     # no pair candidates
        if k.replicas is not None:
            cluster = with_overrides(cluster, replicas=k.replicas, recovery="replica")
        shape = Shape(engine, cluster, roles_for(k.nodes, k.prefill), base.profile, own.colocated,
                      base.host_cores)
        # a fault names a node by number: a candidate without that node does not have it
        faults = [f for f in own.faults if f.node in {f"n{i + 1}" for i in range(k.nodes)}]
        records, duration, _ = simulate(shape, conversations, opts, encode, faults=faults)
        k.metrics = metrics.compute_metrics(records, duration, percentiles, slo)
    good = [k for k in tried if meets(k.metrics, pct, own.slo_ttft, own.slo_tpot)]
    ranked = sorted(good or tried, key=lambda k: (-k.metrics["request_goodput"] / k.nodes, k.nodes, k.label))
    return Plan(tried, good, ranked, form, base, pct, prompt_len, output_len)


def main(argv: list[str]) -> int:
    own, args = parse(argv, PROG, _extra)
    try:
        plan = search(own, args)
    except SimUsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    tried, good, ranked, pct = plan.tried, plan.good, plan.ranked, plan.pct
    print(_table(ranked[:own.top], pct, own.slo_ttft, own.slo_tpot))
    if not good:
        print(f"{PROG}: error: no configuration within {own.max_nodes} node(s) meets the SLOs: "
              + binding(tried, plan.form, plan.base, pct, own.slo_ttft, own.slo_tpot, own.max_nodes,
                        plan.prompt_len, plan.output_len), file=sys.stderr)
        return 2
    best = ranked[0]
    print(f"{PROG}: best: {best.label} on {best.nodes} node(s), goodput "
          f"{best.metrics['request_goodput'] / best.nodes:.2f} req/s per node ({len(tried)} simulated)",
          file=sys.stderr)
    if own.output:
        text = config_toml(best, pct, "kvd plan " + " ".join(argv))
        try:
            Path(own.output).write_text(text)
        except OSError as exc:
            print(f"{PROG}: error: cannot write {own.output}: {exc}", file=sys.stderr)
            return 2
        print(f"{PROG}: wrote {own.output}", file=sys.stderr)
    return 0


def _table(rows: list[Candidate], pct: str, slo_ttft: float, slo_tpot: float) -> str:
    head = f"{'candidate':<44} {'nodes':>5} {'goodput/node':>12} {'p' + pct + ' TTFT':>10} {'p' + pct + ' TPOT':>10} {'attain':>7}"
    lines = [head, "-" * len(head)]
    for k in rows:
        m = k.metrics
        ttft = m[f"p{pct}_ttft_ms"]
        lines.append(f"{k.label:<44} {k.nodes:>5} {m['request_goodput'] / k.nodes:>12.2f} "
                     f"{'n/a' if ttft is None else f'{ttft:.0f}':>10} {m.get(f'p{pct}_tpot_ms') or 0:>10.1f} "
                     f"{m['slo_attainment']:>7.1%}")
    lines.append(f"(SLOs: p{pct} TTFT <= {slo_ttft:g} ms, TPOT <= {slo_tpot:g} ms; goodput counts requests meeting both)")
    return "\n".join(lines)
