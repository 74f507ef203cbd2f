"""kvd against llama.cpp on the same GGUF, the same thread count and the same host, in one run.

    .venv/bin/python -m tools.bench.engine.bench_llamacpp --llama-cpp /path/to/llama.cpp/build/bin [--threads 2]
        [--parts engine,http] [--rounds 2] [--gguf FILE]

llama.cpp is not part of kvd and never built by it: build ``llama-bench`` and
``llama-server`` yourself (docs/benchmarks.md gives the commands) and point
``--llama-cpp`` at the folder that holds them. Rows, each side by side:

- **engine**: ``llama-bench -p 512 -n 128 -r 3`` (pp512, tg128) against kvd's
  engine in this process: single-stream greedy decode of 128 tokens and the
  prefill of fresh 512-token prompts (no cached prefix), 3 repetitions each,
  with the bandwidth bound for the weight bytes a decode step reads (read
  bandwidth probed before each kvd round, the highest probe taken), both
  engines' tg128 as a fraction of it, and each kvd round against its own
  probe; rounds alternate between the two, and the table gives each side's
  fastest repetition and the median of the per-round ratios;
- **depth**: decode at long context, ``llama-bench -p 0 -n 128 -d D`` (tg128 after a
  D-token context, llama.cpp's "tg128 @ dD") against kvd's engine decoding 128 tokens
  after a D-token prompt (its prefill not timed), for each D of ``--depths``;
- **HTTP**: ``kvd-loadgen`` against ``llama-server`` and against ``kvd serve``
  (``--threads`` as its ``--num-threads``, or its default where ``--threads`` is
  every CPU, as ``llama-server -t`` then takes them all),
  the same dataset and seed: one stream (``--max-concurrency 1``) and 32
  concurrent requests (``llama-server -np 32``); output tok/s, TPOT, TTFT, and
  kvd's mean engine step over the run (from its /metrics): one stream's TPOT
  above it is what kvd's serving path adds.

Both load the same GGUF: the bundled SmolLM2, or ``--gguf FILE`` (any file both
serve: a ``Q4_K_M`` of the bundled model made with ``llama-quantize``, another
model of a supported architecture, or random blocks of the same shapes and types
where the real file cannot be copied: ``tools/random_gguf.py``). Every row names
the CPU; the run prints and records the file and its tensor types. Writes JSON to
``--out`` (default ``results/bench_llamacpp.json``) and prints markdown rows for
docs/benchmarks.md. Bad arguments (a missing file or binary, a count below 1, an
unknown part) get a one-line error and exit status 2 before anything runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.model.registry import bundled_gguf_path  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from tools._twoproc import free_port, stop_processes, wait_healthy, write_results  # noqa: E402
from tools.bench.engine.bench_engine import decode_rates, make_engine, random_prompts, read_bandwidth  # noqa: E402
from tools.bench.engine.bench_weights import prefill_seconds  # noqa: E402
from tools.loadgen.report import cpu_model  # noqa: E402

# KV blocks of kvd's engine in the engine and depth parts: the longest run (4,096 + 129 tokens)
# fits, and so does the KV pool of a larger --gguf (tools/random_gguf.py)
KV_BLOCKS = 512
# (name, concurrency, prompts, input tokens, output tokens)
HTTP_LOADS = (("1 stream", 1, 8, 32, 128), ("32 concurrent", 32, 64, 300, 128))


def llama_bench_rows(bin_dir: Path, gguf: Path, threads: int, reps: int, *tests: str) -> list[dict]:
    """llama-bench's JSON rows for ``tests`` (its -p / -n / -d arguments), ``reps`` repetitions."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), *tests,
                          "-r", str(reps), "-o", "json"], capture_output=True, text=True, timeout=3600,
                         check=True).stdout
    return json.loads(out)


def llama_bench(bin_dir: Path, gguf: Path, threads: int, reps: int) -> dict[str, float]:
    """{"pp512": tok/s, "tg128": tok/s} from one llama-bench run of ``reps`` repetitions:
    the fastest repetition of each (as for kvd below: a shared host only slows runs down)."""
    rows = llama_bench_rows(bin_dir, gguf, threads, reps, "-p", "512", "-n", "128")
    return {("pp512" if r["n_prompt"] else "tg128"): max(float(x) for x in r["samples_ts"]) for r in rows}


def llama_bench_depth(bin_dir: Path, gguf: Path, threads: int, depth: int, reps: int) -> float:
    """tg128 (tok/s) after a ``depth``-token context: the fastest of ``reps`` repetitions."""
    rows = llama_bench_rows(bin_dir, gguf, threads, reps, "-p", "0", "-n", "128", "-d", str(depth))
    return max(float(x) for r in rows for x in r["samples_ts"])


