"""Loss-spike and NaN/inf guard.

A step is skipped (no optimizer update, gradients dropped, counted) when its loss or gradient norm is not
finite, or when its loss lies more than `zscore` standard deviations above the mean of the last `window`
accepted losses. After `max_consecutive` skips in a row the trainer rolls back to the last checkpoint and
skips the offending data window (the loader continues after the samples that caused the skips), as large-scale
runs do by hand (OPT-175B logbook; PaLM, Chowdhery et al. 2022, sec. 5.1). The loss and norm it judges are the
global ones, so every rank reaches the same verdict without communicating.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from framework.checkpoint.config import GuardConfig


@dataclass(frozen=True)
class Verdict:
    skip: bool
    reason: str = ""
    """"nonfinite_loss", "nonfinite_grad" or "spike" when skipped."""
    zscore: float = 0.0


class LossGuard:
    """Judges each step's (loss, grad_norm); its state travels in checkpoints so a resume judges identically."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.consecutive = 0
        self.skipped_total = 0
        self.rollbacks = 0
        self.rollback_targets: dict[str, int] = {}
        """Rollbacks per checkpoint name ("" when there was none to roll back to)."""

    def zscore(self, loss: float) -> float:
        if len(self.history) < self.cfg.min_history:
            return 0.0
        mean = sum(self.history) / len(self.history)
        var = sum((x - mean) ** 2 for x in self.history) / len(self.history)
        return (loss - mean) / max(math.sqrt(var), 1e-12)

    def check(self, loss: float, grad_norm: float) -> Verdict:
        """The verdict for one step; updates the counters and, for accepted steps, the loss history."""
        if not self.cfg.enabled:
            return Verdict(False)
        verdict = Verdict(False)
        if not math.isfinite(loss):
            verdict = Verdict(True, "nonfinite_loss")
        elif not math.isfinite(grad_norm):
            verdict = Verdict(True, "nonfinite_grad")
        else:
            z = self.zscore(loss)
            if self.cfg.zscore > 0 and z > self.cfg.zscore:
                verdict = Verdict(True, "spike", z)
        if verdict.skip:
            self.consecutive += 1
            self.skipped_total += 1
        else:
            self.consecutive = 0
            self.history.append(loss)
        return verdict

    @property
    def rollback_due(self) -> bool:
        return self.cfg.enabled and self.consecutive >= self.cfg.max_consecutive

    @property
    def skipping(self) -> bool:
        """The last step was skipped: the weights may already be diverged (no checkpoint should be trusted)."""
        return self.cfg.enabled and self.consecutive > 0

    def rollback_refusal(self, target: str) -> str | None:
        """Why rolling back to checkpoint `target` would loop (the cap, or a second time there), else None."""
        if self.rollbacks >= self.cfg.max_rollbacks:
            return f"{self.rollbacks} rollback(s) already, checkpoint.guard.max_rollbacks={self.cfg.max_rollbacks}"
        if self.rollback_targets.get(target):
            return f"a rollback to {target or 'the initial weights'} already happened and the divergence came back"
        return None

    def rolled_back(self, target: str = "") -> None:
        self.consecutive = 0
        self.rollbacks += 1
        self.rollback_targets[target] = self.rollback_targets.get(target, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "consecutive": self.consecutive,
                "skipped_total": self.skipped_total, "rollbacks": self.rollbacks,
                "rollback_targets": dict(self.rollback_targets)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.history = deque((float(x) for x in state["history"]), maxlen=self.cfg.window)
        self.consecutive = int(state["consecutive"])
        self.skipped_total = int(state["skipped_total"])
        self.rollbacks = int(state.get("rollbacks", 0))
        self.rollback_targets = {str(k): int(v) for k, v in state.get("rollback_targets", {}).items()}
