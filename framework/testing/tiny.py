"""The tiny config every test trains on (configs/smoke/tiny.yaml), by a path that does not depend on the
working directory, and a builder for it."""

from __future__ import annotations

from pathlib import Path

from framework.config import Config, load_config

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "smoke" / "tiny.yaml")


def tiny_config(run_dir: str | Path | None = None, *overrides: str) -> Config:
    """configs/smoke/tiny.yaml with `overrides`, writing to `run_dir` when given."""
    return load_config(TINY, [*([f"run.dir={run_dir}"] if run_dir is not None else []), *overrides])
