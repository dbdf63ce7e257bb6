"""Communication paths of a step: DDP buckets launched from backward hooks, pipeline p2p in the compute dtype.

One 4-rank spawn: parity with the 1-process engine for small DDP buckets (many per step) under plain replication
with gradient accumulation, TP + SP (partial norm gradients) and a pipeline (buckets launched after its schedule);
bf16 pipelines (with and without FSDP's mixed precision) against the fp32 1-process run, and the dtype their p2p
moved; then a 2-rank step whose buckets must overlap backward, measured by the communication logger on gloo.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from parallel_parity import compare, make_config, run_round

from framework.parallel.ddp import plan_buckets
from framework.parallel.mesh import ParallelDims
from framework.testing import run_distributed

SMALL = 0.02
"""MiB per bucket: the tiny model's ~0.2 MiB of gradients in about ten buckets."""
ROUNDS: list[list[dict[str, Any]]] = [
    [{"dp_replicate": 2, "dp_shard": 1, "zero_stage": 0, "ddp_bucket_mb": SMALL},
     {"dp_replicate": 2, "dp_shard": 1, "zero_stage": 0, "model.tied_embeddings": True, "ddp_bucket_mb": SMALL}],
    [{"tp": 2, "dp_replicate": 2, "dp_shard": 1, "zero_stage": 0, "ddp_bucket_mb": SMALL}],
    [{"pp": 2, "dp_replicate": 2, "dp_shard": 1, "zero_stage": 0, "ddp_bucket_mb": SMALL,
      "train.micro_batch_size": 1}],
    [{"pp": 2, "dp_shard": 1, "zero_stage": 0, "train.precision": "bf16"},
     {"pp": 2, "dp_shard": 1, "zero_stage": 0, "train.precision": "fp16", "pp_schedule": "Interleaved1F1B"}],
]
P2P_DTYPES = [{"pp": 2, "dp_shard": 1, "train.precision": "bf16"},
              {"pp": 2, "dp_shard": 2, "train.precision": "bf16", "fsdp_mixed_precision": False}]
"""Layouts whose p2p buffers' dtypes are recorded (one step, comm_log on)."""
LAG = 0.3
"""Seconds rank 1 starts backward late, and rank 0 computes (sleeps) before its embedding's gradient."""


def _overlap_step(rank: int) -> dict[str, Any]:
    """dp_replicate=2 on ranks 0-1, comm_log on: rank 1 enters backward LAG late, so the buckets of the late layers
    rank 0 launched wait ~LAG for it; rank 0 meanwhile spends 2 x LAG before its embedding gradient. Overlapped,
    those buckets finish while rank 0 computes: in flight ~LAG, exposed ~0."""
    from framework.train.parallel_engine import ParallelEngine

    cfg = make_config(("parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.zero_stage=0",
                       f"parallel.ddp_bucket_mb={SMALL}", "parallel.comm_log=true"))
    dims = ParallelDims.from_config(cfg.parallel, 2, cfg.model)
    mesh = dims.build_mesh("cpu", torch.arange(0, 2))
    if rank >= 2:
        return {}
    engine = ParallelEngine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"), dims, mesh)
    part = engine.model_parts[0]

    def delay(seconds: float) -> Any:
        def forward_hook(_: Any, __: Any, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda g: time.sleep(seconds))
        return forward_hook

    (part.output if rank == 1 else part.tok_embeddings).register_forward_hook(delay(LAG if rank == 1 else 2 * LAG))
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.model.vocab_size, (1, 4, cfg.data.seq_len + 1), generator=gen)
    engine.forward_backward(batch)
    assert engine.comm is not None and engine.replica_sync is not None
    buckets = [(t.seconds, t.exposed_s) for t in engine.comm.resolved_timings()
               if t.axis == "dp_replicate" and t.bytes > 8]  # the loss's fp64 scalar all-reduce left out
    return {"buckets": buckets, "n_buckets": len(engine.replica_sync.buckets),
            "in_backward": engine.replica_sync.launched_in_backward, "metrics": engine.extra_metrics()}


def _p2p_dtypes(rank: int, layout: dict[str, Any]) -> dict[str, Any]:
    """The dtypes the pipeline's send / recv moved in one step of `layout` (on ranks 0..its world)."""
    from parallel_parity import layout_overrides, layout_world

    from framework.train.parallel_engine import ParallelEngine

    cfg = make_config((*layout_overrides(layout), "parallel.comm_log=true"))
    dims = ParallelDims.from_config(cfg.parallel, layout_world(layout), cfg.model)
    mesh = dims.build_mesh("cpu", torch.arange(0, dims.world_size))
    if rank >= dims.world_size:
        return {}
    engine = ParallelEngine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"), dims, mesh)
    batch = torch.randint(0, cfg.model.vocab_size, (2, 2, cfg.data.seq_len + 1), generator=torch.Generator())
    engine.forward_backward(batch)
    assert engine.comm is not None
    return {op: engine.comm.dtypes[("pp", op)] for op in ("send", "recv")}


