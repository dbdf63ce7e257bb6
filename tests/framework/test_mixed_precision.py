"""Mixed precision as users run it: the engine ends every optimizer step, applied or skipped, and
the fp16 loss-scale state survives a resume.

A guard skip changes nothing a step changes (weights, optimizer, loss scale and growth tracker, MoE routing
biases) and the next steps train; an fp16 overflow is the loss scaler's skip (it backs off), never a guard verdict.

fp16 resume: the runs start at a loss scale that overflows, so the scale backs off twice before the step-4
checkpoint and the growth tracker is mid-count there (growth every 3 clean steps): a resume that restarted the
tracker (or the scale) would grow at another step. Stopped at 4 and resumed, a run logs losses and loss scales
bitwise equal to the uninterrupted run — on one process and on two FSDP ranks (both engines' LossScaler,
framework/numerics/precision.py). The 2-rank spawn also checks the parallel engine's skipped steps.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from framework.config import Config, load_config
from framework.testing import run_distributed
from framework.testing.tiny import TINY
from framework.train.local_engine import LocalEngine
from framework.train.trainer import Trainer

MOE = ("model.preset=test-moe", "model.n_layers=2", "model.moe.n_experts=4", "model.moe.top_k=2",
       "model.moe.bias_update_rate=0.01")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def config(*overrides: str) -> Config:
    return load_config(TINY, ["train.grad_clip=1.0", *overrides])


def batches(cfg: Config, n: int) -> torch.Tensor:
    shape = (n, cfg.train.global_batch_size // cfg.train.micro_batch_size, cfg.train.micro_batch_size,
             cfg.data.seq_len + 1)
    return torch.randint(0, cfg.model.vocab_size, shape, generator=torch.Generator().manual_seed(3))


def snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (the MoE routing biases are buffers), cloned."""
    out = {}
    for part in engine.model_parts:
        out.update({k: v.detach().clone() for k, v in part.state_dict().items()})
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def step(engine: Any, batch: torch.Tensor, apply: bool = True) -> bool:
    engine.forward_backward(batch)
    engine.clip_grad_norm(1.0)
    return bool(engine.optimizer_step(1e-3, apply=apply))


def test_fp16_guard_skip_leaves_weights_and_scale_bitwise_and_the_next_steps_train() -> None:
    cfg = config("train.precision=fp16", "train.loss_scale_growth_interval=3")
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    data = batches(cfg, 4)
    assert step(engine, data[0])
    before, scale_before = snapshot(engine), engine.extra_state()
    assert scale_before == {"loss_scale": {"scale": 2.0**16, "growth_tracker": 1}}
    assert not step(engine, data[1], apply=False)
    assert_bitwise(snapshot(engine), before)
    assert engine.extra_state() == scale_before  # not a clean step, not an overflow: the scaler never saw it
    assert all(p.grad is None for p in engine.parameters())
    # The next steps train: the scaler is ready (no "unscale_() has already been called"), weights move.
    assert step(engine, data[2]) and step(engine, data[3])
    moved = snapshot(engine)
    assert any(not torch.equal(moved[k], before[k]) for k in before)
    assert engine.extra_state() == {"loss_scale": {"scale": 2.0**17, "growth_tracker": 0}}  # 3 clean steps: grew


def test_moe_skip_leaves_routing_biases_as_if_the_step_never_happened() -> None:
    cfg = config(*MOE)
    data = batches(cfg, 3)
    skipped = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    never = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    assert step(skipped, data[0]) and step(never, data[0])
    before = snapshot(skipped)
    assert any(k.endswith("expert_bias") and v.abs().sum() > 0 for k, v in before.items())  # biases do move
    assert not step(skipped, data[1], apply=False)
    assert_bitwise(snapshot(skipped), before)
    assert step(skipped, data[2]) and step(never, data[2])
    # Weights, optimizer moments and routing biases: bitwise those of the run that never saw data[1].
    assert_bitwise(snapshot(skipped), snapshot(never))
    assert_bitwise(skipped.optimizers[0].state_dict()["state"][0], never.optimizers[0].state_dict()["state"][0])


