"""Model shape configuration and named presets.

`ModelConfig` describes a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) or, with
`mlp="gelu"`, a GPT-style block (used by the planner to reason about Megatron's published layouts).
Large presets are only ever built on the meta device on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from framework.base.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    """Mixture-of-experts settings; `n_experts == 0` means a dense model."""

    n_experts: int = 0
    """Routed experts per MoE layer; 0 disables MoE."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_hidden: int = 0
    """Hidden size of one expert's MLP (fine-grained experts); 0 means model.ffn_hidden."""
    n_shared_experts: int = 0
    """Always-on shared experts (DeepSeek style)."""
    every_k_layers: int = 1
    """MoE replaces the MLP on every k-th layer."""
    first_dense_layers: int = 0
    """The first N layers keep a dense MLP."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """softmax: top-k of softmax probabilities (Switch/GShard/Mixtral); sigmoid: top-k of per-expert sigmoid
    affinities (DeepSeek-V3)."""
    topk_renormalize: bool | None = None
    """Rescale the k routing weights of a token to sum to 1; None: sigmoid yes (DeepSeek-V3), softmax no
    (Switch/GShard). Mixtral's softmax over the top-k logits is softmax with True."""
    aux_loss_coef: float = 0.01
    """Load-balancing loss coefficient (Switch/GShard form, Fedus et al. 2021); 0 disables it."""
    aux_loss_scope: Literal["micro_batch", "global_batch"] = "micro_batch"
    """micro_batch: expert fractions of this token group; global_batch: fractions all-reduced over the data
    ranks (same micro-batch index), probabilities local (Qiu et al. 2025)."""
    z_loss_coef: float = 0.0
    """Router z-loss coefficient (ST-MoE, Zoph et al. 2022): mean logsumexp(logits)^2; 0 disables it."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): per-step update of the routing bias; 0 disables."""
    capacity_factor: float = 0.0
    """Tokens per expert = ceil(capacity_factor * tokens * top_k / n_experts) per token group (data rank,
    micro-batch); the lowest-weight assignments above it are dropped. 0 means dropless."""
    experts_impl: Literal["auto", "loop", "grouped_mm"] = "auto"
    """Expert matmuls: a loop over local experts, or one `torch._grouped_mm` (auto: where it runs)."""
    routed_scale: float = 1.0
    """Multiplies the routed experts' combine weights (DeepSeek-V3's routed_scaling_factor, 2.5)."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x . g), a learned D -> 1 gate (Qwen2-MoE)."""
    n_groups: int = 1
    """Group-limited routing (DeepSeek-V3): the experts form n_groups equal groups, consecutive by index (with
    expert parallelism over ep = n_groups ranks, a group is one rank's experts: node-limited routing)."""
    topk_groups: int = 1
    """Groups a token may use: those with the highest sum of their top-2 expert scores; then top_k experts
    among the kept groups' experts."""

    @property
    def enabled(self) -> bool:
        return self.n_experts > 0

    @property
    def renormalize(self) -> bool:
        return self.router == "sigmoid" if self.topk_renormalize is None else self.topk_renormalize

    def validate(self) -> None:
        if self.n_experts < 0:
            raise ConfigError(f"model.moe.n_experts={self.n_experts} must be >= 0; 0 means a dense model")
        if not self.enabled:
            return
        if self.top_k < 1 or self.top_k > self.n_experts:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} must be in [1, model.moe.n_experts={self.n_experts}]; "
                f"lower top_k or add experts")
        if self.capacity_factor < 0:
            raise ConfigError(
                f"model.moe.capacity_factor={self.capacity_factor} must be > 0 (capacity mode) or 0 (dropless); "
                f"set e.g. 1.25 or 0")
        if self.every_k_layers < 1:
            raise ConfigError(f"model.moe.every_k_layers={self.every_k_layers} must be >= 1; set 1 for every layer")
        for name in ("expert_hidden", "n_shared_experts", "first_dense_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.moe.{name}={getattr(self, name)} must be >= 0; set 0 or a positive value")
        self._validate_groups()
        if not self.routed_scale > 0:
            raise ConfigError(f"model.moe.routed_scale={self.routed_scale} must be > 0; 1 leaves the weights as "
                              f"routed (DeepSeek-V3 uses 2.5)")
        if self.shared_expert_gate and not self.n_shared_experts:
            raise ConfigError("model.moe.shared_expert_gate=true gates the shared experts, but "
                              "model.moe.n_shared_experts=0; add a shared expert or set it false")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ConfigError(f"model.moe.{name}={value} must be >= 0; 0 disables it")

    def _validate_groups(self) -> None:
        if self.n_groups < 1 or self.n_experts % self.n_groups:
            raise ConfigError(f"model.moe.n_groups={self.n_groups} must be >= 1 and divide model.moe.n_experts="
                              f"{self.n_experts}; e.g. 8 for 256 experts (DeepSeek-V3), 1 for no grouping")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ConfigError(f"model.moe.topk_groups={self.topk_groups} must be in [1, n_groups={self.n_groups}]"
                              f"; DeepSeek-V3 keeps 4 of 8 groups")
        reachable = self.topk_groups * (self.n_experts // self.n_groups)
        if self.top_k > reachable:
            raise ConfigError(f"model.moe.top_k={self.top_k} exceeds the {reachable} experts that topk_groups="
                              f"{self.topk_groups} groups of {self.n_experts // self.n_groups} hold; raise "
                              f"model.moe.topk_groups or lower top_k")


@dataclass(kw_only=True, frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, sec. 2.1), read when model.attention=mla.

    Keys and values are up-projected per head from one compressed latent of `kv_lora_rank` channels, and
    position enters through a decoupled rotary key of `qk_rope_head_dim` channels shared by every head, so
    generation caches kv_lora_rank + qk_rope_head_dim numbers per token and layer. Names as DeepSeek's configs.
    """

    q_lora_rank: int = 0
    """Rank of the query's low-rank compression (DeepSeek-V3: 1536); 0: one full query projection (V2-Lite)."""
    kv_lora_rank: int = 512
    """Channels of the compressed key/value latent (the cache)."""
    qk_rope_head_dim: int = 64
    """Rotary channels per query head, and of the key shared by all heads."""
    qk_nope_head_dim: int = 128
    """Channels per head of queries and keys without position."""
    v_head_dim: int = 128
    """Channels per value head."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.mla.{name}={getattr(self, name)} must be >= 1; DeepSeek-V3 uses "
                                  f"kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128")
        if self.q_lora_rank < 0:
            raise ConfigError(f"model.mla.q_lora_rank={self.q_lora_rank} must be >= 0; 0 means no query compression")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE; e.g. 64")


ROPE_TYPES = ("none", "linear", "llama3", "yarn")


@dataclass(kw_only=True, frozen=True)
class RopeScaling:
    """RoPE context extension (models/rope.py), as transformers' rope_parameters define it."""

    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    """none: plain RoPE; linear: position interpolation; llama3: Llama 3.1's; yarn: YaRN (Peng et al. 2023)."""
    factor: float = 1.0
    """Context extension factor (HF `factor`)."""
    original_max_seq_len: int = 0
    """Pre-extension context length (HF `original_max_position_embeddings`); llama3 and yarn need it."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_seq_len / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_seq_len / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotations bounding the extrapolated (kept) dimensions."""
    beta_slow: float = 1.0
    """yarn: rotations bounding the interpolated dimensions."""
    attention_factor: float | None = None
    """yarn: cos/sin scale; None: 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio when both are set."""
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    """yarn: round the correction range to whole dimensions (transformers' default)."""

    def validate(self) -> None:
        if self.type == "none":
            return
        if not self.factor >= 1.0:
            raise ConfigError(f"model.rope_scaling.factor={self.factor} must be >= 1 for type={self.type!r}; "
                              f"e.g. 8 for Llama 3.1")
        if self.type in ("llama3", "yarn") and self.original_max_seq_len < 1:
            raise ConfigError(f"model.rope_scaling.original_max_seq_len={self.original_max_seq_len}: type="
                              f"{self.type!r} needs the pre-extension context length (e.g. 8192 for Llama 3.1)")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                              f"low_freq_factor={self.low_freq_factor} (Llama 3.1: 4 and 1)")
        if self.type == "yarn" and self.beta_fast < self.beta_slow:
            raise ConfigError(f"model.rope_scaling.beta_fast={self.beta_fast} must be >= beta_slow="
                              f"{self.beta_slow} (YaRN: 32 and 1)")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Decoder shape. Every field has the meaning it has in Llama/Megatron configs."""

    preset: str | None = None
    """Name of a preset in `models.config.PRESETS` to start from; explicit fields override it."""
    vocab_size: int = 8192
    hidden: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Grouped-query attention: key/value heads; None means n_heads (multi-head attention)."""
    kv_channels: int | None = None
    """Per-head channels of queries, keys and values (Megatron's kv_channels, HF's head_dim); None means
    hidden / n_heads. Qwen3-MoE sets 128 with hidden / n_heads = 64."""
    ffn_hidden: int | None = None
    """MLP hidden size; None means the Llama rule (8/3 * hidden rounded up to `ffn_multiple_of`)."""
    ffn_multiple_of: int = 64
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """RoPE context extension (linear / llama3 / yarn); type none by default."""
    max_seq_len: int = 4096
    qkv_bias: bool = False
    """The query, key and value projections carry biases (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key before RoPE, one weight per head channel (Qwen3, OLMo 2)."""
    tied_embeddings: bool = False
    init_std: float = 0.02
    depth_scaled_init: bool = True
    """Output projections of each block use std / sqrt(2 * n_layers) (GPT-2 / Megatron)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    attention: Literal["gqa", "mla"] = "gqa"
    """gqa: grouped-query attention (multi-head with n_kv_heads = n_heads); mla: multi-head latent attention
    shaped by `mla`."""
    mla: MLAConfig = field(default_factory=MLAConfig)
    mtp_depth: int = 0
    """Multi-token prediction modules (DeepSeek-V3, sec. 2.2): module k predicts the token k + 1 ahead of the
    main head's target, sharing the embedding and the output head; 0 disables MTP."""
    mtp_loss_weight: float = 0.3
    """lambda of DeepSeek-V3's L_MTP = lambda / D * sum_k L_k, added to the main loss (0.3, later 0.1, there)."""

    @property
    def kv_heads(self) -> int:
        if self.attention == "mla":  # every head has its own key and value, up-projected from the shared latent
            return self.n_heads
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def rope_dim(self) -> int:
        """Channels each rotary table row covers: the head dim, or MLA's decoupled rotary channels."""
        return self.mla.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden // self.n_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.hidden
        h = int(8 * self.hidden / 3)
        m = self.ffn_multiple_of
        return m * ((h + m - 1) // m)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has an MoE MLP instead of a dense one."""
        moe = self.moe
        return moe.enabled and layer >= moe.first_dense_layers and (layer + 1) % moe.every_k_layers == 0

    def validate(self) -> None:
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1; set a positive value")
        if self.attention == "mla":
            self._validate_mla()
        elif self.kv_channels is None and self.hidden % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} must divide model.hidden={self.hidden}; "
                f"choose n_heads in {[d for d in range(1, 129) if self.hidden % d == 0]}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}; "
                f"choose one of {[d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]}")
        if self.attention != "mla" and self.head_dim % 2:
            raise ConfigError(
                f"model head_dim = {self.head_dim} (kv_channels, else hidden / n_heads) must be even for RoPE; "
                f"change kv_channels, hidden or n_heads")
        if self.init_std <= 0:
            raise ConfigError(f"model.init_std={self.init_std} must be > 0; the usual value is 0.02")
        if self.moe.enabled:
            if self.mlp != "swiglu":
                raise ConfigError(f"model.mlp={self.mlp!r}: MoE experts are SwiGLU; set model.mlp=swiglu")
            if not any(self.is_moe_layer(i) for i in range(self.n_layers)):
                raise ConfigError(
                    f"model.moe.n_experts={self.moe.n_experts} but no layer is MoE (n_layers={self.n_layers}, "
                    f"first_dense_layers={self.moe.first_dense_layers}, every_k_layers={self.moe.every_k_layers}); "
                    f"lower first_dense_layers/every_k_layers or set n_experts=0")
        if self.mtp_depth < 0 or not self.mtp_loss_weight >= 0:
            raise ConfigError(f"model.mtp_depth={self.mtp_depth} and model.mtp_loss_weight={self.mtp_loss_weight} "
                              f"must be >= 0; DeepSeek-V3 uses 1 and 0.3 (mtp_depth=0 disables MTP)")

    def _validate_mla(self) -> None:
        self.mla.validate()
        if self.n_kv_heads not in (None, self.n_heads):
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} with model.attention=mla: MLA gives every head "
                              f"its own key and value from the shared latent; leave n_kv_heads unset")
        if self.mlp == "gelu":
            raise ConfigError("model.attention=mla is DeepSeek's bias-free block; set model.mlp=swiglu")


