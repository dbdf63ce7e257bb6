"""`tessera smoke --nproc 1` end to end on the tiny synthetic config: stop half-way, resume, print the summary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from framework.drivers.smoke import run_smoke

REPO = Path(__file__).resolve().parents[2]


def test_single_process_smoke_stops_resumes_and_summarises(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    overrides = [f"run.dir={tmp_path / 'run'}", "train.steps=6", "train.eval_interval=3", "train.eval_batches=1",
                 "checkpoint.interval=3"]
    code = run_smoke(str(REPO / "configs/smoke/tiny.yaml"), overrides, nproc=1)
    out = capsys.readouterr().out
    assert "steps             : 0 -> 3 (stop), resumed -> 6" in out
    val = re.search(r"validation loss   : (.*)", out)
    assert val is not None
    names = [part.rsplit(" ", 1)[0] for part in val.group(1).split(", ")]
    assert names == sorted(set(names), key=names.index), f"a validation name is printed twice: {names}"
    first, final = (float(re.search(rf"{k} loss\s*: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
                    for k in ("first logged", "final"))
    assert code == (0 if final <= 0.6 * first else 1)
    assert (tmp_path / "run" / "checkpoints" / "step_6").is_dir()
