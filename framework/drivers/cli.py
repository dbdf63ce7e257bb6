"""CLI subcommands of the experiment drivers (framework/drivers): `tessera ablate`, `plot`, `preflight`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from framework.base.errors import ConfigError


def _threads() -> None:
    threads = os.environ.get("TESSERA_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def cmd_ablate(args: argparse.Namespace) -> int:
    from framework.drivers.ablate import load_spec, plan_runs, run_ablation
    from framework.drivers.ablate_report import write_report

    spec, config_path = load_spec(args.spec, args.set)
    out = Path(args.out or f"runs/ablations/{spec.name}")
    if args.slurm:
        from framework.drivers.ablate_slurm import launch_array

        return launch_array(args, spec, config_path, out)
    _threads()
    index = args.index
    if args.array_task:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        if task is None:
            raise ConfigError("--array-task reads SLURM_ARRAY_TASK_ID, which is not set; run it inside a SLURM "
                              "job array or pass --index N")
        index = int(task)
    if not args.report_only:
        run_ablation(args.spec, out, index=index, extra_overrides=args.set)
    if index is None:
        report = write_report(spec, plan_runs(spec, config_path, out), out, config_path, confirm=args.confirm)
        print(f"ablation {spec.name}: report {report}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from framework.observe.plot import plot_runs, plot_weights, read_curves

    if args.weights:
        if len(args.runs) != 1:
            raise ConfigError(f"tessera plot --weights draws one run's mixture weights; got {len(args.runs)} runs")
        out = plot_weights(args.runs[0], args.out, title=Path(args.runs[0]).name)
    else:
        out = plot_runs([read_curves(r) for r in args.runs], args.out, smooth_window=args.smooth)
    print(f"wrote {out}")
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from framework.config import load_config
    from framework.drivers.preflight import run_preflight

    _threads()
    cfg = load_config(args.config, args.overrides)
    report = run_preflight(cfg, keep=args.keep, config=args.config, overrides=args.overrides,
                           skip_layout=args.skip_layout)
    return 0 if report.passed else 1


def register(sub: Any) -> None:
    """Add ablate, plot and preflight to the `tessera` parser."""
    p = sub.add_parser("ablate", help="data-mixture ablation: many small runs over mixture weights, then a report")
    p.add_argument("spec", help="ablation spec YAML, e.g. configs/ablations/stdlib-mix.ablate.yaml")
    p.add_argument("--out", help="output directory (default runs/ablations/<name>)")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE",
                   help="an override for every run, after the spec's own (repeatable)")
    p.add_argument("--index", type=int, help="run only this run of the plan (0-based); no report")
    p.add_argument("--array-task", action="store_true", help="take --index from SLURM_ARRAY_TASK_ID")
    p.add_argument("--report-only", action="store_true", help="only (re)write the report from finished runs")
    p.add_argument("--confirm", action=argparse.BooleanOptionalAction, default=True,
                   help="train the proposed mixture like every proxy (same budget and seeds) and report its "
                        "measured objective against the prediction and the best swarm run (default: on)")
    p.add_argument("--slurm", action="store_true", help="render (and submit) a SLURM job array plus a report job")
    p.add_argument("--dry-run", action="store_true", help="with --slurm: write the scripts, submit nothing")
    p.add_argument("--max-parallel", type=int, default=0, help="with --slurm: at most N array tasks at once")
    p.add_argument("--time", default="01:00:00", help="with --slurm: time limit of each array task")
    p.add_argument("--partition", help="with --slurm: partition")
    p.add_argument("--gpus", type=int, default=0, help="with --slurm: GPUs per array task")
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("plot", help="loss curves of several runs in one PNG")
    p.add_argument("runs", nargs="+", help="run directories (holding metrics.jsonl)")
    p.add_argument("--out", default="loss_curves.png")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window over train loss")
    p.add_argument("--weights", action="store_true",
                   help="one run trained with data.mixing=online: its mixture weights over time")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("preflight", help="before cluster time: overfit one sample, a small batch, a short full run")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    p.add_argument("--keep", action="store_true", help="keep the stage-3 and stage-4 run directories")
    p.add_argument("--skip-layout", action="store_true",
                   help="do not run stage 4 (the configured parallel layout); the verdict says it was skipped")
    p.set_defaults(func=cmd_preflight)
