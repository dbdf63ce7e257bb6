"""What the parallelize recipe promises beyond parity (framework/parallel/parallelize.py, step 9): a rank allocates
and draws only its shards — the initialization runs once, after FSDP, over the rank's local shards, never over the
whole model first (the final values would be the same, so parity cannot see it; the memory of a full-size model
on one rank would) — and a layout without a pipeline is one stage of one. One 2-rank spawn, three layouts.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.testing import run_distributed
from framework.testing.tiny import tiny_config


def _local_numel(p: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def _draws(rank: int, world: int) -> list[dict[str, Any]]:
    from framework.parallel.mesh import ParallelDims
    from framework.parallel.parallelize import parallelize
    from models.decoder import Decoder

    real = Decoder.init_weights
    calls: list[int] = []

    def spy(self: Decoder, seed: int = 0, device: torch.device | None = None) -> None:
        calls.append(sum(_local_numel(p) for p in self.parameters()))  # what this call fills
        real(self, seed, device)

    Decoder.init_weights = spy  # type: ignore[method-assign]
    out = []
    try:
        for overrides in (["parallel.dp_shard=2", "parallel.zero_stage=3"], ["parallel.tp=2", "parallel.dp_shard=1"],
                          ["parallel.dp_shard=1", "parallel.dp_replicate=2", "parallel.zero_stage=0"]):
            cfg = tiny_config(None, *overrides)
            dims = ParallelDims.from_config(cfg.parallel, world, cfg.model)
            mesh = dims.build_mesh("cpu")
            calls.clear()
            pm = parallelize(cfg.model, cfg.parallel, dims, mesh, torch.device("cpu"), seed=0, precision="fp32")
            with torch.device("meta"):
                whole = sum(p.numel() for p in Decoder(cfg.model).parameters())
            out.append({"calls": list(calls), "local": sum(_local_numel(p) for p in pm.parameters()), "whole": whole,
                        "n_stages": pm.n_stages, "stage_ids": pm.stage_ids, "parts": len(pm.parts)})
    finally:
        Decoder.init_weights = real  # type: ignore[method-assign]
    import torch.distributed as dist

    dist.barrier()  # rank 0 hosts the store the groups rendezvous through: it must not exit before the others
    return out


def test_each_rank_draws_only_its_shards_once_and_without_pp_is_one_stage() -> None:
    results = run_distributed(_draws, 2, timeout_s=240)
    for per_rank in results:
        fsdp, tp, replicas = per_rank
        for r in per_rank:
            assert r["calls"] == [r["local"]], r  # one initialization, of exactly the local shards
            assert (r["n_stages"], r["stage_ids"], r["parts"]) == (1, [0], 1), r
        # control: the sharded layouts really hold less than the whole model, the replicated one all of it
        assert fsdp["local"] < 0.6 * fsdp["whole"] and tp["local"] < 0.8 * tp["whole"]
        assert replicas["local"] == replicas["whole"]
