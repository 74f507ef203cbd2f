"""``kvd profile``: measure this machine with the served model and fit the
step-time model of kvd/sim/costs.py.

What is timed, each on the engine ``kvd serve`` would build from the same
config (its threads, dtype and kernels):

- prefill: one engine step computing ``n`` new prompt tokens after ``c``
  cached ones (a prefix cached by an earlier request: the same call a chunk
  of a long prompt makes), over a grid of ``n`` and ``c``;
- decode: one engine step of ``B`` requests whose attention reads a total
  context, over a grid of batch sizes and prompt lengths;
- swap: moving blocks device -> host -> device (``MemPool`` private swaps);
- transfer: a request of ``x`` bytes and its small answer over a zmq+tcp
  link between two loopback endpoints (kvd's own transports), which is also
  what replication sends each step (one token's KV per request);
- cache: what a decode step costs with the weights out of the last-level
  cache, and how prefills and a second node on the host evict them
  (tools/sim/profile_cache.py, kvd/sim/warmth.py). It is measured first:
  the decode grid then drops each point's steps that the point's own
  prefill left cold, so the decode fit is of warm steps;
- wake: what a step right after the engine waited for work costs beyond
  one right after a step, per length of the wait (tools/sim/profile_wake.py,
  kvd/sim/wake.py). The prefill grid's samples run back to back;
- reference: the host's speed, a short fixed reading taken five times over
  the phases above (tools/sim/speed_ref.py), so that validation can bring
  the profile to the host's speed of a later hour.

Then (unless ``--serving-requests 0``) the serving overhead: a few requests
through a real ``kvd serve`` of the same config, one at a time, against the
simulator's TTFT for them on the fitted costs, then the same through a
one-prefill-one-decode ``kvd serve`` for a disaggregated request's path
(tools/sim/measure.py).

Each fit is least squares on relative error; the profile records the samples
and each fit's median error, names the model, the CPU and the build
fingerprint (engine/fingerprint.py). ``--quick`` shrinks every grid (seconds:
for tests and a first look). One progress line on stderr.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np

from kvd.sim.costs import StepCosts, least_squares, relative_error

GRIDS = {
    # (prefill new tokens, prefill contexts, decode batches, decode prompt lengths,
    #  decode steps per point, swap block counts, transfer sizes in bytes, repeats)
    # decode steps a point, after those its prefill left cold (measured: see the cache)
    "full": ([16, 64, 128, 256], [0, 128], [1, 2, 3, 4, 6, 8], [32, 128], 8,
             [8, 32], [4 << 10, 64 << 10, 1 << 20, 8 << 20], 3),
    "quick": ([16, 64], [0, 32], [1, 4], [32], 3, [8], [4 << 10, 256 << 10], 2),
}


class Progress:
    """One line on stderr, rewritten in place: ``kvd profile: <phase> i/n``."""

    def __init__(self, total: int, out=None) -> None:
        self.total, self.done, self.out = total, 0, out or sys.stderr    # stderr as of now, not of import

    def tick(self, phase: str) -> None:
        self.done += 1
        end = "\n" if self.done >= self.total else ""
        print(f"\rkvd profile: {phase:<9} {self.done}/{self.total}", end=end, file=self.out, flush=True)


def profile_engine(config, *, quick: bool = False, progress: Progress | None = None) -> dict:
    """Measure an engine built from ``config`` (an EngineConfig) and return the
    profile document (kvd/sim/profile_file.py). Slow: minutes, or seconds with
    ``quick`` (which measures no cache: its profile is always warm)."""
    import math

    from tools.sim.profile_cache import CACHE_ROUNDS, measure_cache
    from tools.sim.profile_wake import WAKE_ROUNDS, measure_wake
    from tools.sim.speed_ref import PROFILE_READINGS, measure_reference, reference_of_readings
    from engine.engine import LLMEngine
    from engine.request import SamplingParams

    from kvd.sim.profile_file import KIND, VERSION, this_cpu

    ns, cs, batches, lens, dsteps, swaps, sizes, reps = GRIDS["quick" if quick else "full"]
    longest = max(max(ns) + max(cs), max(lens) + 4 * dsteps + 2)
    blocks = max(64, max(batches) * (-(-(max(lens) + 4 * dsteps + 2) // config.block_size)) + 64, max(swaps) + 8)
    # unchunked: a prefill sample is exactly one call of n tokens; chunked serving makes the same calls
    config = replace(config, prefill_chunk_tokens=0, max_num_batched_tokens=max(longest, 4096),
                     kv_blocks=max(config.kv_blocks, blocks), host_kv_blocks=max(config.host_kv_blocks, max(swaps) + 8),
                     max_num_seqs=max(config.max_num_seqs, max(batches)), enable_prefix_caching=True)
    engine = LLMEngine.from_config(config)
    if engine.max_model_len <= longest:
        raise ValueError(f"the model's context ({engine.max_model_len}) is too short to profile")
    total = len(ns) * len(cs) * reps + len(batches) * len(lens) * reps + len(swaps) * reps + len(sizes) * reps \
        + (0 if quick else 2 * CACHE_ROUNDS + WAKE_ROUNDS + PROFILE_READINGS)
    progress = progress or Progress(total)
    rng = np.random.default_rng(0)
    vocab = engine.model.config.vocab_size
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    counter = iter(range(1 << 30))

    def ids(n: int) -> list[int]:
        return rng.integers(10, vocab - 10, size=n).tolist()

    def run_alone(prompt: list[int], params) -> None:
        engine.add_request(f"profile-{next(counter)}", prompt, params)
        while engine.has_unfinished():
            engine.step()

    # warm-up: the first call of each kind (a prefill, a one-row and a batched decode) pays one-off costs
    warm = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for b in sorted({1, max(batches)}):
        for _ in range(b):
            engine.add_request(f"profile-{next(counter)}", ids(32), warm)
        while engine.has_unfinished():
            engine.step()
    for n in ns:                                                 # each prefill shape once, untimed
        run_alone(ids(n), greedy)
    engine.pool.flush()
    readings = []

    def reading() -> None:                                       # the host's speed now (tools/sim/speed_ref.py)
        if not quick:
            readings.append(measure_reference(engine, ids))
            progress.tick("reference")
    reading()
    cache = None if quick else measure_cache(engine, lambda: LLMEngine.from_config(config), ids, progress=progress)
    engine.pool.flush()
    reading()
    wake = None if quick else measure_wake(engine, ids, progress=progress)
    reading()
    cold_steps = min(3 * dsteps, math.ceil(cache.warm_steps * cache.prefill_cools)) if cache is not None else 0
    prefill = []
    for _ in range(reps):
        for c in cs:
            for n in ns:
                prefix = ids(c)
                if c:
                    run_alone(prefix + ids(1), greedy)           # caches the prefix's full blocks
                engine.add_request(f"profile-{next(counter)}", prefix + ids(n), greedy)
                t0 = time.perf_counter()
                outs = engine.step()
                dt = time.perf_counter() - t0
                cached = outs[0].num_cached_tokens
                prefill.append([c + n - cached, cached, dt])
                engine.pool.flush()                              # the next sample starts cold
                progress.tick("prefill")
    reading()
    decode = []
    for _ in range(reps):
        for length in lens:
            for b in batches:
                params = SamplingParams(max_tokens=cold_steps + dsteps + 1, temperature=0.0, ignore_eos=True)
                for _ in range(b):
                    engine.add_request(f"profile-{next(counter)}", ids(length), params)
                since_prefill = 0
                while engine.has_unfinished():
                    sched = engine.scheduler
                    pure = not sched.waiting and sched.running and not any(r.prefilling for r in sched.running)
                    context = sum(r.num_computed + 1 for r in sched.running)
                    batch = len(sched.running)
                    t0 = time.perf_counter()
                    engine.step()
                    dt = time.perf_counter() - t0
                    since_prefill = since_prefill + 1 if pure else 0
                    if pure and since_prefill > cold_steps:
                        decode.append([batch, context, dt])
                engine.pool.flush()
                progress.tick("decode")
    reading()
    swap = []
    for _ in range(reps):
        for k in swaps:
            dev = engine.pool.alloc_mem(k)
            t0 = time.perf_counter()
            host = engine.pool.swap_out_private(dev)
            back = engine.pool.swap_in_private(host)
            dt = time.perf_counter() - t0
            engine.pool.free_mem(back)
            swap.append([k, dt / 2])
            progress.tick("swap")
    transfer = asyncio.run(_time_transfers(sizes, reps, progress))

    costs, fit = fit_costs(prefill, decode, swap, transfer)
    kv = engine.pool.kv_layout()
    return {
        "kind": KIND, "version": VERSION, "model": config.model, "cpu": this_cpu(),
        "threads": engine.compute_threads, "fingerprint": engine.fingerprint,
        "host_cpus": len(os.sched_getaffinity(0)),
        "block_size": config.block_size, "kv_bytes_per_token": kv.bytes_per_block // config.block_size,
        "num_layers": kv.num_layers, "quick": quick,
        # the engine ignores prefill_chunk_tokens for 16-bit activations (LLMEngine.effective_chunk_tokens)
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "chunked_prefill": LLMEngine.effective_chunk_tokens(replace(config, prefill_chunk_tokens=1),
                                                            engine.model) > 0,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "costs": costs.as_dict(), "fit": fit,
        "samples": {"prefill": prefill, "decode": decode, "swap": swap, "transfer": transfer},
        **({"cache": cache.as_dict()} if cache is not None else {}),
        **({"wake": wake.as_list()} if wake is not None else {}),
        **({"reference": reference_of_readings(readings)} if readings else {}),
    }


async def _time_transfers(sizes: list[int], reps: int, progress: Progress) -> list[list[float]]:
    """[bytes, seconds] of a request of that many bytes answered by a small ack,
    over zmq+tcp between two loopback endpoints of this process."""
    import transports
    from transports import TransportOptions

    opts = TransportOptions(send_timeout=60, request_timeout=60, max_frame_bytes=1 << 31)
    listener = await transports.listen("zmq+tcp://127.0.0.1:0", options=opts)

    async def serve() -> None:
        while True:
            incoming = await listener.recv()
            await listener.reply(incoming, b'{"ok":true}')

    server = asyncio.create_task(serve())
    conn = await transports.connect(listener.url, options=opts)
    out = []
    try:
        await conn.request(b'{"warm":1}', [np.zeros(1024, np.uint8)])
        for _ in range(reps):
            for size in sizes:
                payload = np.ones(size, np.uint8)
                t0 = time.perf_counter()
                await asyncio.wait_for(conn.request(b'{"kv":1}', [payload]), 60)
                out.append([size, time.perf_counter() - t0])
                progress.tick("transfer")
    finally:
        server.cancel()
        await conn.close()
        await listener.close()
    return out


def _medians(samples: list[list[float]]) -> list[list[float]]:
    """One sample per point (all but the last column): the median of its times (a shared host's
    outliers out)."""
    groups: dict[tuple, list[float]] = {}
    for *key, s in samples:
        groups.setdefault(tuple(key), []).append(s)
    return [[*k, sorted(v)[len(v) // 2]] for k, v in groups.items()]


def _decode_table(decode: list[list[float]]) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(seconds per context token, ((batch, seconds at zero context), ...)): one
    intercept per measured batch size and one context slope shared by all,
    least squares over ``decode`` ([batch, context, seconds] rows)."""
    sizes = sorted({int(b) for b, _, _ in decode})
    col = {b: i for i, b in enumerate(sizes)}
    rows = [[1.0 if col[int(b)] == i else 0.0 for i in range(len(sizes))] + [ctx] for b, ctx, _ in decode]
    x = least_squares(rows, [s for *_, s in decode])
    return x[-1], tuple((b, x[col[b]]) for b in sizes)