def _p(**kw: object) -> dict[str, object]:
    return kw


_LLAMA31 = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

PRESETS: dict[str, dict[str, object]] = {
    # Test and smoke sizes (CPU).
    "test-tiny": _p(vocab_size=512, hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=256),
    "smoke-3m": _p(vocab_size=4096, hidden=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_hidden=512,
                   max_seq_len=512, tied_embeddings=True),
    "test-moe": _p(vocab_size=512, hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=256,
                   moe=dict(n_experts=4, top_k=2, expert_hidden=64)),
    "test-mla": _p(vocab_size=512, hidden=64, n_layers=4, n_heads=4, ffn_hidden=128, max_seq_len=256,
                   attention="mla", mla=dict(q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8,
                                             qk_nope_head_dim=16, v_head_dim=12)),
    "smoke-moe": _p(vocab_size=4096, hidden=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384,
                    max_seq_len=512, tied_embeddings=True,
                    moe=dict(n_experts=8, top_k=2, expert_hidden=128, n_shared_experts=1, first_dense_layers=1,
                             capacity_factor=1.25, z_loss_coef=1e-3)),
    # Tiny CPU members of each Hugging Face MoE family (framework/checkpoint/hf_moe.py maps them both ways).
    "test-mixtral": _p(vocab_size=512, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=256,
                       rope_theta=1e6, moe=dict(n_experts=4, top_k=2, expert_hidden=64, topk_renormalize=True)),
    "test-qwen2-moe": _p(vocab_size=512, hidden=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                         max_seq_len=256, rope_theta=1e6, qkv_bias=True,
                         moe=dict(n_experts=8, top_k=2, expert_hidden=32, n_shared_experts=2, shared_expert_gate=True,
                                  first_dense_layers=1, aux_loss_coef=0.001)),
    "test-qwen3-moe": _p(vocab_size=512, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, kv_channels=32,
                         qk_norm=True, ffn_hidden=128, max_seq_len=256, rope_theta=1e6, norm_eps=1e-6,
                         moe=dict(n_experts=8, top_k=2, expert_hidden=32, topk_renormalize=True, aux_loss_coef=0.001)),
    "test-deepseek-v3": _p(vocab_size=512, hidden=64, n_layers=3, n_heads=4, ffn_hidden=128, max_seq_len=256,
                           norm_eps=1e-6, attention="mla", mla=dict(q_lora_rank=32, kv_lora_rank=24,
                                                                    qk_rope_head_dim=8, qk_nope_head_dim=16,
                                                                    v_head_dim=12),
                           moe=dict(n_experts=8, top_k=2, expert_hidden=32, n_shared_experts=1, first_dense_layers=1,
                                    router="sigmoid", n_groups=4, topk_groups=2, routed_scale=2.5,
                                    aux_loss_coef=0.0001, bias_update_rate=0.001)),
    # Llama shapes (meta device only on a laptop).
    "llama-1b": _p(vocab_size=128256, hidden=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                   rope_theta=500000.0, max_seq_len=8192, tied_embeddings=True),
    "llama2-7b": _p(vocab_size=32000, hidden=4096, n_layers=32, n_heads=32, ffn_hidden=11008, max_seq_len=4096),
    "llama3-8b": _p(vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                    rope_theta=500000.0, max_seq_len=8192),
    "llama2-70b": _p(vocab_size=32000, hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                     max_seq_len=4096),
    "llama3-70b": _p(vocab_size=128256, hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                     rope_theta=500000.0, max_seq_len=8192),
    # Llama 3.1 (Dubey et al. 2024): the Llama 3 shapes at 128k context, RoPE scaled llama3-style (factor 8).
    "llama3.1-8b": _p(vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                      rope_theta=500000.0, max_seq_len=131072, rope_scaling=_LLAMA31),
    "llama3.1-70b": _p(vocab_size=128256, hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                       rope_theta=500000.0, max_seq_len=131072, rope_scaling=_LLAMA31),
    "llama3.1-405b": _p(vocab_size=128256, hidden=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                        rope_theta=500000.0, max_seq_len=131072, rope_scaling=_LLAMA31),
    "llama3-405b": _p(vocab_size=128256, hidden=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                      rope_theta=500000.0, max_seq_len=8192),
    # MoE shapes for the planner (meta device only). Mixtral 8x7B (Jiang et al. 2024): softmax over the top-2
    # logits, i.e. renormalized top-2 softmax weights; 46.7B parameters, 12.9B active.
    "mixtral-8x7b": _p(vocab_size=32000, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                       rope_theta=1e6, max_seq_len=32768,
                       moe=dict(n_experts=8, top_k=2, expert_hidden=14336, topk_renormalize=True)),
    # Mixtral 8x22B (Mistral AI 2024): 141B total, 39B active.
    "mixtral-8x22b": _p(vocab_size=32768, hidden=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_hidden=16384,
                        rope_theta=1e6, max_seq_len=65536,
                        moe=dict(n_experts=8, top_k=2, expert_hidden=16384, topk_renormalize=True)),
    # Qwen2-57B-A14B (Qwen team 2024): q/k/v biases, 64 experts top-8 (softmax, not renormalized) and a shared
    # expert 8 experts wide behind a sigmoid gate; 57B total, 14B active.
    "qwen2-57b-a14b": _p(vocab_size=151936, hidden=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_hidden=18944,
                         rope_theta=1e6, max_seq_len=32768, norm_eps=1e-6, qkv_bias=True,
                         moe=dict(n_experts=64, top_k=8, expert_hidden=2560, n_shared_experts=8,
                                  shared_expert_gate=True, aux_loss_coef=0.001)),
    # Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen team 2025): q/k norms, head_dim 128 wider than hidden / heads,
    # 128 experts top-8 renormalized, no shared expert.
    "qwen3-30b-a3b": _p(vocab_size=151936, hidden=2048, n_layers=48, n_heads=32, n_kv_heads=4, kv_channels=128,
                        qk_norm=True, ffn_hidden=6144, rope_theta=1e6, max_seq_len=40960, norm_eps=1e-6,
                        moe=dict(n_experts=128, top_k=8, expert_hidden=768, topk_renormalize=True,
                                 aux_loss_coef=0.001)),
    "qwen3-235b-a22b": _p(vocab_size=151936, hidden=4096, n_layers=94, n_heads=64, n_kv_heads=4, kv_channels=128,
                          qk_norm=True, ffn_hidden=12288, rope_theta=1e6, max_seq_len=40960, norm_eps=1e-6,
                          moe=dict(n_experts=128, top_k=8, expert_hidden=1536, topk_renormalize=True,
                                   aux_loss_coef=0.001)),
    # DeepSeek-V3 (DeepSeek-AI 2024): multi-head latent attention (q/kv LoRA ranks 1536/512, 128 + 64 rotary
    # query-key channels, 128 value channels per head), 3 dense layers, then 256 fine-grained experts + 1 shared,
    # top-8 sigmoid routing limited to 4 of 8 expert groups (node-limited with ep = 8 groups), weights x 2.5,
    # aux-loss-free bias balancing and a tiny sequence aux loss: 671.0B parameters as the paper's model (685B with
    # its one MTP module, model.mtp_depth=1). Pretraining at 4K context, before YaRN's extension.
    "deepseek-v3-671b": _p(vocab_size=129280, hidden=7168, n_layers=61, n_heads=128, ffn_hidden=18432,
                           max_seq_len=4096, norm_eps=1e-6, attention="mla",
                           mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                    v_head_dim=128),
                           moe=dict(n_experts=256, top_k=8, expert_hidden=2048, n_shared_experts=1,
                                    first_dense_layers=3, router="sigmoid", n_groups=8, topk_groups=4,
                                    routed_scale=2.5, aux_loss_coef=0.0001, bias_update_rate=0.001)),
    # A ~535B-class fine-grained MoE (the size class users read about): 128 experts, top-8, 1 shared, 2 dense
    # layers, GQA; ~536B total, ~44B active per token.
    "moe-535b": _p(vocab_size=131072, hidden=6144, n_layers=64, n_heads=48, n_kv_heads=8, ffn_hidden=16384,
                   rope_theta=500000.0, max_seq_len=8192,
                   moe=dict(n_experts=128, top_k=8, expert_hidden=3584, n_shared_experts=1, first_dense_layers=2,
                            router="sigmoid", aux_loss_coef=0.0001, bias_update_rate=0.001)),
    # GPT-3 175B (Brown et al. 2020): GELU MLP of 4 x hidden, untied embeddings.
    "gpt3-175b": _p(vocab_size=51200, hidden=12288, n_layers=96, n_heads=96, mlp="gelu", norm="layernorm",
                    max_seq_len=2048),
}


def _resolve_preset(name: str) -> dict[str, object]:
    if name not in PRESETS:
        import difflib

        close = difflib.get_close_matches(name, list(PRESETS), n=3)
        raise ConfigError(
            f"model.preset={name!r} is not a known preset; "
            + (f"did you mean {', '.join(close)}? " if close else "")
            + f"known: {', '.join(sorted(PRESETS))} (`tessera presets` shows their shapes)")
    return dict(PRESETS[name])


def model_config(preset: str | None = None, **overrides: object) -> ModelConfig:
    """A ModelConfig from a preset name plus explicit field overrides (validated)."""
    from framework.base.yaml_config import deep_merge, from_dict

    data: dict[str, object] = _resolve_preset(preset) if preset else {}
    data = deep_merge(data, overrides)
    if preset:
        data["preset"] = preset
    cfg = from_dict(ModelConfig, data, "model")
    cfg.moe.validate()
    cfg.rope_scaling.validate()
    cfg.validate()
    return cfg


__all__ = ["PRESETS", "ROPE_TYPES", "MLAConfig", "MoEConfig", "ModelConfig", "RopeScaling", "model_config"]
