"""The ``kvd`` command line: ``kvd serve`` (more subcommands join with the cluster)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvd.config import ConfigError, load_config

ENGINE_FLAGS = {
    # flag: (dest in EngineConfig, type, help)
    "--model": ("model", str, "smollm2 (bundled SmolLM2-135M-Instruct), tiny[:SEED], a .gguf file or an HF directory"),
    "--dtype": ("dtype", str, "auto (default: bfloat16 on CPUs with native bf16, else float32), float32 or bfloat16"),
    "--block-size": ("block_size", int, "tokens per KV block"),
    "--kv-blocks": ("kv_blocks", int, "KV blocks in the device tier"),
    "--host-kv-blocks": ("host_kv_blocks", int, "KV blocks in the host tier (swap space)"),
    "--max-num-seqs": ("max_num_seqs", int, "most requests decoding at once"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "prefill token budget per step"),
    "--max-model-len": ("max_model_len", int, "context length (default: the model's)"),
    "--preemption-mode": ("preemption_mode", str, "swap or recompute"),
    "--num-threads": ("num_threads", int, "torch threads (default: torch's choice)"),
}
SERVER_FLAGS = {
    "--host": ("host", str, "bind address (default 127.0.0.1)"),
    "--port": ("port", int, "HTTP port (default 8000; 0 picks a free one)"),
    "--api-key": ("api_key", str, "require 'Authorization: Bearer KEY' on /v1 (also $KVD_API_KEY)"),
    "--api-key-file": ("api_key_file", str, "read the API key from this file"),
    "--served-model-name": ("served_model_name", str, "model id in /v1/models and requests"),
    "--drain-timeout": ("drain_timeout", float, "seconds SIGTERM waits for in-flight requests"),
    "--log-level": ("log_level", str, "debug, info, warning or error"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description="KV-cache-centric LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("-c", "--config", help="TOML config (see etc/kvd.toml)")
    for flag, (dest, typ, help_) in {**ENGINE_FLAGS, **SERVER_FLAGS}.items():
        serve.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const",
                       const=False, default=None, help="disable the MemPool prefix cache")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


def serve(args: argparse.Namespace) -> int:
    engine = {d: getattr(args, d) for d, _, _ in ENGINE_FLAGS.values()}
    engine["enable_prefix_caching"] = args.enable_prefix_caching
    server = {d: getattr(args, d) for d, _, _ in SERVER_FLAGS.values()}
    try:
        config = load_config(args.config, {"engine": engine, "server": server})
    except ConfigError as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvd.server import Server  # imports torch: after argument errors are reported

    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(Server(config).run())
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
