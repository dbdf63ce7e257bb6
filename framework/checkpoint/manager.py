"""The checkpoint side of a run: where to resume from, whether the checkpoint fits this run, saving (sync/async).

    manager = CheckpointManager(cfg.checkpoint, run_dir.checkpoints)
    path = manager.resume_point()                 # newest checkpoint that verifies, with fallback + warnings
    meta = manager.load(path, parts, optimizers, config_dict, fingerprint)
    manager.save(step, parts, optimizers, meta)   # async when checkpoint.async_save
    manager.wait()                                # before exiting or loading
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.base.errors import CheckpointError
from framework.base.logs import get_logger
from framework.checkpoint import dcp as ckpt
from framework.checkpoint.async_save import AsyncSaver, new_checkpoint_group
from framework.checkpoint.config import CheckpointConfig
from framework.checkpoint.manifest import VerifyMode, verify_manifest
from framework.checkpoint.resume_rules import LrAt, check_resume

log = get_logger("checkpoint")

def verify_checkpoint(path: Path, mode: VerifyMode = "checksum") -> None:
    """Raise a `CheckpointError` unless `path` is a committed checkpoint whose files match its manifest."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; `latest` names a deleted directory")
    ckpt.read_meta(path)
    verify_manifest(path, mode)


def find_valid_checkpoint(root: Path, mode: VerifyMode = "checksum",
                          failures: list[tuple[Path, str]] | None = None) -> Path | None:
    """The newest checkpoint under `root` that verifies, warning about each one skipped (this process only).

    `failures`, when given, collects (checkpoint, why) for every checkpoint that did not verify.
    """
    for path in ckpt.candidates(root):
        try:
            verify_checkpoint(path, mode)
            if ckpt.read_meta(path).get("guard_suspect"):
                log.info("passing over %s: it was taken while the loss guard was skipping steps", path.name)
                continue
            return path
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s; falling back to the previous one", path.name, err)
            if failures is not None:
                failures.append((path, str(err)))
    return None


def refuse_or_move_aside(root: Path, failures: list[tuple[Path, str]], start_over: bool) -> None:
    """Checkpoints exist but none verifies: never train over them silently.

    Raises:
        CheckpointError: naming each checkpoint and why it failed, unless `start_over` (then they are moved aside).
    """
    existing = [p for p, _ in failures if p.is_dir()]
    if start_over:
        dest = ckpt.move_aside(root, existing, "invalid", with_latest=True)
        log.warning("checkpoint.start_over=true: no checkpoint verified; moved %s to %s and starting at step 0",
                    ", ".join(p.name for p in existing) or "`latest`", dest)
        return
    named = "\n".join(f"  {p.name}: {why}" for p, why in failures)
    raise CheckpointError(
        f"{root} holds {len(failures)} checkpoint(s) and none verifies:\n{named}\nnothing was deleted. Restore "
        f"the files (a shared filesystem may still be syncing), or check with checkpoint.verify=size; to start "
        f"over on purpose set checkpoint.start_over=true (they are moved aside to {root}/invalid-<time>/, not "
        f"deleted)")


def check_compatible(meta: dict[str, Any], config: dict[str, Any], fingerprint: str | None, *,
                     allow_model_change: bool = False, allow_data_change: bool = False, path: Path | None = None
                     ) -> list[str]:
    """`check_resume` (framework/checkpoint/resume_rules.py) with only the model and data overrides."""
    cfg = CheckpointConfig(allow_model_change=allow_model_change, allow_data_change=allow_data_change)
    return check_resume(meta, config, fingerprint, cfg, path=path)


class CheckpointManager:
    """Saves, verifies, selects and loads the checkpoints of one run directory on every rank."""

    def __init__(self, cfg: CheckpointConfig, root: Path, lr_at: LrAt | None = None) -> None:
        self.cfg = cfg
        self.root = root
        self.lr_at = lr_at
        """States the LR jump when a resume reshapes the schedule (`check_resume`)."""
        self.rank, self.world = ckpt.rank_world()
        self.saver = AsyncSaver(new_checkpoint_group(), int(cfg.async_pin_budget_gb * 2**30)) if cfg.async_save \
            else None
        self.last_saved_step: int | None = None

    def remove_partial_saves(self) -> None:
        """Delete `.tmp-*` leftovers of a killed save (call before the first save of this process)."""
        if self.rank == 0:
            for p in ckpt.remove_partial_saves(self.root):
                log.warning("removed %s, left by a save that did not commit", p)
        ckpt.barrier()

    def resume_point(self) -> Path | None:
        """The newest valid checkpoint (rank 0 verifies; every rank gets its choice), or None.

        Raises:
            CheckpointError: checkpoints exist but none verifies (see `refuse_or_move_aside`).
        """
        self.wait()  # a rollback may come while a save is in flight: let it commit (or fail) first
        step, refusal = -1, None
        if self.rank == 0:
            failures: list[tuple[Path, str]] = []
            path = find_valid_checkpoint(self.root, self.cfg.verify, failures)
            step = -1 if path is None else int(ckpt.step_of(path) or 0)
            if path is None and failures:
                try:
                    refuse_or_move_aside(self.root, failures, self.cfg.start_over)
                except CheckpointError as err:
                    refusal, step = err, -2
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([step], dtype=torch.int64)
            dist.broadcast(t, src=0)
            step = int(t.item())
        if refusal is not None:
            raise refusal
        if step == -2:
            raise CheckpointError(f"rank 0 found no valid checkpoint in {self.root} and refused to start; its "
                                  f"log names each checkpoint and why")
        return None if step < 0 else self.root / ckpt.step_dir_name(step)

    def load(self, path: Path, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer] | None,
             config: dict[str, Any], fingerprint: str | None, data_build: str | None = None) -> dict[str, Any]:
        """Check the resume rules, then load model/optimizer/RNG state from `path` in place; return its meta."""
        self.wait()
        meta = ckpt.read_meta(path)
        for note in check_resume(meta, config, fingerprint, self.cfg, data_build=data_build, path=path,
                                 lr_at=self.lr_at):
            log.warning("resuming across a change (overridden): %s", note)
        if meta.get("model_only"):  # an imported model (tessera ckpt import-hf): fresh optimizer and RNG
            log.info("%s holds model weights only: starting with a fresh optimizer", path)
            return ckpt.load_checkpoint(path, parts, None, restore_rng=False)
        return ckpt.load_checkpoint(path, parts, optimizers)

    def save(self, step: int, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
             meta: dict[str, Any], *, blocking: bool = False) -> None:
        """Checkpoint `step`: in the background when async (unless `blocking`), else before returning."""
        state = ckpt.training_state(parts, optimizers)
        keep = {"keep_last": self.cfg.keep_last, "keep_every": self.cfg.keep_every}
        if self.saver is not None and not blocking:
            self.saver.save(self.root, step, state, meta, on_commit=self._committed, **keep)
        else:
            self.wait()
            pg = self.saver.pg if self.saver is not None else None
            tmp = ckpt.begin_save(self.root, step, pg)
            ckpt.write_shards(state, tmp, pg)
            self._committed(ckpt.commit(self.root, step, meta, pg, **keep))
        self.last_saved_step = step

    def _committed(self, path: Path) -> None:
        if self.rank == 0:
            log.info("checkpoint %s committed", path)

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) has committed."""
        if self.saver is not None:
            self.saver.wait()
