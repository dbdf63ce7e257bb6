"""Muon on every parity layout against the one-process Muon run (`LocalEngine`): loss and grad norm per step
within 1e-5 and the final parameters' checksums within 1e-5 relative (tests/parallel/parallel_parity.py).

The Newton-Schulz matmuls run in fp32 here (`train.muon.ns_dtype=fp32`): the whole matrices the owner ranks
assemble are then the one-process matrices up to the gradients' reduction order, and so are the updates.
Layouts cover every way a matrix is cut: FSDP Shard(0) with ZeRO-1/2/3, HSDP, TP column/row shards, FSDP x TP
(`_StridedShard`), uneven shards (dp_shard=3: 64 rows as 22/22/20, 128 as 43/43/42), stacked experts under EP
with FSDP's Shard(1), pipeline stages (1F1B and interleaved), TP2 x PP2 x DP2 and CP2; QK-clip (MuonClip) under
TP2, DP2 ZeRO-3 and TP2 x DP2 ZeRO-3; per-head blocks under TP2 x DP2 ZeRO-3; plus fp16 loss scaling
around Muon (against the fp16 one-process run, as the AdamW suite does). All rounds share one 8-rank process
group.

The owner exchange overlapped with backward (`train.muon.overlap`, on by default where the layout allows it:
FSDP, tp included, pp with a whole backward; EP with MoE, grouped FSDP units and ZeRO++ qgZ included; tp without
FSDP, also under dp_replicate) runs on every such layout above; nine of them run again with it off (ZeRO-3, uneven
shards, HSDP, PP2 x DP2 1F1B ZeRO-3 and interleaved ZeRO-1, EP2 x DP4 with units of two blocks, qgZ,
TP2 x dp_replicate 2, TP2 x DP2 ZeRO-3), and the two runs must agree bitwise (losses, grad norms, final
parameters, the momentum `state_dict` saves, and the momentum elements held over the ranks). Each overlapped run
must have launched its exchange from inside backward, once per FSDP unit holding exchanged matrices and step
(`hooked_units`; under pp those of the optimizer's own stage, from that stage's last backward; without FSDP once
per block), and sent nothing at the step; the others never launch. The qgZ layout, whose int8 gradients leave
the one-process run, is held to its twin only.
"""

from __future__ import annotations

from typing import Any

import pytest
from parallel_parity import STEPS, compare, layout_world, make_config, pack_rounds, run_round

from framework.parallel.mesh import ParallelDims, stage_layers
from framework.testing import run_distributed
from framework.train.muon_overlap import overlap_problem

MUON = {"train.optimizer": "muon", "train.muon.ns_dtype": "fp32"}
CLIP = {**MUON, "train.muon.qk_clip": True, "train.muon.qk_clip_tau": 0.1}
MOE = {**MUON, "model.preset": "test-moe", "model.moe.n_experts": 4, "model.moe.top_k": 2}
# experts cut over a 2-rank edp group (Shard(1)), each an FSDP unit inside a unit of 2 blocks
EXPERT_UNITS = {"ep": 2, "dp_shard": 4, "zero_stage": 2, "fsdp_layers_per_unit": 2, **MOE}
# ZeRO++ qgZ (int8 reduce-scatter) with ZeRO-1's accumulation: held to its plain-exchange twin only (bitwise), as
# quantized gradients leave the 1-process run
QGZ = {"dp_shard": 2, "zero_stage": 1, "zero_quantized_gradients": True, **MUON}
QUANTIZED = ("zero_quantized_gradients",)

