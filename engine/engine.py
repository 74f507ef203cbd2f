"""LLMEngine: the synchronous inference core.

``step()`` is schedule -> execute -> update, deterministic given the inputs.
No sockets, no asyncio, no threads: the node daemon (or the embedded server)
drives it from one thread and talks to it through queues.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import torch

from engine.memory.kv_cache import KVCache
from engine.memory.mempool import MemPool
from engine.memory.region import Region
from engine.model.decode_kernels import float_unsupported_reason, fused_decoder, plan_decoder
from engine.model.llama import LlamaModel
from engine.model.registry import ModelSource, resolve_model
from engine.model.tokenizer import Tokenizer
from engine.model.weights import LoadedWeights
from engine.output import OutputProcessor
from engine.prefill_alone import PrefillAlone
from engine.request import (ENGINE_ERROR, FinishReason, InvalidParam, Request, RequestOutput, RequestStatus,
                            SamplingParams)
from engine.stats import EngineStats
from engine.structured.grammar import GrammarCompiler
from engine.structured.spec import StructuredOutputError
from engine.team import TeamSizer
from engine.borrowing import KVBorrowing
from engine.config import EngineConfig  # noqa: F401  (re-exported: callers import it from here)
from engine.dist_attention import RemoteKV, RemoteKVError
from engine.cpus import format_cpulist
from engine.exactness import same_bits
from engine.fingerprint import engine_parts, fingerprint
from engine.runner import SMALL_BATCH, ModelRunner
from engine.sampling import UNSAMPLED, make_generator
from engine.scheduler import ScheduledBatch, Scheduler
from engine.stream import KVSink, LayerStreamer
from kernels.native import compiler_version, cpu_has_native_bf16
from kernels.plan_decode import PlanDecoder
from kernels.quant_linear import QuantKernel
from kernels.logprob_rows import LogprobKernel
from kernels.sampler import RowSampler

log = logging.getLogger(__name__)

# seconds the engine spends at start timing decode teams (EngineConfig.decode_threads = 0)
TEAM_TIMING_S = 0.3

DTYPES = {"float32": torch.float32, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` picks the faster serving dtype for this machine (docs/benchmarks.md):
    bf16 where the CPU has native bf16 matmuls, else fp32 — on an AVX2-only CPU
    bf16 is emulated, and prefill or batched decode run several times slower."""
    if name == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return DTYPES[name]


