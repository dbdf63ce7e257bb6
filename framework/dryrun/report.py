"""The dry run's verdict: per rank class, does the step fit the GPU, by how much, what dominates, what to change.

The tracked peak is what the dry run measured (tensor bytes). A GPU needs more than its tensors; these terms no
fake backend sees, so they are added as stated figures, each with its source, never folded into a factor:

- CUDA context and kernel images: 0.75 GiB per process. Source: PyTorch's CUDA notes (the context takes
  "hundreds of MB"); 500-800 MiB is what `nvidia-smi` shows for an idle torch 2.x + CUDA 12 process on H100.
- NCCL buffers: 2 x NCCL_BUFFSIZE (4 MiB default) x 16 channels = 128 MiB per communicator the rank uses (one
  per mesh axis the step communicates on). Source: NCCL's environment documentation (NCCL_BUFFSIZE,
  NCCL_MAX_NCHANNELS); lower with NCCL_BUFFSIZE or fewer channels.
- cuBLAS workspace: 32 MiB per stream x 3 streams (compute, FSDP all-gather, reduce-scatter). Source: cuBLAS
  documentation of CUBLAS_WORKSPACE_CONFIG (32 MiB recommended on Hopper).
- Allocator caching and fragmentation: 5% of the tracked peak. Source: PyTorch's CUDA caching-allocator notes
  (block rounding, split blocks; `expandable_segments:True` keeps it small). An allowance, not a measurement.

`Verdict.fits` compares tracked peak + these terms with the GPU's memory (framework/plan/hardware.py) less the
safety margin the user asks for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from framework.dryrun.run import RankClass
from framework.dryrun.step import StepMeasure
from framework.plan.hardware import GIB, Hardware

MIB = 2**20
CUDA_CONTEXT = int(0.75 * GIB)
NCCL_PER_COMMUNICATOR = 2 * 4 * MIB * 16
CUBLAS_WORKSPACE = 3 * 32 * MIB
FRAGMENTATION = 0.05

_LABELS = {
    "params": "parameters (local shards)",
    "grads": "gradients",
    "optimizer": "optimizer states",
    "buffers": "buffers (RoPE tables)",
    "forward": "activations kept for backward (all micro-batches in flight)",
    "backward": "backward: gradients not yet reduced, temporaries, recomputed activations",
    "logits_loss": "logits and loss",
    "fsdp_gathered": "FSDP all-gathered parameters",
    "collective_buffers": "FSDP all-gather / reduce-scatter buffers",
    "pipeline_recv": "pipeline receive buffers",
    "all_to_all": "MoE all-to-all buffers",
    "setup": "tensors from building the model (each rank's shards of the weights, drawn after FSDP shards them)",
}
_ADVICE = {
    "setup": "building the model passes the budget: this rank's shards of the weights do not fit, "
             "so raise tp or pp (smaller local weights) or the FSDP group",
    "forward": "activations dominate: set parallel.recompute=full (or selective), lower train.micro_batch_size, "
               "or spread the sequence with a larger tp (sequence parallel) or cp",
    "backward": "backward working memory dominates: set parallel.recompute=selective/full or lower "
                "train.micro_batch_size",
    "optimizer": "optimizer states dominate: raise parallel.zero_stage (1 shards them over dp), a larger data "
                 "axis, more pp/tp, or parallel.nvme_offload",
    "params": "parameters dominate: parallel.zero_stage=3, or more tp / pp (fewer layers per rank)",
    "grads": "gradients dominate: parallel.zero_stage>=2 shards them, or more tp / pp",
    "fsdp_gathered": "gathered FSDP units dominate: parallel.fsdp_layers_per_unit=1 and parallel.fsdp_prefetch=1 "
                     "(or 0), or fewer layers per rank",
    "collective_buffers": "FSDP bucket buffers dominate: lower parallel.fsdp_layers_per_unit",
    "logits_loss": "the logits dominate: parallel.loss_parallel with tp > 1, or a smaller micro-batch",
    "pipeline_recv": "pipeline buffers dominate: fewer micro-batches in flight (1F1B over GPipe) or smaller ones",
    "all_to_all": "all-to-all buffers dominate: a larger ep, a capacity factor, or a smaller micro-batch",
}


@dataclass
class Verdict:
    """One rank class: measured peak, the stated extra terms, the total against the GPU."""

    rank_class: RankClass
    measure: StepMeasure
    extra: dict[str, int]
    total: int
    budget: int
    gpu: str
    top: list[tuple[str, int]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget and not self.measure.over_budget

    @property
    def headroom(self) -> int:
        return self.budget - self.total

    def advice(self) -> list[str]:
        if self.fits:
            return []
        return [_ADVICE[k] for k, _ in self.top[:2] if k in _ADVICE]

    def to_json(self) -> dict[str, Any]:
        return {"rank_class": asdict(self.rank_class), "measure": self.measure.to_json(), "extra": self.extra,
                "total": self.total, "budget": self.budget, "gpu": self.gpu, "fits": self.fits,
                "headroom": self.headroom, "top": self.top, "advice": self.advice()}


def extra_terms(measure: StepMeasure) -> dict[str, int]:
    """The stated terms a fake backend cannot see (module docstring)."""
    communicators = sum(1 for axis in {c.axis for c in measure.collectives}
                        if any(c.axis == axis and c.group_size > 1 for c in measure.collectives))
    return {"cuda_context": CUDA_CONTEXT, "nccl_buffers": communicators * NCCL_PER_COMMUNICATOR,
            "cublas_workspace": CUBLAS_WORKSPACE, "allocator_fragmentation": int(FRAGMENTATION * measure.peak)}


def verdict(rank_class: RankClass, measure: StepMeasure, hw: Hardware, margin: float) -> Verdict:
    extra = extra_terms(measure)
    top = sorted(measure.peak_by_label.items(), key=lambda kv: -kv[1])[:4]
    return Verdict(rank_class, measure, extra, measure.peak + sum(extra.values()),
                   int(hw.memory_bytes * (1 - margin)), hw.name, top)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def format_table(verdicts: list[Verdict], world_size: int, config: str) -> str:
    """The 10-second read: one line per rank class, the verdict first, then what dominates."""
    if not verdicts:
        return "no rank classes"
    budget = verdicts[0].budget
    lines = [f"dry run of {config} at {world_size} ranks on {verdicts[0].gpu} "
             f"(budget {_gib(budget)} GiB per GPU after the margin)", ""]
    head = f"{'rank class':<22} {'ranks':>6} {'layers':>6} {'states':>7} {'peak':>7} {'+extra':>7} " \
           f"{'total':>7}  verdict"
    lines += [head, "-" * len(head)]
    for v in verdicts:
        s = v.measure.states
        states = s.get("params", 0) + s.get("grads", 0) + s.get("optimizer", 0)
        word = f"fits, {_gib(v.headroom)} GiB spare" if v.fits else f"DOES NOT FIT by {_gib(-v.headroom)} GiB"
        if v.measure.over_budget:
            word = f"DOES NOT FIT: stopped at {_gib(v.measure.peak)} GiB of tensors ({v.measure.peak_phase})"
        lines.append(f"{v.rank_class.name:<22} {v.rank_class.members:>6} {v.rank_class.layers:>6} "
                     f"{_gib(states):>7} {_gib(v.measure.peak):>7} {_gib(sum(v.extra.values())):>7} "
                     f"{_gib(v.total):>7}  {word}")
    lines.append("(GiB; states = params + grads + optimizer held between steps; peak = tracked tensor bytes of "
                 "one step; extra = CUDA context, NCCL, cuBLAS, fragmentation: framework/dryrun/report.py)")
    for v in verdicts:
        lines += ["", f"{v.rank_class.name}: biggest terms at the peak ({v.measure.peak_phase}): " + ", ".join(
            f"{_LABELS.get(k, k)} {_gib(b)}" for k, b in v.top)]
        by_axis: dict[str, list[str]] = {}
        for c in v.measure.collectives:
            if c.bytes >= MIB:
                by_axis.setdefault(f"{c.axis}({c.group_size})", []).append(
                    f"{c.op} {c.bytes / GIB:.2f} GiB x{c.calls} {'/'.join(c.dtypes)}")
        for axis, ops in by_axis.items():
            lines.append(f"  {axis:<16} " + "; ".join(ops))
        for advice in v.advice():
            lines.append(f"  to fit: {advice}")
    return "\n".join(lines)