def _moe_axes(rank: int) -> set[tuple[str, str]]:
    """The (axis, op) pairs the engine's own communication logger saw in one EP2 x dp_shard 4 MoE Muon step."""
    from framework.train.parallel_engine import ParallelEngine

    cfg = make_config(("model.preset=test-moe", "parallel.ep=2", "parallel.dp_shard=4", "parallel.zero_stage=3",
                       "train.optimizer=muon", "parallel.comm_log=true"))
    dims = ParallelDims.from_config(cfg.parallel, 4, cfg.model)
    engine = ParallelEngine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"), dims,
                            dims.build_mesh("cpu", torch.arange(0, 4)))
    batch = torch.randint(0, cfg.model.vocab_size, (1, 4, cfg.data.seq_len + 1), generator=torch.Generator())
    engine.forward_backward(batch)
    engine.clip_grad_norm(1.0)
    engine.optimizer_step(1e-3)
    assert engine.comm is not None
    return set(engine.comm.dtypes)


def _body(rank: int, world: int) -> dict[str, Any]:
    out = {"parity": [run_round(rank, world, r) for r in ROUNDS], "overlap": _overlap_step(rank),
           "p2p": [_p2p_dtypes(rank, layout) for layout in P2P_DTYPES], "moe_axes": _moe_axes(rank)}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_distributed(_body, 4, timeout_s=300)


@pytest.mark.distributed
def test_pipeline_sends_in_the_compute_dtype(four_ranks: list[dict[str, Any]]) -> None:
    for i, layout in enumerate(P2P_DTYPES):
        moved = four_ranks[0]["p2p"][i]
        # The first step also exchanges shape metadata (integer tensors): only the floating buffers are activations.
        floating = {op: {d for d in dtypes if d.is_floating_point} for op, dtypes in moved.items()}
        assert floating == {"send": {torch.bfloat16}, "recv": {torch.bfloat16}}, (layout, moved)


@pytest.mark.distributed
def test_small_buckets_and_low_precision_pipelines_match_one_process(four_ranks: list[dict[str, Any]]) -> None:
    bad = compare(ROUNDS, [r["parity"] for r in four_ranks])
    assert not bad, "\n".join(bad)


@pytest.mark.distributed
def test_buckets_launch_in_backward_and_hide_their_time(four_ranks: list[dict[str, Any]]) -> None:
    rank0 = four_ranks[0]["overlap"]
    n = rank0["n_buckets"]
    assert n > 1 and len(rank0["buckets"]) == n, rank0
    assert rank0["in_backward"] == n and four_ranks[1]["overlap"]["in_backward"] == n
    seconds = sum(s for s, _ in rank0["buckets"])
    exposed = sum(e for _, e in rank0["buckets"])
    # The buckets before the embedding's waited ~LAG for rank 1 while rank 0 computed: all of that hidden.
    assert seconds > 0.5 * LAG and exposed < 0.5 * seconds, rank0["buckets"]
    metrics = rank0["metrics"]
    assert metrics["comm/dp_replicate/all_reduce/exposed_s"] < metrics["comm/dp_replicate/all_reduce/seconds"]


@pytest.mark.distributed
def test_the_engine_logger_names_the_expert_axes(four_ranks: list[dict[str, Any]]) -> None:
    """The expert units' FSDP and Muon traffic runs on the expert mesh's edp groups, the dispatch on ep: both named
    as the dry run names them (framework/parallel/comm.py `layout_axes`), so a training run's comm metrics do too."""
    for rank in four_ranks:
        axes = {axis for axis, _ in rank["moe_axes"]}
        assert "other" not in axes and {"ep", "edp", "dp_shard"} <= axes, sorted(rank["moe_axes"])
        assert ("edp", "all_to_all") in rank["moe_axes"], sorted(rank["moe_axes"])


def test_buckets_cut_in_reverse_order_per_dtype_at_the_cap() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 30))  # 40, 40, 120 bytes
    h = torch.nn.Parameter(torch.zeros(10, dtype=torch.float16))
    buckets = plan_buckets([a, h, b, c], bucket_bytes=100)
    assert [[id(p) for p in bucket] for bucket in buckets] == [[id(c)], [id(b), id(a)], [id(h)]]
