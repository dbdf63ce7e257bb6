"""Search the layouts of a cluster: enumerate, reject (with reasons), keep what fits, rank by step time.

Enumerated: tp (divisors of the node size), pp (divisors of n_layers), dp = GPUs / (tp·pp), ep (divisors of the
expert count), ZeRO stage 0-3, recompute none/selective/full, micro-batch size, and per pipeline size the
schedules with their virtual-stage counts. A layout is kept when its peak per-rank memory stays under
(1 - margin) of the GPU's memory; kept layouts are ranked by estimated step time (equivalently MFU).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from framework.base.errors import ParallelismError, divisors
from framework.parallel.pipeline_schedules import schedule_spec
from framework.plan.activations import RECOMPUTE_MODES
from framework.plan.estimate import Estimate, estimate
from framework.plan.hardware import GIB, Hardware
from framework.plan.layout import Layout, Workload, layout_problem
from framework.plan.memory import peak_memory

DEFAULT_SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class SearchSpace:
    """What to enumerate beyond the structural degrees."""

    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    nvme_offload: tuple[bool, ...] = (False,)
    """(False, True) also tries every sharded layout with its AdamW states on NVMe."""
    prefetch: int = 1
    """FSDP units gathered ahead under ZeRO-3 (parallel.fsdp_prefetch)."""
    zeropp: frozenset[str] = frozenset()
    """ZeRO++ options applied to every sharded tp=1 dense layout, as Tessera runs them: "qwz", "hpz" (a node's
    shard ranks, gpus_per_node, where that divides dp x cp and is smaller), "qgz"."""
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    max_virtual: int = 8
    cp_degrees: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Context-parallel degrees tried where each rank keeps >= `min_cp_tokens` tokens of the sequence."""
    min_cp_tokens: int = 4096
    """Below this many local tokens a cp rank's attention and K/V gathers are latency-bound (Llama 3 ran 8k
    per rank at 128k context); such cp degrees are not enumerated."""
    memory_margin: float = 0.1
    """Fraction of GPU memory kept free (allocator fragmentation, CUDA context, NCCL buffers)."""


@dataclass
class PlanResult:
    """Ranked feasible estimates, and why everything else was rejected."""

    gpus: int
    feasible: list[Estimate]
    rejected: Counter[str] = field(default_factory=Counter)
    """Rejections by kind of reason (numbers blanked out)."""
    examples: dict[str, str] = field(default_factory=dict)
    """One concrete sentence per kind of reason."""
    closest_over_memory: tuple[float, Layout] | None = None
    """The layout that came closest to fitting: (peak bytes, layout)."""
    evaluated: int = 0

    def top(self, k: int) -> list[Estimate]:
        """The best estimate of each of the k best distinct (tp, pp, ep) layouts."""
        out: list[Estimate] = []
        seen: set[tuple[int, int, int, int]] = set()
        for est in self.feasible:
            if est.layout.key() not in seen:
                seen.add(est.layout.key())
                out.append(est)
            if len(out) == k:
                break
        return out

    def rank_of(self, tp: int, pp: int, ep: int = 1, cp: int = 1) -> int | None:
        """1-based rank of the (tp, pp, ep, cp) layout among distinct layouts, or None when none of it fits."""
        keys: list[tuple[int, int, int, int]] = []
        for est in self.feasible:
            if est.layout.key() not in keys:
                keys.append(est.layout.key())
        return keys.index((tp, pp, ep, cp)) + 1 if (tp, pp, ep, cp) in keys else None


def usable_bytes(hw: Hardware, space: SearchSpace) -> float:
    """GPU memory a layout may use: capacity minus the safety margin."""
    return hw.memory_bytes * (1 - space.memory_margin)


def _schedules(lay: Layout, work: Workload, space: SearchSpace) -> Iterator[tuple[str, int]]:
    if lay.pp == 1:
        yield "1F1B", 1
        return
    per_rank = work.model.n_layers // lay.pp
    for name in space.schedules:
        shape = schedule_spec(name).shape
        if shape == "looped":
            yield from ((name, v) for v in divisors(per_rank) if 1 < v <= space.max_virtual)
        elif shape == "v":
            if per_rank % 2 == 0:
                yield name, 2
        else:
            yield name, 1


def degrees(work: Workload, gpus: int, hw: Hardware, space: SearchSpace | None = None
            ) -> Iterator[tuple[int, int, int, int, int]]:
    """(tp, pp, dp, ep, cp) with tp·pp·cp·dp = gpus, tp within a node, pp dividing n_layers."""
    cfg, space = work.model, space or SearchSpace()
    cps = [c for c in space.cp_degrees if c == 1 or (work.seq_len // c >= space.min_cp_tokens
                                                     and not cfg.moe.enabled)]
    for tp in divisors(hw.gpus_per_node):
        for pp in divisors(cfg.n_layers):
            for cp in cps:
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                for ep in divisors(cfg.moe.n_experts) if cfg.moe.enabled else [1]:
                    yield tp, pp, dp, ep, cp


