"""Engine configuration: torch-free, so daemons that never load a model
(the coordinator) can parse and validate the same config file."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.cpus import parse_cpulist
from engine.memory.caching_cost import CachingCostModel
from engine.scheduler import SchedulerConfig

DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16")
# reserved_cpus applies from this many usable CPUs: below it a reserved CPU costs the
# compute team too large a share (half of a 2-CPU host's decode speed)
RESERVE_FROM_CPUS = 8
DECODE_KERNELS = ("auto", "torch")
# decode_threads = 0 calibrates the small-batch decode team from this many compute threads
# (below, every thread: the fewer there are, the more each one's share of the weights weighs)
CALIBRATE_FROM_THREADS = 8
WEIGHTS_MODES = ("native", "dequantize")
# auto: the KV cache in the model's dtype; float16: an fp32 model's K/V stored as IEEE halves
KV_CACHE_DTYPES = ("auto", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "auto"                 # auto | float32 | bfloat16 (see resolve_dtype)
    block_size: int = 16
    kv_blocks: int = 2048               # device tier
    host_kv_blocks: int = 2048          # host tier (swap space, demoted cache)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    prefill_chunk_tokens: int = 256     # chunked prefill: most prompt tokens per step; 0: off
    max_model_len: int | None = None    # None: the model's max_position_embeddings
    preemption_mode: str = "swap"
    enable_prefix_caching: bool = True
    num_threads: int | None = None      # torch intra-op threads; None: torch's default (see compute_threads)
    reserved_cpus: int = 1              # CPUs left to the serving threads when num_threads is None
    decode_threads: int = 0             # threads of a one-call decode step of <= 4 rows; 0: calibrated
    decode_kernel: str = "auto"         # auto: fused C++ bf16 decode step where the CPU has it; torch
    weights: str = "native"             # native: the file's formats (Q4_0/Q4_1/Q8_0 blocks, 16-bit matrices); dequantize
    kv_cache_dtype: str = "auto"        # auto: the model's dtype; float16: half the KV bytes of an fp32 model
    batch_invariant: bool = False       # float matrices prefill on the decode kernel: a token's bits on every path
    cpus: str = ""                      # a Linux CPU list the daemon binds the engine to; "": every CPU it may use
    # A prefix hit with host-tier blocks: "cost" (swap in or recompute, the
    # cheaper by the caching cost model below), "swap" (always), "recompute" (always)
    host_hit_policy: str = "cost"
    # the caching cost model's coefficients (engine/memory/caching_cost.py), seconds,
    # fitted by tools/bench/engine/bench_caching_cost.py (docs/benchmarks.md): see etc/kvd.toml
    cost_token_s: float = 3.32e-3
    cost_attention_s: float = 1.6e-6
    cost_fixed_s: float = 0.0509
    cost_swap_block_s: float = 1.1e-4
    # a `kvd profile` JSON file of this model and CPU whose measured costs replace the cost_* defaults
    # above (kvd/config.py applies it; a cost_* set explicitly still wins); "": none
    profile: str = ""
    # most device KV blocks this node lends to other nodes at once (Infinite-LLM's
    # rManager cap, engine/memory/rmanager.py); 0: lending off
    lend_kv_blocks: int = 0
    # most device KV blocks this node's requests borrow from other nodes at once
    # (engine/borrowing.py); 0: borrowing off, a request must fit in kv_blocks
    borrow_kv_blocks: int = 0

    def __post_init__(self) -> None:
        _check_one_of("dtype", self.dtype, DTYPE_NAMES)
        if self.block_size < 1 or self.kv_blocks < 1 or self.host_kv_blocks < 0:
            raise ValueError("block_size and kv_blocks must be >= 1, host_kv_blocks >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        _check_one_of("decode_kernel", self.decode_kernel, DECODE_KERNELS)
        _check_one_of("weights", self.weights, WEIGHTS_MODES)
        _check_one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be true or false, got {self.batch_invariant!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.cpus:
            parse_cpulist(self.cpus)
        if self.reserved_cpus < 0:
            raise ValueError("reserved_cpus must be >= 0")
        if self.decode_threads < 0:
            raise ValueError("decode_threads must be >= 0")
        if not 0 <= self.lend_kv_blocks <= self.kv_blocks:
            raise ValueError(f"lend_kv_blocks must be between 0 and kv_blocks ({self.kv_blocks}), "
                             f"got {self.lend_kv_blocks}")
        if isinstance(self.borrow_kv_blocks, bool) or not isinstance(self.borrow_kv_blocks, int) \
                or self.borrow_kv_blocks < 0:
            raise ValueError(f"borrow_kv_blocks must be an int >= 0, got {self.borrow_kv_blocks!r}")
        if self.borrow_kv_blocks and self.dtype in ("bfloat16", "bf16"):
            raise ValueError("borrow_kv_blocks needs dtype float32 (attention over borrowed blocks runs on "
                             "the float32 paged attention kernel)")
        for name in ("cost_token_s", "cost_attention_s", "cost_fixed_s", "cost_swap_block_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (seconds), got {v!r}")
        self.scheduler_config(self.prefill_chunk_tokens)

    def compute_threads(self, default: int, usable_cpus: int) -> int:
        """The threads the engine computes with: ``num_threads`` where set. Else
        ``default`` (torch's choice, one per physical core), less ``reserved_cpus``
        where that would take every one of the ``usable_cpus`` this process may run
        on and there are at least RESERVE_FROM_CPUS of them: a compute team spins on
        its CPUs between barriers, so the event loop, the transports and a local
        client would take a CPU from one of its threads, stalling the whole team
        (vLLM's CPU backend keeps a core for its serving process likewise)."""
        if self.num_threads is not None:
            return self.num_threads
        if default >= usable_cpus >= RESERVE_FROM_CPUS:
            return max(1, usable_cpus - self.reserved_cpus)
        return default

    def decode_team_candidates(self, threads: int) -> list[int]:
        """The team sizes a one-call decode step of at most 4 rows may run on, given
        ``threads`` compute threads, largest first: ``decode_threads`` (capped) where set;
        else, from CALIBRATE_FROM_THREADS threads, every thread, three quarters and half
        of them (the engine times each at start and keeps the fastest); else every thread."""
        if self.decode_threads:
            return [min(self.decode_threads, threads)]
        if threads < CALIBRATE_FROM_THREADS:
            return [threads]
        return sorted({threads, (3 * threads + 3) // 4, (threads + 1) // 2}, reverse=True)

    def caching_cost(self) -> CachingCostModel:
        """The cost model of the ``cost_*`` coefficients."""
        return CachingCostModel(token_s=self.cost_token_s, attention_s=self.cost_attention_s,
                                fixed_s=self.cost_fixed_s, swap_block_s=self.cost_swap_block_s)

    def scheduler_config(self, prefill_chunk_tokens: int) -> SchedulerConfig:
        """The scheduler's share of this config, chunking as the model runs it
        (``LLMEngine.effective_chunk_tokens``). Raises ValueError if invalid."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size, preemption_mode=self.preemption_mode,
            enable_prefix_caching=self.enable_prefix_caching, prefill_chunk_tokens=prefill_chunk_tokens,
            host_hit_policy=self.host_hit_policy,
            caching_cost=self.caching_cost() if self.host_hit_policy == "cost" else None)


def _check_one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
