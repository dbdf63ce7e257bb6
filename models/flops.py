"""Parameter counts and training FLOPs per token — the one definition observability and the planner reuse.

Convention (Kaplan et al. 2020; PaLM appendix B; torchtitan): training FLOPs per token
    6 * N + 12 * n_layers * hidden * seq_len
where N counts the parameters a token's matmuls touch, excluding the input embedding (a lookup, no FLOPs) but
including the output head, and for MoE only the routed top-k and shared experts. The attention term counts
Q·K^T and A·V for every key position; with `causal=True` it is halved, since a causal kernel skips the masked
half.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part of the model."""

    embedding: int
    head: int
    attention: int
    """All layers' attention projections (q, k, v, o; MLA's with its latent norms), MTP blocks included."""
    dense_mlp: int
    """All dense-MLP layers' weights (and MTP's eh_proj)."""
    experts: int
    """All routed experts of all MoE layers."""
    active_experts: int
    """Routed experts one token touches (top_k per MoE layer) plus shared experts."""
    router: int
    norms: int

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.attention + self.dense_mlp + self.experts + self.router + self.norms

    @property
    def active_non_embedding(self) -> int:
        """N of the FLOPs formula: what one token's matmuls touch, without the input embedding."""
        return self.head_flop_params + self.attention + self.dense_mlp + self.active_experts + self.router + self.norms

    head_flop_params: int = 0


def _mlp_params(cfg: ModelConfig, hidden_ffn: int) -> int:
    n_mats = 3 if cfg.mlp == "swiglu" else 2
    bias = 0 if cfg.mlp == "swiglu" else hidden_ffn + cfg.hidden  # GPT blocks carry biases
    return n_mats * cfg.hidden * hidden_ffn + bias


def mla_params(cfg: ModelConfig, tp: int = 1) -> int:
    """One MLA layer's parameters on one tp rank: down-projections and latent norms replicated, the
    up-projections and o_proj split by heads (framework/parallel/tensor.py)."""
    d, h, m = cfg.hidden, cfg.n_heads, cfg.mla
    replicated = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    split = m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d
    if m.q_lora_rank:
        replicated += d * m.q_lora_rank + m.q_lora_rank
        split += m.q_lora_rank * h * m.qk_head_dim
    else:
        split += d * h * m.qk_head_dim
    return replicated + split // tp


def _attention_params(cfg: ModelConfig) -> int:
    """One layer's attention projections (MLA: with its two latent norms)."""
    d, hd, h = cfg.hidden, cfg.head_dim, cfg.n_heads
    if cfg.attention == "mla":
        return mla_params(cfg)
    attn_one = d * h * hd + 2 * d * cfg.kv_heads * hd + h * hd * d
    if cfg.mlp == "gelu":  # GPT blocks: qkv and output biases
        attn_one += h * hd + 2 * cfg.kv_heads * hd + d
    elif cfg.qkv_bias:  # Qwen2: q/k/v biases only
        attn_one += h * hd + 2 * cfg.kv_heads * hd
    if cfg.qk_norm:
        attn_one += 2 * hd
    return attn_one


def attention_score_dims(cfg: ModelConfig, executed: bool = False) -> tuple[int, int]:
    """(query/key channels, value channels) summed over the heads: what Q·K^T and A·V contract per position.

    `executed`: what the kernels run rather than the model's count: MLA's values are zero-padded to the query/key
    head dim before the fused attention kernels (models/mla.py), so A·V contracts qk channels too."""
    if cfg.attention == "mla":
        v = cfg.mla.qk_head_dim if executed else cfg.mla.v_head_dim
        return cfg.n_heads * cfg.mla.qk_head_dim, cfg.n_heads * v
    return cfg.n_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Exact parameter counts of `models.decoder.Decoder(cfg)` (checked against the built module in tests)."""
    d = cfg.hidden
    attn_one = _attention_params(cfg)
    norm_one = d if cfg.norm == "rmsnorm" else 2 * d
    dense_mlp = experts = active = router = 0
    moe = cfg.moe
    expert_ffn = moe.expert_hidden or cfg.ffn
    n_blocks = cfg.n_layers + cfg.mtp_depth  # each multi-token prediction depth adds one block (models/mtp.py)
    for layer in range(n_blocks):
        if cfg.is_moe_layer(layer):
            experts += moe.n_experts * _mlp_params(cfg, expert_ffn)
            shared = moe.n_shared_experts * _mlp_params(cfg, expert_ffn)
            dense_mlp += shared
            active += moe.top_k * _mlp_params(cfg, expert_ffn)
            router += d * moe.n_experts + (d if moe.shared_expert_gate else 0)
        else:
            dense_mlp += _mlp_params(cfg, cfg.ffn)
    dense_mlp += cfg.mtp_depth * 2 * d * d  # MTP's eh_proj
    head = cfg.vocab_size * d
    return ParamCounts(
        embedding=cfg.vocab_size * d,
        head=0 if cfg.tied_embeddings else head,
        attention=n_blocks * attn_one,
        dense_mlp=dense_mlp,
        experts=experts,
        active_experts=active,
        router=router,
        norms=(2 * n_blocks + 1 + 3 * cfg.mtp_depth) * norm_one,  # MTP: enorm, hnorm, its final norm
        head_flop_params=head * (1 + cfg.mtp_depth),  # the shared head runs once more per MTP depth
    )


def num_params(cfg: ModelConfig) -> int:
    """Total trainable parameters (tied embeddings counted once)."""
    return param_counts(cfg).total


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = False, recompute: bool = False,
                    executed: bool = False) -> float:
    """Training FLOPs (forward + backward) per token.

    Args:
        cfg: model shape.
        seq_len: tokens per sequence (the attention term grows with it).
        causal: halve the attention term, as a causal kernel skips the masked half.
        recompute: hardware FLOPs with full activation recomputation of the blocks (one extra forward of every
            layer: 8N instead of 6N and 16·L·h·s instead of 12·L·h·s; the output head is not recomputed and stays
            at 6·V·h), the "HFU" convention of Narayanan et al. 2021: 96·B·s·l·h²(1 + s/6h + V/(16·l·h)).
        executed: the attention core as the kernels run it (`attention_score_dims`): the planner's step time and
            hardware FLOPs; model FLOPs (the MFU convention) leave it False.
    """
    n = param_counts(cfg).active_non_embedding
    qk, v = attention_score_dims(cfg, executed)
    attn: float = 6 * (cfg.n_layers + cfg.mtp_depth) * (qk + v) * seq_len  # 12·L·h·s for dense heads (qk = v = h)
    if causal:
        attn /= 2
    if recompute:
        head = param_counts(cfg).head_flop_params
        return 8 * n - 2 * head + attn * 4 / 3
    return 6 * n + attn


MFU_CAUSAL = False
"""The MFU convention: attention counted whole (12·L·h·s, no causal halving), as PaLM, Megatron and torchtitan
publish. The observer's `mfu`, the planner's MFU and bench/gpu_bench.py all count through `mfu_flops_per_token`."""


def mfu_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per token by Tessera's MFU convention (`MFU_CAUSAL`)."""
    return flops_per_token(cfg, seq_len, causal=MFU_CAUSAL)