def candidates(work: Workload, gpus: int, hw: Hardware, space: SearchSpace) -> Iterator[Layout]:
    """Every layout of the search space for `gpus` GPUs (structurally invalid ones included, to count them)."""
    for tp, pp, dp, ep, cp in degrees(work, gpus, hw, space):
        for mbs in space.micro_batches:
            base = Layout(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, micro_batch=mbs)
            for schedule, v in _schedules(base, work, space):
                for zero in space.zero_stages:
                    for rc in space.recompute:
                        for nvme in space.nvme_offload if zero > 0 else (False,):
                            yield dataclasses.replace(base, schedule=schedule, virtual=v, zero_stage=zero,
                                                      recompute=rc, nvme_offload=nvme,  # type: ignore[arg-type]
                                                      prefetch=space.prefetch, **_zeropp(base, zero, hw, space))


def _zeropp(lay: Layout, zero: int, hw: Hardware, space: SearchSpace) -> dict[str, Any]:
    """The ZeRO++ fields of a candidate (framework/parallel/mesh.py `zeropp_layout_problem`'s rules)."""
    if zero == 0 or lay.shard_group == 1 or lay.tp > 1 or lay.ep > 1:  # proven on tp=1 dense layouts only
        return {}
    node = hw.gpus_per_node // lay.tp
    hpz = node if ("hpz" in space.zeropp and zero == 3 and 1 < node < lay.shard_group
                   and lay.shard_group % node == 0) else 1
    return {"qwz": "qwz" in space.zeropp, "qgz": "qgz" in space.zeropp, "hpz": hpz}


def _reason_key(problem: str) -> str:
    """Group similar rejection sentences ('tp=16 exceeds ...' and 'tp=32 exceeds ...')."""
    return re.sub(r"(?<![A-Za-z])\d+(\.\d+)?", "#", problem)


def _reject(result: PlanResult, key: str, example: str) -> None:
    result.rejected[key] += 1
    result.examples.setdefault(key, example)


def plan(work: Workload, gpus: int, hw: Hardware, space: SearchSpace | None = None, *,
         progress: bool = False) -> PlanResult:
    """Enumerate every layout of `gpus` GPUs for `work`, estimate those that fit, rank by step time."""
    space = space or SearchSpace()
    limit = usable_bytes(hw, space)
    result = PlanResult(gpus, [])
    items = list(candidates(work, gpus, hw, space))
    for lay in tqdm(items, desc=f"plan {gpus} GPUs", disable=not progress, leave=False):
        result.evaluated += 1
        problem = layout_problem(work, lay, hw)
        if problem is not None:
            _reject(result, _reason_key(problem), problem)
            continue
        mem = peak_memory(work, lay)[0]
        if mem > limit:
            _reject(result, "peak memory over the usable GPU memory",
                    f"peak memory {mem / GIB:.1f} GiB over {limit / GIB:.1f} GiB usable ({lay.describe()})")
            if result.closest_over_memory is None or mem < result.closest_over_memory[0]:
                result.closest_over_memory = (mem, lay)
            continue
        result.feasible.append(estimate(work, lay, hw))
    if result.closest_over_memory is not None:
        mem, lay = result.closest_over_memory
        result.examples["peak memory over the usable GPU memory"] = (
            f"peak memory over {limit / GIB:.1f} GiB usable; closest: {lay.describe()} at {mem / GIB:.1f} GiB")
    result.feasible.sort(key=lambda e: (e.step_s, e.memory_bytes))
    return result


def fits_somewhere(work: Workload, gpus: int, hw: Hardware, space: SearchSpace) -> Layout | None:
    """A layout of `gpus` GPUs that is valid and fits memory, trying the leanest settings first."""
    limit = usable_bytes(hw, space)
    for tp, pp, dp, ep, cp in degrees(work, gpus, hw, space):
        lay = Layout(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, zero_stage=3 if dp * cp > 1 else 1, recompute="full",
                     micro_batch=1)
        if layout_problem(work, lay, hw) is None and peak_memory(work, lay)[0] <= limit:
            return lay
    return None


