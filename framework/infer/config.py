"""Downstream-evaluation configuration (`cfg.eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from framework.base.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    """JSONL task files (format: framework/infer/tasks.py), or the built-in "stdlib-nextline" (pick the real next
    line of a held-out standard-library file among four; needs a stdlib/build data run). Scored at every eval
    step (train.eval_interval) and, with `at_start`, before the first step."""
    at_start: bool = True
    """Score the step-0 model too (the baseline the trained model should beat)."""
    batch_size: int = 32
    """Sequences (one per choice) per scoring forward."""
    mutual_info: bool = False
    """Also score each choice after the EOS token alone and report acc_mutual_info (context's gain in
    log-likelihood; twice the scoring cost). Small models' summed scores mostly reflect how likely a line is on
    its own; this one measures what the context adds."""
    max_items: int = 0
    """Score at most this many items of each file task (0: all)."""
    stdlib_items: int = 400
    seed: int = 0
    """Seed of the built-in task's item sampling."""

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"eval.batch_size={self.batch_size} must be >= 1; e.g. 32")
        if self.max_items < 0:
            raise ConfigError(f"eval.max_items={self.max_items} must be >= 0 (0 scores every item)")
        if self.stdlib_items < 1:
            raise ConfigError(f"eval.stdlib_items={self.stdlib_items} must be >= 1; e.g. 400")
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"eval.tasks={self.tasks} names a task twice; list each once")
