"""One layout's estimate: peak memory per rank, step time, MFU and HFU, communication per axis.

Step time on the slowest pipeline rank:
    t_micro   = FLOPs of its layers (and head) for one micro-batch / (peak x mm_efficiency)
                + its tensor-parallel and expert-parallel collectives, on the critical path: the engine runs
                DualPipeV's overlapped forward/backward pairs one after the other (torch's schedule does, unless
                a custom overlap function is registered), so no schedule hides the expert all-to-alls
                + under ep > 1, the busiest expert rank's extra routed tokens (`Workload.moe_imbalance`): its
                expert matmuls and all-to-all bytes scale with it
    pipeline  = m · t_micro / (1 - bubble)
    step      = pipeline + pipeline p2p + exposed data-parallel traffic + optimizer step (HBM-bound)
Data-parallel traffic overlaps with compute: the once-per-step gradient reduction with the last micro-batch's
backward and the drain half of the bubble, the parameter gather with the first forward and the fill half;
per-micro-batch ZeRO-2 traffic with that micro-batch's backward. Only the excess is exposed. ZeRO-3 is modelled
per FSDP unit (`_zero3_exposed`): each pass's first all-gather and backward's last reduce-scatter have no
compute to hide behind, the others hide behind the neighbouring unit's compute up to its length (with
prefetch >= 1; FSDP2's default, prefetch 0, still prefetches one unit in backward) or not at all (forward,
prefetch 0); per-unit latency ((n-1) ring steps) and the inter-node bandwidth
of a group that spans nodes enter through each collective's time (`framework.plan.comm`).
Under Muon (`Workload.optimizer`) the owners' Newton-Schulz FLOPs and the exchange's return trip add to the step
whole (framework/plan/muon.py); the trip to the owners too, except where it overlaps backward (`_muon_exposed`).
NVMe offload adds reading and writing the rank's AdamW states (16 bytes per parameter) at `nvme_gbps` after
backward, where nothing hides it.
Selective recompute adds the memory traffic of rewriting what it recomputes (norms, RoPE, activations are
memory-bound). FLOPs come from `models.flops.flops_per_token` (model FLOPs, non-causal as Megatron and PaLM count them;
hardware FLOPs add the recomputed forward under full recompute).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from framework.parallel.pipeline_schedules import bubble_fraction
from framework.plan.comm import (
    AxisComm,
    cp_comm_per_micro,
    dp_comm_per_step,
    ep_comm_per_micro,
    muon_comm_per_step,
    pp_comm_per_step,
    tp_comm_per_micro,
)
from framework.plan.hardware import Hardware
from framework.plan.layout import Layout, Workload
from framework.plan.memory import (
    RankParams,
    layer_bytes,
    model_state_bytes,
    peak_memory,
    rank_chunks,
    rank_params,
)
from framework.plan.muon import chunk_layers, muon_bytes
from models.config import ModelConfig
from models.flops import flops_per_token, mfu_flops_per_token


@dataclass(frozen=True)
class Estimate:
    """What the planner predicts for one layout."""

    layout: Layout
    memory_bytes: float
    memory_rank: int
    memory: dict[str, float]
    step_s: float
    mfu: float
    hfu: float
    tokens_per_s: float
    bubble: float
    flops: tuple[float, float] = (0.0, 0.0)
    """(model, hardware) FLOPs per step over the whole cluster."""
    comm: dict[str, AxisComm] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)


@functools.lru_cache(maxsize=256)
def _flops(cfg: ModelConfig, seq: int, recompute: bool) -> float:
    return flops_per_token(cfg, seq, recompute=recompute, executed=True)


@functools.lru_cache(maxsize=256)
def _layer_and_head_flops(cfg: ModelConfig, seq: int, recompute: bool) -> tuple[float, float]:
    """(FLOPs per token of one average layer, FLOPs per token of the head and final norm), forward + backward."""
    # what the kernels execute (MLA's zero-padded values included): the step's time, not the MFU convention
    total = flops_per_token(cfg, seq, recompute=recompute, executed=True)
    head = flops_per_token(dataclasses.replace(cfg, n_layers=0), seq, recompute=recompute, executed=True)
    return (total - head) / cfg.n_layers, head


def _routed_flops(cfg: ModelConfig, recompute: bool) -> float:
    """FLOPs per token of the routed experts of one MoE layer (top_k of them), forward + backward (6N; 8N with
    full recompute, as `flops_per_token` counts)."""
    n_mats = 3 if cfg.mlp == "swiglu" else 2
    params = cfg.moe.top_k * n_mats * cfg.hidden * (cfg.moe.expert_hidden or cfg.ffn)
    return (8 if recompute else 6) * params


def zero3_pass_exposed(gathers: Sequence[float], reduces: Sequence[float], computes: Sequence[float],
                       prefetch: int, blocking_reduce: bool = False) -> float:
    """Exposed communication of one ZeRO-3 pass over FSDP units in execution order (the planner's overlap model).

    Unit i has an all-gather of `gathers[i]` s in front of its compute (`computes[i]` s) and, in backward, a
    reduce-scatter of `reduces[i]` s after it (forward: zeros). One communication stream beside compute
    (FSDP2's all-gather and reduce-scatter streams share the links). With prefetch >= 1, unit i's gather is
    issued at unit i-1's start and runs under its compute, queued behind unit i-1's reduce-scatter, so only its
    excess shows; the first gather and the last reduce-scatter have nothing to hide behind. Without prefetch
    every gather waits in front of its unit (FSDP2 issues it when the unit starts); reduce-scatters still run
    beside the next unit's compute. `blocking_reduce`: a backend whose reduce-scatter blocks compute (FSDP2 on
    CPU/gloo issues it synchronously): every reduce-scatter is exposed, and a prefetched gather hides behind
    the previous unit's compute and reduce-scatter. Deeper prefetch hides no more with equal units.
    """
    k = len(gathers)
    if k == 0:
        return 0.0
    if blocking_reduce:
        hidden = [computes[i - 1] + reduces[i - 1] for i in range(1, k)]
        gather = gathers[0] + sum(max(0.0, gathers[i] - hidden[i - 1]) for i in range(1, k)) if prefetch \
            else sum(gathers)
        return gather + sum(reduces)
    if prefetch == 0:
        return sum(gathers) + sum(max(0.0, reduces[i] - computes[i + 1]) for i in range(k - 1)) + reduces[-1]
    return gathers[0] + sum(max(0.0, gathers[i] + reduces[i - 1] - computes[i - 1]) for i in range(1, k)) \
        + reduces[-1]


def _zero3_exposed(gather: float, reduce: float, m: int, units: int, fwd: float, bwd: float, prefetch: int
                   ) -> float:
    """Exposed ZeRO-3 traffic per step: `units` equal FSDP units per pass, 2m gathers and m reduce-scatters of
    each, the step's forward and backward compute `fwd` / `bwd` split evenly (`zero3_pass_exposed`).

    prefetch 0 is FSDP2's default, which still prefetches one unit in backward (`FSDPParamGroup.
    _backward_prefetch`, implicit when no explicit backward prefetch is set; measured in bench/zero_overlap.py),
    so only the forward loses its overlap."""
    g, r = gather / (2 * m * units), reduce / (m * units)
    forward = zero3_pass_exposed([g] * units, [0.0] * units, [fwd / units] * units, prefetch)
    backward = zero3_pass_exposed([g] * units, [r] * units, [bwd / units] * units, max(prefetch, 1))
    return m * (forward + backward)


def _dp_exposed(dp: dict[str, AxisComm], lay: Layout, m: int, fwd: float, bwd: float, bubble_s: float,
                units: int) -> float:
    reduce, gather = dp["reduce"].seconds, dp["gather"].seconds
    if lay.zero_stage == 3:
        if gather == reduce == 0.0:
            return 0.0
        return _zero3_exposed(gather, reduce, m, units, fwd, bwd, lay.prefetch)
    if lay.zero_stage == 2 and lay.pp == 1:  # under pp the stages reduce once, after the last backward
        return m * max(0.0, reduce / m - bwd) + max(0.0, gather - fwd - bubble_s / 2)
    return max(0.0, reduce - bwd - bubble_s / 2) + max(0.0, gather - fwd - bubble_s / 2)


def estimate(work: Workload, lay: Layout, hw: Hardware) -> Estimate:
    """Memory, time and utilization of `lay` running `work` on `hw` (structural validity is checked elsewhere)."""
    cfg, s = work.model, work.seq_len
    mem, mem_rank, parts = peak_memory(work, lay)
    m = lay.n_micro(work.global_batch)
    full_rc = lay.recompute == "full"
    layer_f, head_f = _layer_and_head_flops(cfg, s, full_rc)
    tokens_micro = s * lay.micro_batch // lay.cp  # load-balanced chunks: equal causal work per cp rank
    rate = hw.peak_flops * hw.mm_efficiency
    worst: tuple[float, float, AxisComm, AxisComm, AxisComm, RankParams, int] | None = None
    for rank in sorted({0, lay.pp - 1}):
        params = rank_params(cfg, lay, rank)
        n_layers = len(params.layers)
        is_last = lay.pp * lay.virtual - 1 in rank_chunks(lay, rank)
        compute = (n_layers * layer_f + (head_f if is_last else 0.0)) * tokens_micro / lay.tp / rate
        if lay.recompute == "selective":
            # The recomputed norms, RoPE and activations are memory-bound: rewrite what they produce.
            redo = layer_bytes(work, lay, "none") - layer_bytes(work, lay, "selective")
            compute += n_layers * 2 * max(0.0, redo) / (hw.hbm_gbps * 1e9)
        if lay.ep > 1 and params.n_moe:  # the busiest expert rank's surplus tokens through its experts
            compute += (work.moe_imbalance - 1) * params.n_moe * _routed_flops(cfg, full_rc) * tokens_micro \
                / lay.tp / rate
        tp = tp_comm_per_micro(work, lay, hw, n_layers)
        ep = ep_comm_per_micro(work, lay, hw, params.n_moe)
        cp = cp_comm_per_micro(work, lay, hw, n_layers)  # K/V all-gathers: on the critical path
        t = tp.seconds + cp.seconds + compute + ep.seconds
        if worst is None or t > worst[0]:
            worst = (t, compute, tp, ep, cp, params, rank)
    assert worst is not None
    t_micro, compute, tp_c, ep_c, cp_c, params, worst_rank = worst
    bubble = bubble_fraction(lay.schedule, lay.pp, m, lay.virtual)
    pipeline = m * t_micro / (1 - bubble)
    bubble_s = pipeline - m * t_micro
    pp = pp_comm_per_step(work, lay, hw)
    dp = dp_comm_per_step(work, lay, hw, params, worst_rank)
    fwd = compute * (0.25 if full_rc else 1 / 3)
    dp_exposed = _dp_exposed(dp, lay, m, fwd, compute - fwd, bubble_s, max(1, len(params.layers)))
    state_bytes = sum(parts[k] for k in ("params", "master", "grads", "optimizer"))
    optimizer_s = 2 * state_bytes / (hw.hbm_gbps * 1e9)
    nvme_s = 0.0
    if lay.nvme_offload:  # read and write exp_avg + exp_avg_sq of this rank's shard; the update waits on them
        states = model_state_bytes(params, dataclasses.replace(lay, nvme_offload=False), work.precision)
        nvme_s = 2 * states["optimizer"] / (hw.nvme_gbps * 1e9)
        optimizer_s += 2 * states["optimizer"] / (hw.hbm_gbps * 1e9)
    muon = AxisComm(0.0, 0, 0.0)
    muon_s = 0.0
    if work.optimizer == "muon":  # Newton-Schulz and the return trip run after backward, nothing hides them
        mb = muon_bytes(work, lay, max({0, lay.pp - 1}, key=lambda r: muon_bytes(work, lay, r).ns_flops))
        muon = muon_comm_per_step(work, lay, hw, mb)
        optimizer_s += mb.ns_flops / rate
        layer_bwd = (compute - fwd) / max(1, len(params.layers))  # one block's backward of one micro-batch
        muon_s = max(_muon_exposed(muon_comm_per_step(work, lay, hw, muon_bytes(work, lay, r)).seconds,
                                   mb.overlapped, _rank_chunk_blocks(work, lay, r), layer_bwd)
                     for r in sorted({0, lay.pp - 1}))
    step = pipeline + pp.seconds + dp_exposed + optimizer_s + nvme_s + muon_s
    tokens = work.global_batch * s
    model_flops = mfu_flops_per_token(cfg, s) * tokens  # the MFU convention shared with the observer
    hw_flops = _flops(cfg, s, full_rc) * tokens
    denom = step * lay.world * hw.peak_flops
    comm = {"tp": _scaled(tp_c, m), "cp": _scaled(cp_c, m), "ep": _scaled(ep_c, m), "pp": pp,
            "dp_reduce": dp["reduce"], "dp_gather": dp["gather"], **({"muon": muon} if muon.messages else {})}
    time = {"compute": m * compute, "tp": m * tp_c.seconds, "cp": m * cp_c.seconds, "ep": m * ep_c.seconds,
            "bubble": bubble_s, "pp_p2p": pp.seconds, "dp_exposed": dp_exposed, "optimizer": optimizer_s,
            "nvme_io": nvme_s, **({"muon_exchange": muon_s} if muon.messages else {})}
    return Estimate(lay, mem, mem_rank, parts, step, model_flops / denom, hw_flops / denom, tokens / step, bubble,
                    (model_flops, hw_flops), comm, time)


def _scaled(c: AxisComm, m: int) -> AxisComm:
    return AxisComm(c.wire_bytes * m, c.messages * m, c.seconds * m)


def _muon_exposed(seconds: float, overlapped: bool, chunks: list[tuple[int, int]], layer_bwd_s: float) -> float:
    """Exposed seconds of one pipeline rank's Muon all-to-alls (`seconds` both; `chunks`: (stage index, blocks)
    of its pipeline chunks, one (0, layers) without pp). The return trip is exposed whole. Overlapped, each
    chunk's share of the trip to the owners (by blocks) leaves unit by unit from the chunk's last backward: the
    last unit's share has nothing left of that backward to hide behind, the rest hides behind it up to its length;
    what remains hides behind the pipeline's drain after it, the last backwards of the stage-1 .. 0 chunks before
    it (stage c's last backward ends about c chunk backwards before stage 0's, whose end the step's first
    all-reduce waits for): the last stage finishes first and hides most, stage 0 hides nothing more."""
    if not overlapped:
        return seconds
    half, total = seconds / 2, sum(n for _, n in chunks)
    exposed = half
    for stage, units in chunks:
        share, own = half * units / total, units * layer_bwd_s
        exposed += max(0.0, share / units + max(0.0, share * (units - 1) / units - own) - stage * own)
    return exposed


def _rank_chunk_blocks(work: Workload, lay: Layout, rank: int) -> list[tuple[int, int]]:
    """(stage index, blocks) of each pipeline chunk of pipeline rank `rank`."""
    return [(stage, max(1, len(layers))) for stage, layers in zip(rank_chunks(lay, rank),
                                                                   chunk_layers(work.model, lay, rank), strict=True)]


__all__ = ["Estimate", "estimate", "zero3_pass_exposed"]

