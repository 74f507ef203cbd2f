"""Model configuration: the shape of a Llama-family decoder.

One frozen dataclass shared by the loaders (GGUF, Hugging Face directory), the
decoder and the KV memory (which sizes its blocks from ``num_kv_heads`` and
``head_dim``). Field names follow Hugging Face's ``LlamaConfig`` so a
``config.json`` maps onto it with a rename table, not code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Llama-3 style RoPE scaling: {"rope_type": "llama3", "factor": ..., ...} or None.
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)   # qkv
            + self.q_size * self.hidden_size                      # o
            + 3 * self.hidden_size * self.intermediate_size       # gate, up, down
            + 2 * self.hidden_size                                # two norms
        )
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        return emb + head + self.num_layers * per_layer + self.hidden_size


def tiny_config(vocab_size: int = 49152, **overrides) -> LlamaConfig:
    """A tiny random-initialised Llama for fast tests (GQA, 4 layers)."""
    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
                tie_word_embeddings=True)
    base.update(overrides)
    return LlamaConfig(**base)
