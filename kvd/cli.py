"""The ``kvd`` command line.

    kvd serve [-c FILE] [--nodes N]    coordinator + one in-process node (default),
                                       or + N local node processes
    kvd coordinator -c FILE            the coordinator daemon (imports no torch)
    kvd node -c FILE --name n1         a node daemon

Under systemd (``Type=notify``) each daemon reports to ``$NOTIFY_SOCKET``:
READY=1 once it serves, STATUS= lines, STOPPING=1 when the drain begins, and
WATCHDOG=1 from a task on its event loop that starts before any slow start-up
work (weights, tokenizer). The notify variables are removed from the
environment at start, so ``kvd serve --nodes N``'s node processes do not
speak for their parent.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import asyncio
import logging
import os
import sys

from kvd.cluster_config import KV_LOAD_FAILURE, KV_STREAMS, RECOVERY_POLICIES, ROLES, SPLIT_CPUS


ENGINE_FLAGS = {
    # flag: (dest in EngineConfig, type, help)
    "--model": ("model", str, "smollm2 (bundled SmolLM2-135M-Instruct), tiny[:SEED], a .gguf file or an HF directory"),
    "--dtype": ("dtype", str, "auto (default: bfloat16 on CPUs with native bf16, else float32), float32 or bfloat16"),
    "--block-size": ("block_size", int, "tokens per KV block"),
    "--kv-blocks": ("kv_blocks", int, "KV blocks in the device tier"),
    "--host-kv-blocks": ("host_kv_blocks", int, "KV blocks in the host tier (swap space)"),
    "--max-num-seqs": ("max_num_seqs", int, "most requests decoding at once"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "prefill token budget per step"),
    "--prefill-chunk-tokens": ("prefill_chunk_tokens", int,
                               "chunked prefill: most prompt tokens per step, beside the decodes (0: off)"),
    "--max-model-len": ("max_model_len", int, "context length (default: the model's)"),
    "--preemption-mode": ("preemption_mode", str, "swap or recompute"),
    "--num-threads": ("num_threads", int, "compute threads (default: one per physical core, less --reserved-cpus)"),
    "--reserved-cpus": ("reserved_cpus", int,
                        "CPUs left to the serving threads when --num-threads is not given, on 8+ CPUs (default 1)"),
    "--cpus": ("cpus", str, "CPUs to compute on, a Linux CPU list such as 0-7,16-23 (default: every CPU "
               "this process may use; with --nodes N, the CPUs to split among the nodes)"),
    "--decode-threads": ("decode_threads", int,
                         "threads of a decode step of at most 4 rows (default 0: timed at start on 8+ threads)"),
    "--decode-kernel": ("decode_kernel", str, "auto (fused C++ bf16 decode where the CPU has AVX512-BF16) or torch"),
    "--weights": ("weights", str, "native (serve the file's formats as they are: a GGUF's Q4_0/Q4_1/Q8_0 blocks, "
                                  "a bf16/fp16 checkpoint's matrices) or dequantize"),
    "--kv-cache-dtype": ("kv_cache_dtype", str,
                         "auto (the model's dtype) or float16 (an fp32 model's KV in half the bytes)"),
    "--host-hit-policy": ("host_hit_policy", str,
                          "a cached prefix in the host tier: cost (swap in or recompute, the cheaper), swap or recompute"),
    "--cost-token-s": ("cost_token_s", float, "caching cost model: prefill seconds per token"),
    "--cost-attention-s": ("cost_attention_s", float,
                           "caching cost model: prefill seconds per token per token of context"),
    "--cost-fixed-s": ("cost_fixed_s", float, "caching cost model: seconds per prefill step"),
    "--cost-swap-block-s": ("cost_swap_block_s", float, "caching cost model: seconds to swap one host block in"),
    "--profile": ("profile", str, "a kvd profile of this model and CPU (kvd profile) whose measured costs replace "
                  "the cost_* defaults ([engine].profile)"),
    "--lend-kv-blocks": ("lend_kv_blocks", int, "most device KV blocks lent to other nodes at once (0: off)"),
    "--borrow-kv-blocks": ("borrow_kv_blocks", int,
                           "most device KV blocks borrowed from other nodes at once (0: off)"),
}
BATCH_INVARIANT_HELP = ("float matrices prefill on the decode step's kernel, so a token has the same bits "
                        "however it is computed (quantized weights always do; slower float prefills)")
SERVER_FLAGS = {
    "--host": ("host", str, "bind address (default 127.0.0.1)"),
    "--port": ("port", int, "HTTP port (default 8000; 0 picks a free one)"),
    "--api-key": ("api_key", str, "require 'Authorization: Bearer KEY' on /v1 (also $KVD_API_KEY)"),
    "--api-key-file": ("api_key_file", str, "read the API key from this file"),
    "--served-model-name": ("served_model_name", str, "model id in /v1/models and requests"),
    "--drain-timeout": ("drain_timeout", float, "seconds SIGTERM waits for in-flight requests"),
    "--log-level": ("log_level", str, "debug, info, warning or error"),
    "--max-body-bytes": ("max_body_bytes", int, "largest HTTP request body (413 beyond)"),
    "--body-timeout": ("body_timeout", float, "seconds to receive a request body (408 beyond)"),
    "--header-timeout": ("header_timeout", float,
                         "seconds a connection has for a complete request head; also the idle keep-alive"),
    "--max-connections": ("max_connections", int, "most HTTP connections at once (503 and close beyond)"),
}


def build_parser(add_commands: Callable | None = None) -> argparse.ArgumentParser:
    """``kvd``'s parser; ``add_commands(subparsers)`` adds the commands of the layer above (main)."""
    parser = argparse.ArgumentParser(prog="kvd", description="KV-cache-centric LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("-c", "--config", help="TOML config (see etc/kvd.toml)")
    for flag, (dest, typ, help_) in {**ENGINE_FLAGS, **SERVER_FLAGS}.items():
        serve.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const",
                       const=False, default=None, help="disable the MemPool prefix cache")
    serve.add_argument("--batch-invariant", dest="batch_invariant", action="store_const", const=True,
                       default=None, help=BATCH_INVARIANT_HELP)
    serve.add_argument("--nodes", type=int, default=0,
                       help="run N node processes on this machine (default: one node in this process)")
    serve.add_argument("--prefill", type=int, default=0,
                       help="with --nodes N: P of them are prefill nodes, the other N-P decode nodes "
                       "(disaggregated prefill; default 0: N mixed nodes)")
    serve.add_argument("--restart-nodes", dest="restart_nodes", action=argparse.BooleanOptionalAction,
                       default=None, help="with --nodes: start a node process that exited again "
                       "([cluster].restart_nodes, default on)")
    serve.add_argument("--split-cpus", dest="split_cpus", choices=SPLIT_CPUS, default=None,
                       help="with --nodes N: bind each node to cores of its own (cores), to NUMA nodes of "
                       "its own where there are N (numa), or never (off); auto (the default): cores, "
                       "or numa with --prefill ([cluster].split_cpus)")
    _cluster_flags(serve)

    node = sub.add_parser("node", help="run a node daemon (engine, transfers, heartbeats)")
    node.add_argument("-c", "--config", help="TOML config ([engine], [cluster], [nodes.NAME])")
    node.add_argument("--name", required=True, help="this node's name ([nodes.NAME] in the config)")
    node.add_argument("--listen", help="transport URL to listen on (default: [nodes.NAME].address)")
    node.add_argument("--coordinator", help="coordinator URL (default: [cluster].coordinator)")
    node.add_argument("--admin-socket", help="admin Unix socket path (default: [nodes.NAME].admin_socket)")
    node.add_argument("--role", choices=ROLES, default=None,
                      help="what this node computes (default: [nodes.NAME].role, else mixed)")
    node.add_argument("--pair", default=None, help="the node this one is paired with ([nodes.NAME].pair)")
    for flag, (dest, typ, help_) in ENGINE_FLAGS.items():
        node.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    node.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const",
                      const=False, default=None, help="disable the MemPool prefix cache")
    node.add_argument("--batch-invariant", dest="batch_invariant", action="store_const", const=True,
                      default=None, help=BATCH_INVARIANT_HELP)
    for flag in ("--drain-timeout", "--log-level"):
        dest, typ, help_ = SERVER_FLAGS[flag]
        node.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    _cluster_flags(node)

    coord = sub.add_parser("coordinator", help="run the coordinator daemon (HTTP, routing, membership)")
    coord.add_argument("-c", "--config", help="TOML config ([server], [model], [cluster])")
    coord.add_argument("--listen", help="where nodes register (default: [cluster].coordinator)")
    coord.add_argument("--admin-socket", help="admin Unix socket path (default: [cluster].admin_socket)")
    coord.add_argument("--model", dest="model", default=None, help="model spec (for the tokenizer)")
    coord.add_argument("--max-model-len", dest="max_model_len", type=int, default=None,
                       help="context length until nodes report theirs")
    for flag, (dest, typ, help_) in SERVER_FLAGS.items():
        coord.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    _cluster_flags(coord)
    if add_commands is not None:
        add_commands(sub)
    return parser


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default=None, help="zmq+tcp, zmq+ipc or ucx ([cluster].transport)")
    p.add_argument("--heartbeat-interval", dest="heartbeat_interval", type=float, default=None,
                   help="seconds between node heartbeats")
    p.add_argument("--heartbeat-deadline", dest="heartbeat_deadline", type=float, default=None,
                   help="seconds without a heartbeat before a node is declared dead")
    p.add_argument("--curve-keys-dir", dest="curve_keys_dir", default=None,
                   help="directory of CURVE keys (kvctl keys) authenticating every zmq/ucx link")
    p.add_argument("--insecure", dest="insecure", action="store_const", const=True, default=None,
                   help="allow a port without authentication (no keys): anyone who reaches it "
                        "may send it anything; for debugging on a trusted host")
    p.add_argument("--prefill-threshold", dest="prefill_threshold", type=int, default=None,
                   help="a decode node computes prompts with fewer uncached tokens itself "
                        "([cluster].prefill_threshold)")
    p.add_argument("--prefill-queue-factor", dest="prefill_queue_factor", type=float, default=None,
                   help="the coordinator sends a prompt of n tokens to a prefill node only while that "
                        "node's queue holds at most factor*n prompt tokens; else its decode node computes "
                        "it; 0: no limit ([cluster].prefill_queue_factor)")
    p.add_argument("--kv-load-failure", dest="kv_load_failure", choices=KV_LOAD_FAILURE, default=None,
                   help="a decode node whose prompt KV does not arrive: recompute or fail "
                        "([cluster].kv_load_failure)")
    p.add_argument("--kv-stream", dest="kv_stream", choices=KV_STREAMS, default=None,
                   help="prefill nodes send KV per layer as computed, or per request ([cluster].kv_stream)")
    p.add_argument("--kv-return", dest="kv_return", choices=("on", "off"), default=None,
                   help="decode nodes return a finished disaggregated sequence's KV to its prefill node "
                        "([cluster].kv_return)")
    p.add_argument("--kv-transfer-timeout", dest="kv_transfer_timeout", type=float, default=None,
                   help="seconds a decode node waits for a prompt's KV ([cluster].kv_transfer_timeout)")
    p.add_argument("--replicas", dest="replicas", type=int, choices=(0, 1), default=None,
                   help="1: stream each request's KV to a peer node ([cluster].replicas)")
    p.add_argument("--recovery", dest="recovery", choices=RECOVERY_POLICIES, default=None,
                   help="what a dead node's requests do ([cluster].recovery)")
    p.add_argument("--max-recoveries", dest="max_recoveries", type=int, default=None,
                   help="recoveries one request may go through ([cluster].max_recoveries)")
    p.add_argument("--replica-kv-blocks", dest="replica_kv_blocks", type=int, default=None,
                   help="host KV blocks a node may hold as its peers' replicas ([cluster].replica_kv_blocks)")
    p.add_argument("--replication-interval", dest="replication_interval", type=float, default=None,
                   help="seconds between replication rounds ([cluster].replication_interval)")
    p.add_argument("--replication-rate", dest="replication_rate", type=float, default=None,
                   help="KV blocks/s at most that replication sends of what the peer lacks, 0 (default): unbounded "
                        "([cluster].replication_rate)")
    p.add_argument("--pairs", dest="pairs", action="store_const", const=True, default=None,
                   help="pair the nodes in order, n1-n2, n3-n4, ... ([cluster].pairs; kvd serve --nodes 2N)")
    p.add_argument("--pair-scheduler", dest="pair_scheduler", action=argparse.BooleanOptionalAction, default=None,
                   help="move decodes within each pair around prefills ([cluster].pair_scheduler, default on)")
    p.add_argument("--dgfm-interval", dest="dgfm_interval_s", type=float, default=None,
                   help="seconds between DGFM rounds bringing borrowed KV home, 0: off ([cluster].dgfm_interval_s)")
    p.add_argument("--dgfm-min-blocks", dest="dgfm_min_blocks", type=int, default=None,
                   help="DGFM resolves debt cycles of at least this many blocks per edge ([cluster].dgfm_min_blocks)")


