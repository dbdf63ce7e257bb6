"""Context parallelism: chunk layout, typed errors before launch, and parity with one process.

One 8-rank spawn runs every cp layout side by side (the parity harness of parallel_parity.py): cp=2, cp=4,
cp2 x tp2 (+SP), cp2 x pp2, cp2 x dp_shard2 at ZeRO-3, HSDP over cp, each with and without document masks over
the ring exchange, then the all-to-all and all-gather exchanges (parallel.cp_comm) with and without TP
(GQA test-tiny model, fp32, 5 AdamW steps, loss and grad norm within 1e-5 of the LocalEngine). The same spawn
then saves a cp=2 x dp_shard=4 checkpoint after 2 steps and resumes it at cp=4 x dp_shard=2; the test process
resumes it at cp=1 (the LocalEngine): both continue with the uninterrupted 1-process losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_parity import (
    STEPS,
    batches,
    compare,
    documents,
    make_config,
    pack_rounds,
    rank_batch,
    reference,
    run_rounds,
)

from framework.base.errors import ParallelismError
from framework.config import load_config
from framework.parallel.context import gathered_indices, local_indices
from framework.parallel.mesh import ParallelDims
from framework.testing import run_distributed
from framework.testing.tiny import TINY

SAVED_AT = 2


# --- pure -------------------------------------------------------------------------------------------------------
def test_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i() -> None:
    assert local_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_indices(8, 4, 3).tolist() == [3, 4]
    for cp in (1, 2, 4, 8):
        order = gathered_indices(64, cp)
        assert sorted(order.tolist()) == list(range(64))
        # causal work (keys visible per query) is the same on every rank: load balance
        work = {int((local_indices(64, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1, (cp, work)


@pytest.mark.parametrize("overrides, match", [
    (["parallel.cp=4", "data.seq_len=36"], r"data.seq_len=36 must be divisible by 2 x cp = 8.*32 or 40"),
    (["parallel.cp=2", "parallel.tp=2", "data.seq_len=36"], r"2 x cp x tp = 8 \(sequence parallelism\)"),
])
def test_seq_len_not_divisible_fails_at_config_load(overrides: list[str], match: str) -> None:
    with pytest.raises(ParallelismError, match=match):
        load_config(TINY, overrides)


@pytest.mark.parametrize("overrides, world, match", [
    (["parallel.cp=4", "parallel.tp=2"], 12, r"world size 12 is not divisible by .* cp x tp = 1 x 1 x 4 x 2 = 8"),
    (["parallel.cp=2", "parallel.dp_shard=1", "parallel.zero_stage=0"], 2, r"cp=2 folds cp into the FSDP.*zero_stage"),
    (["parallel.cp=2", "parallel.dp_shard=2", "parallel.cpu_offload=true"], 4, r"cp=2 with parallel.cpu_offload"),
    (["parallel.cp=2", "model.preset=test-moe"], 2, r"cp=2 with a mixture-of-experts model"),
    (["parallel.cp=8", "parallel.cp_comm=all_to_all", "data.seq_len=64"], 8,
     r"cp_comm=all_to_all scatters each rank's n_heads / tp = 4 / 1 query heads over cp=8"),
])
def test_unsupported_layouts_fail_before_launch(overrides: list[str], world: int, match: str) -> None:
    cfg = load_config(TINY, overrides)
    with pytest.raises(ParallelismError, match=match):
        ParallelDims.from_config(cfg.parallel, world, cfg.model)


# --- parity -----------------------------------------------------------------------------------------------------
def _layouts() -> list[dict[str, Any]]:
    base: list[dict[str, Any]] = [
        {"cp": 2, "dp_shard": 1},
        {"cp": 4, "dp_shard": 1},
        {"cp": 2, "tp": 2, "dp_shard": 1},
        {"cp": 2, "pp": 2, "dp_shard": 1},
        {"cp": 2, "dp_shard": 2, "zero_stage": 3},
    ]
    masked = [{**b, "data.document_mask": True} for b in base]
    masked[1]["data.reset_position_ids"] = True  # cp=4: positions restart per document, per chunk
    masked[3]["pp_schedule"] = "Interleaved1F1B"  # mask + positions reach both stages of each rank
    extra = [{"cp": 2, "dp_shard": 1, "dp_replicate": 2},  # HSDP: (dp_replicate, dp_shard_cp) mesh
             {"cp": 2, "tp": 2, "dp_shard": 1, "recompute": "full", "data.reset_position_ids": True}]
    # the default exchange is the ring; the all-to-all (Ulysses) and all-gather exchanges with and without TP
    others = [{"cp": 2, "dp_shard": 1, "cp_comm": "all_to_all"},
              {"cp": 4, "dp_shard": 1, "cp_comm": "all_to_all", "data.document_mask": True},
              {"cp": 2, "tp": 2, "dp_shard": 1, "cp_comm": "all_to_all", "data.document_mask": True},
              {"cp": 2, "tp": 2, "dp_shard": 1, "cp_comm": "allgather", "data.document_mask": True}]
    return base + masked + extra + others


def _ckpt_phase(rank: int, world: int, root: str) -> list[tuple[float, float]]:
    """Train cp=2 x dp_shard=4 for SAVED_AT steps, save; resume at cp=4 x dp_shard=2 for the remaining steps."""
    from framework.checkpoint.dcp import load_checkpoint, save_checkpoint
    from framework.train.parallel_engine import build_parallel_engine

    def run(engine: Any, cfg: Any, steps: range) -> list[tuple[float, float]]:
        from framework.train.lr_schedule import lr_at

        data, out = batches(cfg), []
        for step in steps:
            batch = rank_batch(data[step], engine.dp_rank, engine.dp_size, cfg.train.micro_batch_size)
            loss = engine.forward_backward(batch)
            out.append((loss, engine.clip_grad_norm(cfg.train.grad_clip)))
            engine.optimizer_step(lr_at(cfg.train, step))
        return out

    cfg2 = make_config(("parallel.cp=2", "parallel.dp_shard=4"))
    engine = build_parallel_engine(cfg2.model, cfg2.train, cfg2.parallel, torch.device("cpu"),
                                   documents=documents(cfg2))
    run(engine, cfg2, range(SAVED_AT))
    path = save_checkpoint(Path(root), SAVED_AT, engine.model_parts, engine.optimizers, {})
    cfg4 = make_config(("parallel.cp=4", "parallel.dp_shard=2"))
    engine = build_parallel_engine(cfg4.model, cfg4.train, cfg4.parallel, torch.device("cpu"),
                                   documents=documents(cfg4))
    load_checkpoint(path, engine.model_parts, engine.optimizers)
    return run(engine, cfg4, range(SAVED_AT, STEPS))


def _spawn(rank: int, world: int, rounds: list[list[dict[str, Any]]], root: str) -> Any:
    return run_rounds(rank, world, rounds), _ckpt_phase(rank, world, root)


def _resume_on_one_process(path: Path) -> list[tuple[float, float]]:
    from framework.checkpoint.dcp import load_checkpoint
    from framework.train.local_engine import LocalEngine
    from framework.train.lr_schedule import lr_at

    cfg = make_config()
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"), documents(cfg))
    load_checkpoint(path, engine.model_parts, engine.optimizers)
    data, out = batches(cfg), []
    for step in range(SAVED_AT, STEPS):
        loss = engine.forward_backward(data[step].reshape(-1, cfg.train.micro_batch_size, data.shape[-1]))
        out.append((loss, engine.clip_grad_norm(cfg.train.grad_clip)))
        engine.optimizer_step(lr_at(cfg.train, step))
    return out


def _latest(root: Path) -> Path:
    from framework.checkpoint.dcp import latest_checkpoint

    path = latest_checkpoint(root)
    assert path is not None, f"no checkpoint under {root}"
    return path


@pytest.mark.slow
@pytest.mark.distributed
def test_context_parallel_layouts_match_one_process_and_checkpoints_reshard(tmp_path: Path) -> None:
    rounds = pack_rounds(_layouts(), 8)
    results = run_distributed(_spawn, 8, timeout_s=600, rounds=rounds, root=str(tmp_path / "ckpt"))
    bad = compare(rounds, [r[0] for r in results])
    want = reference()[0][SAVED_AT:]
    resumed = {"cp=2 -> cp=4": results[0][1], "cp=2 -> cp=1": _resume_on_one_process(_latest(tmp_path / "ckpt"))}
    for name, got in resumed.items():
        for step, (g, w) in enumerate(zip(got, want, strict=True), start=SAVED_AT):
            if abs(g[0] - w[0]) > 1e-5 or abs(g[1] - w[1]) > 1e-5 * max(1.0, w[1]):
                bad.append(f"checkpoint {name} step {step}: (loss, grad norm) {g} vs 1-process {w}")
    assert not bad, "\n".join(bad)
