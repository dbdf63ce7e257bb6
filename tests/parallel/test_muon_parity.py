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
"""

from __future__ import annotations

from typing import Any

import pytest
from parallel_parity import compare, pack_rounds, run_rounds

from framework.testing import run_distributed

MUON = {"train.optimizer": "muon", "train.muon.ns_dtype": "fp32"}
CLIP = {**MUON, "train.muon.qk_clip": True, "train.muon.qk_clip_tau": 0.1}
MOE = {**MUON, "model.preset": "test-moe", "model.moe.n_experts": 4, "model.moe.top_k": 2}

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
]


@pytest.mark.slow
@pytest.mark.distributed
def test_muon_layouts_match_one_process_muon() -> None:
    rounds = pack_rounds(LAYOUTS, 8)
    results = run_distributed(run_rounds, 8, timeout_s=600, rounds=rounds)
    bad = compare(rounds, results)
    assert not bad, "\n".join(bad)
