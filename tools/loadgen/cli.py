"""``kvd-loadgen``: command line.

    kvd-loadgen [run] --base-url URL --dataset-name random --num-prompts 100 ...
    kvd-loadgen plot RESULT.json... [-o PREFIX]
    kvd-loadgen compare A.json B.json
    kvd-loadgen table RESULT.json...          (markdown rows for docs/benchmarks.md)

Flag names are vLLM ``bench serve``'s where one exists, and a ``vllm bench
serve`` command line runs unchanged apart from the model and URL; a vLLM flag
kvd-loadgen lacks is refused by name (``vllm_flags.py``).  A user error (bad
flag, missing file, unreachable server, no admin socket) prints one line
``kvd-loadgen: error: ...`` and exits 2 (arguments) or 1 (anything found at
run time); tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path
from typing import NoReturn, Sequence

PROG = "kvd-loadgen"
SUBCOMMANDS = ("run", "plot", "compare", "table")


class UserError(Exception):
    """Something the user can fix; printed as one line, exit 1."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports an error as one line instead of usage + error."""

    def __init__(self, *args, **kwargs) -> None:
        # No abbreviations: a vLLM flag kvd-loadgen lacks must not match one of ours by prefix.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------- parsers

def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (use inf for all at once)") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf for all at once), got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _dataset_name(text: str) -> str:
    from tools.loadgen.datasets import DATASETS
    from tools.loadgen.vllm_flags import dataset_refusal

    if text in DATASETS:
        return text
    raise argparse.ArgumentTypeError(dataset_refusal(text) or
                                     f"invalid choice: {text!r} (choose from {', '.join(DATASETS)})")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), value.strip()


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def run_parser() -> OneLineParser:
    from tools.loadgen.datasets import DATASETS
    from tools.loadgen.vllm_flags import BACKENDS

    p = OneLineParser(
        prog=PROG, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Benchmark an OpenAI-compatible streaming server (vLLM `bench serve` flags). "
                    f"Other subcommands: `{PROG} plot RESULT...`, `{PROG} compare A.json B.json`, "
                    f"`{PROG} table RESULT...`.")
    g = p.add_argument_group("target")
    g.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="request shape: openai and vllm send completions, openai-chat chat completions "
                        "(default: from --endpoint, else openai)")
    g.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/chat/completions for --backend openai-chat, "
                        "else /v1/completions)")
    g.add_argument("--header", nargs="*", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="HTTP headers sent with every request")
    g.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    g.add_argument("--tokenizer", help="tokenizer spec for load_tokenizer (default: --model, then smollm2)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=_positive_float, default=3600.0,
                   help="seconds one request may take before it counts as failed")
    g.add_argument("--no-keepalive", action="store_true",
                   help="open a new connection per request: for servers that close idle keep-alive "
                        "connections, where a request sent on one fails before the server sees it "
                        "(llama-server under 32 streams)")

    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=_positive_int, default=1000,
                   help="requests to send; for --dataset-name sessions, the number of sessions")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests (or session starts) per second; inf sends all at once")
    g.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 steadier")
    g.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="most requests in flight at once (default: unlimited)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate exactly max_tokens (request field ignore_eos); "
                        "always on for --dataset-name random, as in vLLM")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=_positive_float, default=None, help="request field top_p (default: not sent)")
    g.add_argument("--top-k", type=_positive_int, default=None, help="request field top_k (default: not sent)")
    for flag in ("--min-p", "--frequency-penalty", "--presence-penalty", "--repetition-penalty"):
        g.add_argument(flag, type=float, default=None,
                       help=f"request field {flag[2:].replace('-', '_')} (default: not sent)")
    g.add_argument("--logprobs", type=_nonneg_int, default=None,
                   help="ask for this many top logprobs per token (completions: logprobs=N; "
                        "chat: logprobs=true, top_logprobs=N; default: not sent)")
    g.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="a JSON object merged into every request body")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", type=_dataset_name, metavar="{" + ",".join(DATASETS) + "}")
    g.add_argument("--dataset-path", help="input file of --dataset-name sharegpt, custom (JSONL), sonnet "
                                          "(default: the bundled sonnets) or file")
    g.add_argument("--input-len", type=_positive_int, default=None,
                   help="sets --random-input-len (vLLM's general spelling)")
    g.add_argument("--output-len", type=_positive_int, default=None,
                   help="sets the output length of every dataset (vLLM's general spelling)")
    g.add_argument("--random-input-len", type=_positive_int, default=1024)
    g.add_argument("--random-output-len", type=_positive_int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are drawn uniformly from [floor(len*(1-r)), ceil(len*(1+r))]")
    g.add_argument("--random-prefix-len", type=_nonneg_int, default=0,
                   help="tokens of one random prefix opening every random prompt (before the "
                        "--random-input-len part)")
    g.add_argument("--prefix-repetition-num-prefixes", type=_positive_int, default=10)
    g.add_argument("--prefix-repetition-prefix-len", type=_nonneg_int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=_nonneg_int, default=256)
    g.add_argument("--prefix-repetition-output-len", type=_positive_int, default=128)
    g.add_argument("--sessions-num-turns", type=_positive_int, default=4,
                   help="turns per session; each waits for the previous answer and resends the history")
    g.add_argument("--sessions-user-len", type=_positive_int, default=64, help="tokens per user message")
    g.add_argument("--sessions-output-len", type=_positive_int, default=64, help="max_tokens per turn")
    g.add_argument("--sessions-shared-prefix-len", type=_nonneg_int, default=0,
                   help="tokens of a prefix shared by every session's first message")
    g.add_argument("--sessions-think-time", type=_nonneg_float, default=0.0,
                   help="seconds between an answer and the session's next turn (a user reading and typing)")
    g.add_argument("--sharegpt-output-len", type=_positive_int, default=None,
                   help="fixed max_tokens (default: the length of the dataset's answer)")
    g.add_argument("--file-output-len", type=_positive_int, default=128, help="max_tokens for --dataset-name file")
    g.add_argument("--custom-output-len", type=_positive_int, default=256,
                   help="max_tokens for --dataset-name custom")
    g.add_argument("--sonnet-input-len", type=_positive_int, default=550)
    g.add_argument("--sonnet-output-len", type=_positive_int, default=150)
    g.add_argument("--sonnet-prefix-len", type=_nonneg_int, default=200)
    g.add_argument("--skip-chat-template", action="store_true",
                   help="custom: send the prompts as they are (they already hold the chat template)")
    g.add_argument("--disable-shuffle", action="store_true",
                   help="sharegpt, custom: keep the file's order instead of shuffling by --seed")

    g = p.add_argument_group("metrics and output")
    g.add_argument("--label", default=None,
                   help="the result's label and file name prefix (default: kvd-loadgen)")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated subset of ttft,tpot,itl,e2el to print")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 e2el:5000")
    g.add_argument("--save-result", action="store_true", help="write the JSON result file")
    g.add_argument("--save-detailed", action="store_true",
                   help="also save per-request records (implies --save-result; needed by plot)")
    g.add_argument("--save-outputs", action="store_true",
                   help="also save each request's generated text (implies --save-detailed; for "
                        "`kvd-loadgen compare --outputs`)")
    g.add_argument("--result-dir", default=".", help="directory of the result file")
    g.add_argument("--result-filename", help="file name (default: derived from dataset, rate, model, time)")
    g.add_argument("--disable-tqdm", "--no-progress", dest="disable_tqdm", action="store_true",
                   help="no progress bar")

    g = p.add_argument_group("fault injection")
    g.add_argument("--admin-socket", metavar="PATH", help="the target daemon's admin Unix socket")
    g.add_argument("--fail", action="append", default=[], metavar="NODE@SECONDS[:MODE]",
                   help="fail NODE that many seconds into the run; MODE exit (default) or stop; repeatable")
    return p