def build_model(config: EngineConfig, weights: LoadedWeights) -> LlamaModel:
    """The model ``config`` asks for over ``weights``.

    Quantized weights (``weights = "native"`` on a GGUF with Q4_0/Q4_1/Q8_0
    matrices) run on this CPU's quantized-weights kernel; where there is none
    (no AVX2/FMA/F16C, or a failed build: logged) they are dequantized here and
    served as ``weights = "dequantize"`` would serve them. ``dtype = "auto"``
    is float32 for quantized weights on every CPU: their kernels compute in
    fp32, and only an fp32 model decodes through the plan executor. An fp32 float
    model keeps its matrices in the executor's layout (``float_layout = "rows"``)
    where its decode steps will run there: ``decode_kernel = "auto"``, shapes the
    executor takes, a CPU with a kernel build (``float_unsupported_reason``)."""
    kernel = None
    dtype = resolve_dtype(config.dtype)
    if weights.is_quantized:
        kernel = QuantKernel.create()
        if kernel is None:
            log.warning("serving %s dequantized: no quantized-weights kernel here", weights.source)
            weights = weights.dequantized()
        else:
            log.info("serving %s with its quantized weights (%s kernel)", weights.source, kernel.variant)
            if config.dtype == "auto":
                dtype = torch.float32
    rows = (kernel is None and dtype == torch.float32 and config.decode_kernel == "auto"
            and float_unsupported_reason(weights.config) is None)
    return LlamaModel(weights.config, weights.tensors, dtype=dtype, quant_kernel=kernel,
                      float_layout="rows" if rows else "auto", batch_invariant=config.batch_invariant)


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's (``auto``), or float16 for an fp32 model's
    (half the bytes per block: twice the blocks in the same memory, half the bytes a
    decode step's attention reads and a transfer moves). Raises ValueError for
    float16 under a model that is not fp32 (a bf16 model's cache is 16-bit already)."""
    if config.kv_cache_dtype == "auto":
        return model_dtype
    if model_dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype = {config.kv_cache_dtype!r} stores an fp32 model's KV; this model "
                         f"computes in {str(model_dtype).removeprefix('torch.')} (use kv_cache_dtype = \"auto\")")
    return torch.float16


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LlamaModel, tokenizer: Tokenizer,
                 model_name: str, source: ModelSource | None = None) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.source = source            # where the weights came from (from_config), for the fingerprint
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.kv = KVCache(num_layers=model.num_local_layers, num_kv_heads=mc.num_kv_heads,
                          head_dim=mc.head_dim, block_size=config.block_size,
                          device_blocks=config.kv_blocks, host_blocks=config.host_kv_blocks,
                          dtype=kv_cache_dtype(config, model.dtype))
        self.pool = MemPool(device_blocks=config.kv_blocks, host_blocks=config.host_kv_blocks,
                            block_size=config.block_size, storage=self.kv)
        self.scheduler = Scheduler(config.scheduler_config(self.effective_chunk_tokens(config, model)),
                                   self.pool)
        device_kv = self.kv.tier("device")
        fused = None
        if config.decode_kernel == "auto":   # one C++ call per decode step where one can run it
            make = plan_decoder if model.quantized or model.dtype == torch.float32 else fused_decoder
            fused = make(model, device_kv, config.block_size)
        self.runner = ModelRunner(model, device_kv, config.block_size, fused, RowSampler.create(),
                                  LogprobKernel.create())
        self.compute_threads = torch.get_num_threads()      # the team from_config sized (this thread's)
        self.runner.small_batch_threads = self._small_batch_team()
        self.runner.team = self._adaptive_team()
        self.outputs = OutputProcessor(tokenizer, self.max_model_len)
        # structured output's compiled grammars (thread-safe: the node compiles off the step)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size)
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self.stats = EngineStats()
        self.pair_rule: PrefillAlone | None = None      # a paired node's: no decode in a prompt's steps

    def _adaptive_team(self) -> TeamSizer | None:
        """The sizer of each decode step's team (engine/team.py) where the team is not
        fixed: ``decode_threads`` = 0 and a one-call decoder that runs a step on fewer
        threads than torch's (``SMALL_TEAMS``). Candidates: the whole team (first: the
        default before anything is measured), one thread fewer (a neighbour holding one
        CPU), half of it, and the small-batch team calibrated at start."""
        threads, fused = self.compute_threads, self.runner.fused
        if self.config.decode_threads or fused is None or not fused.SMALL_TEAMS or threads < 2:
            return None
        return TeamSizer([threads, threads - 1, max(1, threads // 2), self.runner.small_batch_threads])

    def _small_batch_team(self) -> int:
        """Threads for one-call decode steps of at most runner.SMALL_BATCH rows: the only
        candidate of ``EngineConfig.decode_team_candidates``, or the fastest of them
        timed here on a one-row step (a device block borrowed from MemPool and given
        back), the largest unless another is at least 3% faster; torch's count for a
        decoder that runs every step on its whole team (``SMALL_TEAMS``)."""
        threads, fused = torch.get_num_threads(), self.runner.fused
        teams = self.config.decode_team_candidates(threads)
        if fused is not None and not fused.SMALL_TEAMS:
            if teams != [threads]:
                log.info("decode_threads not applied: the fused bf16 decoder runs every step on all %d threads",
                         threads)
            return threads
        if len(teams) == 1 or fused is None:
            return teams[0]
        ids = self.pool.alloc_mem(1)
        if ids is None:
            return teams[0]
        try:
            median = self.runner.time_decode_teams(ids[0], teams, TEAM_TIMING_S)
        finally:
            self.pool.free_mem(ids)
        fastest = min(teams, key=median.__getitem__)
        team = fastest if median[fastest] <= 0.97 * median[teams[0]] else teams[0]
        log.info("decode steps of <= %d rows on %d threads (one-row step, median: %s)", SMALL_BATCH, team,
                 ", ".join(f"{n} threads {median[n] * 1e3:.3f} ms" for n in teams))
        return team

    def kernels(self) -> dict[str, str]:
        """What computes each part of a step on this CPU, for operators (node status,
        the start-up log): ``weights`` ("native" block-quantized or "float") and
        ``dtype``; ``matrices``, "quantized" or the float matrices' dtype (a 16-bit
        checkpoint's kept for an fp32 model: ``weights = "native"``); ``kv_cache``, the
        KV cache's dtype (kv_cache_dtype); ``matmul``, the
        quantized-weights kernel's build ("avx2",
        "avx512vnni", ...) or "torch"; ``decode``, the one-call decoder
        ("plan:<build>" or "fused-bf16") or "torch"; ``threads``, the compute team and
        the CPUs it runs on (EngineConfig.cpus); ``decode_threads``, its team for
        small batches (EngineConfig.decode_threads); ``attention``, the paged
        attention kernel's build or "torch" (SDPA); ``row_ops``, the build running
        a prefill's norms, SwiGLU and RoPE, or "torch"; ``sampling``, the build
        drawing random rows (kernels/sampler.py) or "torch"; ``same_bits``, "yes"
        where a token's K/V and logits have the same bits however it is computed
        (engine/exactness.py), else "no: " and why. "torch" where a kernel was
        expected is a fallback: the log at start-up says why."""
        model, fused = self.model, self.runner.fused
        decode = ("torch" if fused is None else f"plan:{fused.variant}" if isinstance(fused, PlanDecoder)
                  else "fused-bf16")
        return {"weights": "native" if model.quantized else "float",
                "dtype": str(model.dtype).removeprefix("torch."),
                "matrices": "quantized" if model.quantized else str(model.matrix_dtype).removeprefix("torch."),
                "kv_cache": str(self.kv.dtype).removeprefix("torch."),
                "matmul": model.quant_kernel.variant if model.quant_kernel is not None else "torch",
                "decode": decode,
                "threads": f"{self.compute_threads} on CPUs {format_cpulist(os.sched_getaffinity(0))}",
                "decode_threads": (f"adaptive: {', '.join(map(str, self.runner.team.sizes))} by measured step time"
                                   if self.runner.team is not None
                                   else f"{self.runner.small_batch_threads} (batches of <= {SMALL_BATCH} rows)"
                                   if fused is not None else "torch"),
                "attention": model.attention_kernel.variant if model.attention_kernel is not None else "torch",
                "row_ops": model.row_ops.variant if model.row_ops is not None else "torch",
                "sampling": self.runner.sampler.variant if self.runner.sampler is not None else "torch",
                "same_bits": same_bits(model, fused)}

    @functools.cached_property
    def fingerprint(self) -> str:
        """The build fingerprint (engine/fingerprint.py): source, torch and compiler
        versions, the model and its file's size, and the kernels that compute a step."""
        source, model, size = self.source, self.model_name, None
        if source is not None:
            model = f"{source.name}:{source.seed}" if source.kind == "tiny" else source.name
            size = source.weights_path.stat().st_size if source.weights_path is not None else None
        return fingerprint(engine_parts(self.kernels(), model, size, torch.__version__, compiler_version()))

    @property
    def prefill_chunk_tokens(self) -> int:
        """The chunk size the scheduler runs (effective_chunk_tokens)."""
        return self.scheduler.config.prefill_chunk_tokens

    @staticmethod
    def effective_chunk_tokens(config: EngineConfig, model: LlamaModel) -> int:
        """``prefill_chunk_tokens`` as this model runs it: 0 (whole prompts)
        for 16-bit activations. A bf16 chunk runs its GEMMs and SDPA with
        fewer query rows than the whole prompt does, and on an AMX CPU oneDNN
        and torch's flash attention pick other kernels (another summation
        order) below 64 rows, so greedy tokens can differ from the unchunked
        engine's; fp32 models (native weights, whose matmuls take fp32 rows, and
        dequantized fp32 weights) chunk."""
        if config.prefill_chunk_tokens and model.dtype != torch.float32:
            log.warning("prefill_chunk_tokens = %d ignored: %s activations prefill whole prompts "
                        "(chunks would not be token-exact, docs/architecture.md)",
                        config.prefill_chunk_tokens, str(model.dtype).removeprefix("torch."))
            return 0
        return config.prefill_chunk_tokens

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        cpus, team = os.sched_getaffinity(0), torch.get_num_threads()
        # torch sized its team from the CPUs of the moment it loaded: no more than there are now
        usable = len(cpus)
        default = min(team, usable)
        threads = config.compute_threads(default, usable)
        if threads != team:
            torch.set_num_threads(threads)
        reserved = usable - threads if config.num_threads is None and threads < default else 0
        log.info("computing on %d threads (CPUs %s%s)", threads, format_cpulist(cpus),
                 f", {reserved} left to the serving threads: reserved_cpus" if reserved else "")
        source = resolve_model(config.model)
        weights = source.load_weights(quantized=config.weights == "native")
        return cls(config, build_model(config, weights), source.load_tokenizer(), source.name, source)

    # ------------------------------------------------------------------ intake
    def max_blocks_per_request(self) -> int:
        return self.config.kv_blocks

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise InvalidParam if a request could never run here. Changes nothing."""
        if num_prompt_tokens < 1:
            raise InvalidParam("prompt", "prompt must contain at least one token")
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidParam("prompt", f"prompt has {num_prompt_tokens} tokens; this model's "
                               f"context is {self.max_model_len} tokens")
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise InvalidParam("max_tokens", f"max_tokens={params.max_tokens} plus the prompt's "
                               f"{num_prompt_tokens} tokens exceeds the context of {self.max_model_len} tokens")
        borrowable = self.scheduler.borrowing.cap if self.scheduler.borrowing is not None else 0
        if -(-total // self.config.block_size) > self.config.kv_blocks + borrowable:
            raise InvalidParam("max_tokens", f"{total} tokens would need more KV blocks than the "
                               f"{self.config.kv_blocks} this node has"
                               + (f" and the {borrowable} it may borrow" if borrowable else ""))
        params.check_vocab(self.model.config.vocab_size)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    kv_out: KVSink | None = None) -> None:
        """Queue a request. Raises InvalidParam (nothing queued) or ValueError on a duplicate id.

        ``kv_out``: prefill only. The prompt's KV goes to the sink layer by
        layer as the prefill computes it (its first ``kv_out.skip_blocks``
        blocks excepted); the first token is sampled here, and unless it
        ends the request, the request's one output says ``handed_off`` (the
        request is done here; its prompt's KV stays in the prefix cache)."""
        req = self._new_request(request_id, prompt_ids, params)
        req.kv_out = kv_out
        self.scheduler.add(req)

    def add_prefilled(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      reservation: Region, first_token: int, cached_tokens: int = 0
                      ) -> RequestOutput | None:
        """Run a request whose prompt KV another instance computed into
        ``reservation`` (a PROMPT ``MemPool.reserve_region`` of ``prompt_ids``, every layer
        imported) and whose first token it sampled: the request decodes from
        there. The first token's output was the prefill instance's to send:
        it is replayed into the stop conditions and text state, not emitted.
        Returns that replayed output when the token already ends the request
        here (then nothing runs), else None. The reservation belongs to the
        request from now on, whatever happens; on an exception it was
        cancelled. ``cached_tokens``: prompt tokens the prefill side served
        from its cache (reported in usage)."""
        try:
            if tuple(prompt_ids) != reservation.tokens:
                raise ValueError("add_prefilled: the reservation is for another prompt")
            if not 0 <= first_token < self.model.config.vocab_size:
                raise InvalidParam("first_token", "first token id out of the vocabulary")
            req = self._new_request(request_id, prompt_ids, params, replayed=[first_token])
        except Exception:
            reservation.cancel()
            raise
        req.prefix = reservation.commit()
        req.block_ids = reservation.all_ids
        req.num_computed = len(prompt_ids)
        req.num_cached_tokens = cached_tokens
        out = self.outputs.append(req, first_token)
        if out.finished:
            self._retire(req, cache=True)
            return out
        self.scheduler.add_prefilled(req)
        return None

    def resume_request(self, request_id: str, prompt_ids: list[int], output_ids: list[int],
                       params: SamplingParams) -> RequestOutput | None:
        """Continue a request another instance ran until it failed: its
        ``output_ids`` (the tokens the client has) are replayed into the stop
        conditions and text state, not emitted, and the request is queued to
        compute prompt and outputs (every cached prefix of them reused: a
        replica region's ``commit`` is one) and go on from the
        next token. With greedy or seeded sampling the tokens are those of a
        run that never stopped. Returns the replayed output when the tokens
        already end the request (then nothing runs), else None. Raises
        InvalidParam or ValueError (nothing queued)."""
        vocab = self.model.config.vocab_size
        # the prompt logprobs went out with token 0, which the client has: not computed again
        params = dataclasses.replace(params, prompt_logprobs=None)
        if not output_ids or any(not 0 <= t < vocab for t in output_ids):
            raise InvalidParam("output_token_ids", f"a resumed request needs its tokens, in [0, {vocab})")
        if len(output_ids) >= params.max_tokens:
            raise InvalidParam("output_token_ids", "the request already has max_tokens tokens")
        req = self._new_request(request_id, prompt_ids, params, replayed=output_ids)
        out = None
        for tok in output_ids:
            out = self.outputs.append(req, tok)
            if out.finished:
                self._retire(req, cache=False)
                return out
        self.scheduler.add(req)
        return None

    def _new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     replayed: list[int] = ()) -> Request:
        """A checked, registered request. ``replayed``: output tokens another instance
        generated (a prefill node's first token, a recovered request's tokens), over
        which its grammar state is advanced. Raises InvalidParam (nothing registered)."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParam("prompt", f"token ids must be in [0, {vocab})")
        self.check_request(len(prompt_ids), params)
        req = Request(request_id=request_id, prompt_ids=list(prompt_ids), params=params)
        if params.structured is not None:
            req.grammar = self._start_grammar(params, replayed)
        self.requests[request_id] = req
        self._generators[request_id] = make_generator(params)
        self.outputs.add(req)
        return req

    def _start_grammar(self, params: SamplingParams, replayed: list[int]):
        """``params.structured``'s grammar state, advanced over ``replayed`` (compiled
        here unless the compiler has it cached). Raises InvalidParam naming what failed."""
        try:
            state = self.grammars.start(params.structured)
        except StructuredOutputError as exc:
            raise InvalidParam(exc.param, str(exc), exc.code) from None
        if not state.replay(list(replayed)):
            raise InvalidParam("output_token_ids", f"the tokens so far do not keep to the request's grammar: "
                               f"{state.error}"[:500])
        return state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish ``request_id`` now, returning its blocks. None if unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.remove(req)
        req.finish_reason = FinishReason.ABORT
        self._retire(req, cache=False)
        return RequestOutput(request_id, [], "", True, FinishReason.ABORT.value,
                             num_prompt_tokens=len(req.prompt_ids),
                             num_output_tokens=len(req.output_ids),
                             num_cached_tokens=req.num_cached_tokens)

    def replicable(self) -> list[tuple[str, int, list[int], list[int]]]:
        """What a replica of each running request that decodes here can hold
        now: (request id, tokens computed, the tokens of its full computed
        blocks, those device block ids), oldest first. A query: nothing changes; the ids stay the
        request's until its next step."""
        bs = self.config.block_size
        out = []
        for req in self.scheduler.running:
            if req.kv_out is not None or self.scheduler._borrows(req):     # its KV is not all here
                continue
            n = min(req.num_computed // bs, len(req.block_ids))
            out.append((req.request_id, req.num_computed, req.all_ids[:n * bs], req.block_ids[:n]))
        return out

    def enable_borrowing(self, borrow, give_back, deadline_s: float) -> KVBorrowing:
        """Let requests borrow KV blocks, up to ``config.borrow_kv_blocks`` (engine/borrowing.py):
        ``borrow(blocks) -> Loan | None``, ``give_back(loan_id)``; a layer waits ``deadline_s`` for
        a remote part. Call before the first request. Raises ValueError (nothing changed)
        when the model has no paged attention kernel (a float32 model has one)."""
        if self.model.attention_kernel is None:
            raise ValueError(f"borrow_kv_blocks needs the paged attention kernel, which this {self.model.dtype} "
                             f"model does not run (dtype float32 does)")
        remote = self.runner.remote_kv = RemoteKV(deadline_s)
        self.scheduler.borrowing = KVBorrowing(self.config.block_size, self.config.borrow_kv_blocks, borrow,
                                               give_back, remote)
        return self.scheduler.borrowing

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns one output per request that got a token."""
        t0 = time.perf_counter()
        if self.pair_rule is not None:
            self.pair_rule.before(self)
        batch = self.scheduler.schedule()
        if self.pair_rule is not None and batch is not None:
            self.pair_rule.ran(self, batch)
        refused = [self._fail(req, f"its {len(req.prompt_ids) + req.params.max_tokens} tokens do not fit in this "
                                   f"node's KV blocks and no node lends the rest") for req in self.scheduler.refused]
        self.scheduler.refused.clear()
        if batch is None:
            return refused
        try:
            return refused + self._step(batch)
        finally:
            self.stats.step_seconds += time.perf_counter() - t0

    def _step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        self.stats.steps += 1
        self.stats.preemptions += len(batch.preempted)
        self.stats.host_blocks_swapped_in += batch.host_blocks_swapped_in
        self.stats.host_blocks_recomputed += batch.host_blocks_recomputed
        outs = []
        if batch.prefill:
            outs += self._execute(batch.prefill, True, batch.prefill_lens)
        if batch.decode:
            outs += self._execute(batch.decode, False)
        return outs

    def _execute(self, reqs: list[Request], is_prefill: bool, num_new: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Run one call of the runner over ``reqs`` (a prefill part computing
        ``num_new`` tokens each, or a decode part) and apply its tokens.

        A streamed prefill (``kv_out``) sends its prompt's KV in the step of its
        last chunk: after each layer of that step, the layer's KV of every
        prompt block (the earlier chunks' blocks hold theirs already) goes to
        the sink, so every layer streams once, in order, as unchunked."""
        # min_tokens bans EOS and the stop ids, except where a request's grammar is complete (EOS is
        # all it allows: the grammar decides where a structured output ends)
        banned = [(i, ids) for i, r in enumerate(reqs)
                  if (ids := self.outputs.banned_ids(r)) and not (r.grammar is not None and r.grammar.complete)]
        streamed = ([r for r, n in zip(reqs, num_new) if r.kv_out is not None and r.num_computed + n == r.num_tokens]
                    if is_prefill else [])
        on_layer = LayerStreamer(self.pool, [(self._prompt_blocks(r)[r.kv_out.skip_blocks:], r.kv_out)
                                             for r in streamed]) if streamed else None
        try:
            tokens, logprobs = self.runner.execute(reqs, is_prefill, [self._generators[r.request_id] for r in reqs],
                                                   banned, on_layer, num_new)
        except RemoteKVError as exc:
            lost = self.scheduler.borrowing.lost(reqs) if self.scheduler.borrowing is not None else []
            if not lost:
                raise
            log.warning("borrowed KV of %s lost (%s): computed again", [r.request_id for r in lost], exc)
            for req in lost:                              # the rest of the step runs again as it was
                self.scheduler.recompute(req)
            return []
        outs = []
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            if tok is None:                               # a prefill chunk short of the prompt's end
                req.num_computed += num_new[i]
                self.scheduler.cache_computed(req)
                continue
            if tok == UNSAMPLED:
                outs.append(self._fail(req, "its logits have no finite weight (a NaN or +inf, or every "
                                            "logit -inf, or no token its grammar allows): no token could be sampled"))
                continue
            if req.grammar is not None and not req.grammar.accept(tok):
                outs.append(self._fail(req, f"its grammar refused token {tok}: {req.grammar.error}"))
                continue
            if is_prefill and req.num_preemptions == 0:
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.stats.prefix_hit_tokens += req.num_cached_tokens
            req.num_computed = req.num_tokens
            req.prefilling = False
            try:
                out = self.outputs.append(req, tok)
            except Exception as exc:  # noqa: BLE001 -- a stop condition or the detokenizer: this request's alone
                log.exception("request %s failed at its token %d", req.request_id, len(req.output_ids))
                outs.append(self._fail(req, f"{type(exc).__name__}: {exc}"))
                continue
            self.stats.generation_tokens += 1
            if logprobs[i] is not None:
                out.logprobs = [logprobs[i]]
            if req.params.prompt_logprobs is not None and len(req.output_ids) == 1:
                out.prompt_logprobs = list(req.prompt_logprobs)     # with the first token, once
            if req.kv_out is not None and not out.finished:
                out.finished = out.handed_off = True      # its decode runs where its KV went
                req.finish_reason = None
            if out.finished:
                self.scheduler.remove(req)
                self._retire(req, cache=True)
            elif is_prefill:
                self.scheduler.cache_computed(req)        # its prompt, for requests arriving meanwhile
            outs.append(out)
        return outs

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End ``req`` in the step that failed it, alone: the rest of the
        batch goes on. Its blocks are returned (none of its KV cached: what
        failed may have been computed from it); the output names it and says
        why."""
        log.error("request %s failed: %s", req.request_id, why)
        self.scheduler.remove(req)
        req.finish_reason = FinishReason.ERROR
        self._retire(req, cache=False)
        return RequestOutput(req.request_id, [], "", True, FinishReason.ERROR.value,
                             num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids),
                             num_cached_tokens=req.num_cached_tokens,
                             error=f"request {req.request_id} failed in the engine: {why}", error_code=ENGINE_ERROR)

    def _prompt_blocks(self, req: Request) -> list[int]:
        return req.block_ids[:-(-len(req.prompt_ids) // self.config.block_size)]

    def _retire(self, req: Request, cache: bool) -> None:
        self.scheduler.release_memory(req, cache=cache)
        req.status = RequestStatus.FINISHED
        if req.finish_reason is None:
            self.stats.handed_off += 1
        else:
            self.stats.finished[req.finish_reason.value] += 1
        self.requests.pop(req.request_id, None)
        self._generators.pop(req.request_id, None)
        self.outputs.discard(req.request_id)

    # ------------------------------------------------------------- utilities
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[int]]:
        """Run prompts to completion (tests, benchmarks). Returns output ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, plist):
            self.add_request(rid, p, sp)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in result:
                    result[out.request_id].extend(out.new_token_ids)
        return [result[rid] for rid in ids]

    def kv_usage(self) -> dict:
        return self.pool.stats()

    def check_integrity(self) -> None:
        """Assert the MemPool invariants (every block free, owned or cached, once)."""
        self.pool.check_integrity()
