"""``kvd simulate``: one simulated run, written as a kvd-loadgen result.

    kvd simulate [-c CONFIG] [--nodes N] [--prefill P] [--routing POLICY] [--colocated] --profile PROFILE.json \\
                 [kvd-loadgen workload flags: --dataset-name, --random-input-len, --request-rate,
                  --burstiness, --num-prompts, --seed, --goodput, --save-result --result-dir DIR ...]

The config's ``[engine]`` (blocks, chunk size, batch limits) and ``[cluster]``
(routing, prefill threshold and queue bound, kv_stream, replicas) shape the
simulated cluster as they shape ``kvd serve --nodes N --prefill P``; the
workload flags are kvd-loadgen's own parser's, and the result is its JSON
(``kvd-loadgen compare`` and ``plot`` read it) with a ``simulated`` object in
``config``. The profile may come from another machine (that is what one
plans with); its model must be the config's when a config names one.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from kvd.sim.profile_file import Profile, ProfileError, load_profile

PROG = "kvd simulate"


class SimUsageError(ValueError):
    """A bad flag, config or profile: one line, exit 2."""


def own_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, add_help=False)
    p.add_argument("-c", "--config", help="TOML config ([engine], [cluster]; see etc/kvd.toml)")
    p.add_argument("--profile", help="the machine's profile (kvd profile)")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster (default 1)")
    p.add_argument("--prefill", type=int, default=0, help="P of the nodes are prefill nodes, the rest decode")
    p.add_argument("--routing", default=None, help="routing policy (default: [cluster].routing)")
    p.add_argument("--pairs", action="store_true", default=None,
                   help="pair the nodes in order, n1-n2, n3-n4, ... ([cluster].pairs; --nodes 2N)")
    p.add_argument("--colocated", action="store_true",
                   help="every node on one host, sharing its last-level cache and cores (as kvd serve --nodes N "
                        "on one machine); default: a host per node")
    p.add_argument("--host-cores", type=int, default=None,
                   help="with --colocated, the host's cores (default: the profile's host_cpus)")
    p.add_argument("--fail", action="append", default=[], metavar="NODE@SECONDS[:MODE]",
                   help="kill NODE (n1, n2, ...) that many simulated seconds into the run; repeatable "
                        "(kvd/sim/faults.py: recovery per [cluster].recovery and replicas)")
    p.add_argument("-h", "--help", action="store_true")
    return p


@dataclass(frozen=True)
class Shape:
    """A cluster to simulate: configs, roles, and the profile whose machine each node is."""

    engine: object          # EngineConfig
    cluster: object         # ClusterConfig
    roles: tuple[str, ...]
    profile: Profile
    colocated: bool = False     # every node on one host (kvd/sim/warmth.py)
    host_cores: int = 0         # that host's cores (0: as many as the nodes' threads)

    @property
    def nodes(self) -> int:
        return len(self.roles)


def roles_for(nodes: int, prefill: int) -> tuple[str, ...]:
    """``kvd serve --nodes N --prefill P``'s roles; raises SimUsageError for a bad pair."""
    if nodes < 1:
        raise SimUsageError("--nodes must be >= 1")
    if prefill and not 0 < prefill < nodes:
        raise SimUsageError("--prefill P needs --nodes N with 0 < P < N (N-P decode nodes)")
    if not prefill:
        return ("mixed",) * nodes
    return ("prefill",) * prefill + ("decode",) * (nodes - prefill)


def load_shape(config: str | None, profile_path: str, nodes: int, prefill: int, routing: str | None,
               colocated: bool = False, host_cores: int | None = None, pairs: bool | None = None) -> Shape:
    """The Shape of the flags; raises SimUsageError (one line) for anything bad."""
    from kvd.cluster_config import ConfigError as ClusterConfigError
    from kvd.cluster_config import ROUTING_POLICIES, load_cluster_config, with_overrides
    from kvd.config import ConfigError, load_config

    if not profile_path:
        raise SimUsageError("--profile PROFILE.json is required (make one with kvd profile)")
    roles = roles_for(nodes, prefill)
    try:
        profile = load_profile(profile_path, check_cpu=False)
        kvd_config = load_config(config, {"engine": {"model": None}})
        cluster = load_cluster_config(config, {})
        if routing is not None:
            if routing not in ROUTING_POLICIES:
                raise SimUsageError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
            cluster = with_overrides(cluster, routing=routing)
        if pairs is not None:
            cluster = with_overrides(cluster, pairs=pairs)
    except (ProfileError, ConfigError, ClusterConfigError) as exc:
        raise SimUsageError(str(exc)) from None
    if cluster.pairs and (nodes < 2 or nodes % 2 or prefill):
        raise SimUsageError("pairs need --nodes 2N (an even number, at least 2) and no --prefill "
                            "(a paired node decodes)")
    engine = kvd_config.engine
    if config is not None and _names_model(config) and engine.model != profile.model:
        raise SimUsageError(f"the profile is of model {profile.model!r}, the config serves {engine.model!r}")
    if engine.block_size != profile.block_size:
        raise SimUsageError(f"the profile was measured with block_size {profile.block_size}, "
                            f"the config has {engine.block_size}")
    if profile.doc.get("chunked_prefill") is False:       # its engine prefills whole prompts (bf16)
        engine = replace(engine, prefill_chunk_tokens=0)
    if host_cores is not None and not 1 <= host_cores <= 4096:
        raise SimUsageError(f"--host-cores must be in 1..4096, got {host_cores}")
    if host_cores is not None and not colocated:
        raise SimUsageError("--host-cores needs --colocated")
    cores = host_cores if host_cores is not None else profile.host_cpus
    return Shape(engine, cluster, roles, profile, colocated, cores if colocated else 0)


