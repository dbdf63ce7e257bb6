"""Per-rank memory: parameters under TP/PP/EP, model states by ZeRO stage, activations, temporary buffers.

Parameters per rank follow the TP plan (column-parallel wq/wk/wv/w1/w3 split their output dim, row-parallel
wo/w2 their input dim, the embedding and head their vocab dim, norms and row-parallel biases replicated);
routed experts are split over ep and not over tp (ep is carved out of the data ranks); pipeline ranks own
L/(p·v) consecutive layers per chunk, the embedding sits with the first chunk and the final norm and head with
the last (on rank 0 for the V-shaped schedules). `tests/plan` checks these counts against meta-device builds.

Model states follow the ZeRO paper (Rajbhandari et al. 2020) with the dtypes of `Precision`: with Ψ parameters
on a rank and N the ZeRO group, stage 0 keeps Ψ(p + m + g + o), stage 1 Ψ(p + g) + Ψ(m + o)/N, stage 2
Ψp + Ψ(g + m + o)/N, stage 3 Ψ(p + g + m + o)/N — with p = 2, g = 2, m = 4, o = 8 the paper's 16Ψ,
4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from framework.parallel.pipeline_schedules import rank_in_flight, stages_of_rank
from framework.plan.activations import (
    FP32,
    INT64,
    Recompute,
    embedding_bytes,
    head_bytes,
    korthikanti_layer_bytes,
    mlp_terms,
    tessera_layer_bytes,
)
from framework.plan.layout import Layout, Precision, Workload
from framework.plan.muon import muon_bytes
from framework.plan.phases import (
    ChunkBytes,
    live_at_peak,
    moment_micro_batches,
    rank_ops,
    single_chunk_peak,
)
from models.config import ModelConfig
from models.flops import mla_params


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one pipeline rank (after TP/EP sharding, before ZeRO)."""

    dense: int
    experts: int
    largest_layer: int
    """The biggest layer on this rank, for gather/reduce buffers."""
    layers: tuple[int, ...]
    n_moe: int = 0
    """MoE layers among `layers`."""

    @property
    def total(self) -> int:
        return self.dense + self.experts


def _mlp_local(cfg: ModelConfig, ffn: int, tp: int) -> int:
    n_mats = 3 if cfg.mlp == "swiglu" else 2
    bias = 0 if cfg.mlp == "swiglu" else ffn // tp + cfg.hidden  # column bias split, row bias replicated
    return n_mats * cfg.hidden * ffn // tp + bias


