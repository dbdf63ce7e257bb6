"""Multi-head latent attention (and multi-token prediction on it) under the parallel layouts, against the
1-process LocalEngine of the same config: loss and grad norm at every step within 1e-5, final parameters'
checksums within 1e-5 relative (tests/parallel/parallel_parity.py). All layouts share one 8-rank spawn.

What each layout proves: TP splits MLA's up-projections by heads while the replicated down-projections, latent norms
and shared rotary key receive their whole gradient (with and without sequence parallelism); PP cuts MLA blocks;
ZeRO-3 shards the latent weights; cp (ring, with and without document masks) attends across ranks; recompute and
compile (aot_eager, sub-layer regions under TP) wrap MLA blocks; EP splits the DeepSeek-V3 test shape's experts;
query compression off (q_proj) under TP. Multi-token prediction: its projection, norms and blocks under TP (with and
without sequence parallelism and vocab-parallel loss), ZeRO-3, cp (labels shifted on whole rows, then cut) and on
the last pipeline stage (1F1B x TP2 tied, ZBV, interleaved 1F1B) train as one process (its loss rides on the
logits' gradient, so the main loss and grad norm carry it).
"""

from __future__ import annotations

from typing import Any

import pytest
from parallel_parity import compare, pack_rounds, run_rounds

from framework.testing import run_distributed

MLA = {"model.preset": "test-mla"}


def _layouts() -> list[dict[str, Any]]:
    return [
        {"tp": 2, "pp": 2, "dp_shard": 2, "zero_stage": 3, **MLA},
        {"tp": 2, "sequence_parallel": False, "loss_parallel": False, "dp_shard": 1, "recompute": "selective",
         "train.compile": True, "train.compile_backend": "aot_eager", **MLA},
        {"pp": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble", "recompute": "full", **MLA},
        {"tp": 2, "dp_shard": 1, "model.mla.q_lora_rank": 0, **MLA},
        # cp through models/attention.py's exchanges (ring, per-head K/V), plain causal and with document masks.
        {"cp": 2, "dp_shard": 1, **MLA},
        {"cp": 2, "dp_shard": 1, "data.document_mask": True, **MLA},
        # Multi-token prediction (two depths) on MLA: TP with SP and vocab-parallel loss, TP without SP, ZeRO-3.
        {"tp": 2, "dp_shard": 2, "model.mtp_depth": 2, **MLA},
        {"tp": 2, "sequence_parallel": False, "loss_parallel": False, "dp_shard": 1, "model.mtp_depth": 2, **MLA},
        {"dp_shard": 2, "zero_stage": 3, "model.mtp_depth": 2, **MLA},
        # MTP under cp (ring): the shifted labels reach past a rank's chunks, the last positions sit on one rank.
        {"cp": 2, "dp_shard": 1, "model.mtp_depth": 2, **MLA},
        # MTP on the last pipeline stage, with its copy of the embedding: 1F1B x TP2 with tied embeddings (the
        # tied head is the copy; the gradients swapped point to point; TP on the copy, vocab-parallel MTP loss),
        # and ZBV untied (stage 0 and the last stage on one rank: the copies' gradients added in place; split
        # backward).
        {"pp": 2, "tp": 2, "dp_shard": 1, "model.mtp_depth": 2, "model.tied_embeddings": True, **MLA},
        {"pp": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble", "model.mtp_depth": 1, **MLA},
        # Interleaved 1F1B: two MLA chunks per rank. EP: the DeepSeek-V3 shape (MLA, sigmoid group-limited routing
        # with its load-balancing bias, a shared expert, a dense first layer, one MTP depth), experts over 2 ranks.
        {"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", "model.mtp_depth": 1, **MLA},
        {"ep": 2, "dp_shard": 2, "zero_stage": 3, "model.preset": "test-deepseek-v3", "model.mtp_depth": 1},
    ]


def _eager(layout: dict[str, Any]) -> dict[str, Any]:
    """The layout as its reference sees it: compiled runs are held to the eager 1-process run."""
    return {k: v for k, v in layout.items() if not k.startswith("train.compile")}


@pytest.mark.slow
@pytest.mark.distributed
def test_mla_layouts_match_one_process() -> None:
    rounds = pack_rounds(_layouts(), 8)
    results = run_distributed(run_rounds, 8, timeout_s=600, rounds=rounds)
    bad = compare([[_eager(layout) for layout in r] for r in rounds], results)
    assert not bad, "\n".join(bad)