def fit_costs(prefill, decode, swap, transfer) -> tuple[StepCosts, dict]:
    """Fit StepCosts to the samples (the median of each point's repeats); also
    return each fit's median relative error."""
    prefill, transfer = _medians(prefill), _medians(transfer)
    # decode contexts differ step by step: group by batch and prompt length's context to within a block
    decode = _medians([[b, ctx // 16 * 16, s] for b, ctx, s in decode])
    pf_rows = [[1.0, n, n * (c + n / 2)] for n, c, _ in prefill]
    pf_y = [s for *_, s in prefill]
    p_fixed, p_tok, p_att = least_squares(pf_rows, pf_y)
    dc_rows = [[1.0, b, ctx] for b, ctx, _ in decode]
    dc_y = [s for *_, s in decode]
    d_fixed, d_seq, _ = least_squares(dc_rows, dc_y)
    d_ctx, table = _decode_table(decode)
    swap_block = sum(s for _, s in swap) / max(1, sum(k for k, _ in swap))
    tr_rows = [[1.0, float(x)] for x, _ in transfer]
    tr_y = [s for _, s in transfer]
    t_lat, t_byte = least_squares(tr_rows, tr_y)
    costs = StepCosts(prefill_fixed_s=p_fixed, prefill_token_s=p_tok, prefill_attention_s=p_att,
                      decode_fixed_s=d_fixed, decode_seq_s=d_seq, decode_context_s=d_ctx,
                      swap_block_s=swap_block, transfer_latency_s=t_lat, transfer_byte_s=t_byte,
                      decode_batch_s=table)
    fit = {
        "prefill_median_error": relative_error([costs.prefill_seconds([(n, c)]) for n, c, _ in prefill], pf_y),
        "decode_median_error": relative_error([costs.decode_seconds(b, x) for b, x, _ in decode], dc_y),
        "transfer_median_error": relative_error([costs.transfer_seconds(int(x)) for x, _ in transfer], tr_y),
    }
    return costs, {k: round(v, 4) for k, v in fit.items()}


def main(args) -> int:
    """``kvd profile`` (args from kvd/cli.py): exit 0, or 2 with one line on a bad config."""
    from kvd.config import ConfigError, load_config
    from kvd.sim.profile_file import write_profile

    try:
        config = load_config(args.config, {"engine": {"model": args.model}})
    except (ConfigError, ValueError) as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        return 2
    requests = args.serving_requests if args.serving_requests is not None else (0 if args.quick else 16)
    if not 0 <= requests <= 1000:
        print(f"kvd: error: --serving-requests must be in [0, 1000], got {requests}", file=sys.stderr)
        return 2
    doc = profile_engine(replace(config.engine, profile=""), quick=args.quick)
    try:
        path = write_profile(doc, args.output)
        if requests:
            from tools.sim.measure import OVERHEAD_INSTANCES, disagg_overhead, serving_overhead

            print("kvd profile: serving overhead through kvd serve ...", file=sys.stderr, flush=True)
            instances = 1 if args.quick else OVERHEAD_INSTANCES             # --quick: a first look
            doc["serving"] = serving_overhead(path, config.engine.model, args.config, requests, instances)
            path = write_profile(doc, args.output)
            print("kvd profile: a disaggregated request's path through kvd serve --nodes 2 --prefill 1 ...",
                  file=sys.stderr, flush=True)
            doc["serving"].update(disagg_overhead(path, config.engine.model, args.config, requests, instances))
            path = write_profile(doc, args.output)
    except OSError as exc:
        print(f"kvd: error: cannot write the profile: {exc}", file=sys.stderr)
        return 2
    except (subprocess.SubprocessError, SystemExit, ValueError) as exc:
        print(f"kvd: error: the serving overhead was not measured ({exc}); {path} holds the rest",
              file=sys.stderr)
        return 2
    c, f = doc["costs"], doc["fit"]
    print(f"kvd profile: {doc['model']} on {doc['cpu']} ({doc['threads']} threads) -> {path}\n"
          f"  prefill {c['prefill_fixed_s'] * 1e3:.2f} ms + {c['prefill_token_s'] * 1e3:.3f} ms/token "
          f"(median error {f['prefill_median_error']:.1%}); decode {c['decode_fixed_s'] * 1e3:.2f} ms + "
          f"{c['decode_seq_s'] * 1e3:.3f} ms/request (median error {f['decode_median_error']:.1%}); "
          f"transfer {c['transfer_latency_s'] * 1e6:.0f} us + {1 / max(c['transfer_byte_s'], 1e-15) / 1e9:.2f} GB/s"
          + (f"; serving {doc['serving']['first_token_s'] * 1e3:.1f} ms per request" if "serving" in doc else ""),
          file=sys.stderr)
    return 0
