"""Engine configuration: torch-free, so daemons that never load a model
(the coordinator) can parse and validate the same config file."""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler import SchedulerConfig

DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16")
DECODE_KERNELS = ("auto", "torch")
WEIGHTS_MODES = ("native", "dequantize")


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
    num_threads: int | None = None      # torch intra-op threads; None: torch's default
    decode_kernel: str = "auto"         # auto: fused C++ bf16 decode step where the CPU has it; torch
    weights: str = "native"             # native: a GGUF's Q4_0/Q4_1/Q8_0 blocks served as they are; dequantize

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.kv_blocks < 1 or self.host_kv_blocks < 0:
            raise ValueError("block_size and kv_blocks must be >= 1, host_kv_blocks >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {', '.join(DECODE_KERNELS)}, "
                             f"got {self.decode_kernel!r}")
        if self.weights not in WEIGHTS_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {self.weights!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.block_size,
                        self.preemption_mode, self.enable_prefix_caching, self.prefill_chunk_tokens)