def layer_params(cfg: ModelConfig, layer: int, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of layer `layer` on one rank under tensor degree tp and expert degree ep."""
    d, hd = cfg.hidden, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    dense = (2 * q * d + 2 * kv * d) // tp if cfg.attention != "mla" else mla_params(cfg, tp)
    if cfg.mlp == "gelu":
        dense += (q + 2 * kv) // tp + d
    dense += 2 * (d if cfg.norm == "rmsnorm" else 2 * d)
    if not cfg.is_moe_layer(layer):
        return dense + _mlp_local(cfg, cfg.ffn, tp), 0
    moe = cfg.moe
    ffn = moe.expert_hidden or cfg.ffn
    dense += moe.n_shared_experts * _mlp_local(cfg, ffn, tp) + d * moe.n_experts
    return dense, moe.n_experts // ep * _mlp_local(cfg, ffn, 1)


def fp8_linear_params(cfg: ModelConfig, layer: int, tp: int = 1) -> int:
    """Weights of a dense layer's attention and MLP linears on one rank (biases excluded): what `train.fp8`
    converts with its default filter (framework/numerics/fp8.py; min_dim 16 keeps every linear of a real model)."""
    if cfg.is_moe_layer(layer) or cfg.attention == "mla":
        return 0  # FP8 is refused for MoE models; MLA's projections are not counted here
    d, q, kv = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    n_mats = 3 if cfg.mlp == "swiglu" else 2
    return (2 * q * d + 2 * kv * d) // tp + n_mats * d * cfg.ffn // tp


def rank_chunks(lay: Layout, rank: int) -> list[int]:
    """Pipeline chunks (0 .. p·v-1, in model order) that pipeline rank `rank` runs."""
    return stages_of_rank(rank, lay.pp, lay.virtual, lay.schedule)


def rank_params(cfg: ModelConfig, lay: Layout, rank: int) -> RankParams:
    """Parameters on pipeline rank `rank` (any tp/dp rank within it holds the same count)."""
    return _rank_params(cfg, lay.tp, lay.pp, lay.ep, lay.virtual, tuple(rank_chunks(lay, rank)), lay.layer_split)


def chunk_params(cfg: ModelConfig, lay: Layout, chunk: int) -> RankParams:
    """Parameters of pipeline chunk `chunk` (0 .. p·v-1) on one rank."""
    return _rank_params(cfg, lay.tp, lay.pp, lay.ep, lay.virtual, (chunk,), lay.layer_split)


@functools.lru_cache(maxsize=4096)
def _rank_params(cfg: ModelConfig, tp: int, pp: int, ep: int, virtual: int, chunks: tuple[int, ...],
                 split: tuple[int, ...] | None = None) -> RankParams:
    n_chunks = pp * virtual
    per_chunk = cfg.n_layers // n_chunks
    bounds = [sum(split[:c]) for c in range(n_chunks + 1)] if split else [c * per_chunk for c in range(n_chunks + 1)]
    layers = tuple(i for c in chunks for i in range(bounds[c], bounds[c + 1]))
    dense = experts = largest = 0
    for i in layers:
        d, e = layer_params(cfg, i, tp, ep)
        dense, experts, largest = dense + d, experts + e, max(largest, d + e)
    vocab_shard = cfg.vocab_size // tp * cfg.hidden
    first, last = 0 in chunks, n_chunks - 1 in chunks
    if first:
        dense += vocab_shard
    if last:
        dense += cfg.hidden * (1 if cfg.norm == "rmsnorm" else 2)
        if not (cfg.tied_embeddings and first):  # tied weights on one rank are one tensor
            dense += vocab_shard
    n_moe = sum(cfg.is_moe_layer(i) for i in layers)
    return RankParams(dense, experts, max(largest, vocab_shard) if first or last else largest, layers, n_moe)


def model_state_bytes(params: RankParams, lay: Layout, prec: Precision) -> dict[str, float]:
    """Parameters, fp32 master copy, gradients and optimizer states on one rank, by ZeRO stage."""
    z = lay.zero_stage
    groups = [(params.dense, lay.shard_group), (params.experts, lay.dp * lay.tp // lay.ep)]
    out = {"params": 0.0, "master": 0.0, "grads": 0.0, "optimizer": 0.0}
    # Under pp, torch's pipeline stages turn FSDP's gradient sync off for every micro-batch's backward and reduce
    # once after the last (PipelineStage.backward_maybe_with_nosync), whatever the stage: ZeRO-2/3 accumulate
    # unsharded gradients through the step like ZeRO-1 (the dry run of the 70B ZeRO-3 config measured them).
    grads_sharded = z >= 2 and lay.pp == 1
    for psi, n in groups:
        n = n if z > 0 else 1
        out["params"] += psi * prec.param / (n if z >= 3 else 1)
        out["grads"] += psi * prec.grad / (n if grads_sharded else 1)
        out["master"] += psi * prec.master / n
        out["optimizer"] += psi * prec.optimizer / n
    if lay.nvme_offload:
        out["optimizer"] = 0.0  # in files on NVMe; one 64 MiB group at a time passes through the device
    return out


def resident_state_bytes(params: RankParams, lay: Layout, prec: Precision) -> float:
    """Model-state bytes Tessera keeps on one rank *between* steps (what `model_state_bytes` splits differently).

    Tessera's ZeRO-1/2/3 all run on FSDP2: between steps a rank holds the shard of each parameter in its storage
    dtype (the fp32 master under mixed precision), the shard of its fp32 gradient and the AdamW shard; the
    compute-dtype copies and the unsharded gradients of ZeRO-1/2 exist only during the step (gathered units,
    gradients accumulated before the reduce-scatter), inside `model_state_bytes`' totals. Without FSDP (ZeRO-0,
    DDP) the fp32 parameters, gradients and AdamW states are whole and there is no stored compute copy: autocast
    casts per op during the step. The dry run's "states" measure exactly this (docs/PLANNER.md).
    """
    per_param = (prec.master or prec.param) + prec.grad + prec.optimizer
    groups = [(params.dense, lay.shard_group), (params.experts, lay.dp * lay.tp // lay.ep)]
    return sum(psi * per_param / (n if lay.zero_stage > 0 else 1) for psi, n in groups)


def moe_layer_extra_bytes(cfg: ModelConfig, seq: int, micro_batch: int, tp: int, act: int) -> int:
    """Activations of an MoE MLP (models/moe) beyond the dense MLP it replaces, on one rank and micro-batch.

    Derived from the saved tensors of models/moe on CPU (within 0.1% there, `tests/plan`): routing runs on this
    rank's sequence shard of the tokens (r rows, R = top_k·r routed copies). Router: fp32 logits and softmax
    probabilities (r·E each) and a logsumexp (r); integer routing metadata (sort values and indices, slot ids, the
    gather index: 4 int64 per routed copy) and the fp32 top-k weights; the dispatched copies, the experts' output
    and the combine slots (3 x R·h); the routed experts' MLP tensors on R rows (experts are not TP-sharded) and
    the shared experts' on r rows. The grouped GEMM pads every expert's group to a 16-byte-aligned start
    (`models/moe/experts.py::pad_groups`, at most E·(16/act - 1) zero rows): its padded input copy (R + pad rows)
    and row index (one int64 per routed copy) are saved, and the experts' MLP tensors span the padded rows.
    """
    moe = cfg.moe
    rows = seq * micro_batch // tp
    routed = moe.top_k * rows
    ffn = moe.expert_hidden or cfg.ffn
    pad = moe.n_experts * (max(1, 16 // act) - 1)
    extra = FP32 * rows * (2 * moe.n_experts + 1) + INT64 * 4 * routed + FP32 * routed
    extra += act * cfg.hidden * 3 * routed
    extra += sum(t.nbytes for t in mlp_terms(cfg, routed, ffn, act))
    extra += act * cfg.hidden * (routed + pad) + INT64 * routed + act * 4 * pad * ffn
    if moe.n_shared_experts:
        extra += sum(t.nbytes for t in mlp_terms(cfg, seq * micro_batch, moe.n_shared_experts * ffn // tp, act))
    return extra - sum(t.nbytes for t in mlp_terms(cfg, seq * micro_batch, cfg.ffn // tp, act))


def layer_bytes(work: Workload, lay: Layout, recompute: Recompute) -> float:
    """Activation bytes of one layer and micro-batch on one rank, by the workload's activation model."""
    return _layer_bytes(work, lay.tp, lay.micro_batch, recompute, lay.cp)


