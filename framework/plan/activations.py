"""Activation bytes saved for backward, per transformer layer and per pipeline stage.

Two formulas, both plain functions of the shape:

* `tessera_layer_bytes` — Tessera's own block (`models.layers`: RMSNorm or LayerNorm, grouped-query attention
  with RoPE, SDPA reading the key/value heads where they lie (enable_gqa), SwiGLU or GELU MLP), derived tensor by
  tensor from what autograd actually keeps (`tessera_layer_terms` lists them by name) and checked byte for byte
  against saved-tensor measurements on CPU (`bench.plan_measure`, tests/plan).
* `korthikanti_layer_bytes` — Korthikanti et al. 2022 (Reducing activation recomputation in large transformer
  models), sbh(34 + 5as/h) for a GPT block with 16-bit activations and dropout, the published reference.

Symbols: s sequence, b micro-batch, h hidden, a query heads, f MLP hidden, t tensor-parallel degree, p bytes of
one activation element (2 for bf16, 4 for fp32). Every count is for one rank and one micro-batch.

Recompute modes (they must match the engine's activation checkpointing):
  none       everything autograd saves;
  selective  the selective-checkpoint policy "save the outputs of aten.mm/addmm and of the fused SDPA kernels,
             recompute the rest" (norms, RoPE, the key/value repeat, activations, and the math-SDPA core);
  full       only the block input is kept; the whole block is recomputed in backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.config import ModelConfig

Recompute = Literal["none", "selective", "full"]
AttnKernel = Literal["flash", "math"]
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class SavedTerm:
    """One tensor autograd keeps for backward: its name, bytes on one rank, and whether selective keeps it."""

    name: str
    nbytes: int
    selective: bool = False
    """Saved under the selective policy (an mm/addmm or fused-SDPA output, or the block input)."""


def _norm_terms(prefix: str, cfg: ModelConfig, rows: int, width: int, p: int) -> list[SavedTerm]:
    """What one pre-norm keeps, on `rows` tokens of `width` channels.

    RMSNorm (models.layers.RMSNorm) computes in fp32: it saves its fp32 input (the input itself in fp32 runs,
    an upcast copy otherwise), the fp32 reciprocal RMS per token, and the normalized tensor cast back to the
    activation dtype (kept by the multiply with the weight). nn.LayerNorm keeps its input, mean and rstd.
    """
    if cfg.norm == "rmsnorm":
        return [SavedTerm(f"{prefix}.input_fp32", FP32 * rows * width), SavedTerm(f"{prefix}.rstd", FP32 * rows),
                SavedTerm(f"{prefix}.normalized", p * rows * width)]
    return [SavedTerm(f"{prefix}.input", p * rows * width), SavedTerm(f"{prefix}.mean_rstd", 2 * FP32 * rows)]


def tessera_layer_terms(cfg: ModelConfig, seq: int, micro_batch: int, *, tp: int = 1, sp: bool = False,
                        act_bytes: int = 2, kernel: AttnKernel = "flash") -> list[SavedTerm]:
    """Every tensor one dense Tessera block saves for backward (no recompute), on one rank.

    Args:
        cfg: model shape (dense layers; MoE layers are approximated by `moe_mlp_terms`).
        seq: sequence length s.
        micro_batch: micro-batch size b.
        tp: tensor-parallel degree; attention heads, kv heads and the MLP hidden are split t ways.
        sp: sequence parallel: the norm region is split t ways along the sequence. The input of the column-
            parallel projections is the all-gathered (full) tensor, which DTensor's matmul saves in full.
        act_bytes: bytes of one activation element (2 bf16/fp16, 4 fp32).
        kernel: "flash" (the flash/efficient SDPA kernels on CUDA, and the flash kernel PyTorch uses on CPU)
            saves q, k, v, out and the fp32 logsumexp — no s x s matrix; "math" (the composite SDPA) saves
            the scaled q and k, v, the s x s attention probabilities (all fp32, also for 16-bit inputs) and
            writes a new output for `wo`.

    Returns:
        The saved tensors in forward order; their `nbytes` sum to the layer's activation bytes.
    """
    p, s, b, h, t = act_bytes, seq, micro_batch, cfg.hidden, tp
    rows = s * b
    norm_rows = rows // t if sp else rows
    a_t = cfg.n_heads // t
    h_t = a_t * cfg.head_dim
    # SDPA reads the key/value heads where they lie (enable_gqa): the fused kernels save k and v kv-heads wide
    # (one replicated head per rank when tp > n_kv_heads); the math kernel repeats them to the query heads.
    kv_t = max(cfg.kv_heads // t, 1) * cfg.head_dim
    terms = _norm_terms("attention_norm", cfg, norm_rows, h, p)
    terms.append(SavedTerm("attention.input", p * rows * h))  # shared by wq, wk, wv
    if cfg.attention == "mla":
        terms += mla_terms(cfg, seq, micro_batch, tp, p, kernel)
    elif kernel == "flash":
        terms += [SavedTerm("attention.q", p * rows * h_t), SavedTerm("attention.k", p * rows * kv_t),
                  SavedTerm("attention.v", p * rows * kv_t),
                  SavedTerm("attention.out", p * rows * h_t, selective=True),  # also wo's input (same storage)
                  SavedTerm("attention.logsumexp", FP32 * a_t * s * b, selective=True)]
    else:
        # The composite kernel upcasts 16-bit q, k, v to fp32 (measured on CPU), so its core is fp32 throughout.
        m = max(p, FP32)
        terms += [SavedTerm("attention.q_scaled", m * rows * h_t), SavedTerm("attention.k_scaled", m * rows * h_t),
                  SavedTerm("attention.v", m * rows * h_t),
                  SavedTerm("attention.probs", m * a_t * s * s * b),
                  SavedTerm("attention.wo_input", p * rows * h_t)]
    terms += _norm_terms("ffn_norm", cfg, norm_rows, h, p)
    terms.append(SavedTerm("feed_forward.input", p * rows * h))  # shared by w1 (and w3)
    terms += mlp_terms(cfg, rows, cfg.ffn // t, p)
    return terms


def mla_terms(cfg: ModelConfig, seq: int, micro_batch: int, tp: int, p: int, kernel: AttnKernel
              ) -> list[SavedTerm]:
    """What multi-head latent attention (models/mla.py) saves beyond its input, no recompute, on one rank.

    The latent norms (RMSNorm, replicated under TP, on every token: the attention input arrives whole) keep
    their fp32 input, rstd and normalized tensor, and the up-projection keeps the norm's output. The kv norm's
    input is a view of kv_a_proj_with_mqa's output, so in fp32 runs that whole (C + R)-wide output stays; a
    16-bit run keeps the C-wide fp32 upcast instead. The kernels see q and k of N + R channels per head and
    values zero-padded to that width (flash: q, k, v, out, logsumexp; math: scaled copies and fp32
    probabilities); o_proj keeps the V-wide slice of the output, copied contiguous.
    Measured on CPU byte for byte (tests/plan/test_plan_activations.py).
    """
    m, rows = cfg.mla, seq * micro_batch
    heads = cfg.n_heads // tp
    e = heads * m.qk_head_dim
    out: list[SavedTerm] = []
    if m.q_lora_rank:
        out += _latent_norm("attention.q_a_layernorm", rows, m.q_lora_rank, m.q_lora_rank, p)
    kv_in = m.kv_lora_rank + (m.qk_rope_head_dim if p == FP32 else 0)
    out += _latent_norm("attention.kv_a_layernorm", rows, m.kv_lora_rank, kv_in, p)
    if kernel == "flash":
        out += [SavedTerm("attention.q", p * rows * e), SavedTerm("attention.k", p * rows * e),
                SavedTerm("attention.v_padded", p * rows * e),
                SavedTerm("attention.out", p * rows * e, selective=True),
                SavedTerm("attention.logsumexp", FP32 * heads * rows, selective=True)]
    else:
        f = max(p, FP32)
        out += [SavedTerm("attention.q_scaled", f * rows * e), SavedTerm("attention.k_scaled", f * rows * e),
                SavedTerm("attention.v_padded", f * rows * e),
                SavedTerm("attention.probs", f * heads * seq * seq * micro_batch)]
    return [*out, SavedTerm("attention.o_proj_input", p * rows * heads * m.v_head_dim)]


def _latent_norm(name: str, rows: int, width: int, input_width: int, p: int) -> list[SavedTerm]:
    return [SavedTerm(f"{name}.input_fp32", FP32 * rows * input_width), SavedTerm(f"{name}.rstd", FP32 * rows),
            SavedTerm(f"{name}.normalized", p * rows * width), SavedTerm(f"{name}.output", p * rows * width)]


def mla_projection_outputs(cfg: ModelConfig, rows: int, tp: int, p: int) -> list[SavedTerm]:
    """The MLA projections' outputs the selective policy keeps (every mm output): the replicated down-
    projections on every token, the head-split up-projections (o_proj's is the block's `attention.wo_out`)."""
    m, heads = cfg.mla, cfg.n_heads // tp
    q = ([SavedTerm("attention.q_a_proj_out", p * rows * m.q_lora_rank, True),
          SavedTerm("attention.q_b_proj_out", p * rows * heads * m.qk_head_dim, True)] if m.q_lora_rank
         else [SavedTerm("attention.q_proj_out", p * rows * heads * m.qk_head_dim, True)])
    kv_b = heads * (m.qk_nope_head_dim + m.v_head_dim)
    return [*q, SavedTerm("attention.kv_a_proj_out", p * rows * (m.kv_lora_rank + m.qk_rope_head_dim), True),
            SavedTerm("attention.kv_b_proj_out", p * rows * kv_b, True)]


def mlp_terms(cfg: ModelConfig, rows: int, ffn_t: int, p: int) -> list[SavedTerm]:
    """The MLP's saved tensors: SwiGLU keeps w1x, w3x, silu(w1x) and the product; GELU keeps w1x and gelu(w1x)."""
    n = p * rows * ffn_t
    if cfg.mlp == "swiglu":
        return [SavedTerm("feed_forward.w1_out", n, selective=True), SavedTerm("feed_forward.w3_out", n, True),
                SavedTerm("feed_forward.silu", n), SavedTerm("feed_forward.product", n)]
    return [SavedTerm("feed_forward.w1_out", n, selective=True), SavedTerm("feed_forward.gelu", n)]


