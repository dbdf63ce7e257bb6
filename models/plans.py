"""Tensor-parallel plans for the decoder: what each weight looks like under TP, as data (FQN -> style).

Megatron-style sharding (Shoeybi et al. 2019): attention heads and the MLP hidden dimension are split
column-wise on the way in and row-wise on the way out, so each block needs one reduction in forward and one
in backward per sub-layer. With sequence parallelism (Korthikanti et al. 2022) the norms and residual stream
are sharded over the sequence (dim 1) and those reductions become reduce-scatter / all-gather pairs.
The embedding is vocab-parallel (row-wise over the vocabulary) and the head column-wise over the vocabulary,
so `loss_parallel` can compute cross-entropy on vocab-sharded logits.
"""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

Plan = dict[str, ParallelStyle]


def decoder_top_plan(sequence_parallel: bool, loss_parallel: bool) -> Plan:
    """Plan for the parts outside the blocks (embedding, final norm, head); stages may lack some of them."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: Plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def _mla_plan(seq: Placement) -> Plan:
    """MLA (models/mla.py): the up-projections split by heads (column-wise), o_proj row-wise; the down-projections
    and latent norms replicated as plain tensors. The block input arrives whole and local, and each up-projection's
    input (a replicated latent) has its gradient summed over tp where it enters (ColwiseParallel's backward), so
    the replicated weights upstream see their full gradient on every rank; the shared rotary key, which enters no
    up-projection, is summed by the module's `shared_key_grad` (framework/parallel/tensor.py). That is three
    all-reduces of q_lora_rank + kv_lora_rank + qk_rope_head_dim channels per token (2,112 for DeepSeek-V3) in
    place of one reduction of the hidden size (7,168)."""
    return {
        "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                        desired_input_layouts=(Replicate(), None, None), use_local_output=True),
        "attention.q_proj": ColwiseParallel(),
        "attention.q_b_proj": ColwiseParallel(),
        "attention.kv_b_proj": ColwiseParallel(),
        "attention.o_proj": RowwiseParallel(output_layouts=seq),
    }


def decoder_block_plan(sequence_parallel: bool, attention: str = "gqa") -> Plan:
    """Plan for one transformer block (attention: wq/wk/wv column-wise, wo row-wise, or MLA's `_mla_plan`;
    SwiGLU: w1/w3, w2)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    attn: Plan = _mla_plan(seq) if attention == "mla" else {
        "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        # Qwen3's q/k norms: one (E,) weight shared by every head, applied to this rank's heads (dim 2 of
        # (B, T, H, E)); as Shard(2) DTensors their weight gradient comes out Partial and is summed over tp.
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    plan: Plan = {
        **attn,
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def mtp_module_plan(sequence_parallel: bool) -> Plan:
    """Plan for one multi-token prediction depth around its block (models/mtp.py): the projection of
    [hnorm(h); enorm(emb)] column-wise, its output back on the residual stream's layout (sequence shards under
    SP: the all-to-all of Shard(-1) -> Shard(1)); the norms as the block's."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: Plan = {"eh_proj": ColwiseParallel(input_layouts=seq, output_layouts=seq)}
    if sequence_parallel:
        plan.update({"hnorm": SequenceParallel(), "enorm": SequenceParallel(), "norm": SequenceParallel()})
    return plan
