"""Time full-size dry runs per rank class and tabulate their figures beside the planner's.

    python bench/dryrun_scale.py                         # the dense reference configs, every rank class
    python bench/dryrun_scale.py --global-batch min      # the fewest micro-batches each schedule allows
    python bench/dryrun_scale.py --only llama3.1-405b --out docs/benchmarks/dryrun_scale.md
    python bench/dryrun_scale.py --replan a.json --replan b.json --out ...   # recorded runs, this planner

For each config: the world size it is written for, every rank class rehearsed in its own process
(framework/dryrun), the seconds each took on this machine, the measured peak and its verdict, and the
planner's figures for the same rank (framework/dryrun/planner.py). `--global-batch min` sets
train.global_batch_size to micro_batch x dp x the schedule's minimum micro-batches: the same per-micro-batch
program, fewer repetitions (1F1B's peak is reached after pp forwards; comm per step scales with the count).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.base.errors import TesseraError
from framework.config import Config, load_config
from framework.dryrun.cli import dry_run
from framework.dryrun.planner import compare, format_rows
from framework.dryrun.report import Verdict, format_table
from framework.dryrun.run import RankClass
from framework.dryrun.step import Collective, StepMeasure
from framework.parallel.mesh import ParallelDims
from framework.parallel.pipeline_schedules import min_micro_batches

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {  # name: (config, world size, GPU)
    "llama3.1-405b": ("configs/pretrain/llama3.1-405b-256n-h100.yaml", 2048, "h100-80g"),
    "gpt3-175b": ("configs/pretrain/gpt3-175b-128n-a100.yaml", 1024, "a100-80g"),
    "llama3-70b": ("configs/pretrain/llama3-70b-128n-h100.yaml", 1024, "h100-80g"),
    "mixtral-8x22b-class": ("configs/pretrain/mixtral-8x22b-class-32n-h100.yaml", 256, "h100-80g"),
    "deepseek-v3-class": ("configs/pretrain/deepseek-v3-class-256n-h100.yaml", 2048, "h100-80g"),
}


def _min_batch(cfg: Config, world: int) -> int:
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model)
    need = min_micro_batches(cfg.parallel.pp_schedule, dims.pp) if dims.pp > 1 else 1
    return cfg.train.micro_batch_size * dims.dp_size * need


def run_one(name: str, path: str, world: int, gpu: str, global_batch: str) -> tuple[str, dict[str, object]]:
    cfg = load_config(str(ROOT / path), [])
    overrides = []
    if global_batch == "min":
        overrides.append(f"train.global_batch_size={_min_batch(cfg, world)}")
        cfg = load_config(str(ROOT / path), overrides)
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    verdicts = dry_run(cfg, world, gpu=gpu)
    seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # each rank class runs in a forked child
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return render(name, cfg, path, world, gpu, overrides, verdicts, seconds, cpu)


def render(name: str, cfg: Config, path: str, world: int, gpu: str, overrides: list[str], verdicts: list[Verdict],
           seconds: float, cpu: float) -> tuple[str, dict[str, object]]:
    """The markdown block and the JSON record of one config's dry runs, with this tree's planner beside them."""
    rows = compare(cfg, world, verdicts)
    per_class = seconds / max(1, len(verdicts))
    text = "\n".join([f"## {name}: {path} at {world} ranks ({' '.join(overrides) or 'as written'})", "",
                      "```", format_table(verdicts, world, path), "", format_rows(rows), "```", "",
                      f"{len(verdicts)} rank classes in {seconds:.0f} s wall ({per_class:.0f} s per class), "
                      f"{cpu / max(1, len(verdicts)):.0f} CPU s per class", ""])
    record = {"config": path, "world": world, "gpu": gpu, "overrides": overrides, "seconds": seconds,
              "seconds_per_class": per_class, "cpu_seconds_per_class": cpu / max(1, len(verdicts)),
              "classes": [v.to_json() for v in verdicts],
              "planner": [r.__dict__ | {"ratio": r.ratio} for r in rows]}
    return text, record


def replan(json_path: str) -> list[tuple[str, tuple[str, dict[str, object]]]]:
    """Re-render a recorded run (`--json`) with this tree's planner: the dry runs' measures as they were."""
    out = []
    for name, rec in json.loads(Path(json_path).read_text()).items():
        if "error" in rec:
            continue
        classes = []
        for c in rec["classes"]:
            measure = dict(c["measure"], collectives=[Collective(**x) for x in c["measure"]["collectives"]])
            rank_class = RankClass(**dict(c["rank_class"], pp_ranks=tuple(c["rank_class"]["pp_ranks"])))
            classes.append(Verdict(rank_class, StepMeasure(**measure), c["extra"], c["total"], c["budget"], c["gpu"],
                                   [tuple(t) for t in c.get("top", [])]))
        cfg = load_config(str(ROOT / rec["config"]), rec["overrides"])
        out.append((name, render(name, cfg, rec["config"], rec["world"], rec["gpu"], rec["overrides"], classes,
                                 rec["seconds"], rec["cpu_seconds_per_class"] * len(classes))))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=sorted(CONFIGS), help="run these configs only")
    p.add_argument("--global-batch", choices=("as-written", "min"), default="as-written")
    p.add_argument("--out", default=None, help="write the tables here (markdown)")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--replan", action="append", default=[], metavar="JSON",
                   help="re-render these recorded runs with this tree's planner instead of dry-running")
    args = p.parse_args(argv)
    texts, records = [], {}
    for name, (text, record) in (item for path in args.replan for item in replan(path)):
        texts.append(text)
        records[name] = record
    for name in [] if args.replan else args.only or list(CONFIGS):
        path, world, gpu = CONFIGS[name]
        try:
            text, record = run_one(name, path, world, gpu, args.global_batch)
        except TesseraError as err:  # one config's failure is a row of the table, not the end of the bench
            text, record = f"## {name}: {path} at {world} ranks\n\nfailed: {err}\n", {"error": str(err)}
        print(text, flush=True)
        texts.append(text)
        records[name] = record
    if args.out:
        Path(args.out).write_text("\n".join(texts))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
