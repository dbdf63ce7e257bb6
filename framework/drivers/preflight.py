"""`tessera preflight CONFIG`: the checks practitioners run before spending cluster time, cheapest first.

    0 dirs     the run and checkpoint directories are writable and their filesystem has room for the checkpoints
               (estimated size x (keep_last + 1) copies present during a save x `disk_headroom`);
    1 overfit  one training sample, the run's model, a constant `overfit_lr`: the loss must fall near zero
               (below `overfit_loss`) — the model, loss and data plumbing can learn at all;
    2 batch    a small fixed batch with the run's optimizer settings (train.lr, betas, clipping, precision) and its
               LR schedule compressed to `batch_steps`: every loss and gradient norm finite, and the loss falls by
               `min_loss_drop` — catches a bad learning rate, broken precision or exploding gradients;
    3 full     a real Trainer run on a small dataset (one pass of `full_steps` x global batch) in a scratch run
               directory: it completes, evaluates, saves a checkpoint, and the checkpoint reloads into a fresh
               model bit-exactly.

Each stage prints PASS or FAIL with its reason; the first failure stops the ladder (later stages are skipped).
The ladder runs on one process with the single-process engine: it checks numerics and I/O, not the parallel
layout (`tessera launch slurm --dry-run` checks that).
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
import torch

from framework.config import Config, replace
from framework.errors import TesseraError
from framework.parallel.config import ParallelConfig


class StageFailed(Exception):
    """A preflight stage's check did not hold (the message is the reason)."""


@dataclass
class StageResult:
    number: int
    name: str
    status: str
    """PASS, FAIL or SKIP."""
    reason: str
    seconds: float = 0.0