def smallest_cluster(work: Workload, hw: Hardware, space: SearchSpace | None = None,
                     max_gpus: int = 1 << 20) -> tuple[int, Layout] | None:
    """The fewest GPUs (whole nodes, or a divisor of one node) on which some layout fits, with that layout."""
    space = space or SearchSpace()
    sizes: set[int] = set()
    for tp in divisors(hw.gpus_per_node):
        for pp in divisors(work.model.n_layers):
            for dp in divisors(work.global_batch):
                for cp in space.cp_degrees:
                    n = tp * pp * dp * cp
                    if n <= max_gpus and (n % hw.gpus_per_node == 0 or hw.gpus_per_node % n == 0):
                        sizes.add(n)
    for n in sorted(sizes):
        lay = fits_somewhere(work, n, hw, space)
        if lay is not None:
            return n, lay
    return None


def valid_gpu_counts_near(work: Workload, gpus: int, hw: Hardware, space: SearchSpace, n: int = 2) -> list[int]:
    """Up to n GPU counts below and above `gpus` (whole nodes) that admit a memory-feasible layout."""
    node = hw.gpus_per_node
    below: list[int] = []
    above: list[int] = []
    c = (gpus // node) * node
    while c >= node and len(below) < n and gpus - c <= 64 * node:
        if c != gpus and fits_somewhere(work, c, hw, space):
            below.append(c)
        c -= node
    c = (gpus // node + 1) * node
    while len(above) < n and c - gpus <= 64 * node:
        if fits_somewhere(work, c, hw, space):
            above.append(c)
        c += node
    return sorted(below) + above


def plan_or_explain(work: Workload, gpus: int, hw: Hardware, space: SearchSpace | None = None, *,
                    progress: bool = False) -> PlanResult:
    """`plan`, raising a `ParallelismError` that explains the rejections when nothing fits."""
    space = space or SearchSpace()
    if gpus < 1:
        raise ParallelismError(f"--gpus {gpus} must be >= 1")
    if gpus > hw.gpus_per_node and gpus % hw.gpus_per_node:
        near = valid_gpu_counts_near(work, gpus, hw, space)
        smallest = smallest_cluster(work, hw, space)
        raise ParallelismError(
            f"--gpus {gpus} is not a whole number of {hw.gpus_per_node}-GPU nodes; "
            f"use a multiple of {hw.gpus_per_node}" + (f", e.g. {near} (layouts fit there)" if near else "")
            + (f"; the smallest cluster that fits is {smallest[0]} x {hw.name}" if smallest else ""))
    result = plan(work, gpus, hw, space, progress=progress)
    if result.feasible:
        return result
    raise ParallelismError(explain_infeasible(work, gpus, hw, space, result))


def explain_infeasible(work: Workload, gpus: int, hw: Hardware, space: SearchSpace, result: PlanResult) -> str:
    """A message naming why each group of layouts was rejected and the smallest cluster that would fit."""
    lines = [f"no layout of {gpus} x {hw.name} fits {describe_workload(work)} "
             f"({result.evaluated} candidates):"]
    lines += rejection_lines(result, 6)
    if result.closest_over_memory is not None:
        mem, lay = result.closest_over_memory
        lines.append(f"  closest: {lay.describe()} needs {mem / GIB:.1f} GiB per GPU, "
                     f"{usable_bytes(hw, space) / GIB:.1f} GiB usable")
    smallest = smallest_cluster(work, hw, space)
    if smallest is None:
        lines.append("  no cluster size fits: lower the sequence length or the micro-batch, or use GPUs with "
                     "more memory")
    else:
        n, lay = smallest
        lines.append(f"  fix: the smallest cluster that fits is {n} x {hw.name} ({lay.describe()}); "
                     f"or change --global-batch so it divides into the data-parallel ranks")
    return "\n".join(lines)


def rejection_lines(result: PlanResult, limit: int | None = None) -> list[str]:
    """'  count x example' per kind of rejection, most frequent first."""
    return [f"  {count:6d} x {result.examples[key]}" + (" (and similar)" if count > 1 else "")
            for key, count in result.rejected.most_common(limit)]


def describe_workload(work: Workload) -> str:
    """'llama3-8b (8.0B params) at seq 4096, global batch 256' for reports and errors."""
    from models.flops import num_params

    cfg = work.model
    name = cfg.preset or f"{cfg.n_layers}L h{cfg.hidden}"
    return (f"{name} ({num_params(cfg) / 1e9:.1f}B params) at seq {work.seq_len}, "
            f"global batch {work.global_batch}")


__all__ = ["DEFAULT_SCHEDULES", "PlanResult", "SearchSpace", "candidates", "degrees", "explain_infeasible",
           "fits_somewhere", "plan", "plan_or_explain", "rejection_lines", "smallest_cluster",
           "usable_bytes", "valid_gpu_counts_near"]