LAYOUTS: list[dict[str, Any]] = [
    {"tp": 2, "dp_shard": 1, "zero_stage": 0, **MUON},
    {"pp": 2, "dp_shard": 1, "pp_schedule": "1F1B", **MUON},
    {"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", **MUON},
    {"dp_shard": 2, "zero_stage": 1, **MUON},
    {"dp_shard": 2, "zero_stage": 2, **MUON},
    {"dp_shard": 2, "zero_stage": 3, **MUON},
    {"dp_shard": 2, "dp_replicate": 2, "zero_stage": 1, **MUON},
    {"dp_shard": 3, "zero_stage": 3, "train.global_batch_size": 6, **MUON},
    {"tp": 2, "dp_shard": 2, "zero_stage": 3, **MUON},
    {"tp": 2, "pp": 2, "dp_shard": 2, "zero_stage": 1, **MUON},
    {"ep": 2, "dp_shard": 2, "zero_stage": 1, **MOE},
    {"ep": 2, "tp": 2, "dp_shard": 2, "zero_stage": 3, **MOE},
    {"dp_shard": 1, "zero_stage": 0, "ep": 1, **MOE},
    # context parallelism folds cp into FSDP's shard dim (dp_shard_cp): the owner exchange runs over it
    {"cp": 2, "dp_shard": 1, **MUON},
    # QK-clip (MuonClip) at a tau under the tiny model's logits (~0.1), so heads clip every step: TP's local heads,
    # the maxima over data ranks, rows rescaled on FSDP shards and on FSDP x TP's _StridedShard pieces
    {"tp": 2, "dp_shard": 1, "zero_stage": 0, **CLIP},
    {"dp_shard": 2, "zero_stage": 3, **CLIP},
    {"tp": 2, "dp_shard": 2, "zero_stage": 3, **CLIP},
    # per-head blocks (train.muon.per_head) on the owners' assembled matrices, FSDP x TP pieces
    {"tp": 2, "dp_shard": 2, "zero_stage": 3, **MUON, "train.muon.per_head": True},
    # fp16 loss scaling (unscale, overflow skip) around Muon, against the fp16 one-process Muon run.
    {"tp": 2, "dp_shard": 2, "zero_stage": 1, "train.precision": "fp16", **MUON},
    # FSDP units of 3 blocks and 1 (fully_shard over a list of blocks), ZeRO-3
    {"dp_shard": 2, "zero_stage": 3, "fsdp_layers_per_unit": 3, **MUON},
    EXPERT_UNITS,
    QGZ,
]
# pipeline stages over FSDP: each stage's last backward launches its units (overlapped). 3 micro-batches, so
# the owners' repeat of the schedule's 1/n_micro is a division that rounds unlike a multiplication by 1/3
PP_ZERO3 = {"pp": 2, "dp_shard": 2, "zero_stage": 3, "pp_schedule": "1F1B", "train.global_batch_size": 12, **MUON}
PP_INTERLEAVED = {"pp": 2, "dp_shard": 2, "zero_stage": 1, "pp_schedule": "Interleaved1F1B", **MUON}
LAYOUTS += [PP_ZERO3, PP_INTERLEAVED]
OFF = {"train.muon.overlap": False}
# the plain exchange on layouts that overlap by default: ZeRO-3, uneven shards, HSDP with ZeRO-1's accumulation
LAYOUTS += [{**layout, **OFF} for layout in (LAYOUTS[5], LAYOUTS[7], LAYOUTS[6])]
# ... and pipeline stages over FSDP (1F1B ZeRO-3, interleaved ZeRO-1: two stages per rank)
LAYOUTS += [{**layout, **OFF} for layout in (PP_ZERO3, PP_INTERLEAVED)]
# ... and experts in their own units inside grouped units, qgZ
LAYOUTS += [{**layout, **OFF} for layout in (EXPERT_UNITS, QGZ)]
# tp: without FSDP each block goes over tp once final (TP2 above from post-accumulate-grad hooks; here under
# dp_replicate from the DDP sync once its bucket is averaged, buckets small enough that every block leaves from
# backward: the last bucket, finished after backward, holds the embedding alone); FSDP x TP over the dp_shard x tp
# ranks in one hop, one owner each (not the plain exchange's owners: the twin checks the batching changes nothing)
TP_REPLICATED = {"tp": 2, "dp_replicate": 2, "dp_shard": 1, "zero_stage": 0, "ddp_bucket_mb": 0.02, **MUON}
LAYOUTS += [TP_REPLICATED, {**TP_REPLICATED, **OFF}, {**LAYOUTS[8], **OFF}]


