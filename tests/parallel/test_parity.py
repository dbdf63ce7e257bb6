"""Parity of every layout with the 1-process LocalEngine: loss and grad norm at every step within 1e-5 and the
final parameters' checksums within 1e-5 relative (fp32); bf16 against the fp32 run at tolerances derived from
bf16's unit roundoff (tests/parallel/parallel_parity.py `reference_and_tolerance`).

Layouts run side by side on disjoint rank ranges of one 8-rank spawn (sub-world meshes), so the whole matrix
pays two process-group start-ups. The reference is computed once per config and cached.
"""

from __future__ import annotations

from typing import Any

import pytest
from parallel_parity import BROKEN_KV, compare, pack_rounds, run_rounds

from framework.testing import run_distributed

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def _matrix() -> list[dict[str, Any]]:
    """tp, pp, dp_shard in {1, 2} x each zero stage that differs, plus dp_replicate where it fits (world <= 8)."""
    out: list[dict[str, Any]] = []
    for tp in (1, 2):
        for pp in (1, 2):
            for dps in (1, 2):
                # Under PP the schedule reduces once per step, so ZeRO-1 and ZeRO-2 coincide there.
                stages = (0,) if dps == 1 else ((1, 3) if pp > 1 else (1, 2, 3))
                for zero in stages:
                    out.append({"tp": tp, "pp": pp, "dp_shard": dps, "zero_stage": zero})
                if tp * pp * dps * 2 <= 8:
                    rep: dict[str, Any] = {"tp": tp, "pp": pp, "dp_shard": dps, "dp_replicate": 2,
                                           "zero_stage": 0 if dps == 1 else 1}
                    if pp * dps * 2 * 2 > 8:
                        rep["train.micro_batch_size"] = 1  # keep n_micro >= pp
                    out.append(rep)
    out.append({"dp_shard": 2, "zero_stage": 3, "cpu_offload": True})
    out.append({"tp": 2, "sequence_parallel": False, "loss_parallel": False, "dp_shard": 1, "zero_stage": 0})
    # data.document_mask: the mask from full-sequence tokens under TP + SP (fills this spawn's last round).
    out.append({"tp": 2, "dp_shard": 1, "zero_stage": 0, "data.document_mask": True})
    # A tied model on one rank through the parallel engine (the matrix's one free slot).
    out.append({"dp_shard": 1, "zero_stage": 0, "model.tied_embeddings": True})
    return out


def _extras() -> list[dict[str, Any]]:
    """All seven schedules on PP=2, recompute full/selective on two layouts, bf16 and fp16 (loose)."""
    out: list[dict[str, Any]] = [{"pp": 2, "dp_shard": 1, "pp_schedule": s} for s in SCHEDULES]
    for mode in ("full", "selective"):
        out.append({"tp": 2, "dp_shard": 2, "recompute": mode})
        out.append({"tp": 2, "pp": 2, "dp_shard": 2, "recompute": mode, "recompute_every": 2,
                    "pp_schedule": "Interleaved1F1B"})
    # Tied embeddings: a 2-stage pipeline swaps the embedding/head gradients, a V keeps both on rank 0.
    out.append({"tp": 2, "pp": 2, "dp_shard": 2, "model.tied_embeddings": True})
    out.append({"pp": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble", "model.tied_embeddings": True})
    # Without pipeline stages the one part holds both ends: to_empty must not untie them (fills a free slot).
    out.append({"dp_shard": 2, "zero_stage": 3, "model.tied_embeddings": True})
    # Deeper pipelines: first and last stage on pp ranks 0 and 3 swap gradients point-to-point (plain and looped).
    out.append({"pp": 4, "dp_shard": 1, "pp_schedule": "1F1B", "model.tied_embeddings": True})
    out.append({"pp": 4, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", "model.tied_embeddings": True,
                "model.n_layers": 8})
    out.append({"tp": 2, "dp_shard": 2, "train.precision": "bf16"})
    out.append({"tp": 2, "pp": 2, "dp_shard": 2, "train.precision": "fp16"})
    # data.document_mask: document ids reach every pipeline stage as schedule kwargs (single-stage, interleaved
    # and V schedules), FSDP forwards them, positions restart per document; one extra 8-rank round.
    mask = {"data.document_mask": True}
    out.append({"pp": 2, "dp_shard": 2, "zero_stage": 1, "pp_schedule": "1F1B", **mask})
    out.append({"tp": 2, "pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", **mask,
                "data.reset_position_ids": True})
    out.append({"dp_shard": 2, "zero_stage": 3, **mask})
    out.append({"pp": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble", **mask})
    # TP4: sharded KV heads on an 8-head / 4-KV-head model; tp > n_kv_heads (tiny: 4 heads, 2 KV
    # heads) replicating each KV head on 2 tp ranks, plain and under FSDP ZeRO-3; a deliberately broken
    # replication (wrong KV head per rank) that must fail; uneven pipeline splits (plain and interleaved).
    out.append({"tp": 4, "dp_shard": 1, "model.n_heads": 8, "model.n_kv_heads": 4})
    out.append({"tp": 4, "dp_shard": 2, "zero_stage": 3})
    out.append({"tp": 4, "dp_shard": 1, BROKEN_KV: True})
    out.append({"tp": 2, "pp": 2, "dp_shard": 1, "pp_layer_split": [3, 1]})
    out.append({"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", "model.n_layers": 6,
                "pp_layer_split": [2, 1, 1, 2]})
    return out


def _run(layouts: list[dict[str, Any]]) -> None:
    rounds = pack_rounds(layouts, 8)
    results = run_distributed(run_rounds, 8, timeout_s=600, rounds=rounds)
    bad = compare(rounds, results)
    broken = [str(layout) for layout in layouts if layout.get(BROKEN_KV)]
    assert not [b for b in bad if BROKEN_KV not in b], "\n".join(bad)
    assert all(any(b.startswith(layout) for b in bad) for layout in broken), f"a broken layout passed: {broken}"


@pytest.mark.slow
@pytest.mark.distributed
def test_layout_matrix_matches_one_process() -> None:
    _run(_matrix())


@pytest.mark.slow
@pytest.mark.distributed
def test_schedules_recompute_and_precision_match_one_process() -> None:
    _run(_extras())
