"""The planner's formulas beside the dry run's measurements, term by term, for one config's layout.

    rows = compare(cfg, world_size, verdicts)      # one row per rank class: (term, planner bytes, dry-run bytes)

The planner (framework/plan/memory.py) predicts a pipeline rank's peak from formulas; the dry run measures the
same rank's step. Terms are matched by meaning: model states (parameters, master copy, gradients, optimizer
states held between steps), activations kept for backward, logits and loss, and the rest (buffers,
gathered parameters, temporaries); under Muon also the owner exchange's all-to-all bytes and the optimizer
step's transient (framework/plan/muon.py). A term whose two figures differ by more than 10% is flagged; docs/PLANNER.md
explains or the planner is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config import Config
from framework.dryrun.report import Verdict
from framework.parallel.mesh import ParallelDims
from framework.plan.activations import FP32
from framework.plan.layout import Layout, Precision, Workload
from framework.plan.memory import rank_memory, rank_params, resident_state_bytes
from framework.plan.muon import muon_bytes

TOLERANCE = 0.10


@dataclass(frozen=True)
class TermRow:
    rank_class: str
    term: str
    planner: float
    dryrun: float

    @property
    def ratio(self) -> float:
        return self.planner / self.dryrun if self.dryrun else float("inf") if self.planner else 1.0

    @property
    def agrees(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE


def layout_of(cfg: Config, world_size: int) -> tuple[Workload, Layout]:
    """The planner's view of `cfg` at `world_size`."""
    p = cfg.parallel
    dims = ParallelDims.from_config(p, world_size, cfg.model)
    work = Workload(cfg.model, cfg.data.seq_len, cfg.train.global_batch_size, Precision.named(cfg.train.precision),
                    cp_comm=p.cp_comm, fp8_all_gather=cfg.train.fp8.enabled and cfg.train.fp8.fsdp_all_gather,
                    optimizer=cfg.train.optimizer, muon_ns_bytes=2 if cfg.train.muon.ns_dtype == "bf16" else 4,
                    muon_overlap=cfg.train.muon.overlap)
    lay = Layout(tp=dims.tp, pp=dims.pp, dp=dims.dp_size, ep=dims.ep, cp=dims.cp, zero_stage=p.zero_stage,
                 recompute=p.recompute, micro_batch=cfg.train.micro_batch_size, schedule=p.pp_schedule,
                 virtual=p.virtual_stages if dims.pp > 1 else 1, prefetch=p.fsdp_prefetch,
                 layer_split=tuple(p.pp_layer_split) if dims.pp > 1 and p.pp_layer_split else None)
    return work, lay


def act_vocab(work: Workload, lay: Layout) -> int:
    """Logit elements of one micro-batch on a last-stage rank (its tokens x its vocabulary shard)."""
    return (work.seq_len // lay.cp) * lay.micro_batch * (work.model.vocab_size // lay.tp)


def compare(cfg: Config, world_size: int, verdicts: list[Verdict]) -> list[TermRow]:
    """Planner vs dry run, per rank class, for states, activations, logits and the total peak."""
    work, lay = layout_of(cfg, world_size)
    rows: list[TermRow] = []
    for v in verdicts:
        pp_rank = v.rank_class.pp_ranks[0]
        plan = rank_memory(work, lay, pp_rank)
        # Held between steps, as the dry run measures them; the step-time rest stays in the planner's peak.
        states = resident_state_bytes(rank_params(work.model, lay, pp_rank), lay, work.precision)
        muon = muon_bytes(work, lay, pp_rank) if work.optimizer == "muon" else None
        states += muon.state_delta if muon else 0.0
        measured = v.measure.states
        dry_states = sum(measured.get(k, 0) for k in ("params", "grads", "optimizer"))
        at_peak = v.measure.peak_by_label
        # The logits and the loss's tensors live for one micro-batch's loss, seldom at the total's peak: they are
        # compared with their own largest size in the step (`label_max`): the logits (compute dtype), their fp32
        # copy in the loss and its fp32 log-probabilities at once. The planner's activations and peak are those
        # of its peak moment (framework/plan/phases.py), as the dry run's are at its peak.
        own_max = v.measure.label_max or at_peak
        logits = (act_vocab(work, lay) * (work.precision.act + 2 * FP32) if "logits" in plan else 0)
        name = v.rank_class.name
        rows += [
            TermRow(name, "model states", states, dry_states),
            TermRow(name, "activations", plan.get("activations", 0.0) + plan.get("pipeline_recv", 0.0),
                    at_peak.get("forward", 0) + at_peak.get("pipeline_recv", 0)),
            TermRow(name, "logits and loss", logits, own_max.get("logits_loss", 0)),
            TermRow(name, "peak", sum(plan.values()), v.measure.peak),
        ]
        if muon:  # the owner exchange's payload per step on its primary axes, and the update's transient
            measured_a2a = sum(c.bytes for c in v.measure.collectives if c.op == "all_to_all" and c.axis != "ep")
            rows += [TermRow(name, "muon all_to_all", sum(muon.all_to_all.values()), measured_a2a),
                     TermRow(name, "muon transient", muon.transient, v.measure.optimizer_rise)]
    return rows


def format_rows(rows: list[TermRow]) -> str:
    biggest = max((max(r.planner, r.dryrun) for r in rows), default=0.0)
    unit, scale = ("GiB", 2**30) if biggest >= 2**30 else ("MiB", 2**20)
    lines = [f"{'rank class':<22} {'term':<16} {'planner ' + unit:>11} {'dry run ' + unit:>11} {'ratio':>6}"]
    for r in rows:
        flag = "" if r.agrees else "  > 10%"
        lines.append(f"{r.rank_class:<22} {r.term:<16} {r.planner / scale:>11.2f} {r.dryrun / scale:>11.2f} "
                     f"{r.ratio:>6.2f}{flag}")
    return "\n".join(lines)
