"""`train.compile` against eager: loss and grad norm within 1e-5 at each of 5 steps, 1 process and parallel layouts.

Inductor (the backend that generates kernels) runs the 1-process engine and one 2-rank layout (DP2 ZeRO-3:
under TP each layer's regions compile separately, too slow for inductor on CI's 2 cores; TP2 with inductor was
measured by hand, bench/compile_tp_repro.py). `aot_eager` (AOT autograd without codegen: the layer where the TP
trouble lives, and cheap to compile) runs the others: every layout `refusal` allows (LAYOUTS, in one 8-rank
spawn). The eager reference is parallel_parity's cached 1-process run of the same config without compile.
Refused combinations raise at config load with the reason; a batch of a new shape compiles once, is logged as a
recompilation, and both shapes' graphs are then reused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_parity import documents, make_config, pack_rounds, reference, run_round, train_engine

from framework.base.errors import ParallelismError
from framework.testing import run_distributed

AOT = {"train.compile": True, "train.compile_backend": "aot_eager"}
INDUCTOR = {"train.compile": True, "train.compile_backend": "inductor"}
TOL = 1e-5

LAYOUTS: list[dict[str, Any]] = [
    # Every wrapper compile meets: FSDP2 at each ZeRO stage (and HSDP, CPU offload, 2-block units), DDP, TP with and
    # without SP / loss parallel, each pipeline schedule compile is allowed for, context parallelism, MoE with EP
    # and with TP, both recompute modes around the compiled regions; NVMe offload is `_nvme_layout` (a directory).
    # Packed 4 rounds deep with two MoE layouts side by side, this spawn deadlocked while MoE engines created their
    # expert groups on their own ranks only; run_round now checks that no group name means two rank sets.
    {"dp_shard": 2, "zero_stage": 3, **INDUCTOR},
    {"tp": 2, "dp_shard": 1, "zero_stage": 0, "sequence_parallel": False, "loss_parallel": False, **AOT},
    {"tp": 2, "dp_shard": 2, "zero_stage": 1, "recompute": "selective", **AOT},
    {"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", **AOT},
    {"pp": 2, "dp_shard": 1, "pp_schedule": "1F1B", "recompute": "full", **AOT},
    {"pp": 2, "dp_shard": 1, "pp_schedule": "GPipe", **AOT},
    {"pp": 2, "dp_shard": 1, "pp_schedule": "LoopedBFS", **AOT},
    {"dp_shard": 2, "ep": 2, "zero_stage": 1, "model.preset": "test-moe", **AOT},
    {"dp_shard": 2, "ep": 2, "zero_stage": 2, "fsdp_layers_per_unit": 2, "model.preset": "test-moe", **AOT},
    {"tp": 2, "dp_shard": 1, "model.preset": "test-moe", **AOT},
    {"dp_shard": 1, "dp_replicate": 2, "zero_stage": 0, "data.document_mask": True, **AOT},
    {"dp_shard": 2, "dp_replicate": 2, "zero_stage": 3, "cpu_offload": True, **AOT},
    {"cp": 2, "dp_shard": 1, **AOT},
]


def _eager_overrides(layout: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{k}={v}" for k, v in layout.items()
                 if "." in k and not k.startswith(("train.compile", "parallel.")))


def _nvme_layout(root: Path) -> dict[str, Any]:
    """ZeRO-Infinity's optimizer states in files (~10 groups on the tiny model), under a compiled model."""
    return {"dp_shard": 2, "zero_stage": 1, "parallel.nvme_offload.path": str(root),
            "parallel.nvme_offload.group_mb": 0.05, **AOT}


def _frames_after_each_step(engine: Any, cfg: Any) -> tuple[list[tuple[float, float]], list[int]]:
    """parallel_parity's 5-step run, noting dynamo's compiled-graph count after every optimizer step."""
    from framework.parallel.compile import compiled_frames

    frames: list[int] = []
    step = engine.optimizer_step

    def counted(lr: float) -> bool:
        ok = step(lr)
        frames.append(compiled_frames())
        return bool(ok)

    engine.optimizer_step = counted
    return train_engine(engine, cfg)[0], frames  # (per-step loss and grad norm, parameter checksums)


def _assert_close(layout: Any, got: list[tuple[float, float]], want: list[tuple[float, float]]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g[0] - w[0]) <= TOL and abs(g[1] - w[1]) <= TOL * max(1.0, abs(w[1])), (
            f"{layout} step {step}: compiled (loss, grad norm) {g} vs eager {w}")