@dataclass
class PreflightReport:
    stages: list[StageResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(s.status == "PASS" for s in self.stages)

    @property
    def failed_stage(self) -> StageResult | None:
        return next((s for s in self.stages if s.status == "FAIL"), None)


def checkpoint_bytes(cfg: Config) -> int:
    """Estimated size of one checkpoint: fp32 parameters plus AdamW's two fp32 moments (12 bytes/parameter)."""
    from models.flops import num_params

    return 12 * num_params(cfg.model)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def stage_dirs(cfg: Config) -> str:
    run, ckpt = cfg.run.path, cfg.run.path / "checkpoints"
    for what, path in (("run.dir", run), ("checkpoint dir", ckpt)):
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".preflight-probe"
            probe.write_bytes(b"x" * 4096)
            probe.unlink()
        except OSError as err:
            raise StageFailed(f"{what} {str(path)!r} is not writable ({err.strerror or err}); choose a writable "
                              f"directory with run.dir=... or fix its permissions") from err
    one = checkpoint_bytes(cfg)
    copies = cfg.checkpoint.keep_last + 1
    need = one * copies * cfg.observe.preflight.disk_headroom
    free = shutil.disk_usage(ckpt).free
    if free < need:
        raise StageFailed(f"checkpoint filesystem of {str(ckpt)!r} has {_gib(free)} free; needs {_gib(need)} "
                          f"(~{_gib(one)} per checkpoint x {copies} copies x headroom "
                          f"{cfg.observe.preflight.disk_headroom}); free space, lower checkpoint.keep_last or "
                          f"move run.dir")
    return (f"{run} and {ckpt} writable; checkpoints ~{_gib(one)} x {copies} copies x headroom "
            f"{cfg.observe.preflight.disk_headroom} = {_gib(need)} needed, {_gib(free)} free")


def _train_steps(cfg: Config, batch: torch.Tensor, train_cfg: Any, steps: int,
                 lr_of: Callable[[int], float]) -> tuple[list[float], list[float]]:
    """Train a fresh single-process engine on the same `batch` for `steps`; losses and grad norms per step."""
    from framework.engine import resolve_device
    from framework.train.local_engine import LocalEngine

    engine = LocalEngine(cfg.model, train_cfg, resolve_device(cfg.run.device))
    losses, norms = [], []
    for step in range(steps):
        losses.append(engine.forward_backward(batch))
        norms.append(engine.clip_grad_norm(train_cfg.grad_clip))
        if not (math.isfinite(losses[-1]) and math.isfinite(norms[-1])):
            break
        engine.optimizer_step(lr_of(step))
    return losses, norms


def stage_overfit(cfg: Config, data: Any) -> str:
    pf = cfg.observe.preflight
    sample = torch.as_tensor(np.asarray(data.train[0]), dtype=torch.long).view(1, 1, -1)
    train_cfg = replace(cfg.train, lr=pf.overfit_lr, weight_decay=0.0, warmup_steps=0, schedule="constant")
    losses, _ = _train_steps(cfg, sample, train_cfg, pf.overfit_steps, lambda _: pf.overfit_lr)
    if not math.isfinite(losses[-1]) or losses[-1] >= pf.overfit_loss:
        raise StageFailed(f"one sample did not overfit: loss {losses[0]:.3f} -> {losses[-1]:.3f} after "
                          f"{len(losses)} steps at lr {pf.overfit_lr:g} (goal < {pf.overfit_loss}); the model cannot "
                          f"memorize one sequence — check the model config, the loss and the labels' shift")
    return (f"one {sample.shape[-1] - 1}-token sample: loss {losses[0]:.3f} -> {losses[-1]:.4f} in {len(losses)} "
            f"steps at lr {pf.overfit_lr:g} (goal < {pf.overfit_loss})")


def stage_batch(cfg: Config, data: Any) -> str:
    from framework.train.lr_schedule import lr_at

    pf = cfg.observe.preflight
    n, mb = pf.batch_sequences, min(cfg.train.micro_batch_size, pf.batch_sequences)
    rows = np.stack([np.asarray(data.train[i]) for i in range(n)])
    batch = torch.as_tensor(rows, dtype=torch.long)[: (n // mb) * mb].view(n // mb, mb, -1)
    steps = pf.batch_steps
    train_cfg = replace(cfg.train, steps=steps, warmup_steps=min(cfg.train.warmup_steps, steps // 4))
    losses, norms = _train_steps(cfg, batch, train_cfg, steps, lambda s: lr_at(train_cfg, s))
    where = f"with train.lr={cfg.train.lr:g} ({cfg.train.schedule}, warmup {train_cfg.warmup_steps} of {steps} steps)"
    for i, (loss, norm) in enumerate(zip(losses, norms)):
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise StageFailed(f"{'loss' if not math.isfinite(loss) else 'gradient norm'} is "
                              f"{loss if not math.isfinite(loss) else norm} at step {i + 1} {where} (loss "
                              f"{losses[0]:.3f} at step 1, {losses[max(0, i - 1)]:.3g} at step {max(1, i)}); the "
                              f"updates diverge — lower train.lr (e.g. 3e-4) or check train.precision")
    goal = (1 - pf.min_loss_drop) * losses[0]
    if losses[-1] > goal:
        raise StageFailed(f"loss did not fall on a {n}-sequence batch {where}: {losses[0]:.3f} -> {losses[-1]:.3f} "
                          f"(goal <= {goal:.3f}); max grad norm {max(norms):.3g} — lower train.lr (e.g. 3e-4)")
    return (f"{n} sequences, {steps} steps {where}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, all finite, "
            f"grad norm <= {max(norms):.3g}")


def stage_full(cfg: Config, keep: bool) -> str:
    from framework.checkpoint import dcp as ckpt
    from framework.checkpoint.signals import check_stopped
    from framework.train.local_engine import LocalEngine
    from framework.train.trainer import Trainer

    pf = cfg.observe.preflight
    scratch = cfg.run.path / "preflight"
    shutil.rmtree(scratch, ignore_errors=True)
    small = replace(cfg,
                    run=replace(cfg.run, dir=str(scratch)),
                    train=replace(cfg.train, steps=pf.full_steps, eval_interval=pf.full_steps,
                                  warmup_steps=min(cfg.train.warmup_steps, pf.full_steps // 4)),
                    data=replace(cfg.data, num_samples=pf.full_steps * cfg.train.global_batch_size),
                    checkpoint=replace(cfg.checkpoint, interval=0, save_final=True, resume=False),
                    parallel=ParallelConfig(),
                    observe=replace(cfg.observe, wandb=replace(cfg.observe.wandb, enabled=False)))
    try:
        trainer = Trainer(small)
        result = trainer.train()
        check_stopped(result.exit_code, "preflight's training stage")
        if result.final_step != pf.full_steps or not all(math.isfinite(v) for v in result.losses.values()):
            raise StageFailed(f"training stopped at step {result.final_step} of {pf.full_steps} or produced "
                              f"non-finite losses {result.losses}")
        path = ckpt.latest_checkpoint(trainer.run_dir.checkpoints)
        if path is None:
            raise StageFailed(f"no checkpoint under {trainer.run_dir.checkpoints} after the final step")
        fresh = LocalEngine(small.model, small.train, trainer.device)
        meta = ckpt.load_checkpoint(path, fresh.model_parts, fresh.optimizers)
        saved, loaded = trainer.engine.model_parts[0].state_dict(), fresh.model.state_dict()
        differ = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        if differ or int(meta["step"]) != pf.full_steps:
            raise StageFailed(f"checkpoint {path} reloaded with different tensors {differ[:3]} or step "
                              f"{meta['step']} != {pf.full_steps}")
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return (f"{pf.full_steps} steps on {small.data.num_samples} samples: loss {result.first_loss:.3f} -> "
                f"{result.last_loss:.3f}, val {result.eval.get('val_loss/mean', float('nan')):.3f}; checkpoint "
                f"{path.name} ({_gib(size)}) saved and reloaded bit-exactly")
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)


def run_preflight(cfg: Config, keep: bool = False, out: TextIO | None = None) -> PreflightReport:
    """Run the ladder, print one line per stage and a verdict; returns the report."""
    from data_pipeline.prepare import prepare_data

    out = out or sys.stdout
    report = PreflightReport()
    data: list[Any] = []

    def get_data() -> Any:
        if not data:
            data.append(prepare_data(cfg.data, global_batch_size=cfg.train.global_batch_size))
        return data[0]

    stages: list[tuple[str, Callable[[], str]]] = [
        ("dirs", lambda: stage_dirs(cfg)),
        ("overfit", lambda: stage_overfit(cfg, get_data())),
        ("batch", lambda: stage_batch(cfg, get_data())),
        ("full", lambda: stage_full(cfg, keep)),
    ]
    print(f"preflight of run {cfg.run.name!r} ({cfg.run.path})", file=out)
    for number, (name, fn) in enumerate(stages):
        if report.failed_stage is not None:
            report.stages.append(StageResult(number, name, "SKIP", "an earlier stage failed"))
        else:
            t0 = time.perf_counter()
            try:
                report.stages.append(StageResult(number, name, "PASS", fn()))
            except (StageFailed, TesseraError) as err:
                report.stages.append(StageResult(number, name, "FAIL", f"{type(err).__name__}: {err}"
                                                 if isinstance(err, TesseraError) else str(err)))
            report.stages[-1].seconds = time.perf_counter() - t0
        s = report.stages[-1]
        print(f"[{s.status}] stage {number} {name:8s} {s.reason}  ({s.seconds:.1f} s)", file=out, flush=True)
    failed = report.failed_stage
    print("preflight PASSED" if failed is None else
          f"preflight FAILED at stage {failed.number} ({failed.name}): {failed.reason}", file=out)
    return report