def main(argv: list[str] | None = None, add_commands: Callable | None = None,
         run_command: Callable[[argparse.Namespace], int] | None = None) -> int:
    """``kvd``'s commands. ``add_commands(subparsers)`` adds more and ``run_command(args)``
    runs them: the layer above kvd's (tools/kvd_command.py: ``kvd profile``, ``simulate``,
    ``plan``) hands its own in, as kvd may not import it."""
    args = build_parser(add_commands).parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "node":
        return node(args)
    if args.command == "coordinator":
        return coordinator(args)
    if run_command is not None:
        return run_command(args)
    return 2


def _cluster(args: argparse.Namespace):
    from kvd.cluster_config import load_cluster_config

    overrides = {k: getattr(args, k) for k in CLUSTER_OVERRIDES}
    if overrides["kv_return"] is not None:
        overrides["kv_return"] = overrides["kv_return"] == "on"
    return load_cluster_config(args.config, overrides)


CLUSTER_OVERRIDES = ("transport", "heartbeat_interval", "heartbeat_deadline", "curve_keys_dir", "insecure",
                     "prefill_threshold", "prefill_queue_factor", "kv_load_failure", "kv_transfer_timeout",
                     "kv_stream", "kv_return",
                     "replicas", "recovery", "max_recoveries", "replica_kv_blocks", "replication_interval",
                     "pairs", "pair_scheduler", "replication_rate", "dgfm_interval_s", "dgfm_min_blocks")