def test_one_process_inductor_matches_eager_and_stops_compiling() -> None:
    from framework.train.local_engine import LocalEngine

    torch.manual_seed(0)
    cfg = make_config(tuple(f"{k}={v}" for k, v in INDUCTOR.items()))
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"), documents(cfg))
    got, frames = _frames_after_each_step(engine, cfg)
    _assert_close("1 process inductor", got, reference(())[0])
    assert frames[0] >= 1, "nothing was compiled"
    assert frames[-1] == frames[1], f"dynamo kept compiling after warm-up: frames after each step {frames}"


def _rank(rank: int, world: int, rounds: list[list[dict[str, Any]]]) -> list[dict[int, Any]]:
    import torch.distributed as dist

    from framework.parallel.compile import compiled_frames

    out = []
    for r in rounds:
        # Rounds rebuild meshes in one process: dynamo's guards on DTensor specs compare meshes by value, so a
        # graph traced for the previous round's TP mesh (its process-group names baked in) would be reused.
        torch._dynamo.reset()
        res = run_round(rank, world, r)
        out.append({i: (v, compiled_frames()) for i, v in res.items()})
    dist.barrier()
    return out


@pytest.mark.slow
def test_parallel_layouts_compiled_match_eager(tmp_path: Path) -> None:
    rounds = pack_rounds([*LAYOUTS, _nvme_layout(tmp_path)], 8)  # 32 ranks: 4 full rounds of the one 8-rank spawn
    results = run_distributed(_rank, 8, timeout_s=900, rounds=rounds)
    for i, layouts in enumerate(rounds):
        merged: dict[int, Any] = {}
        for per_rank in results:
            merged.update(per_rank[i])
        for j, layout in enumerate(layouts):
            (got, _), frames = merged[j]
            assert frames > 0, f"{layout}: nothing was compiled"
            _assert_close(layout, got, reference(_eager_overrides(layout))[0])


REFUSED: list[tuple[tuple[str, ...], str]] = [
    (("parallel.pp=2", "parallel.dp_shard=1", f"parallel.pp_schedule={schedule}"),
     f"pp_schedule={schedule}: zero-bubble schedules run the input and weight halves")
    for schedule in ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV")
]


@pytest.mark.parametrize(("overrides", "reason"), REFUSED)
def test_refused_combinations_raise_with_the_reason(overrides: tuple[str, ...], reason: str) -> None:
    with pytest.raises(ParallelismError, match=reason):
        make_config(("train.compile=true", *overrides))


def test_allowed_combinations_load(tmp_path: Path) -> None:
    """Every layout the parity test compiles loads as written: compile still on with its backend, each parallel
    field as given (a refusal turned into a silent fallback would load too, and then test eager against eager)."""
    from framework.parallel.compile import refusal

    for layout in [*LAYOUTS, _nvme_layout(tmp_path)]:
        cfg = make_config(tuple(f"{k}={v}" if "." in k else f"parallel.{k}={v}" for k, v in layout.items()))
        for key, value in layout.items():
            node: Any = cfg
            for part in (key if "." in key else f"parallel.{key}").split("."):
                node = getattr(node, part)
            assert node == value, (layout, key, node)
        assert cfg.train.compile is True and cfg.train.compile_backend == layout["train.compile_backend"]
        assert refusal(cfg.train.compile_backend, cfg.parallel, cfg.model) is None


def test_a_changed_shape_compiles_once_and_is_logged(capfd: pytest.CaptureFixture[str]) -> None:
    """Batches alternating between two sequence lengths: each shape compiles once (the second logged as a
    recompilation naming the failed size guard), then both graphs are reused, and the run matches eager."""
    from framework.parallel.compile import compiled_frames
    from framework.train.local_engine import LocalEngine

    torch._dynamo.reset()
    cfg = make_config(tuple(f"{k}={v}" for k, v in AOT.items()))
    torch.manual_seed(0)
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    torch.manual_seed(0)
    eager = LocalEngine(cfg.model, make_config().train, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    n_micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
    frames, got, want = [], [], []
    for step in range(4):
        seq = cfg.data.seq_len if step % 2 == 0 else cfg.data.seq_len // 2
        batch = torch.randint(0, cfg.model.vocab_size, (n_micro, cfg.train.micro_batch_size, seq + 1), generator=gen)
        for e, out in ((engine, got), (eager, want)):
            loss = e.forward_backward(batch)
            out.append((loss, e.clip_grad_norm(cfg.train.grad_clip)))
            e.optimizer_step(cfg.train.lr)
        frames.append(compiled_frames())
    _assert_close("alternating shapes", got, want)
    assert frames[1] > frames[0] > 0, f"the second shape was not compiled: frames after each step {frames}"
    assert frames[2:] == [frames[1]] * 2, f"dynamo kept recompiling once both shapes were seen: {frames}"
    err = capfd.readouterr().err
    assert "Recompiling function" in err and "size mismatch" in err, err[-2000:]
