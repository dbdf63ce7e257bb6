"""Communication logger (bytes per collective per axis, ring wire factors) and the model-state memory report."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from framework.parallel.comm import CommLogger, wire_factor
from framework.parallel.memory import model_state_report, unsharded_by_unit, unsharded_bytes
from framework.testing import run_distributed
from models.config import model_config
from models.decoder import build_model


def _plain_collectives(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world)))
    log = CommLogger({group: "dp_shard"})
    with log.active():
        # Pipeline-style p2p (torch.distributed.pipelining batches isend/irecv): 16 bytes each way.
        peer = (rank + 1) % world
        ops = [dist.P2POp(dist.isend, torch.ones(4), peer, group), dist.P2POp(dist.irecv, torch.empty(4), peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.all_reduce(torch.ones(10), group=group)  # 40 bytes
        out = torch.empty(8 * world)
        dist.all_gather_into_tensor(out, torch.ones(8), group=group)  # full buffer 32 * world bytes
        dist.all_reduce(torch.ones(3))  # default group -> "world"
        dist.barrier()  # moves no data: not recorded
    dist.all_reduce(torch.ones(5), group=group)  # outside the block: not counted
    return {"wire": dict(log.wire), "calls": dict(log.calls)}


def _fsdp_and_dtensor(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's all-gather / reduce-scatter and DTensor's functional collectives, each counted once."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))  # 192 params, 768 bytes
    fully_shard(model[0], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    log = CommLogger({mesh.get_group(): "dp_shard"})
    out: dict[str, Any] = {}

    def mid_forward(*_: Any) -> None:
        # model[1]'s parameters are now the root unit's all-gathered working copies (model[0] is resharded):
        # the persistent bytes must still be the shards.
        out["mid_report"] = model_state_report([model], [])
        out["mid_unsharded"] = unsharded_bytes([model])

    model[1].register_forward_hook(mid_forward)
    with log.active():
        model(torch.randn(2, 8)).sum().backward()
        out["fsdp_calls"] = dict(log.calls)
        out["fsdp_payload"] = dict(log.payload)
        log.reset()
        shard = DTensor.from_local(torch.ones(3), mesh, [Shard(0)])
        out["full"] = shard.full_tensor().sum().item()  # one functional all-gather of 12 * world bytes
        out["dtensor_calls"] = dict(log.calls)
        out["dtensor_payload"] = dict(log.payload)
    out["end_report"] = model_state_report([model], [])
    out["end_units"] = unsharded_by_unit([model])
    return out


LATE = 0.3
"""Seconds rank 1 enters the timed collectives late: rank 0's in-flight and blocked times must show it."""


def _timed_collectives(rank: int, world: int) -> dict[str, Any]:
    """A synchronous all-gather rank 1 joins LATE s late (rank 0 blocks through it), then an async one rank 0 waits
    for only after 2 x LATE (it was done by then: in flight ~LATE, exposed ~0)."""
    import time

    log = CommLogger({dist.group.WORLD: "dp_shard"})
    out = torch.empty(4 * world)
    with log.active():
        if rank == 1:
            time.sleep(LATE)
        dist.all_gather_into_tensor(out, torch.ones(4))
        if rank == 1:
            time.sleep(LATE)
        work = dist.all_gather_into_tensor(out, torch.ones(4), async_op=True)
        if rank == 0:
            time.sleep(2 * LATE)
        assert work is not None
        work.wait()
    return {"timings": [(t.op, t.seconds, t.exposed_s) for t in log.resolved_timings()]}


def _zero3_step(rank: int, world: int) -> dict[str, Any]:
    """One step of the engine's ZeRO-3 (dp_shard=2, comm_log on): the timing fields of its metrics."""
    from parallel_parity import make_config

    from framework.train.parallel_engine import build_parallel_engine

    cfg = make_config(("parallel.dp_shard=2", "parallel.zero_stage=3", "parallel.comm_log=true"))
    engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.global_batch_size // world, cfg.data.seq_len + 1),
                          generator=gen)
    engine.forward_backward(batch)
    assert engine.comm is not None
    timings = [(t.op, t.seconds, t.exposed_s) for t in engine.comm.resolved_timings()]
    return {"metrics": engine.extra_metrics(), "timings": timings}


