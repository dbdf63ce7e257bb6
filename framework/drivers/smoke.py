"""The smoke job: embedded corpus -> tokenizer -> .bin/.idx -> a tiny model trained on CPU, stopped half-way and
resumed from its DCP checkpoint -> a printed summary. `make smoke` runs it.

When the config's layout needs several ranks (configs/smoke/smoke.yaml: TP2 x PP2 x DP2, ZeRO-1, 8 ranks) both
halves run through `tessera launch local`; with `--nproc 1` (or a 1-rank layout) everything runs in this process.

A smoke job starts from an empty run directory — unless the last smoke job there, with the same config, overrides
and ranks, stopped before its end (a signal, a crash): then the same command continues where it stopped, from its
last checkpoint (`<run dir>/smoke.json` records the unfinished job; it is removed when the job ends).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from framework.checkpoint.signals import INTERRUPT_EXIT_CODE, check_stopped
from framework.config import load_config
from framework.train.trainer import Trainer

SMOKE_MARKER = "smoke.json"
"""In the run directory while a smoke job is unfinished: its config, overrides and ranks."""


@dataclass
class SmokeSummary:
    run_dir: str
    stop_step: int
    final_step: int
    first_loss: float
    last_loss: float
    mean_step_time_s: float
    tokens_per_s: float
    eval: dict[str, float]
    ranks: int


def _val_losses(record: Mapping[str, Any]) -> dict[str, float]:
    """The validation losses of an eval record (its perplexities, step and type stay in the metrics)."""
    return {k: float(v) for k, v in record.items() if k.startswith("val_loss/")}


def _summary(cfg: Any, half: int, ranks: int) -> SmokeSummary:
    """The summary from the run's metrics (every step once, also across a stop and a rerun)."""
    from framework.base.run_dir import RunDir

    run = RunDir(cfg.run.path)
    train = run.read_metrics("train")
    evals = run.read_metrics("eval")
    resumed = [r["step_time_s"] for r in train if r["step"] > half + 1]  # the first step pays one-off costs
    step_time = float(np.mean(resumed)) if resumed else float("nan")
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    last_eval = _val_losses(evals[-1] if evals else {})
    return SmokeSummary(str(run.path), half, int(train[-1]["step"]), float(train[0]["loss"]),
                        float(train[-1]["loss"]), step_time, tokens / step_time, last_eval, ranks)


def _single_process(config: str, overrides: Sequence[str]) -> SmokeSummary:
    cfg = load_config(config, overrides)
    half = max(1, cfg.train.steps // 2)
    check_stopped(Trainer(cfg).train(stop_at=half).exit_code, "the smoke job")
    check_stopped(Trainer(cfg).train().exit_code, "the smoke job")
    return _summary(cfg, half, 1)


def _launched(config: str, overrides: Sequence[str], nproc: int) -> SmokeSummary:
    from data_pipeline.read.prepare import prepare_data
    from framework.base.errors import TesseraError
    from launch.local import run_local

    cfg = load_config(config, overrides)
    prepare_data(cfg.data)  # build the corpus once here; the ranks then hit the cache
    half = max(1, cfg.train.steps // 2)
    for extra in (["--stop-at", str(half)], []):
        code = run_local(nproc, config, overrides, extra=extra)
        if code in (cfg.checkpoint.requeue_exit_code, INTERRUPT_EXIT_CODE):
            check_stopped(code, f"the {nproc}-rank smoke job")
        if code:
            raise TesseraError(f"the {nproc}-rank smoke run exited with code {code}; see {cfg.run.path}/")
    return _summary(cfg, half, nproc)


def _start(run_path: Path, job: dict[str, Any]) -> None:
    """Continue the unfinished smoke job `job` in `run_path`, or empty the directory for a new one."""
    marker = run_path / SMOKE_MARKER
    try:
        unfinished = json.loads(marker.read_text()) if marker.is_file() else None
    except (OSError, json.JSONDecodeError):
        unfinished = None
    if unfinished == job:
        print(f"smoke: continuing the stopped smoke job in {run_path} from its last checkpoint "
              f"(delete {marker} to start over)", flush=True)
        return
    if run_path.exists():
        shutil.rmtree(run_path)  # a new smoke job starts fresh; the corpus and tokenizer stay cached
    run_path.mkdir(parents=True)
    marker.write_text(json.dumps(job))


def run_smoke(config: str, overrides: Sequence[str], nproc: int | None = None) -> int:
    from launch.local import layout_world

    cfg = load_config(config, overrides)
    needed = layout_world(config, overrides)
    nproc = needed if nproc is None else nproc
    _start(cfg.run.path, {"config": str(config), "overrides": list(overrides), "nproc": nproc})
    if nproc == 1 and needed > 1:
        overrides = [*overrides, "parallel.tp=1", "parallel.pp=1", "parallel.dp_shard=1", "parallel.dp_replicate=1"]
    t0 = time.perf_counter()
    s = _single_process(config, overrides) if nproc == 1 else _launched(config, overrides, nproc)
    elapsed = time.perf_counter() - t0
    (cfg.run.path / SMOKE_MARKER).unlink(missing_ok=True)  # finished: the next smoke job starts fresh
    _print_summary(s, elapsed)
    _print_downstream(s.run_dir)
    ok = s.last_loss <= 0.6 * s.first_loss
    print(f"smoke {'PASSED' if ok else 'FAILED'}: final loss {s.last_loss:.4f} is "
          f"{100 * s.last_loss / s.first_loss:.1f}% of the first ({s.first_loss:.4f}); goal <= 60%")
    return 0 if ok else 1


def _print_summary(s: SmokeSummary, elapsed: float) -> None:
    print("\n=== Tessera smoke summary ===")
    print(f"run directory     : {s.run_dir}  ({s.ranks} rank{'s' if s.ranks > 1 else ''})")
    print(f"steps             : 0 -> {s.stop_step} (stop), resumed -> {s.final_step}")
    print(f"first logged loss : {s.first_loss:.4f}")
    print(f"final loss        : {s.last_loss:.4f}")
    print(f"tokens/s          : {s.tokens_per_s:.0f} (mean step {1000 * s.mean_step_time_s:.0f} ms)")
    if s.eval:
        print("validation loss   : " + ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in s.eval.items()))
    print(f"wall time         : {elapsed:.1f} s (data preparation included)")


def _print_downstream(run_dir: str) -> None:
    """Each downstream task's accuracy at the first and the last eval, and the gain in standard errors."""
    from framework.base.run_dir import RunDir

    evals = [r for r in RunDir(Path(run_dir)).read_metrics("eval") if any(k.startswith("downstream/") for k in r)]
    if not evals:
        return
    first, last = evals[0], evals[-1]
    for key in sorted(k for k in last if k.startswith("downstream/") and k.split("/")[-1].startswith("acc")
                      and not k.endswith("_stderr")):
        se = float(np.hypot(first[key + "_stderr"], last[key + "_stderr"])) or float("nan")
        task, metric = key.split("/")[1:3]
        n = int(last[f"downstream/{task}/n"])
        print(f"downstream        : {task} {metric} {first[key]:.4f} (step {first['step']}) -> {last[key]:.4f} "
              f"(step {last['step']}): {(last[key] - first[key]) / se:+.1f} standard errors of the difference "
              f"({n} items)")