def _run(main_coro_factory) -> int:
    """Run the daemon's coroutine on uvloop; settings that clash with the
    loaded model (ConfigError) are exit status 2; a bad model or file, or an HTTP
    port it cannot bind, is exit status 1 with one line per error (they may
    arrive grouped by a TaskGroup); an engine that died (EngineDead) is exit
    status ENGINE_DEAD_EXIT, for systemd or the supervisor to restart it."""
    import uvloop

    from kvd.api.connections import BindError
    from kvd.config import ConfigError
    from kvd.engine_client import EngineDead
    from kvd.supervisor import ENGINE_DEAD_EXIT

    errors: list[BaseException] = []
    status = 0
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main_coro_factory())
    except* ConfigError as group:           # settings that only the loaded model shows to clash
        errors += _leaves(group)
        status = 2
    except* (ValueError, FileNotFoundError, BindError) as group:
        errors += _leaves(group)
        status = 1
    except* EngineDead as group:
        errors += _leaves(group)
        status = status or ENGINE_DEAD_EXIT
    for exc in errors:
        print(f"kvd: error: {exc}", file=sys.stderr)
    return status


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _systemd():
    """(Notifier, watchdog interval or None) from the environment, which they are
    then removed from: child processes must not notify for us."""
    from kvd.sdnotify import Notifier, watchdog_interval

    interval = watchdog_interval()          # read before from_env(unset=True) clears it
    return Notifier.from_env(unset=True), interval


