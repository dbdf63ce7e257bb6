"""What may change between a checkpoint and the run that resumes it — every rule in one place (docs/CHECKPOINTS.md).

    notes = check_resume(meta, config_dict, fingerprint, cfg.checkpoint)   # raises CheckpointError, or notes

Allowed silently: evaluation, logging, observability, checkpointing and run settings; a new or changed
`data.schedule` phase that starts after the resumed step (the data seen so far is unchanged).
Allowed with a flag, and logged: a new `train.steps` (`checkpoint.steps_change=reshape`: cosine, linear and WSD
depend on the total, so the schedule is recomputed for the new total from this step on and the LR jump is
logged); a new `train.global_batch_size` (`checkpoint.allow_batch_size_change=true`: the sample position carries
on, the step count restarts nothing; with `data.schedule`, started phases keep their sample and later phases start
at their steps under the new batch size — no `allow_data_change` needed); model and data changes
(`allow_model_change`, `allow_data_change`).
Refused: a different model shape, different data already seen (build, seed, sequence length, an earlier phase),
another `train.optimizer` (the saved states are the other optimizer's).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from framework.base.errors import CheckpointError
from framework.checkpoint.config import CheckpointConfig

LrAt = Callable[[dict[str, Any], int], float]
"""The LR at a step of a `train` config section given as a dict (`framework/train/lr_schedule.py::section_lr_at`,
handed down by the trainer: the loop sits above checkpointing)."""

# Model fields that do not change what a checkpoint holds (naming, initialization).
SHAPE_NEUTRAL = {"preset", "init_std", "depth_scaled_init"}


def _diff(a: Any, b: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _diff(a.get(key), b.get(key), f"{prefix}.{key}")
        return out
    return [] if a == b else [(prefix, a, b)]


def _future_phases_only(saved: dict[str, Any], now: dict[str, Any], step: int) -> bool:
    """True when the data configs differ only in `data.schedule` phases that start after `step`."""
    rest_saved = {k: v for k, v in saved.items() if k != "schedule"}
    rest_now = {k: v for k, v in now.items() if k != "schedule"}
    if rest_saved != rest_now:
        return False

    def seen(phases: Any) -> list[Any]:
        return [p for p in phases or [] if int(p.get("start_step", 0)) <= step]

    return seen(saved.get("schedule")) == seen(now.get("schedule"))


def _check_steps(saved: dict[str, Any], now: dict[str, Any], step: int, cfg: CheckpointConfig,
                 where: str, lr_at: LrAt | None) -> list[str]:
    old_steps, new_steps = saved.get("steps"), now.get("steps")
    if old_steps is None or old_steps == new_steps or now.get("schedule") == "constant":
        return []
    if cfg.steps_change != "reshape":
        raise CheckpointError(
            f"train.steps is {new_steps} in this run but {old_steps} in {where}; the {now.get('schedule')} LR "
            f"schedule depends on the total, so resuming would change the LR from this step on. Set "
            f"checkpoint.steps_change=reshape to recompute the schedule for {new_steps} steps (the LR jump is "
            f"logged), or restore train.steps={old_steps}")
    note = f"train.steps: {old_steps} -> {new_steps} (checkpoint.steps_change=reshape): LR at step {step} "
    if lr_at is None:
        return [note + "recomputed for the new total"]
    return [note + f"{lr_at({**now, 'steps': old_steps}, step):.3e} -> {lr_at(now, step):.3e}"]


def check_resume(meta: dict[str, Any], config: dict[str, Any], fingerprint: str | None, cfg: CheckpointConfig, *,
                 data_build: str | None = None, path: Path | None = None, lr_at: LrAt | None = None) -> list[str]:
    """Apply every resume rule to the checkpoint's `meta` and this run's resolved `config`.

    `data_build`: the fingerprint of the data build this run reads (None for synthetic data), so that a changed
    future phase is told apart from changed data. `lr_at`: states the LR jump of a reshaped schedule in its note.

    Returns:
        The logged notes of the changes that were allowed.

    Raises:
        CheckpointError: naming the first refused change and the flag or fix.
    """
    where = f"checkpoint {path}" if path else "the checkpoint"
    saved = meta.get("config") or {}
    step = int(meta.get("step", 0))
    notes: list[str] = []
    model_diff = [d for d in _diff(saved.get("model"), config.get("model"), "model")
                  if d[0].split(".")[-1] not in SHAPE_NEUTRAL]
    if model_diff and saved.get("model") is not None:
        field, old, new = model_diff[0]
        if not cfg.allow_model_change:
            raise CheckpointError(
                f"{field} is {new!r} in this run but {old!r} in {where} ({len(model_diff)} model field(s) differ); "
                f"restore the model config, start a new run.name, or set checkpoint.allow_model_change=true")
        notes += [f"{f}: {o!r} -> {n!r}" for f, o, n in model_diff]
    old_train, new_train = saved.get("train") or {}, config.get("train") or {}
    batch_changed = False
    if old_train and not meta.get("model_only"):
        notes += _check_steps(old_train, new_train, step, cfg, where, lr_at)
        old_opt, new_opt = old_train.get("optimizer", "adamw"), new_train.get("optimizer", "adamw")
        if old_opt != new_opt:  # the saved states belong to the other optimizer (exp_avg vs momentum_buffer)
            raise CheckpointError(
                f"train.optimizer is {new_opt} in this run but {old_opt} in {where}, whose optimizer state is "
                f"{old_opt}'s; restore train.optimizer={old_opt}, or start a new run.name from its weights")
        old_gbs, new_gbs = old_train.get("global_batch_size"), new_train.get("global_batch_size")
        if old_gbs is not None and old_gbs != new_gbs:
            if not cfg.allow_batch_size_change:
                raise CheckpointError(
                    f"train.global_batch_size is {new_gbs} in this run but {old_gbs} in {where}; the optimizer "
                    f"state and the LR were tuned for the old batch. Set checkpoint.allow_batch_size_change=true to "
                    f"continue from the same sample with the new batch, or restore train.global_batch_size={old_gbs}")
            batch_changed = True
            notes.append(f"train.global_batch_size: {old_gbs} -> {new_gbs} (allowed by the flag; training "
                         f"continues from the same sample)")
    old_fp = meta.get("data_fingerprint")
    if old_fp is not None and fingerprint is not None and old_fp != fingerprint:
        old_data, new_data = saved.get("data") or {}, config.get("data") or {}
        data_diff = _diff(old_data, new_data, "data")
        named = ", ".join(f"{f}: {o!r} -> {n!r}" for f, o, n in data_diff) or "the data files changed"
        same_build = meta.get("data_build") == data_build
        if data_diff and same_build and _future_phases_only(old_data, new_data, step):
            notes.append(f"data.schedule: a phase after step {step} changed ({named}); the data seen so far is "
                         f"unchanged")
        elif batch_changed and same_build and new_data.get("schedule") and _future_phases_only(old_data, new_data,
                                                                                               step):
            # The trainer keeps every started phase at its sample (the batch history in the checkpoint) and
            # places the phases after this step at their steps under the new batch size.
            notes.append(f"data.schedule: the phases after step {step} start at their steps under the new batch "
                         f"size{f' ({named})' if data_diff else ''}; the data seen so far is unchanged")
        elif not cfg.allow_data_change:
            raise CheckpointError(
                f"data fingerprint is {fingerprint} in this run but {old_fp} in {where} ({named}); restore the data "
                f"config, start a new run.name, or set checkpoint.allow_data_change=true")
        else:
            notes.append(f"data fingerprint {old_fp} -> {fingerprint} ({named})")
    return notes
