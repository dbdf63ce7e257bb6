"""`tessera launch local --nproc N CONFIG [a.b.c=value ...]`: any layout on one node, CPU or GPU, via torchrun.

The layout is validated against N ranks and the model before any process starts (ParallelismError names the
fix). Each rank runs `tessera train CONFIG overrides`; on CPU every rank gets `--threads` intra-op threads
(default: cores / N, at least 1) so N ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence


def layout_world(config: str, overrides: Sequence[str]) -> int:
    """The smallest world size the config's layout needs (dp_shard=-1 counts as 1)."""
    from framework.config import load_config

    p = load_config(config, overrides).parallel
    return p.tp * p.pp * p.cp * p.dp_replicate * max(p.dp_shard, 1)


def validate(config: str, overrides: Sequence[str], nproc: int) -> None:
    """Raise ParallelismError/ConfigError now rather than in N ranks."""
    from framework.config import load_config
    from framework.parallel.engine import micro_batches
    from framework.parallel.mesh import ParallelDims

    cfg = load_config(config, overrides)
    micro_batches(ParallelDims.from_config(cfg.parallel, nproc, cfg.model), cfg.train, cfg.parallel.pp_schedule)


def build_command(nproc: int, args: Sequence[str], python: str = sys.executable) -> list[str]:
    """torchrun (standalone rendezvous on a free local port) running `tessera <args>` on `nproc` ranks."""
    return [python, "-m", "launch.torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "framework.cli",
            *args]


def launch_env(nproc: int, threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    per_rank = threads or max(1, (os.cpu_count() or 1) // nproc)
    env.setdefault("OMP_NUM_THREADS", str(per_rank))
    env["TESSERA_NUM_THREADS"] = str(per_rank)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_local(nproc: int, config: str, overrides: Sequence[str], *, command: str = "train",
              extra: Sequence[str] = (), threads: int | None = None) -> int:
    """Validate, then run `tessera COMMAND CONFIG overrides extra` on `nproc` local ranks; the exit code."""
    validate(config, overrides, nproc)
    cmd = build_command(nproc, [command, config, *overrides, *extra])
    return subprocess.call(cmd, env=launch_env(nproc, threads))


def cmd_local(args: argparse.Namespace) -> int:
    if args.dry_run:
        validate(args.config, args.overrides, args.nproc)
        print(" ".join(build_command(args.nproc, ["train", args.config, *args.overrides])))
        return 0
    return run_local(args.nproc, args.config, args.overrides, threads=args.threads)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `local` under `tessera launch` (called by launch.cli)."""
    p = sub.add_parser("local", help="run a config on N local ranks through torchrun (CPU or GPU)",
                       description="Validate the layout for N ranks, then torchrun `tessera train CONFIG`.")
    p.add_argument("--nproc", type=int, required=True, help="ranks on this node (the world size)")
    p.add_argument("config", help="YAML config, e.g. configs/smoke/smoke.yaml")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default cores / N)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.set_defaults(func=cmd_local)