def kvd_depth(eng, prompt: list[int], reps: int) -> float:
    """tg128 (tok/s) of kvd's engine after ``prompt``: the fastest of ``reps`` repetitions,
    each timed from the first sampled token (prefill done, in as many steps as it takes)
    to the 128th."""
    sp = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
    best = 0.0
    for rep in range(reps):
        eng.add_request(f"depth-{rep}", prompt, sp)
        while eng.has_unfinished() and not eng.step():
            pass
        t, n = time.perf_counter(), 0
        while eng.has_unfinished():
            n += len(eng.step())
        best = max(best, n / (time.perf_counter() - t))
    return best


def kvd_engine(eng, prompts: list[list[int]]) -> dict[str, float]:
    """{"pp512": tok/s, "tg128": tok/s} of kvd's engine, the fastest of len(prompts) repetitions
    each: fresh 512-token prefills (no cached prefix), 128-token greedy decodes."""
    pre = [prefill_seconds(eng, p) for p in prompts]
    dec = decode_rates(eng, prompts[0][:16], rounds=len(prompts))
    return {"pp512": 512 / min(pre), "tg128": max(dec)}


def loadgen(url: str, load: tuple, tmp: str, tag: str, gguf: Path) -> dict:
    name, conc, n, inp, outp = load
    out = Path(tmp) / f"{tag}.json"
    subprocess.run([sys.executable, "-m", "tools.loadgen.cli", "run", "--base-url", url,
                    "--tokenizer", str(gguf), "--endpoint", "/v1/completions", "--dataset-name", "random",
                    "--random-input-len", str(inp), "--random-output-len", str(outp), "--num-prompts", str(n),
                    "--max-concurrency", str(conc), "--request-rate", "inf", "--ignore-eos", "--seed", "0",
                    "--temperature", "0", "--no-keepalive", "--save-result", "--result-dir", tmp,
                    "--result-filename", out.name,
                    "--disable-tqdm"], cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    m = json.loads(out.read_text())["metrics"]
    return {k: m.get(k) for k in ("output_throughput", "median_tpot_ms", "median_ttft_ms", "p99_ttft_ms",
                                  "completed", "failed", "duration")}


def engine_step_counters(url: str) -> tuple[float, float]:
    """(steps, seconds inside them) from kvd's /metrics (``kvd_engine_steps_total``,
    ``kvd_engine_step_seconds_total``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    got = {sample.name: sample.value for family in text_string_to_metric_families(text)
           for sample in family.samples}
    return got["kvd_engine_steps_total"], got["kvd_engine_step_seconds_total"]


def serve(kind: str, bin_dir: Path, gguf: Path, threads: int, conc: int, port: int) -> subprocess.Popen:
    if kind == "llama.cpp":
        cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
               "-np", str(conc), "-c", str(1024 * conc), "--host", "127.0.0.1", "--port", str(port),
               # its HTTP pool defaults to a thread per core: with 32 streams open it drops new
               # connections ("Can not write request body"), which would count as its failures
               "--threads-http", str(2 * conc + 4)]
    else:
        # every CPU: kvd's default (one per core, one left to its serving threads on 8+ CPUs,
        # EngineConfig.compute_threads), as llama-server's -t takes them all beside its HTTP threads
        every = threads >= len(os.sched_getaffinity(0))
        cmd = [sys.executable, "-m", "kvd.cli", "serve", "--port", str(port),
               *([] if every else ["--num-threads", str(threads)]),
               "--max-num-seqs", str(max(conc, 8)), "--model", str(gguf)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def http_rows(bin_dir: Path, gguf: Path, threads: int, rounds: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-llamacpp-") as tmp:
        for load in HTTP_LOADS:
            for rnd in range(rounds):
                for kind in (("llama.cpp", "kvd") if rnd % 2 == 0 else ("kvd", "llama.cpp")):
                    port = free_port()
                    proc = serve(kind, bin_dir, gguf, threads, load[1], port)
                    try:
                        url = f"http://127.0.0.1:{port}"
                        why = wait_healthy(url, proc, 180.0)
                        if why:
                            raise SystemExit(f"bench_llamacpp: {kind} server {why}")
                        before = engine_step_counters(url) if kind == "kvd" else None
                        r = loadgen(url, load, tmp, f"{kind}-{load[1]}-{rnd}", gguf)
                        if before is not None:
                            after = engine_step_counters(url)
                            r["engine_steps"] = after[0] - before[0]
                            r["engine_step_ms"] = 1e3 * (after[1] - before[1]) / max(after[0] - before[0], 1)
                    finally:
                        stop_processes([proc])
                    rows.append({"part": "http", "load": load[0], "server": kind, "round": rnd, **r})
                    step = f", engine step mean {r['engine_step_ms']:.1f} ms" if "engine_step_ms" in r else ""
                    print(f"{load[0]:14s} {kind:9s} round {rnd}: {r['output_throughput']:.1f} out tok/s, "
                          f"TPOT p50 {r['median_tpot_ms']:.1f} ms, TTFT p50 {r['median_ttft_ms']:.0f} ms "
                          f"({r['completed']} done, {r['failed']} failed){step}", flush=True)
    return rows


PARTS = ("engine", "depth", "http")
# the llama.cpp programs each part runs
PROGRAMS = {"engine": "llama-bench", "depth": "llama-bench", "http": "llama-server"}


def tensor_types(gguf_path: Path) -> dict[str, int]:
    """{GGUF type name: tensors of it} of a file (its header only, no tensor data read)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        name = gguf.GGMLQuantizationType(t.tensor_type).name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The parts and depths asked for; ``ap.error`` (one line, exit status 2) for anything that
    would fail later: an unknown part, a count or depth below 1, a GGUF file that is missing or
    is not one, a llama.cpp folder without the programs the parts run."""
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts {args.parts!r}: expected a comma-separated list of {', '.join(PARTS)}")
    for name in ("threads", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: must be at least 1")
    try:
        depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        ap.error(f"--depths {args.depths!r}: expected comma-separated token counts of at least 1")
    if args.gguf is not None:
        try:
            with open(args.gguf, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            ap.error(f"--gguf {args.gguf}: {exc.strerror or exc}")
        if magic != b"GGUF":
            ap.error(f"--gguf {args.gguf}: not a GGUF file (it does not start with the GGUF magic)")
    for program in sorted({PROGRAMS[p] for p in parts}):
        path = args.llama_cpp / program
        if not (path.is_file() and os.access(path, os.X_OK)):
            ap.error(f"--llama-cpp {args.llama_cpp}: no executable {program} there (build llama.cpp: docs/benchmarks.md)")
    return parts, depths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path, help="folder with llama-bench and llama-server")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="engine,http", help="comma-separated: engine, depth, http")
    ap.add_argument("--depths", default="1024,4096", help="context lengths of the depth part")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="the GGUF both engines load (default: the bundled SmolLM2); the tokenizer is its own")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_llamacpp.json"))
    args = ap.parse_args()
    parts, depths = check_args(ap, args)
    from kernels.quant_linear import host_variant
    gguf, rows = (args.gguf or bundled_gguf_path()).resolve(), []
    cpu = f"{cpu_model()} ({host_variant() or 'no quantized kernel'})"
    types = tensor_types(gguf)
    print(f"model: {gguf.name} (tensor types: {', '.join(f'{k} x{v}' for k, v in types.items())})", flush=True)
    torch.set_num_threads(args.threads)
    if "engine" in parts:
        eng = make_engine("float32", weights="native", num_threads=args.threads, model=str(gguf), kv_blocks=KV_BLOCKS)
        tok = eng.tokenizer
        weight_bytes = eng.model.weight_bytes_per_token()
        for rnd in range(args.rounds):
            for side in (("llama.cpp", "kvd") if rnd % 2 == 0 else ("kvd", "llama.cpp")):
                if side == "llama.cpp":
                    r = llama_bench(args.llama_cpp, gguf, args.threads, reps=3)
                else:
                    bw_gbs = read_bandwidth() / 1e9     # probed each round: the host's minute moves it
                    r = kvd_engine(eng, random_prompts(tok, 3, [512] * 3, seed=100 + rnd))
                    r["bandwidth_gbs"] = bw_gbs
                rows.append({"part": "engine", "side": side, "round": rnd, **r})
                print(f"engine {side:9s} round {rnd}: pp512 {r['pp512']:.1f} tok/s, tg128 {r['tg128']:.1f} tok/s",
                      flush=True)
        kvd_rows = [r for r in rows if r.get("side") == "kvd"]
        bws = [r["bandwidth_gbs"] for r in kvd_rows]
        bw = max(bws)                           # GB/s, the strictest bound: the most the host gave in the run
        bound = bw * 1e9 / weight_bytes
        print(f"\nbandwidth bound: {bw:.1f} GB/s (rounds: {', '.join(f'{b:.1f}' for b in bws)}) "
              f"/ {weight_bytes / 1e6:.0f} MB per token = {bound:.0f} tok/s")
        best = {s: {k: max(r[k] for r in rows if r.get("side") == s) for k in ("pp512", "tg128")}
                for s in ("kvd", "llama.cpp")}
        per_round = {k: statistics.median(
            next(r[k] for r in rows if r.get("side") == "kvd" and r["round"] == n)
            / next(r[k] for r in rows if r.get("side") == "llama.cpp" and r["round"] == n)
            for n in range(args.rounds)) for k in ("pp512", "tg128")}
        print("\n| CPU | threads | test | llama.cpp (llama-bench) | kvd | kvd / llama.cpp: best, median of rounds |")
        print("|---|---|---|---|---|---|")
        for k in ("tg128", "pp512"):
            print(f"| {cpu} | {args.threads} | {k} | {best['llama.cpp'][k]:.1f} tok/s | {best['kvd'][k]:.1f} tok/s "
                  f"| **{best['kvd'][k] / best['llama.cpp'][k]:.2f}x**, {per_round[k]:.2f}x |")
        print(f"\ntg128 of the bandwidth bound ({bound:.0f} tok/s): kvd {best['kvd']['tg128'] / bound:.2f}, "
              f"llama.cpp {best['llama.cpp']['tg128'] / bound:.2f}")
        paired = [r["tg128"] * weight_bytes / (r["bandwidth_gbs"] * 1e9) for r in kvd_rows]
        print(f"kvd tg128 of the bound its own round's probe gives: {', '.join(f'{f:.2f}' for f in paired)} "
              f"(median {statistics.median(paired):.2f})")
        rows.append({"part": "bound", "bandwidth_gbs": bw, "bandwidth_gbs_rounds": bws,
                     "weight_bytes": weight_bytes, "bound_tok_s": bound})
        del eng
    if "depth" in parts:
        eng = make_engine("float32", weights="native", num_threads=args.threads, model=str(gguf), kv_blocks=KV_BLOCKS)
        for depth in depths:
            prompt = random_prompts(eng.tokenizer, 1, [depth], seed=200 + depth)[0]
            for rnd in range(args.rounds):
                for side in (("llama.cpp", "kvd") if rnd % 2 == 0 else ("kvd", "llama.cpp")):
                    rate = (llama_bench_depth(args.llama_cpp, gguf, args.threads, depth, reps=3) if side == "llama.cpp"
                            else kvd_depth(eng, prompt, reps=3))
                    rows.append({"part": "depth", "depth": depth, "side": side, "round": rnd, "tg128": rate})
                    print(f"depth {depth} {side:9s} round {rnd}: tg128 {rate:.1f} tok/s", flush=True)
        print("\n| CPU | threads | test | llama.cpp (llama-bench) | kvd | kvd / llama.cpp: best, median of rounds |")
        print("|---|---|---|---|---|---|")
        for depth in depths:
            got = {s: [r["tg128"] for r in sorted((r for r in rows if r.get("part") == "depth" and r["depth"] == depth
                                                  and r["side"] == s), key=lambda r: r["round"])]
                   for s in ("kvd", "llama.cpp")}
            ratio = statistics.median(k / c for k, c in zip(got["kvd"], got["llama.cpp"]))
            print(f"| {cpu} | {args.threads} | tg128 @ d{depth} | {max(got['llama.cpp']):.1f} tok/s "
                  f"| {max(got['kvd']):.1f} tok/s | **{max(got['kvd']) / max(got['llama.cpp']):.2f}x**, {ratio:.2f}x |")
        del eng
    if "http" in parts:
        rows += http_rows(args.llama_cpp, gguf, args.threads, args.rounds)
        print("\n| CPU | threads | load | llama-server out tok/s | kvd serve out tok/s | ratio "
              "| TPOT p50 llama / kvd (ms) | TTFT p50 llama / kvd (ms) | kvd engine step, mean (ms) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, *_ in HTTP_LOADS:
            med = {s: {k: statistics.median(r[k] for r in rows if r.get("load") == name and r["server"] == s)
                       for k in ("output_throughput", "median_tpot_ms", "median_ttft_ms")}
                   for s in ("llama.cpp", "kvd")}
            lc, kv = med["llama.cpp"], med["kvd"]
            step = statistics.median(r["engine_step_ms"] for r in rows
                                     if r.get("load") == name and r["server"] == "kvd")
            print(f"| {cpu} | {args.threads} | {name} | {lc['output_throughput']:.1f} | {kv['output_throughput']:.1f} "
                  f"| **{kv['output_throughput'] / lc['output_throughput']:.2f}x** "
                  f"| {lc['median_tpot_ms']:.1f} / {kv['median_tpot_ms']:.1f} "
                  f"| {lc['median_ttft_ms']:.0f} / {kv['median_ttft_ms']:.0f} "
                  f"| {step:.1f} |")
    write_results(args.out, rows, cpu=cpu, model=gguf.name, tensor_types=types,
                  args={k: str(v) for k, v in vars(args).items()})


if __name__ == "__main__":
    main()