def rope_input_bytes(work: Workload, lay: Layout) -> int:
    """The RoPE table one layer keeps per micro-batch under FSDP mixed precision.

    The decoder passes its whole fp32 (max_seq_len, E/2, 2) table to every block (models/decoder.py) and FSDP casts
    each unit's floating inputs to the compute dtype (MixedPrecisionPolicy.cast_forward_inputs), so every block
    gets its own 16-bit copy of the whole table: a checkpointed block (full or selective recompute) keeps it as an
    input; without recompute the copy dies after the block's forward and `apply_rope`'s multiply keeps the fp32
    upcast of the s rows it uses. Without FSDP (ZeRO-0) or in fp32 runs the buffer itself is used: nothing added.
    """
    act = work.precision.act
    if lay.zero_stage == 0 or act >= FP32 or work.activations == "korthikanti":
        return 0
    if lay.recompute != "none":
        return work.model.max_seq_len * work.model.rope_dim * act
    return work.seq_len // lay.cp * work.model.rope_dim * FP32


def cp_kv_bytes(cfg: ModelConfig, seq: int, micro_batch: int, tp: int, cp: int, act: int,
                comm: str = "allgather") -> int:
    """Bytes of K/V one layer keeps for backward on a cp rank beyond a local block of s/cp tokens.

    allgather: SDPA keeps k and v of all s keys, repeated to the query heads on CUDA (the fused kernel that takes
    a mask has no GQA), so 2 x b x (s - s/cp) x h/t elements. ring: only the local k and v are kept (the blocks
    in flight are transient; framework/parallel/context_ring.py): nothing beyond the local block. all_to_all:
    the kernel keeps q, k, v and the output of the whole sequence on h/(t cp) heads, the local block's bytes,
    except that KV heads not divisible by cp are repeated to the query heads first.
    """
    if cp == 1 or comm == "ring":
        return 0
    kv_local = max(1, cfg.kv_heads // tp)
    if comm == "all_to_all":
        return 0 if kv_local % cp == 0 else 2 * act * micro_batch * seq * (cfg.n_heads // tp - kv_local) // cp \
            * cfg.head_dim
    return 2 * act * micro_batch * (seq - seq // cp) * (cfg.n_heads // tp) * cfg.head_dim


def cp_mask_bytes(seq: int, micro_batch: int, cp: int, act: int, comm: str = "allgather") -> int:
    """The (b, 1, s/cp, s) additive attention mask of an allgather cp rank, one per forward, shared by every
    layer; ring and all_to_all take no mask without document masks (`is_causal` per block)."""
    return act * micro_batch * (seq // cp) * seq if cp > 1 and comm == "allgather" else 0


@functools.lru_cache(maxsize=4096)
def _layer_bytes(work: Workload, tp: int, micro_batch: int, recompute: Recompute, cp: int = 1) -> float:
    """One layer on s/cp local tokens, plus the gathered K/V SDPA saves when it is not recomputed."""
    cfg, sp, s = work.model, tp > 1, work.seq_len // cp
    kv = cp_kv_bytes(cfg, work.seq_len, micro_batch, tp, cp, work.precision.act, work.cp_comm) \
        if recompute == "none" else 0
    if work.activations == "korthikanti":
        return kv + korthikanti_layer_bytes(s, micro_batch, cfg.hidden, cfg.n_heads, tp=tp, sp=sp,
                                            recompute=recompute, flash=work.kernel == "flash")
    return kv + tessera_layer_bytes(cfg, s, micro_batch, tp=tp, sp=sp, recompute=recompute,
                                    act_bytes=work.precision.act, kernel=work.kernel)


def rank_memory(work: Workload, lay: Layout, rank: int) -> dict[str, float]:
    """Peak bytes on one rank of pipeline rank `rank`, by part: model states, activations, buffers."""
    cfg, prec = work.model, work.precision
    s, b, act = work.seq_len // lay.cp, lay.micro_batch, prec.act  # this rank's tokens
    params = rank_params(cfg, lay, rank)
    out = model_state_bytes(params, lay, prec)
    kept_layer = layer_bytes(work, lay, lay.recompute)
    per_layer = kept_layer + rope_input_bytes(work, lay)
    full_layer = layer_bytes(work, lay, "none")
    moe_extra = moe_layer_extra_bytes(cfg, s, b, lay.tp, act) if cfg.moe.enabled else 0
    stage_layers = len(params.layers) * per_layer + (params.n_moe * moe_extra if lay.recompute == "none" else 0)
    m = lay.n_micro(work.global_batch)
    chunks = rank_chunks(lay, rank)
    last = lay.pp * lay.virtual - 1 in chunks
    # torch's stage keeps each in-flight micro-batch's output (its fwd_cache) until that micro-batch's backward:
    # the residual stream leaving every chunk but the model's last, which no layer of the chunk saves
    sent = sum(c < lay.pp * lay.virtual - 1 for c in chunks) if lay.pp > 1 else 0
    # ... less, under recompute, the received input the first block keeps (it is the receive buffer, pipeline_recv)
    sent -= sum(c > 0 for c in chunks) if lay.recompute != "none" else 0
    stage_layers += sent * s * b * cfg.hidden // (lay.tp if lay.sp else 1) * act
    in_flight = rank_in_flight(lay.schedule, lay.pp, m, lay.virtual, rank)  # micro-batches, on this rank's layers
    out["activations"] = (stage_layers + (embedding_bytes(s, b) if 0 in chunks else 0)) * in_flight
    if lay.cp > 1:
        out["cp_mask"] = cp_mask_bytes(work.seq_len, b, lay.cp, act, work.cp_comm) * in_flight
    if lay.pp > 1:  # torch's stages keep a receive buffer per micro-batch and neighbour for the run: activations
        # in (all but the first chunk), gradients in (all but the last), in FSDP's compute dtype (fp32 under DDP)
        recv = sum(m * ((c > 0) + (c < lay.pp * lay.virtual - 1)) for c in chunks)
        out["pipeline_recv"] = float(recv * s * b * cfg.hidden // (lay.tp if lay.sp else 1) * (act if lay.zero_stage
                                                                                                else FP32))
    if last:  # the loss's fp32 log-probabilities are counted with the logits, as the dry run labels them
        vocab = s * b * (cfg.vocab_size // lay.tp)
        out["activations"] += head_bytes(cfg, s, b, tp=lay.tp, sp=lay.sp, act_bytes=act) - FP32 * vocab
        out["logits"] = vocab * (act + 2 * FP32)
    # Transients: the rematerialized layer during its backward; ZeRO-3's gathered units; one layer's gradients.
    # (an MoE layer's, routed experts included, where the rank has one)
    remat_moe = moe_layer_extra_bytes(cfg, s, b, lay.tp, act) if params.n_moe and lay.recompute != "none" else 0
    out["recompute_buffer"] = float(full_layer + remat_moe - kept_layer if lay.recompute != "none" else 0)
    z = lay.zero_stage
    # ZeRO-3 holds the unit being computed plus `prefetch` units gathered ahead
    out["comm_buffers"] = float(params.largest_layer * (1 + lay.prefetch) * prec.param if z == 3 else 0)
    out["layer_grads"] = float(params.largest_layer * prec.grad)  # before its reduce-scatter (or accumulation)
    if z == 3 and lay.hpz > 1:  # ZeRO++ hpZ: every unit's node-sharded copy, held from its forward to its backward
        out["hpz_secondary"] = params.dense * prec.param / lay.hpz
    _at_peak_moment(out, work, lay, rank, params, per_layer, moe_extra if lay.recompute == "none" else 0)
    if work.optimizer == "muon":
        _add_muon(out, work, lay, rank)
    return out


def _at_peak_moment(out: dict[str, float], work: Workload, lay: Layout, rank: int, params: RankParams,
                    per_layer: float, moe_extra: float) -> None:
    """Activations, logits, accumulated gradients and the two transients (the recomputed layer; the gradients of
    the largest layer before they are added to the accumulated ones, in the compute dtype, or before their
    reduce-scatter, fp32) as they are at one moment of the step, the one where their sum is largest
    (framework/plan/phases.py), instead of each at its own largest; for the schedules the walk models (else the
    in-flight counts above stay). `per_layer`, `moe_extra`: one layer's kept bytes and an MoE layer's extra."""
    n_micro = lay.n_micro(work.global_batch)
    ops = rank_ops(lay.schedule, lay.pp, moment_micro_batches(lay.schedule, lay.pp, n_micro, rank), lay.virtual, rank)
    if ops is None:
        return
    cfg, act, prec = work.model, work.precision.act, work.precision
    s, b = work.seq_len // lay.cp, lay.micro_batch
    n_chunks = lay.pp * lay.virtual
    # ZeRO-1 accumulates unsharded gradients over the micro-batches, and so do ZeRO-2/3 under pp (model_state_bytes)
    accumulate = lay.zero_stage == 1 or (lay.zero_stage >= 2 and lay.pp > 1)
    vocab = s * b * (cfg.vocab_size // lay.tp)
    chunks = []
    own = rank_chunks(lay, rank)
    for c in own:
        part = params if len(own) == 1 else chunk_params(cfg, lay, c)
        kept = len(part.layers) * per_layer + part.n_moe * moe_extra + (embedding_bytes(s, b) if c == 0 else 0)
        if c < n_chunks - 1:  # the stage output torch keeps until this micro-batch's backward
            kept += s * b * cfg.hidden // (lay.tp if lay.sp else 1) * act
        if c > 0 and lay.recompute != "none":  # the first block's kept input is the receive buffer (pipeline_recv)
            kept -= s * b * cfg.hidden // (lay.tp if lay.sp else 1) * act
        grads = part.total * prec.grad if accumulate else 0.0
        if c == n_chunks - 1:
            head = head_bytes(cfg, s, b, tp=lay.tp, sp=lay.sp, act_bytes=act) - FP32 * vocab
            chunks.append(ChunkBytes(kept, head, FP32 * vocab, act * vocab, grads))
        else:
            chunks.append(ChunkBytes(kept, grads=grads))
    remat, layer_grads = out["recompute_buffer"], params.largest_layer * (prec.param if accumulate else prec.grad)
    if len(chunks) == 1:  # one chunk: warm-up forwards, backward/forward pairs, cooldown backwards, in closed form
        warm = 1 if lay.pp == 1 else n_micro if lay.schedule == "GPipe" else min(n_micro, lay.pp - rank)
        moment = single_chunk_peak(warm, n_micro - warm, chunks[0], remat, layer_grads)
    else:
        moment = live_at_peak(ops, chunks, remat, layer_grads)
    out["activations"], out["recompute_buffer"] = moment.activations, moment.layer
    out["layer_grads"] = moment.backward
    if "logits" in out:
        out["logits"] = moment.logits
    if accumulate:
        out["grads"] = moment.grads


def _add_muon(out: dict[str, float], work: Workload, lay: Layout, rank: int) -> None:
    """Muon's terms (framework/plan/muon.py): its momentum in place of AdamW's moments, the owners' index, and the
    update's transient where it passes the forward-backward transients (freed before the optimizer step)."""
    mb = muon_bytes(work, lay, rank)
    out["optimizer"] += mb.state_delta
    states = ("params", "master", "grads", "optimizer")
    during_backward = sum(v for k, v in out.items() if k not in states)
    out["muon_index"] = mb.index
    out["muon_step"] = max(0.0, mb.transient - during_backward)


def checkpoint_staging_bytes(work: Workload, lay: Layout, rank: int, pin_budget: float = 16 * 2**30
                             ) -> dict[str, float]:
    """Host memory one rank holds for asynchronous checkpoints (framework/checkpoint/staging.py), not device memory.

    The staged state is this rank's fp32 weights and AdamW moments as sharded here (a DCP save stages every local
    tensor); it is pinned when it fits `pin_budget` (checkpoint.async_pin_budget_gb), else pageable plus one pinned
    bucket of that size. Returns {"host": all staging bytes, "pinned": the page-locked part of them}.
    """
    states = model_state_bytes(rank_params(work.model, lay, rank), lay, work.precision)
    staged = (states["master"] or states["params"]) + states["optimizer"]
    pinned = staged if staged <= pin_budget else pin_budget
    return {"host": staged + (pin_budget if staged > pin_budget else 0.0), "pinned": pinned}


def peak_memory(work: Workload, lay: Layout) -> tuple[float, int, dict[str, float]]:
    """The largest per-rank peak over the first and the last pipeline rank: (bytes, rank, breakdown)."""
    best: tuple[float, int, dict[str, float]] = (-1.0, 0, {})
    for rank in sorted({0, lay.pp - 1}):
        parts = rank_memory(work, lay, rank)
        total = sum(parts.values())
        if total > best[0]:
            best = (total, rank, parts)
    return best


__all__ = [
    "RankParams",
    "checkpoint_staging_bytes",
    "chunk_params",
    "cp_kv_bytes",
    "cp_mask_bytes",
    "fp8_linear_params",
    "layer_bytes",
    "layer_params",
    "model_state_bytes",
    "moe_layer_extra_bytes",
    "peak_memory",
    "rank_chunks",
    "rank_memory",
    "rank_params",
    "resident_state_bytes",
    "rope_input_bytes",
]
