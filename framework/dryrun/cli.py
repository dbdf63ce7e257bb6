"""`tessera dryrun` — rehearse a config's training step at its real world size on this machine.

    tessera dryrun configs/pretrain/llama3.1-405b-256n-h100.yaml --world 2048            # every rank class
    tessera dryrun CONFIG --world 2048 --rank 1920 --gpu h100-80g --json dryrun.json     # one rank
    tessera dryrun CONFIG parallel.recompute=full                                         # with overrides

Exit code 0 when every rehearsed rank fits, 3 when one does not (the table says which and what to change),
2 on a configuration error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from framework.base.errors import ConfigError

if TYPE_CHECKING:
    from framework.config import Config
    from framework.dryrun.report import Verdict

NOT_FITTING = 3


def world_of(cfg: Config, world: int | None) -> int:
    """The world size: `world`, or the layout's when every axis is pinned (dp_shard != -1)."""
    p = cfg.parallel
    if world is not None:
        return world
    if p.dp_shard == -1:
        raise ConfigError(f"{'parallel.dp_shard=-1'} takes the data axis from the world size: give --world N "
                          f"(tp={p.tp} x pp={p.pp} x cp={p.cp} x dp_replicate={p.dp_replicate} x dp_shard)")
    return int(p.tp * p.pp * p.cp * p.dp_replicate * p.dp_shard)


def dry_run(cfg: Config, world_size: int, *, rank: int | None = None, gpu: str = "h100-80g",
            margin: float = 0.05) -> list[Verdict]:
    """Verdicts (framework/dryrun/report.py) for every rank class of `cfg` at `world_size`, or for `rank` alone.

    Raises:
        ParallelismError: the layout does not fit the world or the model.
        DryRunError: the rehearsal could not be faithful.
    """
    from framework.dryrun.report import CUBLAS_WORKSPACE, CUDA_CONTEXT, verdict
    from framework.dryrun.run import RankClass, dry_run_ranks, rank_classes
    from framework.parallel.mesh import ParallelDims
    from framework.plan.hardware import get_hardware

    hw = get_hardware(gpu)
    classes = rank_classes(cfg, world_size)
    if rank is not None:
        dims = ParallelDims.from_config(cfg.parallel, world_size, cfg.model)
        pp = dims.coords(rank)["pp"]
        own = next(c for c in classes if pp in c.pp_ranks)
        classes = [RankClass(f"rank {rank} ({own.name})", rank, 1, (pp,), own.layers)]
    # past this many live tensor bytes no rank can fit: the step stops there (a non-fitting layout is quick)
    limit = int(hw.memory_bytes * (1 - margin)) - CUDA_CONTEXT - CUBLAS_WORKSPACE
    measures = dry_run_ranks(cfg, [c.rank for c in classes], world_size, limit)
    return [verdict(c, m, hw, margin) for c, m in zip(classes, measures)]


def cmd_dryrun(args: argparse.Namespace) -> int:
    from framework.config import load_config
    from framework.dryrun.report import format_table

    cfg = load_config(args.config, args.overrides)
    world = world_of(cfg, args.world)
    t0 = time.perf_counter()
    verdicts = dry_run(cfg, world, rank=args.rank, gpu=args.gpu, margin=args.margin)
    print(format_table(verdicts, world, args.config))
    print(f"\n({len(verdicts)} rank(s) rehearsed in {time.perf_counter() - t0:.0f} s)")
    if args.vs_planner:
        from framework.dryrun.planner import compare, format_rows

        print("\nthe planner's formulas (framework/plan/memory.py) beside the dry run, per rank class:")
        print(format_rows(compare(cfg, world, verdicts)))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": args.config, "overrides": args.overrides, "world_size": world, "gpu": args.gpu,
            "margin": args.margin, "classes": [v.to_json() for v in verdicts]}, indent=1))
    return 0 if all(v.fits for v in verdicts) else NOT_FITTING


def add_arguments(p: argparse.ArgumentParser) -> None:
    from framework.plan.hardware import HARDWARE

    p.add_argument("config", help="YAML config, e.g. configs/pretrain/llama3.1-405b-256n-h100.yaml")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    p.add_argument("--world", type=int, default=None,
                   help="ranks of the real run (default: the layout's, when parallel.dp_shard is not -1)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=None, help="rehearse this one rank")
    which.add_argument("--all-rank-classes", action="store_true",
                       help="rehearse one rank of every class: first / middle / last pipeline stage (the default)")
    p.add_argument("--gpu", default="h100-80g", choices=sorted(HARDWARE), help="the GPU whose memory it must fit")
    p.add_argument("--margin", type=float, default=0.05, help="fraction of GPU memory kept free (default 0.05)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--vs-planner", action="store_true",
                   help="print the planner's memory terms for the same layout beside the measured ones")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("dryrun", help="rehearse a config at its real world size on this machine (fake "
                                             "backend, no weights): memory per rank class and every collective")
    add_arguments(p)
    p.set_defaults(func=cmd_dryrun)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera dryrun")
    add_arguments(parser)
    return cmd_dryrun(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