async def supervised(notifier, interval: float | None, main) -> None:
    """Await ``main`` while the systemd watchdog is pinged from this loop by an
    owned task, started first so that slow start-up work is covered too."""
    from kvd.sdnotify import run_watchdog

    async with asyncio.TaskGroup() as tg:
        watchdog = tg.create_task(run_watchdog(notifier, interval), name="watchdog")
        try:
            await main
        finally:
            watchdog.cancel()


def _refuse_model(spec: str) -> bool:
    """Print one line and return True when ``spec`` names nothing on this
    machine or its tokenizer cannot be built (the known names, the missing
    package's install command, or the file's problem). Called after logging is
    set up (building the tokenizer logs a fallback chat template) and before
    any port opens. Reads metadata only and imports no torch; the tokenizer
    stays cached for this process. A GGUF's tensor table is checked too: a
    tensor of a type kvd does not load, or cut off by a truncated file."""
    from engine.model.gguf_meta import check_tensor_table
    from engine.model.registry import resolve_model

    try:
        source = resolve_model(spec)
        source.load_tokenizer()
        if source.kind == "gguf":
            check_tensor_table(source.weights_path)
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        return True
    return False


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def node(args: argparse.Namespace) -> int:
    from kvd.config import ConfigError, load_config
    engine = {d: getattr(args, d) for d, _, _ in ENGINE_FLAGS.values()}
    engine["enable_prefix_caching"] = args.enable_prefix_caching
    engine["batch_invariant"] = args.batch_invariant
    server = {"drain_timeout": args.drain_timeout, "log_level": args.log_level}
    try:
        config = load_config(args.config, {"engine": engine, "server": server})
        cluster = _cluster(args)
        from kvd import links
        from kvd.cluster_config import check_node_name

        check_node_name(args.name)
        if args.pair:
            from kvd.cluster_pairs import pair_map, with_pair
            cluster = with_pair(cluster, args.name, args.pair)
            pair_map(cluster)                    # ConfigError: a pair with itself, twice
        if (args.role or cluster.node(args.name).role) == "prefill" and cluster.partner_of(args.name):
            raise ValueError(f"node {args.name} is paired with {cluster.partner_of(args.name)}: its role "
                             "must decode (mixed or decode), not prefill")
        if config.engine.cpus:
            _bind(config.engine.cpus)            # before torch loads: its team is sized to them
        # before the model loads: a port that would run open is refused at once
        links.check_listen(cluster, args.listen or cluster.node(args.name).address
                           or cluster.default_address(args.name))
    except (ConfigError, ValueError) as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        return 2
    _logging(config.server.log_level)
    if _refuse_model(config.engine.model):
        return 2
    host_nodes = _host_nodes()
    if not _die_with_parent():
        print("kvd: error: the kvd serve process that started this node is gone", file=sys.stderr)
        return 1
    from kvd.node.daemon import NodeDaemon

    notifier, watchdog = _systemd()

    async def main() -> None:
        import signal

        daemon = NodeDaemon(config.engine, cluster, args.name, address=args.listen,
                            coordinator=args.coordinator, admin_socket=args.admin_socket, role=args.role,
                            drain_timeout=config.server.drain_timeout, notifier=notifier,
                            host_nodes=host_nodes)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.request_stop)
        await supervised(notifier, watchdog, daemon.run())
        if daemon.engine_failure:
            from kvd.engine_client import EngineDead
            raise EngineDead(f"node {args.name}: the engine died: {daemon.engine_failure}")
    return _run(main)


