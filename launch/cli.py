"""`tessera launch ...`: the launchers' subcommands (registered by framework.cli through `register`).

    tessera launch slurm CONFIG --nodes N (--gpus-per-node G | --procs-per-node P) --time T
                         [--partition P] [--account A] [--mode srun|torchrun] [--dry-run] [a.b.c=value ...]
    tessera launch local --nproc N CONFIG ...   (launch.local)
    tessera launch exclude RUN_DIR [--add NODE | --clear NODE|all] [--job ID]   (launch.exclude)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from launch import exclude, local


class _OverridesParser(argparse.ArgumentParser):
    """Lets `a.b.c=value` overrides follow the options: argparse fills positionals only up to the first option,
    so `CONFIG --nodes 2 train.lr=1e-3` would otherwise reject the override."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        ns, extras = super().parse_known_args(args, namespace)
        late = [a for a in extras if "=" in a and not a.startswith("-")]
        if late and hasattr(ns, "overrides"):
            ns.overrides = [*(ns.overrides or []), *late]
            extras = [a for a in extras if a not in late]
        return ns, extras


def cmd_slurm(args: argparse.Namespace) -> int:
    from framework.config import load_config
    from launch.slurm import (
        SlurmSpec,
        check_cluster,
        data_warnings,
        node_cpus,
        node_local_paths,
        render_sbatch,
        submit,
        validate_spec,
    )

    cfg = load_config(args.config, args.overrides)
    gpus = args.gpus_per_node or 0
    procs = args.procs_per_node or gpus
    if procs < 1:
        from launch.env import LaunchError

        raise LaunchError("give --gpus-per-node G (one rank per GPU) or, on CPU nodes, --procs-per-node P")
    cpus_per_rank = args.cpus_per_rank
    if not cpus_per_rank:  # auto: share the node's cores among its ranks
        cores = node_cpus(args.partition)
        cpus_per_rank = max(1, cores // procs) if cores else 0
        if cores is None:
            print("tessera: note: sinfo could not tell the node's cores; the job shares the node's cores among its "
                  "ranks when it starts (SLURM_CPUS_ON_NODE; set --cpus-per-rank to fix the count)", file=sys.stderr)
    if args.nodes > 1:
        # The interpreter too: the script runs this one on every node (a venv on the submit host's local disk
        # is not there).
        paths = {"run.dir": cfg.run.path, "data.cache_dir": Path(cfg.data.cache_dir), "python": Path(sys.prefix)}
        if cfg.data.build_dir:
            paths["data.build_dir"] = Path(cfg.data.build_dir)
        for warning in node_local_paths(paths):
            print(f"tessera: warning: {warning}", file=sys.stderr)
    for warning in data_warnings(cfg, args.nodes, refuse=not args.dry_run):
        print(f"tessera: warning: {warning}", file=sys.stderr)
    spec = SlurmSpec(nodes=args.nodes, procs_per_node=procs, gpus_per_node=gpus, cpus_per_rank=cpus_per_rank,
                     time=args.time, partition=args.partition, account=args.account, mode=args.mode,
                     signal_lead_s=args.signal_lead, extra_sbatch=tuple(args.sbatch_arg))
    degrees = validate_spec(cfg, spec)
    exclude.check_shrink(cfg, spec)  # observe.exclude.shrink: the layout must also fit the smaller world
    if gpus and procs % degrees["tp"]:
        print(f"tessera: warning: parallel.tp={degrees['tp']} does not divide {procs} ranks per node, so tensor-"
              f"parallel groups span nodes and every layer's collectives cross the network", file=sys.stderr)
    program = None
    if args.stop_at is not None:
        program = ["-m", "framework.cli", "train", args.config, *args.overrides, "--stop-at", str(args.stop_at)]
    script = render_sbatch(cfg, spec, args.config, list(args.overrides), python=sys.executable, degrees=degrees,
                           program=program)
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    if gpus and not args.no_dryrun:  # before any allocation is asked for: a layout that cannot fit stops here
        _dry_run_first(cfg, args.nodes * procs, args.dryrun_gpu)
    check_cluster(spec)
    job_id = submit(script, cfg.run.path)
    print(job_id)
    print(f"submitted job {job_id}; log: {cfg.run.path}/slurm-{job_id}.out", file=sys.stderr)
    return 0


def _dry_run_first(cfg: Any, world_size: int, gpu: str) -> None:
    """Rehearse every rank class on this machine (framework/dryrun) and refuse a layout that does not fit,
    before any allocation is requested."""
    from framework.dryrun.cli import dry_run
    from framework.dryrun.report import format_table
    from launch.env import LaunchError

    print(f"tessera: dry run of {world_size} ranks on {gpu} first (skip with --no-dryrun) ...", file=sys.stderr)
    verdicts = dry_run(cfg, world_size, gpu=gpu)
    if not all(v.fits for v in verdicts):
        print(format_table(verdicts, world_size, cfg.run.name), file=sys.stderr)
        raise LaunchError(f"the layout does not fit {gpu} memory on every rank (table above); change the layout "
                          f"or pass --no-dryrun to submit anyway")
    worst = min(v.headroom for v in verdicts)
    print(f"tessera: dry run: every rank class fits, {worst / 2**30:.1f} GiB spare on the fullest", file=sys.stderr)


def _register_slurm(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("slurm", help="render an sbatch script from a config and submit it (or --dry-run)",
                       description="Render an sbatch script for CONFIG, check it against the parallel layout and "
                                   "the cluster, and submit it with sbatch (prints the job id).")
    p.add_argument("config", help="YAML config, e.g. configs/pretrain/llama3-70b-128n-h100.yaml")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides, passed on to `tessera train`")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node, one rank each (0: CPU nodes)")
    p.add_argument("--procs-per-node", type=int, default=0, help="ranks per node on CPU nodes")
    p.add_argument("--cpus-per-rank", type=int, default=0,
                   help="cores (and OpenMP threads) per rank; default: the node's cores (sinfo) / ranks per node")
    p.add_argument("--time", default="01:00:00", help="time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition", default=None, help="required when the cluster has no default partition")
    p.add_argument("--account", default=None)
    p.add_argument("--mode", choices=("srun", "torchrun"), default="srun",
                   help="srun: one task per rank; torchrun: one torchrun agent per node, c10d rendezvous")
    p.add_argument("--signal-lead", type=int, default=300,
                   help="seconds before the time limit at which SIGUSR1 asks the trainer to save and requeue")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="OPT",
                   help="extra #SBATCH option, verbatim (repeatable), e.g. --sbatch-arg=--qos=high")
    p.add_argument("--stop-at", type=int, default=None, help="the job stops (and checkpoints) after this step")
    p.add_argument("--dry-run", action="store_true", help="print the script instead of submitting it")
    p.add_argument("--no-dryrun", action="store_true",
                   help="skip the rehearsal on this machine (`tessera dryrun`) a GPU job gets before it is submitted")
    p.add_argument("--dryrun-gpu", default="h100-80g", help="the GPU the rehearsal checks memory against")
    p.set_defaults(func=cmd_slurm)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `launch` with its launchers: `slurm` here, `local` from launch.local."""
    launch = subparsers.add_parser("launch", help="launch training on one node (local) or a SLURM cluster (slurm)")
    sub = launch.add_subparsers(dest="launcher", required=True, metavar="LAUNCHER", parser_class=_OverridesParser)
    _register_slurm(sub)
    local.register(sub)
    exclude.add_parser(sub)