def _run_rounds(rank: int, world: int, rounds: list[list[dict[str, Any]]]) -> list[dict[int, Any]]:
    """parallel_parity.run_rounds, adding each layout's Muon launch counts ({"backward": n, "step": n}), its saved
    momentum's checksums and the momentum elements this rank holds."""
    import torch.distributed as dist

    from framework.train.muon import Muon

    made: list[Muon] = []
    init = Muon.__init__

    def recording_init(self: Muon, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    Muon.__init__ = recording_init  # type: ignore[method-assign]
    out = []
    for layouts in rounds:
        before = len(made)
        result = run_round(rank, world, layouts)
        held = sum(_momentum_elements(m) for m in made[before:])
        out.append({i: (*v, [(m.overlapped, dict(m.launches)) for m in made[before:]],
                        [_momentum(m) for m in made[before:]], held) for i, v in result.items()})
    dist.barrier()
    return out


def _momentum(opt: Any) -> list[tuple[float, float, float]]:
    """Checksums of the whole momentum matrices in `opt.state_dict()` (what a checkpoint saves; a collective under
    the overlapped exchange, whose owners send their whole momentum back to the pieces)."""
    from parallel_parity import checksum
    from torch.distributed.tensor import DTensor

    states = opt.state_dict()["state"]
    bufs = [states[k]["momentum_buffer"] for k in sorted(states) if "momentum_buffer" in states[k]]
    return [checksum(b.full_tensor() if isinstance(b, DTensor) else b) for b in bufs]


def _momentum_elements(opt: Any) -> int:
    from torch.distributed.tensor import DTensor

    bufs = [st["momentum_buffer"] for p, st in opt.state.items() if "momentum_buffer" in st]
    return sum((b.to_local() if isinstance(b, DTensor) else b).numel() for b in bufs)


def overlap_mismatches(rounds: list[list[dict[str, Any]]], results: list[list[dict[int, Any]]]) -> list[str]:
    """Launch counts against `overlap_problem`, and each plain-exchange twin against its overlapped layout: the
    same results, and the same momentum elements over the layout's ranks (each matrix's once per replica, whoever
    holds it; under FSDP x TP not once per tp rank of its owner)."""
    bad, runs, held = [], {}, {}
    for i, layouts in enumerate(rounds):
        for j, layout in enumerate(layouts):
            per_rank = [r[i][j] for r in results if j in r[i]]
            runs[str(sorted(layout.items()))] = (*per_rank[0][:2], [r[3] for r in per_rank])  # + saved momentum
            held[str(sorted(layout.items()))] = sum(r[4] for r in per_rank)
            cfg = make_config(tuple(f"{k}={v}" if "." in k else f"parallel.{k}={v}" for k, v in layout.items()))
            dims = ParallelDims.from_config(cfg.parallel, layout_world(layout), cfg.model)
            on = overlap_problem(cfg.train, cfg.parallel, dims, cfg.model) is None
            want = (on, {"backward": STEPS * hooked_units(cfg, dims) if on else 0, "step": 0})
            bad += [f"{layout}: (overlapped, launches) {got} on a rank, want {want}"
                    for r in per_rank for got in r[2] if got != want]
    for layout in LAYOUTS:
        if OFF.items() <= layout.items():
            twin = {k: v for k, v in layout.items() if k not in OFF}
            if runs[str(sorted(layout.items()))] != runs[str(sorted(twin.items()))]:
                bad.append(f"{layout}: the plain exchange differs from the overlapped one (losses, grad norms, "
                           "parameters or the momentum state_dict saves)")
            if held[str(sorted(layout.items()))] != held[str(sorted(twin.items()))]:
                bad.append(f"{twin}: momentum elements over the ranks, plain {held[str(sorted(layout.items()))]}, "
                           f"overlapped {held[str(sorted(twin.items()))]}")
    return bad


def hooked_units(cfg: Any, dims: ParallelDims) -> int:
    """The FSDP units that send Muon pieces from backward, each once per step, of every Muon optimizer of a rank:
    one optimizer per model part, and under pp a part is a pipeline stage holding only its own layers (equal
    splits here). A part's units: its blocks' (parallel.fsdp_layers_per_unit blocks each, the last one shorter),
    and each MoE layer's experts where they are an FSDP unit (dp_shard > 1) cut over more than one edp rank (else
    every rank holds its experts whole and nothing of theirs is exchanged). The root unit holds no Muon matrix."""
    parts = (stage_layers(cfg.model.n_layers, dims.pp * cfg.parallel.virtual_stages, cfg.parallel.pp_layer_split)
             if dims.pp > 1 else [list(range(cfg.model.n_layers))])
    experts_cut = dims.dp_shard > 1 and dims.edp_size // dims.dp_replicate > 1
    counts = {-(-len(layers) // cfg.parallel.fsdp_layers_per_unit)
              + (sum(cfg.model.is_moe_layer(i) for i in layers) if experts_cut else 0) for layers in parts}
    assert len(counts) == 1, f"parts with unequal unit counts {counts}: each optimizer would need its own count"
    return counts.pop()


def _exact(rounds: list[list[dict[str, Any]]], results: list[list[dict[int, Any]]]
           ) -> tuple[list[list[dict[str, Any]]], list[list[dict[int, Any]]]]:
    """The rounds and results without the quantized layouts (held to their plain-exchange twins only)."""
    keep = [[j for j, layout in enumerate(r) if not any(layout.get(k) for k in QUANTIZED)] for r in rounds]
    return ([[r[j] for j in k] for r, k in zip(rounds, keep, strict=True)],
            [[{n: per[i][j] for n, j in enumerate(k) if j in per[i]} for i, k in enumerate(keep)] for per in results])


@pytest.mark.slow
@pytest.mark.distributed
def test_muon_layouts_match_one_process_muon() -> None:
    rounds = pack_rounds(LAYOUTS, 8)
    results = run_distributed(_run_rounds, 8, timeout_s=600, rounds=rounds)
    bad = compare(*_exact(rounds, results)) + overlap_mismatches(rounds, results)
    assert not bad, "\n".join(bad)