def _bind(cpus: str) -> None:
    """Bind this process to the CPU list ``cpus`` (``[engine].cpus``), before torch is
    imported (the engine logs the CPUs it computes on). Raises ValueError (nothing
    changed) on CPUs this process may not use."""
    from engine.cpus import bind

    bind(cpus)


def _host_nodes() -> int:
    """How many kvd nodes share this host: ``$KVD_HOST_NODES`` (``kvd serve --nodes N``
    sets it for its node processes; taken out of the environment), else 1. A value that
    is not a positive integer counts as 1, with a warning."""
    from kvd.cluster_config import HOST_NODES_ENV

    raw = os.environ.pop(HOST_NODES_ENV, "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    if raw:
        logging.getLogger("kvd").warning("%s=%r ignored: not a positive integer", HOST_NODES_ENV, raw)
    return 1


def _die_with_parent() -> bool:
    """A node started by ``kvd serve --nodes`` (``$KVD_PARENT`` = its pid) gets
    SIGTERM when that process dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``),
    so it drains and exits instead of living on as an orphan. False when the
    parent is already gone (it died before the request took effect)."""
    parent = os.environ.pop("KVD_PARENT", "")
    if not parent.isdigit():
        return True
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    return os.getppid() == int(parent)


def coordinator(args: argparse.Namespace) -> int:
    from kvd.coordinator.settings import load_settings

    overrides = {d: getattr(args, d) for d, _, _ in SERVER_FLAGS.values()}
    overrides.update(model=args.model, max_model_len=args.max_model_len)
    try:
        settings = load_settings(args.config, overrides)   # same checks as kvd serve / kvd node
        cluster = _cluster(args)
        if args.listen:
            from kvd.cluster_config import with_overrides
            cluster = with_overrides(cluster, coordinator=args.listen)
        from kvd import links

        links.check_listen(cluster, cluster.coordinator)
    except ValueError as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        return 2
    _logging(settings.server.log_level)
    if _refuse_model(settings.model):
        return 2
    from kvd.coordinator.daemon import CoordinatorDaemon
    from kvd.coordinator.settings import load_tokenizer

    notifier, watchdog = _systemd()

    async def start_and_run() -> None:
        name, tokenizer, context_length = await asyncio.to_thread(load_tokenizer, settings.model)
        daemon = CoordinatorDaemon(cluster, settings.server, name, tokenizer, admin_socket=args.admin_socket,
                                   default_max_model_len=settings.assumed_max_model_len(context_length),
                                   notifier=notifier)
        await daemon.run(install_signals=True)
    return _run(lambda: supervised(notifier, watchdog, start_and_run()))


def serve(args: argparse.Namespace) -> int:
    from kvd.config import ConfigError, load_config
    engine = {d: getattr(args, d) for d, _, _ in ENGINE_FLAGS.values()}
    engine["enable_prefix_caching"] = args.enable_prefix_caching
    engine["batch_invariant"] = args.batch_invariant
    server = {d: getattr(args, d) for d, _, _ in SERVER_FLAGS.values()}
    try:
        config = load_config(args.config, {"engine": engine, "server": server})
        cluster = _cluster(args)
        if cluster.pairs and (args.nodes < 2 or args.nodes % 2 or args.prefill):
            raise ValueError("--pairs needs --nodes 2N (an even number, at least 2) and no --prefill "
                             "(a paired node decodes)")
        for name in ("restart_nodes", "split_cpus"):
            if getattr(args, name) is not None:
                from kvd.cluster_config import with_overrides
                cluster = with_overrides(cluster, **{name: getattr(args, name)})
        if args.nodes:
            from kvd.local_cluster import node_cpu_sets
            node_cpus = node_cpu_sets(args.nodes, config.engine.cpus, cluster.split_cpus,
                                      disaggregated=args.prefill > 0)
        elif config.engine.cpus:
            _bind(config.engine.cpus)            # before torch loads: its team is sized to them
    except (ConfigError, ValueError) as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        return 2
    if args.nodes < 0:
        print("kvd: error: --nodes must be >= 0", file=sys.stderr)
        return 2
    if args.prefill and not 0 < args.prefill < args.nodes:
        print("kvd: error: --prefill P needs --nodes N with 0 < P < N (N-P decode nodes)", file=sys.stderr)
        return 2
    _logging(config.server.log_level)
    if _refuse_model(config.engine.model):
        return 2
    notifier, watchdog = _systemd()
    if args.nodes:
        from kvd.coordinator.settings import CoordinatorSettings
        from kvd.local_cluster import LocalCluster

        node_args = _passthrough(args)
        return _run(lambda: LocalCluster(CoordinatorSettings.from_config(config), cluster, args.nodes,
                                         node_args, notifier=notifier, watchdog=watchdog,
                                         prefill=args.prefill, node_cpus=node_cpus).run())
    from kvd.server import Server  # imports torch: after argument errors are reported

    return _run(lambda: Server(config, cluster, notifier=notifier, watchdog=watchdog).run())


def _passthrough(args: argparse.Namespace) -> list[str]:
    """The config file and engine/cluster flags of ``kvd serve``, for ``kvd node``."""
    out = ["-c", args.config] if args.config else []
    for flag, (dest, _, _) in ENGINE_FLAGS.items():
        if getattr(args, dest) is not None:
            out += [flag, str(getattr(args, dest))]
    if args.enable_prefix_caching is False:
        out.append("--no-prefix-caching")
    if args.batch_invariant:
        out.append("--batch-invariant")
    for flag in ("--drain-timeout", "--log-level"):
        dest = SERVER_FLAGS[flag][0]
        if getattr(args, dest) is not None:
            out += [flag, str(getattr(args, dest))]
    for flag, dest in (("--heartbeat-interval", "heartbeat_interval"),
                       ("--heartbeat-deadline", "heartbeat_deadline"),
                       ("--curve-keys-dir", "curve_keys_dir"), ("--transport", "transport"),
                       ("--prefill-threshold", "prefill_threshold"),
                       ("--prefill-queue-factor", "prefill_queue_factor"), ("--kv-load-failure", "kv_load_failure"),
                       ("--kv-transfer-timeout", "kv_transfer_timeout"), ("--kv-stream", "kv_stream"),
                       ("--kv-return", "kv_return"), ("--replicas", "replicas"), ("--recovery", "recovery"),
                       ("--max-recoveries", "max_recoveries"), ("--replica-kv-blocks", "replica_kv_blocks"),
                       ("--replication-interval", "replication_interval"),
                       ("--replication-rate", "replication_rate"), ("--dgfm-interval", "dgfm_interval_s"),
                       ("--dgfm-min-blocks", "dgfm_min_blocks")):
        if getattr(args, dest) is not None:
            out += [flag, str(getattr(args, dest))]
    if args.insecure:
        out.append("--insecure")
    return out


if __name__ == "__main__":
    sys.exit(main())