def _names_model(config: str) -> bool:
    import tomllib

    data = tomllib.loads(Path(config).read_text())
    return "model" in data.get("engine", {}) or "name" in data.get("model", {})


def simulate(shape: Shape, conversations, opts, encode, *, keep_log: bool = False, faults=()):
    """Run the workload on the shape, killing the nodes of ``faults`` (kvd-loadgen
    ``FaultSpec``s) at their times; returns (records, duration seconds, the
    SimCluster). Raises SimUsageError for a fault on a node the shape lacks."""
    from kvd.sim.cluster import SimCluster
    from kvd.sim.events import EventQueue
    from tools.sim.workload import SimClient

    events = EventQueue()
    cluster = SimCluster(shape.engine, shape.cluster, list(shape.roles), shape.profile, events,
                         colocated=shape.colocated, host_cores=shape.host_cores, keep_log=keep_log)
    try:
        cluster.failover.schedule(faults)
    except ValueError as exc:
        raise SimUsageError(str(exc)) from None
    client = SimClient(conversations, opts, encode, cluster, events)
    client.start()
    events.run()
    duration = max(client.last_end, 1e-9)
    return sorted(client.records, key=lambda r: r.index), duration, cluster


def workload_of(args):
    """(conversations, WorkloadOptions, encode) from kvd-loadgen's parsed flags."""
    from tools.loadgen import datasets
    from tools.loadgen.cli import UserError, load_tokenizer_for

    from tools.sim.workload import WorkloadOptions

    try:
        tokenizer, spec = load_tokenizer_for(args.tokenizer, args.model or "smollm2")
        conversations = datasets.build(args.dataset, tokenizer)
    except (UserError, datasets.DatasetError) as exc:
        raise SimUsageError(str(exc)) from None
    opts = WorkloadOptions(request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed,
                           max_concurrency=args.max_concurrency, think_time_s=args.sessions_think_time)
    return conversations, opts, tokenizer.encode, spec


def parse(argv: list[str], prog: str = PROG, extra=None):
    """(own flags, kvd-loadgen's parsed flags). Exits 2 with one line on a bad flag."""
    from tools.loadgen.cli import _parse_run_args

    parser = own_parser(prog)
    if extra is not None:
        extra(parser)
    own, rest = parser.parse_known_args(argv)
    if own.help:
        parser.print_help()
        print(f"\n{prog} also takes kvd-loadgen's workload flags (kvd-loadgen --help).")
        raise SystemExit(0)
    from tools.loadgen.faults import FaultSpec
    try:
        own.faults = tuple(FaultSpec.parse(f) for f in own.fail)
    except ValueError as exc:
        _die(prog, str(exc))
    args = _parse_run_args(rest)
    if own.profile:
        try:
            args.model = args.model or load_profile(own.profile, check_cpu=False).model
        except ProfileError as exc:
            _die(prog, str(exc))
    return own, args


def _die(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str]) -> int:
    from tools.loadgen import metrics, report
    from tools.loadgen.cli import _config

    try:
        own, args = parse(argv)
        shape = load_shape(own.config, own.profile, own.nodes, own.prefill, own.routing, own.colocated,
                           own.host_cores, own.pairs)
        conversations, opts, encode, spec = workload_of(args)
        wall = time.perf_counter()
        records, duration, cluster = simulate(shape, conversations, opts, encode, faults=own.faults)
        wall = time.perf_counter() - wall
    except SimUsageError as exc:
        _die(PROG, str(exc))
    m = metrics.compute_metrics(records, duration, args.percentiles, args.slo)
    errors = metrics.error_counts(records)
    print(report.summary_table(m, selected=args.selected, percentiles=args.percentiles,
                               max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                               errors=errors, faults=cluster.failover.faults))
    print(f"{PROG}: {len(records)} requests on {shape.nodes} simulated node(s) "
          f"({', '.join(f'{n} {role}' for role, n in Counter(shape.roles).items())}), {duration:.1f} s "
          f"simulated in {wall:.1f} s; the router took {cluster.describe()['route_us_per_decision']:.0f} µs "
          f"per decision", file=sys.stderr)
    if args.save_result:
        args.label = args.label or "kvd-simulate"
        config = _config(args, shape.profile.model, spec)
        config["url"] = "simulated"
        config["simulated"] = simulated_config(shape, own.profile, cluster, wall)
        started = time.time()
        doc = report.build_result(config=config, metrics=m, errors=errors, faults=cluster.failover.faults,
                                  records=records if args.save_detailed else None, started_at=started)
        name = args.result_filename or report.default_filename(config, started)
        try:
            path = report.write_result(doc, Path(args.result_dir) / name)
        except OSError as exc:
            _die(PROG, f"cannot write the result file: {exc}")
        print(f"{PROG}: result written to {path}", file=sys.stderr)
    return 0 if m["completed"] else 1


def simulated_config(shape: Shape, profile_path: str, cluster, wall_s: float) -> dict:
    """What a result's ``config.simulated`` records: the shape and the run's own cost."""
    e, c = shape.engine, shape.cluster
    return {"profile": str(profile_path), "model": shape.profile.model, "cpu": shape.profile.cpu,
            "nodes": shape.nodes, "roles": list(shape.roles), "routing": c.routing,
            "prefill_chunk_tokens": e.prefill_chunk_tokens, "kv_blocks": e.kv_blocks,
            "max_num_seqs": e.max_num_seqs, "replicas": c.replicas, "colocated": shape.colocated,
            "host_cores": shape.host_cores,
            "wall_seconds": round(wall_s, 3),
            **cluster.describe()}
