"""One run = one directory: resolved config, metrics.jsonl, a readable log, checkpoints.

    runs/<name>/config.yaml      the resolved config of the latest start
    runs/<name>/metrics.jsonl    one JSON record per line (schema in docs/METRICS.md)
    runs/<name>/train.log        the console log lines, all ranks' warnings, rank 0's info
    runs/<name>/checkpoints/     step_N directories and the `latest` pointer
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from framework.base.errors import ConfigError


class RunDir:
    """The run directory of one training run (rank 0 writes; every rank may read)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def log_file(self) -> Path:
        return self.path / "train.log"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def create(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise ConfigError(
                f"run.dir={str(self.path)!r} is not writable ({err.strerror}); choose a writable directory "
                f"with run.dir=... or fix its permissions") from err

    def write_config(self, text: str) -> None:
        _atomic_write(self.config_file, text)

    def truncate_metrics_after(self, step: int) -> int:
        """Drop train/eval records after `step` (a resume from `step`), so the file reads as one run.

        Returns how many records were dropped.
        """
        if not self.metrics_file.exists():
            return 0
        kept, dropped = [], 0
        for line in self.metrics_file.read_text().splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a torn last line from a killed run
                continue
            if isinstance(rec.get("step"), int) and rec["step"] > step:
                dropped += 1
            else:
                kept.append(line)
        _atomic_write(self.metrics_file, "".join(k + "\n" for k in kept))
        return dropped

    def append_metrics(self, record: dict[str, Any]) -> None:
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(strict_json(record), sort_keys=False, allow_nan=False) + "\n")
            f.flush()

    def read_metrics(self, kind: str | None = "train") -> list[dict[str, Any]]:
        if not self.metrics_file.exists():
            return []
        out = []
        for line in self.metrics_file.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if kind is None or rec.get("type") == kind:
                    out.append(rec)
        return out


def strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every non-finite float (top level or in a list) written as null, and its value named in
    `"nonfinite": {"key": "nan" | "inf" | "-inf"}`, so strict JSON readers accept the line (docs/METRICS.md)."""
    out: dict[str, Any] = {}
    bad: dict[str, str] = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key], bad[key] = None, str(value)
        elif isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
            out[key] = [None if isinstance(v, float) and not math.isfinite(v) else v for v in value]
            bad[key] = "list"
        else:
            out[key] = value
    if bad:
        out["nonfinite"] = bad
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