def _body(rank: int, world: int) -> dict[str, Any]:
    return {"plain": _plain_collectives(rank, world), **_fsdp_and_dtensor(rank, world),
            "timed": _timed_collectives(rank, world), "zero3": _zero3_step(rank, world)}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, Any]:
    return run_distributed(_body, 2, timeout_s=120)[0]


def test_collective_timings_in_flight_and_exposed(two_ranks: dict[str, Any]) -> None:
    (op1, total1, exposed1), (op2, total2, exposed2) = two_ranks["timed"]["timings"]
    assert op1 == op2 == "all_gather"
    # Synchronous: rank 0 blocked until the late rank joined, so nearly all of it is exposed.
    assert total1 >= 0.8 * LATE and exposed1 >= 0.8 * LATE and exposed1 <= total1 + 1e-6
    # Async, waited long after it finished: in flight ~LATE (from its future), hardly any of it exposed.
    assert total2 >= 0.5 * LATE and total2 < 2 * LATE and exposed2 < 0.25 * LATE

    # A real ZeRO-3 step through the engine: every FSDP all-gather / reduce-scatter timed, positive, exposed <= total.
    zero3 = two_ranks["zero3"]
    fsdp = [t for t in zero3["timings"] if t[0] in ("all_gather", "reduce_scatter")]
    assert {t[0] for t in fsdp} == {"all_gather", "reduce_scatter"}
    for op, total, exposed in fsdp:
        assert 0 < total < 60 and 0 <= exposed <= total + 1e-6, (op, total, exposed)
    metrics = zero3["metrics"]
    for op in ("all_gather", "reduce_scatter"):
        assert 0 < metrics[f"comm/dp_shard/{op}/exposed_s"] <= metrics[f"comm/dp_shard/{op}/seconds"] + 1e-6
    assert metrics["comm/exposed_s"] == pytest.approx(sum(t[2] for t in zero3["timings"]))


def test_logger_counts_every_collective_once_per_axis_and_fsdp_memory(two_ranks: dict[str, Any]) -> None:
    world = 2
    res = two_ranks
    plain = res["plain"]
    assert plain["calls"] == {("dp_shard", "all_reduce"): 1, ("dp_shard", "all_gather"): 1, ("world", "all_reduce"): 1,
                              ("dp_shard", "send"): 1, ("dp_shard", "recv"): 1}
    assert plain["wire"][("dp_shard", "send")] == plain["wire"][("dp_shard", "recv")] == 16
    assert plain["wire"][("dp_shard", "all_reduce")] == 40 * 2 * (world - 1) / world
    assert plain["wire"][("dp_shard", "all_gather")] == 32 * world * (world - 1) / world
    assert wire_factor("all_reduce", 8) == 2 * 7 / 8 and wire_factor("send", 4) == 1.0

    # FSDP2 binds dist.all_gather_single / reduce_scatter_single: both units all-gathered in forward and again in
    # backward (reshard_after_forward=True), each gradient reduce-scattered once; full buffers, 768 bytes per pass.
    assert res["fsdp_calls"] == {("dp_shard", "all_gather"): 4, ("dp_shard", "reduce_scatter"): 2}
    assert res["fsdp_payload"] == {("dp_shard", "all_gather"): 2 * 768, ("dp_shard", "reduce_scatter"): 768}
    # DTensor's functional all-gather is counted once, not again as the c10d op it runs on.
    assert res["full"] == 3 * world
    assert res["dtensor_calls"] == {("dp_shard", "all_gather"): 1}
    assert res["dtensor_payload"] == {("dp_shard", "all_gather"): 12 * world}

    # Persistent bytes are each rank's shard (768 / world), mid-step as after; working copies are reported apart.
    assert res["mid_report"] == {"params": 768 // world, "params/float32": 768 // world, "total": 768 // world}
    assert res["mid_unsharded"] == (256, 0)  # the root unit's 64 all-gathered parameters, no gradient yet
    assert res["end_report"]["grads"] == 768 // world and res["end_units"] == {}


def test_memory_report_counts_params_grads_and_adam_states() -> None:
    cfg = model_config("test-tiny")
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = sum(p.numel() for p in model.parameters())
    model(torch.randint(0, cfg.vocab_size, (1, 8))).sum().backward()
    opt.step()
    report = model_state_report([model], [opt])
    assert report["params"] == 4 * n and report["params/float32"] == 4 * n
    assert report["grads"] == 4 * n
    assert report["optimizer"] == 8 * n  # exp_avg + exp_avg_sq; the scalar step counters are left out
    assert report["total"] == 16 * n