def selective_terms(cfg: ModelConfig, seq: int, micro_batch: int, *, tp: int = 1, sp: bool = False,
                    act_bytes: int = 2, kernel: AttnKernel = "flash") -> list[SavedTerm]:
    """What the selective policy keeps: the block input and the outputs of every mm/addmm/bmm, of the fused SDPA
    kernels and of the tensor-parallel reduce-scatters (`framework.parallel.recompute.SAVED_OPS`).

    Row-parallel projections (wo, w2) output a full-width partial sum before the reduce-scatter, and the policy
    keeps it too (it cannot tell which matmul outputs backward needs). The math kernel's core is two bmm: the
    policy keeps the fp32 scores q·kᵀ (a·s²·b) and the fp32 probabilities·v, and recomputes the softmax.
    """
    p, rows, h, t = act_bytes, seq * micro_batch, cfg.hidden, tp
    kv_t = cfg.kv_heads // t * cfg.head_dim
    q_t = cfg.n_heads // t * cfg.head_dim
    terms = [SavedTerm("block.input", p * (rows // t if sp else rows) * h, True)]
    if cfg.attention == "mla":
        terms += mla_projection_outputs(cfg, rows, t, p)
        q_t = cfg.n_heads // t * cfg.mla.qk_head_dim  # the kernels' head dim (values padded to it)
    else:
        terms += [SavedTerm("attention.wq_out", p * rows * q_t, True),
                  SavedTerm("attention.wk_out", p * rows * kv_t, True),
                  SavedTerm("attention.wv_out", p * rows * kv_t, True)]
    full = tessera_layer_terms(cfg, seq, micro_batch, tp=tp, sp=sp, act_bytes=act_bytes, kernel=kernel)
    terms += [term for term in full if term.selective and term.name.startswith("attention.")]
    if kernel == "math":
        m = max(p, FP32)
        terms += [SavedTerm("attention.scores", m * cfg.n_heads // t * seq * seq * micro_batch, True),
                  SavedTerm("attention.probs_v", m * rows * q_t, True)]
    terms.append(SavedTerm("attention.wo_out", p * rows * h, True))
    terms += [term for term in full if term.selective and term.name.startswith("feed_forward.")]
    terms.append(SavedTerm("feed_forward.w2_out", p * rows * h, True))
    if t > 1 and sp:  # the reduce-scatters after wo and w2
        terms += [SavedTerm("attention.reduce_scatter", p * rows // t * h, True),
                  SavedTerm("feed_forward.reduce_scatter", p * rows // t * h, True)]
    return terms


def tessera_layer_bytes(cfg: ModelConfig, seq: int, micro_batch: int, *, tp: int = 1, sp: bool = False,
                        recompute: Recompute = "none", act_bytes: int = 2, kernel: AttnKernel = "flash") -> int:
    """Activation bytes one Tessera block keeps for backward on one rank, per micro-batch.

    Args:
        cfg, seq, micro_batch, tp, sp, act_bytes, kernel: as in `tessera_layer_terms`.
        recompute: "none" (every saved tensor), "selective" (`selective_terms`), "full" (the block input only,
            sequence-sharded under sp).

    Returns:
        Bytes, exact for the CPU fp32 path (tested against saved-tensor measurements).
    """
    if recompute == "full":
        rows = seq * micro_batch // (tp if sp else 1)
        return act_bytes * rows * cfg.hidden
    if recompute == "selective":
        terms = selective_terms(cfg, seq, micro_batch, tp=tp, sp=sp, act_bytes=act_bytes, kernel=kernel)
    else:
        terms = tessera_layer_terms(cfg, seq, micro_batch, tp=tp, sp=sp, act_bytes=act_bytes, kernel=kernel)
    return sum(term.nbytes for term in terms)


def head_bytes(cfg: ModelConfig, seq: int, micro_batch: int, *, tp: int = 1, sp: bool = False,
               act_bytes: int = 2) -> int:
    """Bytes the final norm, the output projection and the cross-entropy keep (last pipeline stage).

    The final norm saves like a block norm, the (gathered) head input is kept by the projection, and the loss
    keeps the fp32 log-probabilities over this rank's vocabulary shard (vocab-parallel cross-entropy), the
    int64 targets and a scalar.
    """
    rows = seq * micro_batch
    terms = _norm_terms("norm", cfg, rows // tp if sp else rows, cfg.hidden, act_bytes)
    loss = FP32 * rows * (cfg.vocab_size // tp) + INT64 * rows + FP32  # log-probs, targets, total weight
    return sum(x.nbytes for x in terms) + act_bytes * rows * cfg.hidden + loss


def embedding_bytes(seq: int, micro_batch: int) -> int:
    """The token ids the embedding keeps for its backward (first pipeline stage).

    A Tessera sample holds seq + 1 tokens (inputs and shifted labels), and the embedding's input is a view of it.
    """
    return INT64 * (seq + 1) * micro_batch


def korthikanti_layer_bytes(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                            sp: bool = False, recompute: Recompute = "none", flash: bool = False) -> float:
    """Korthikanti et al. 2022, activation bytes per GPT layer (16-bit activations, 1-byte dropout masks).

    none: sbh(34 + 5as/h) at t=1; sbh(10 + 24/t + 5as/(ht)) with tensor parallelism; sbh(34/t + 5as/(ht)) with
    sequence parallelism. selective (recompute the attention core): sbh(10 + 24/t), or 34 sbh/t with SP.
    full: the layer input, 2sbh (2sbh/t with SP). `flash=True` models Megatron with a fused attention kernel:
    the 5as/h term (softmax output, dropout mask and output) is gone, as under selective recompute.
    """
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn_core = 0.0 if recompute == "selective" or flash else 5 * a * s / (h * t)
    if sp:
        return sbh * (34 / t + attn_core)
    return sbh * (10 + 24 / t + attn_core)


__all__ = ["RECOMPUTE_MODES", "AttnKernel", "Recompute", "SavedTerm", "embedding_bytes", "head_bytes",
           "korthikanti_layer_bytes", "mla_projection_outputs", "mla_terms", "mlp_terms", "selective_terms",
           "tessera_layer_bytes", "tessera_layer_terms"]
