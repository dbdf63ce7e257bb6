"""The smoke job: embedded corpus -> tokenizer -> .bin/.idx -> a tiny model trained on CPU, stopped half-way and
resumed from its DCP checkpoint -> a printed summary. `make smoke` runs it."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence

from framework.config import load_config
from framework.train.trainer import Trainer, TrainResult


def run_smoke(config: str, overrides: Sequence[str]) -> int:
    cfg = load_config(config, overrides)
    run_path = cfg.run.path
    if run_path.exists():
        shutil.rmtree(run_path)  # a smoke run starts fresh; the corpus and tokenizer stay cached
    t0 = time.perf_counter()
    half = max(1, cfg.train.steps // 2)
    first = Trainer(cfg).train(stop_at=half)
    second = Trainer(cfg).train()
    elapsed = time.perf_counter() - t0
    _print_summary(first, second, elapsed)
    ok = second.last_loss <= 0.6 * first.first_loss
    print(f"smoke {'PASSED' if ok else 'FAILED'}: final loss {second.last_loss:.4f} is "
          f"{100 * second.last_loss / first.first_loss:.1f}% of the first ({first.first_loss:.4f}); goal <= 60%")
    return 0 if ok else 1


def _print_summary(first: TrainResult, second: TrainResult, elapsed: float) -> None:
    print("\n=== Tessera smoke summary ===")
    print(f"run directory     : {second.run_dir}")
    print(f"steps             : 0 -> {first.final_step} (stop), resumed {second.start_step} -> {second.final_step}")
    print(f"first logged loss : {first.first_loss:.4f}")
    print(f"final loss        : {second.last_loss:.4f}")
    print(f"tokens/s          : {second.tokens_per_s:.0f} (mean step {1000 * second.mean_step_time_s:.0f} ms)")
    if second.eval:
        print("validation loss   : " + ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in second.eval.items()))
    print(f"wall time         : {elapsed:.1f} s (data preparation included)")
