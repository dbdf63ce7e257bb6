"""Communication per step per mesh axis: wire bytes one rank sends, and the time at the hardware table's rates.

Ring collectives over n ranks move, per rank, 2(n-1)/n of the buffer for an all-reduce and (n-1)/n for an
all-gather, a reduce-scatter or an all-to-all (Thakur et al. 2005; the ZeRO paper's 2Ψ / 3Ψ accounting).

  tp  per layer and micro-batch, sequence parallel: all-gather before and reduce-scatter after attention and
      MLP, forward and backward (8 collectives of s·b·h activations), 4 more when the forward is recomputed
      in full, 2 under selective recompute (it keeps the reduce-scatter outputs, reruns the all-gathers).
  pp  per micro-batch and chunk: the activation forward and its gradient backward, s·b·h/t each (SP-sharded).
  dp  per step on this rank's Ψ: stage 0 all-reduces gradients; 1 reduce-scatters gradients once and
      all-gathers parameters once; 2 reduce-scatters every micro-batch; 3 also all-gathers parameters before
      every micro-batch's forward and backward. ZeRO++ on the dense parameters (Wang et al. 2023; the formulas
      tests/parallel/test_zeropp.py checks against measured bytes): qwZ gathers 1 + 4/B bytes per element
      (int8 + an fp32 scale per block of B) instead of the bf16 2; hpZ moves ZeRO-3's backward gathers to the
      s-rank node group (intra-node link, ring over s); qgZ reduces 1 + 4/B bytes per element by all-to-all,
      with hpZ in two hops: ring over s inside the node, then over n/s nodes on 1/s of the volume.
  cp  per layer and micro-batch: all-gather of K and V (b x s x n_kv/t x E each) forward, their gradients
      reduce-scattered backward, the all-gather again under recompute (Llama 3's all-gather context parallel).
  ep  per MoE layer and micro-batch: dispatch and combine all-to-all of top_k copies of the rank's tokens,
      forward and backward (+2 when recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.plan.hardware import Hardware
from framework.plan.layout import Layout, Workload
from framework.plan.memory import RankParams, chunk_params, fp8_linear_params, layer_params, rank_chunks
from framework.plan.muon import MuonBytes
from framework.plan.phases import fsdp_gathers, rank_ops

QUANT_BLOCK = 256
"""Elements per ZeRO++ quantization block (parallel.zero_quant_block_size's default)."""


@dataclass(frozen=True)
class AxisComm:
    """One axis's traffic on one rank: wire bytes per step, collectives per step, and the seconds they take."""

    wire_bytes: float
    messages: int
    seconds: float


def ring_factor(kind: str, n: int) -> float:
    """Fraction of the buffer each rank sends in a ring collective over n ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _axis(hw: Hardware, intra: bool, wire: float, messages: int, group: int) -> AxisComm:
    # A ring collective takes n-1 steps, each paying the link latency (point-to-point: group=2, one step).
    seconds = wire / hw.link_bytes_per_s(intra) + messages * (group - 1) * hw.latency_us * 1e-6
    return AxisComm(wire, messages, seconds)


def tp_comm_per_micro(work: Workload, lay: Layout, hw: Hardware, n_layers: int) -> AxisComm:
    """Tensor-parallel traffic of one micro-batch through `n_layers` layers on one rank."""
    if lay.tp == 1:
        return AxisComm(0.0, 0, 0.0)
    buf = work.seq_len // lay.cp * lay.micro_batch * work.model.hidden * work.precision.act
    # Recompute reruns the forward's collectives; the selective policy keeps reduce-scatter outputs, so only
    # its two all-gathers run again.
    n_coll = (8 + {"none": 0, "selective": 2, "full": 4}[lay.recompute]) * n_layers
    return _axis(hw, True, n_coll * ring_factor("all_gather", lay.tp) * buf, n_coll, lay.tp)


def cp_comm_per_micro(work: Workload, lay: Layout, hw: Hardware, n_layers: int) -> AxisComm:
    """Context-parallel K/V traffic of one micro-batch through `n_layers` layers on one rank."""
    if lay.cp == 1:
        return AxisComm(0.0, 0, 0.0)
    cfg = work.model
    kv = work.seq_len * lay.micro_batch * (cfg.kv_heads // lay.tp) * cfg.head_dim * work.precision.act  # K or V
    n_coll = (4 + (2 if lay.recompute != "none" else 0)) * n_layers
    return _axis(hw, lay.tp * lay.cp <= hw.gpus_per_node, n_coll * ring_factor("all_gather", lay.cp) * kv, n_coll,
                 lay.cp)


def ep_comm_per_micro(work: Workload, lay: Layout, hw: Hardware, n_moe_layers: int) -> AxisComm:
    """Expert-parallel all-to-all traffic of one micro-batch through `n_moe_layers` MoE layers on the busiest
    rank (`Workload.moe_imbalance` times the mean)."""
    if lay.ep == 1 or n_moe_layers == 0:
        return AxisComm(0.0, 0, 0.0)
    tokens = work.seq_len // lay.cp * lay.micro_batch // (lay.tp if lay.sp else 1)
    buf = work.model.moe.top_k * tokens * work.model.hidden * work.precision.act * work.moe_imbalance
    n_coll = (4 + (2 if lay.recompute != "none" else 0)) * n_moe_layers
    return _axis(hw, lay.ep <= hw.gpus_per_node, n_coll * ring_factor("all_to_all", lay.ep) * buf, n_coll,
                 lay.ep)


def pp_comm_per_step(work: Workload, lay: Layout, hw: Hardware) -> AxisComm:
    """Point-to-point traffic of one pipeline rank per step (all micro-batches, every chunk boundary)."""
    if lay.pp == 1:
        return AxisComm(0.0, 0, 0.0)
    buf = (work.seq_len // lay.cp * lay.micro_batch * work.model.hidden * work.precision.act
           / (lay.tp if lay.sp else 1))
    messages = 2 * lay.virtual * lay.n_micro(work.global_batch)
    return _axis(hw, lay.world <= hw.gpus_per_node, messages * buf, messages, 2)


def zero3_gathers(work: Workload, lay: Layout, rank: int = 0) -> tuple[float, float, dict[int, int]]:
    """All-gathers of ZeRO-3 parameters on pipeline rank `rank` per step, in the order its schedule runs
    (framework/plan/phases.py `fsdp_gathers`): (dense elements gathered over the rank's dense elements, the same for
    the experts, gathers per layer). The units: each block (the chunk's last one is never resharded after
    forward), the chunk's own parameters (embedding, final norm, head: FSDP's root, not resharded after forward
    under pp only, zero.py) and each block's experts (resharded after every forward). Without pp every
    micro-batch gathers a block for forward and again for backward."""
    cfg, m = work.model, lay.n_micro(work.global_batch)
    chunks = rank_chunks(lay, rank)
    ops = rank_ops(lay.schedule, lay.pp, m, lay.virtual, rank)
    # a schedule the walk does not model: each chunk as 1F1B's last stage runs it (forward, backward, ...)
    counts = fsdp_gathers(ops, len(chunks), lay.pp > 1) if ops is not None else [(m + 1, 1)] * len(chunks)
    dense = [0.0, 0.0]  # gathered, held
    experts = [0.0, 0.0]
    per_layer: dict[int, int] = {}
    for (resharding, kept), c in zip(counts, chunks):
        part = chunk_params(cfg, lay, c)
        root = part.dense
        for i in part.layers:
            d, e = layer_params(cfg, i, lay.tp, lay.ep)
            root -= d
            per_layer[i] = kept if i == part.layers[-1] else resharding
            dense[0] += per_layer[i] * d
            dense[1] += d
            experts[0] += resharding * e
            experts[1] += e
        dense[0] += (kept if lay.pp > 1 else resharding) * root
        dense[1] += root
    return (dense[0] / dense[1] if dense[1] else 0.0, experts[0] / experts[1] if experts[1] else 0.0, per_layer)


def dp_comm_per_step(work: Workload, lay: Layout, hw: Hardware, params: RankParams,
                     rank: int = 0) -> dict[str, AxisComm]:
    """Data-parallel traffic of pipeline rank `rank` per step, split into the gradient reduction and the parameter
    gather; `params` its parameters (`rank_params`)."""
    prec, z, m = work.precision, lay.zero_stage, lay.n_micro(work.global_batch)
    intra = lay.tp * lay.shard_group <= hw.gpus_per_node
    reduce = gather = node_reduce = node_gather = cross_reduce = 0.0
    n_reduce = n_gather = 0
    layers = max(1, len(params.layers))
    z3 = zero3_gathers(work, lay, rank) if z == 3 and lay.hpz == 1 else None  # in the schedule's order
    q = 1 + 4 / QUANT_BLOCK
    s = lay.hpz if z == 3 or lay.qgz else 1
    for psi, n, dense in ((params.dense, lay.shard_group, True), (params.experts, lay.dp * lay.tp // lay.ep, False)):
        if z == 0:
            reduce += ring_factor("all_reduce", n) * psi * prec.grad
            continue
        # torch's pipeline stages reduce once per step, after each stage's last backward, whatever the stage
        rs_times = m if z >= 2 and lay.pp == 1 else 1
        ag_times: float = 2 * m if z == 3 else 1
        if z3 is not None:
            ag_times = z3[0] if dense else z3[1]
        if dense and lay.qgz and s > 1:  # two hops: inside the node, then across nodes on 1/s of the volume
            node_reduce += rs_times * ring_factor("all_to_all", s) * psi * q
            cross_reduce += rs_times * ring_factor("all_to_all", n // s) * psi / s * q
        else:
            reduce += rs_times * ring_factor("reduce_scatter", n) * psi * (q if dense and lay.qgz else prec.grad)
        if dense and z == 3 and lay.hpz > 1:  # backward's m gathers over the node group
            gather += m * ring_factor("all_gather", n) * psi * prec.param
            node_gather += m * ring_factor("all_gather", lay.hpz) * psi * prec.param
        else:
            gather += ag_times * ring_factor("all_gather", n) * psi * (q if dense and lay.qwz else prec.param)
            if dense and work.fp8_all_gather:  # FP8 all-gathers: 1 byte per converted weight element
                times = z3[2] if z3 is not None else {i: ag_times for i in params.layers}
                f8 = sum(times.get(i, 0) * fp8_linear_params(work.model, i, lay.tp) for i in params.layers)
                gather -= ring_factor("all_gather", n) * f8 * (prec.param - 1)
        n_reduce = rs_times * layers
        n_gather = round(ag_times * layers) if z3 is None else sum(z3[2].values())
    n_node_gather = m * layers if node_gather else 0
    n_gather -= n_node_gather
    if lay.shard_group == 1 and lay.dp * lay.tp // lay.ep == 1:
        return {"reduce": AxisComm(0.0, 0, 0.0), "gather": AxisComm(0.0, 0, 0.0)}
    if node_reduce:
        red = _plus(_axis(hw, True, node_reduce, n_reduce, s), _axis(hw, False, cross_reduce, n_reduce,
                                                                    lay.shard_group // s))
        red = _plus(red, _axis(hw, intra, reduce, 0, lay.shard_group))  # experts' plain reduce-scatter, if any
    else:
        red = _axis(hw, intra, reduce, n_reduce or layers, lay.shard_group)
    gat = _axis(hw, intra, gather, n_gather, lay.shard_group)
    if node_gather:
        gat = _plus(gat, _axis(hw, True, node_gather, n_node_gather, lay.hpz))
    return {"reduce": red, "gather": gat}


def muon_comm_per_step(work: Workload, lay: Layout, hw: Hardware, mb: MuonBytes) -> AxisComm:
    """The owner exchange's wire traffic and time on one rank per step: two all-to-alls per primary axis and the
    tp hop's all-gather, after backward with nothing to hide behind (framework/plan/estimate.py adds it whole)."""
    intra = {"dp_shard": lay.tp * lay.shard_group <= hw.gpus_per_node, "tp": True,
             "edp": lay.dp * lay.tp <= hw.gpus_per_node, "dp_shard_tp": lay.tp * lay.shard_group <= hw.gpus_per_node}
    group = {"dp_shard": lay.shard_group, "tp": lay.tp, "edp": lay.dp * lay.tp // lay.ep,
             "dp_shard_tp": lay.shard_group * lay.tp}
    total = AxisComm(0.0, 0, 0.0)
    for axis, payload in mb.all_to_all.items():
        total = _plus(total, _axis(hw, intra[axis], ring_factor("all_to_all", group[axis]) * payload, 2, group[axis]))
    if mb.all_gather_tp:
        total = _plus(total, _axis(hw, True, ring_factor("all_gather", lay.tp) * mb.all_gather_tp, 1, lay.tp))
    return total


def _plus(a: AxisComm, b: AxisComm) -> AxisComm:
    return AxisComm(a.wire_bytes + b.wire_bytes, a.messages + b.messages, a.seconds + b.seconds)


__all__ = ["AxisComm", "cp_comm_per_micro", "dp_comm_per_step", "ep_comm_per_micro", "muon_comm_per_step",
           "pp_comm_per_step", "ring_factor", "tp_comm_per_micro", "zero3_gathers"]
