"""Model configuration: the shape of a Llama-family decoder, and what sets an
architecture of that family apart.

One frozen dataclass shared by the loaders (GGUF, Hugging Face directory), the
decoder and the KV memory (which sizes its blocks from ``num_kv_heads`` and
``head_dim``). Field names follow Hugging Face's ``LlamaConfig`` so a
``config.json`` maps onto it with a rename table, not code.

The architectures kvd serves (``ARCHITECTURES``: llama, qwen2, qwen3, gemma3,
phi3) are one decoder; the fields after ``rope_scaling`` are what differs
between them, as data: llama.py turns them into the layer plan
(``layer_steps``) and the per-layer attention (window, RoPE base). Their
defaults are Llama's. Norm weights are always the multiplier itself: a
checkpoint storing Gemma's ``w`` for ``(1 + w)`` has 1 added at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# general.architecture values (GGUF) the one decoder serves
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
ACTIVATIONS = ("silu", "gelu_tanh")       # the gate's activation: SwiGLU or GeGLU (tanh GELU)


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
    # ---- what an architecture changes (defaults: Llama's)
    architecture: str = "llama"
    qkv_bias: bool = False                # biases on q, k, v (qwen2)
    qk_norm: bool = False                 # RMSNorm over each q and k head before RoPE (qwen3, gemma3)
    sandwich_norms: bool = False          # RMSNorm on the attention and MLP outputs before the residual (gemma3)
    activation: str = "silu"              # ACTIVATIONS
    embed_scale: float = 1.0              # embeddings times this (gemma3: sqrt(hidden_size))
    # keys a query at position p sees on a sliding layer: p - sliding_window < k <= p
    sliding_window: int | None = None
    # None: every layer slides (when sliding_window is set); n: every n-th layer is global (gemma3: 6)
    global_layer_every: int | None = None
    rope_local_theta: float | None = None     # RoPE base of sliding layers (None: rope_theta)
    query_pre_attn_scalar: float | None = None    # attention scale is this ** -0.5 (None: head_dim)
    attn_logit_softcap: float | None = None   # scores become c * tanh(scores / c)
    final_logit_softcap: float | None = None  # logits become c * tanh(logits / c)

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
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: use one of {', '.join(ACTIVATIONS)}")
        for name in ("sliding_window", "global_layer_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"LlamaConfig.{name} must be a positive int or None, got {value!r}")
        for name in ("embed_scale", "rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcap",
                     "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {value!r}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (keys it attends to, the query's own
        included), or None for a global layer."""
        if self.sliding_window is None:
            return None
        if self.global_layer_every is not None and (layer + 1) % self.global_layer_every == 0:
            return None
        return self.sliding_window

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of layer ``layer`` (sliding layers may have their own)."""
        if self.layer_window(layer) is not None and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
            + (4 if self.sandwich_norms else 2) * self.hidden_size    # norms
            + (self.q_size + 2 * self.kv_size if self.qkv_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
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
