"""Straggler detector on 4 gloo ranks: false alarms over long healthy runs with random seeds, and the step at which
an injected slow rank is named (the ratio: the slow section's time over the median of its peers, as measured).

    PYTHONPATH=. python bench/straggler_false_alarms.py --steps 1000 --seeds 3 [--inject 2:forward:0.02]

Prints one line per run: seed, steps, alarms (records naming a straggler), the first naming step and who.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

from framework.base.run_dir import RunDir
from framework.testing import run_distributed
from framework.testing.tiny import tiny_config
from framework.train.trainer import Trainer


def _run(rank: int, world: int, run: Path, steps: int, seed: int, inject: str) -> list[dict[str, Any]]:
    cfg = tiny_config(run, "parallel.dp_replicate=4", "parallel.zero_stage=0", f"train.steps={steps}",
                      f"data.seed={seed}", f"train.seed={seed}", "checkpoint.interval=0", "checkpoint.save_final=false",
                      "train.log_interval=100000", *([f"observe.straggler.inject={inject}"] if inject else []))
    Trainer(cfg).train()
    return RunDir(run).read_metrics("train") if rank == 0 else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--inject", default="", help="RANK:SECTION:SECONDS for a slowed run instead of healthy ones")
    args = ap.parse_args()
    for _ in range(args.seeds):
        seed = random.randrange(1 << 30)
        with tempfile.TemporaryDirectory() as tmp:
            records = run_distributed(_run, 4, timeout_s=3600, run=Path(tmp) / "run", steps=args.steps, seed=seed,
                                      inject=args.inject)[0]
        named = [r for r in records if "straggler/rank" in r]
        first = (f"first at step {named[0]['step']}: rank {named[0]['straggler/rank']} {named[0]['straggler/section']} "
                 f"{named[0]['straggler/slowdown']:.2f}x") if named else "none"
        top = max((r.get("straggler/max_score", 0.0) for r in records), default=0.0)
        print(f"seed {seed}: {len(records)} steps, {len(named)} alarm records, {first}; highest window score {top:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