def _train_records(run: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


def test_trainer_fp16_overflow_is_not_a_guard_skip_and_a_guard_skip_ends_through_the_engine(tmp_path: Path) -> None:
    # 1. Overflows: the scale halves on each, the guard (rollback after 2 in a row) never hears of them.
    run = tmp_path / "overflow"
    cfg = config(f"run.dir={run}", "train.steps=5", "checkpoint.interval=0", "train.precision=fp16",
                 "train.loss_scale_init=1e9", "checkpoint.guard.max_consecutive=2")
    trainer = Trainer(cfg)
    trainer.train()
    recs = _train_records(run)
    assert [r["overflow"] for r in recs] == [True] * 5 and all(r["skipped"] and "guard" not in r for r in recs)
    assert [r["loss_scale"] for r in recs] == [1e9 / 2**k for k in range(1, 6)]
    assert trainer.ft.guard.skipped_total == 0 and trainer.ft.guard.rollbacks == 0
    # 2. A guard verdict under fp16 (a non-finite loss with finite gradients): skipped, and training goes on.
    run = tmp_path / "guard"
    trainer = Trainer(config(f"run.dir={run}", "train.steps=5", "checkpoint.interval=0", "train.precision=fp16"))
    real_fb = trainer.engine.forward_backward
    calls = {"n": 0}

    def forward_backward(batch: torch.Tensor) -> float:
        calls["n"] += 1
        loss = real_fb(batch)
        return math.nan if calls["n"] == 3 else loss

    trainer.engine.forward_backward = forward_backward  # type: ignore[method-assign]
    trainer.train()
    recs = _train_records(run)
    assert [(r["step"], r["skipped"], r.get("guard")) for r in recs] == [
        (1, False, None), (2, False, None), (3, True, "nonfinite_loss"), (4, False, None), (5, False, None)]
    assert all(r["loss_scale"] == 2.0**16 for r in recs)
    opt_steps = {int(s["step"]) for s in trainer.engine.optimizers[0].state_dict()["state"].values()}
    assert opt_steps == {4}


FP16 = ["data.seed=7", "train.steps=8", "checkpoint.interval=4", "train.precision=fp16",
        "train.loss_scale_init=8388608", "train.loss_scale_growth_interval=3"]
FP16_INIT = 8388608.0


def loss_and_scale(run: Path) -> dict[int, tuple[float, float]]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "train":
            out[rec["step"]] = (rec["loss"], rec["loss_scale"])
    return out


def stop_and_resume(tmp: Path, *layout: str) -> tuple[dict[int, tuple[float, float]], dict[int, tuple[float, float]]]:
    """(uninterrupted, stopped at step 4 and resumed) per-step (loss, loss scale), in this process group."""
    ref, run = tmp / "ref", tmp / "run"
    Trainer(load_config(TINY, [*FP16, f"run.dir={ref}", *layout])).train()
    Trainer(load_config(TINY, [*FP16, f"run.dir={run}", *layout])).train(stop_at=4)
    resumed = Trainer(load_config(TINY, [*FP16, f"run.dir={run}", *layout])).train()
    assert resumed.start_step == 4
    return loss_and_scale(ref), loss_and_scale(run)


def check_resume(ref: dict[int, tuple[float, float]], resumed: dict[int, tuple[float, float]],
                 meta: dict[str, Any]) -> None:
    assert sorted(ref) == list(range(1, 9))
    scales = [ref[s][1] for s in range(1, 5)]
    assert min(scales) < FP16_INIT, f"no backoff before the checkpoint: {scales}"
    state = meta["engine"]["loss_scale"]
    assert state["scale"] == ref[4][1] and state["growth_tracker"] > 0, state  # mid-count at the checkpoint
    assert resumed == ref  # bitwise: losses and loss scales


def test_fp16_one_process_resume_is_bitwise(tmp_path: Path) -> None:
    ref, resumed = stop_and_resume(tmp_path)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_4" / "meta.json").read_text())
    check_resume(ref, resumed, meta)


def _two_ranks(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    from framework.train.parallel_engine import build_parallel_engine
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    out["resume"] = stop_and_resume(tmp, "parallel.dp_shard=2")
    out["meta"] = json.loads((tmp / "run" / "checkpoints" / "step_4" / "meta.json").read_text())
    # fp16 guard skip on the parallel engine: weights and scale unchanged, the next step trains.
    cfg = config("train.precision=fp16", "parallel.dp_shard=2", "parallel.tp=1")
    engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
    data = batches(cfg, 3)[:, rank * 2:(rank + 1) * 2]
    assert step(engine, data[0])
    before, scale = snapshot(engine), engine.extra_state()
    assert not step(engine, data[1], apply=False)
    assert_bitwise(snapshot(engine), before)
    assert engine.extra_state() == scale == {"loss_scale": {"scale": 2.0**16, "growth_tracker": 1}}
    assert step(engine, data[2]) and engine.extra_state()["loss_scale"]["growth_tracker"] == 2
    # MoE: skipping the middle step == never seeing it (weights, routing biases), over 2 data ranks.
    cfg = config(*MOE, "parallel.dp_shard=2")
    skipped, never = (build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu")) for _ in "ab")
    data = batches(cfg, 3)[:, rank * 2:(rank + 1) * 2]
    assert step(skipped, data[0]) and step(never, data[0])
    before = snapshot(skipped)
    assert not step(skipped, data[1], apply=False)
    assert_bitwise(snapshot(skipped), before)
    assert step(skipped, data[2]) and step(never, data[2])
    assert_bitwise(snapshot(skipped), snapshot(never))
    out["gathered"] = {mp: _gathered_dtypes(mp) for mp in ("null", "false")}
    return out


def _gathered_dtypes(fsdp_mixed_precision: str) -> dict[str, Any]:
    """ZeRO-3 under bf16: the dtypes and bytes of the buffers FSDP's collectives actually moved in one step."""
    from framework.train.parallel_engine import build_parallel_engine

    cfg = config("train.precision=bf16", "parallel.dp_shard=2", "parallel.zero_stage=3", "parallel.comm_log=true",
                 f"parallel.fsdp_mixed_precision={fsdp_mixed_precision}")
    engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
    assert engine.comm is not None
    step(engine, batches(cfg, 1)[0, :2])
    dtypes = {op: ds for (axis, op), ds in engine.comm.dtypes.items() if axis == "dp_shard"}
    masters = {p.to_local().dtype for p in engine.parameters()}  # type: ignore[attr-defined]
    states = {v.dtype for s in engine.optimizers[0].state.values() for k, v in s.items() if k != "step"}
    return {"dtypes": dtypes, "bytes": engine.comm.payload[("dp_shard", "all_gather")], "masters": masters,
            "states": states}


@pytest.mark.distributed
def test_two_ranks_fp16_resume_is_bitwise_skips_change_nothing_and_bf16_all_gathers_bf16(tmp_path: Path) -> None:
    results = run_distributed(_two_ranks, 2, timeout_s=600, tmp=tmp_path)
    ref, resumed = results[0]["resume"]
    check_resume(ref, resumed, results[0]["meta"])
    assert results[1]["resume"] == results[0]["resume"]
    # bf16 by default all-gathers bf16 parameters (half the bytes) and reduces fp32 gradients; fp32 masters.
    on, off = results[0]["gathered"]["null"], results[0]["gathered"]["false"]
    assert on["dtypes"]["all_gather"] == {torch.bfloat16} and on["dtypes"]["reduce_scatter"] == {torch.float32}
    assert off["dtypes"]["all_gather"] == {torch.float32} and off["dtypes"]["reduce_scatter"] == {torch.float32}
    assert 2 * on["bytes"] == off["bytes"] > 0
    assert on["masters"] == on["states"] == off["masters"] == {torch.float32}
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_rollback_restores_the_loss_scale_and_keeps_guard_counters(tmp_path: Path) -> None:
    """fp16: checkpoint at step 3; a guard skip, an overflow (the scale halves; the guard does not count it), a
    second guard skip -> rollback to step 3, whose loss scale and growth tracker come back; the guard's counters
    stay cumulative."""
    run = tmp_path / "run"
    trainer = Trainer(config(f"run.dir={run}", "train.steps=8", "checkpoint.interval=3", "train.precision=fp16",
                             "checkpoint.guard.max_consecutive=2"))
    engine = trainer.engine
    real_fb = engine.forward_backward
    calls = {"n": 0}

    def forward_backward(batch: torch.Tensor) -> float:
        calls["n"] += 1
        loss = real_fb(batch)
        if calls["n"] == 5:
            next(engine.model.parameters()).grad.fill_(math.inf)  # type: ignore[union-attr]
        return math.nan if calls["n"] in (4, 6) else loss

    engine.forward_backward = forward_backward  # type: ignore[method-assign]
    trainer.train()
    recs = _train_records(run)
    assert [(r["step"], r.get("overflow", False), r.get("guard"), r["loss_scale"]) for r in recs[3:6]] == [
        (4, False, "nonfinite_loss", 2.0**16), (5, True, None, 2.0**15), (6, False, "nonfinite_loss", 2.0**15)]
    # Rolled back to step 3 (scale 2^16 after 3 clean steps), then steps 4-8 clean: 8 — a kept state says 2^15, 5.
    assert [r["step"] for r in recs[6:]] == [4, 5, 6, 7, 8] and recs[6]["loss_scale"] == 2.0**16
    assert engine.extra_state() == {"loss_scale": {"scale": 2.0**16, "growth_tracker": 8}}
    assert trainer.ft.guard.skipped_total == 2 and trainer.ft.guard.rollbacks == 1