def _parse_run_args(argv: Sequence[str]):
    """Parse and cross-validate; every problem exits 2 through parser.error."""
    from tools.loadgen import vllm_flags
    from tools.loadgen.datasets import DatasetError, DatasetOptions
    from tools.loadgen.faults import FaultSpec
    from tools.loadgen.metrics import LATENCIES, Slo

    parser = run_parser()
    argv = vllm_flags.normalize_argv(argv)
    refused = vllm_flags.refusal(argv)
    if refused:
        parser.error(refused)
    args = parser.parse_args(argv)
    try:
        args.backend, args.endpoint = vllm_flags.resolve_backend(args.backend, args.endpoint)
    except ValueError as exc:
        parser.error(str(exc))
    args.chat = args.backend == "openai-chat"
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        for name in ("random", "prefix_repetition", "sharegpt", "custom", "sonnet", "sessions", "file"):
            setattr(args, f"{name}_output_len", args.output_len)
    if args.dataset_name == "random":
        args.ignore_eos = True      # vLLM's rule: random prompts run to the length asked for
    args.selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    for m in args.selected:
        if m not in LATENCIES:
            parser.error(f"--percentile-metrics: unknown metric {m!r} (choose from {','.join(LATENCIES)})")
    try:
        args.percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--metric-percentiles: {args.metric_percentiles!r} is not a comma-separated list of numbers")
    if not args.percentiles or any(not 0 <= p <= 100 for p in args.percentiles):
        parser.error("--metric-percentiles: percentiles must lie in [0, 100]")
    try:
        args.slo = Slo.parse(args.goodput) if args.goodput else None
        args.faults = tuple(FaultSpec.parse(f) for f in args.fail)
    except ValueError as exc:
        parser.error(str(exc))
    if args.faults and not args.admin_socket:
        parser.error("--fail needs --admin-socket PATH")
    try:
        args.dataset = DatasetOptions(
            name=args.dataset_name, num_prompts=args.num_prompts, seed=args.seed,
            random_input_len=args.random_input_len, random_output_len=args.random_output_len,
            random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
            prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
            prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
            prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
            prefix_repetition_output_len=args.prefix_repetition_output_len,
            sessions_num_turns=args.sessions_num_turns, sessions_user_len=args.sessions_user_len,
            sessions_output_len=args.sessions_output_len,
            sessions_shared_prefix_len=args.sessions_shared_prefix_len,
            dataset_path=args.dataset_path, sharegpt_output_len=args.sharegpt_output_len,
            file_output_len=args.file_output_len, custom_output_len=args.custom_output_len,
            sonnet_input_len=args.sonnet_input_len, sonnet_output_len=args.sonnet_output_len,
            sonnet_prefix_len=args.sonnet_prefix_len, chat=args.chat,
            skip_chat_template=args.skip_chat_template, shuffle=not args.disable_shuffle)
    except DatasetError as exc:
        parser.error(str(exc))
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if not args.base_url.startswith(("http://", "https://")):
        parser.error(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    args.save_detailed = args.save_detailed or args.save_outputs
    args.save_result = args.save_result or args.save_detailed
    return args


# --------------------------------------------------------------------------- run

def _event_loop_runner() -> asyncio.Runner:
    try:
        import uvloop
        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        return asyncio.Runner()


async def _served_models(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """GET /v1/models; raises UserError when the server cannot be reached."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(f"{base_url}/v1/models", headers=headers) as resp:
                if resp.status != 200:
                    return []
                data = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else (str(exc) or type(exc).__name__)
        raise UserError(f"cannot reach server at {base_url}: {reason}") from None
    except ValueError:
        return []
    models = data.get("data") if isinstance(data, dict) else None
    return [m["id"] for m in models or () if isinstance(m, dict) and "id" in m]


def load_tokenizer_for(spec: str | None, model: str):
    """The tokenizer named by ``spec``; without one, the model's, then smollm2's."""
    try:
        from engine.model.registry import load_tokenizer
    except ImportError as exc:
        raise UserError(f"cannot import the tokenizer registry (engine.model.registry): {exc}") from None
    candidates = [spec] if spec else list(dict.fromkeys([model, "smollm2"]))
    reasons = []
    for candidate in candidates:
        try:
            tokenizer = load_tokenizer(candidate)
        except Exception as exc:   # the registry's own errors vary; any of them means "not this one"
            reasons.append(f"{candidate!r}: {' '.join(str(exc).split())[:200] or type(exc).__name__}")
            continue
        if reasons:   # lengths will be in another model's tokens: say so
            print(f"{PROG}: note: no tokenizer for model {model!r}; measuring lengths with "
                  f"{candidate!r} (pass --tokenizer SPEC for exact lengths)", file=sys.stderr)
        return tokenizer, candidate
    raise UserError("cannot load a tokenizer (" + "; ".join(reasons) + "); pass --tokenizer SPEC")


def _config(args, model: str, tokenizer_spec: str) -> dict:
    """The run's options as saved in the result file (inf as the string "inf")."""
    from tools.loadgen.report import rate_to_json

    skip = {"dataset", "slo", "faults", "fail", "selected", "percentiles", "api_key", "header"}
    config = {k: v for k, v in vars(args).items() if k not in skip}
    config.update(model=model, tokenizer=tokenizer_spec, url=args.base_url + args.endpoint,
                  metric_percentiles=args.percentiles, percentile_metrics=args.selected,
                  goodput=args.slo.as_dict() if args.slo else None,
                  fail=[vars(f) for f in args.faults],
                  request_rate=rate_to_json(args.request_rate))
    return config


def request_fields(args) -> dict:
    """Body fields every request carries beyond the prompt and max_tokens: the
    sampling flags that were given, logprobs, then --extra-body (which wins)."""
    fields = {name: getattr(args, name) for name in
              ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
              if getattr(args, name) is not None}
    if args.logprobs is not None:
        fields.update({"logprobs": True, "top_logprobs": args.logprobs} if args.chat
                      else {"logprobs": args.logprobs})
    fields.update(args.extra_body or {})
    return fields


def cmd_run(argv: Sequence[str]) -> int:
    from tools.loadgen import datasets, faults, metrics, report, runner

    args = _parse_run_args(argv)
    if args.admin_socket:
        try:
            faults.check_admin_socket(args.admin_socket)
        except faults.AdminSocketError as exc:
            raise UserError(str(exc)) from None

    with _event_loop_runner() as loop_runner:
        served = loop_runner.run(_served_models(args.base_url, args.api_key))
        model = args.model or (served[0] if served else None)
        if model is None:
            raise UserError(f"{args.base_url}/v1/models lists no model; pass --model NAME")
        tokenizer, tokenizer_spec = load_tokenizer_for(args.tokenizer, model)
        try:
            conversations = datasets.build(args.dataset, tokenizer)
        except datasets.DatasetError as exc:
            raise UserError(str(exc)) from None
        cfg = runner.RunConfig(
            url=args.base_url + args.endpoint, model=model, chat=args.chat, headers=dict(args.header),
            api_key=args.api_key, request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
            request_timeout_s=args.request_timeout, keepalive=not args.no_keepalive, seed=args.seed,
            progress=not args.disable_tqdm,
            admin_socket=args.admin_socket, faults=args.faults, think_time_s=args.sessions_think_time,
            extra_body=request_fields(args))
        total = sum(len(c.turns) for c in conversations)
        print(f"{PROG}: {total} requests ({args.dataset_name}) -> {cfg.url} model={model} "
              f"rate={args.request_rate:g}/s burstiness={args.burstiness:g} "
              f"max_concurrency={args.max_concurrency or 'unlimited'}", file=sys.stderr)
        result = loop_runner.run(runner.run(conversations, cfg))

    m = metrics.compute_metrics(result.records, result.duration_s, args.percentiles, args.slo)
    errors = metrics.error_counts(result.records)
    print(report.summary_table(m, selected=args.selected, percentiles=args.percentiles,
                               max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                               errors=errors, faults=result.fault_events))
    if args.save_result:
        config = _config(args, model, tokenizer_spec)
        doc = report.build_result(config=config, metrics=m, errors=errors, faults=result.fault_events,
                                  records=result.records if args.save_detailed else None,
                                  started_at=result.started_at, with_text=args.save_outputs)
        name = args.result_filename or report.default_filename(config, result.started_at)
        try:
            path = report.write_result(doc, Path(args.result_dir) / name)
        except OSError as exc:
            raise UserError(f"cannot write the result file: {exc}") from None
        print(f"{PROG}: result written to {path}", file=sys.stderr)
    if m["completed"] == 0:
        raise UserError(f"all {m['num_requests']} requests failed")
    return 0


# --------------------------------------------------------------------------- plot, compare

def cmd_plot(argv: Sequence[str]) -> int:
    from tools.loadgen.plot import plot_results

    p = OneLineParser(prog=f"{PROG} plot", description="Latency CDFs and throughput over time (PNG).")
    p.add_argument("results", nargs="+", metavar="RESULT", help="result files saved with --save-detailed")
    p.add_argument("-o", "--output", default=None,
                   help="output prefix; writes PREFIX-cdf.png and PREFIX-throughput.png "
                        "(default: the first result's path without .json)")
    p.add_argument("--bin", type=_positive_float, default=1.0, help="throughput bin width in seconds")
    args = p.parse_args(argv)
    prefix = args.output or str(Path(args.results[0]).with_suffix(""))
    try:
        written = plot_results(args.results, prefix, args.bin)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    for path in written:
        print(path)
    return 0


def cmd_compare(argv: Sequence[str]) -> int:
    from tools.loadgen.compare import compare_files, compare_output_files

    p = OneLineParser(prog=f"{PROG} compare", description="Every metric side by side, with ratios to the first; "
                      "with --outputs, each request's generated text against the first run's.")
    p.add_argument("results", nargs="+", metavar="RESULT")
    p.add_argument("--outputs", action="store_true",
                   help="compare texts request by request (results saved with --save-outputs); exit status 1 "
                        "when any request differs or failed")
    args = p.parse_args(argv)
    if len(args.results) < 2:
        p.error("compare needs at least two result files")
    try:
        if args.outputs:
            text, same = compare_output_files(args.results)
            print(text)
            return 0 if same else 1
        print(compare_files(args.results))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return 0


def cmd_table(argv: Sequence[str]) -> int:
    from tools.loadgen.report import load_result, markdown_table

    p = OneLineParser(prog=f"{PROG} table", description="A markdown serving table, one row per result.")
    p.add_argument("results", nargs="+", metavar="RESULT")
    args = p.parse_args(argv)
    try:
        print(markdown_table([load_result(path) for path in args.results]))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = ("run", argv)
    if argv and argv[0] in SUBCOMMANDS:
        command, rest = argv[0], argv[1:]
    handler = {"run": cmd_run, "plot": cmd_plot, "compare": cmd_compare, "table": cmd_table}[command]
    try:
        return handler(rest)
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (`kvd-loadgen compare ... | head`): not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
