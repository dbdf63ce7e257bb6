"""`tessera launch local --nproc N CONFIG [a.b.c=value ...]`: any layout on one node, CPU or GPU.

The layout is validated against N ranks and the model before any process starts (ParallelismError names the
fix). Each rank runs `tessera train CONFIG overrides` with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR
and a free MASTER_PORT on the loopback interface), supervised by launch/supervise.py: SIGTERM, SIGUSR1 and
SIGINT reach every rank, which commit one checkpoint and stop; nothing outlives the launcher; the exit code is
the ranks' (42 requeue, 130 interrupted). On CPU every rank gets `--threads` intra-op threads (default: cores / N,
at least 1) so N ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from framework.config import Config


def layout_world(config: str, overrides: Sequence[str]) -> int:
    """The smallest world size the config's layout needs (dp_shard=-1 counts as 1)."""
    from framework.config import load_config

    return ranks_needed(load_config(config, overrides).parallel)


def ranks_needed(p: Any) -> int:
    """The smallest world size of a ParallelConfig (dp_shard=-1 counts as 1)."""
    return int(p.tp * p.pp * p.cp * p.dp_replicate * max(p.dp_shard, 1))


def validate(config: str, overrides: Sequence[str], nproc: int) -> Config:
    """Raise ParallelismError/ConfigError now rather than in N ranks; return the loaded config."""
    from framework.base.errors import ParallelismError
    from framework.config import load_config
    from framework.parallel.mesh import ParallelDims
    from framework.train.parallel_engine import micro_batches

    if nproc < 1:
        raise ParallelismError(f"--nproc {nproc} must be >= 1 (the number of ranks on this node); for this config "
                               f"use --nproc {layout_world(config, overrides)}")
    cfg = load_config(config, overrides)
    from data_pipeline.read.prepare import check_build_vocab

    check_build_vocab(cfg.data, cfg.model.vocab_size)  # DataError / ConfigError now, not in every rank after launch
    micro_batches(ParallelDims.from_config(cfg.parallel, nproc, cfg.model), cfg.train, cfg.parallel.pp_schedule)
    return cfg


def rank_command(args: Sequence[str], python: str = sys.executable) -> list[str]:
    """What every rank runs: `tessera <args>`."""
    return [python, "-m", "framework.cli", *args]


def launch_env(nproc: int, threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    per_rank = threads or max(1, (os.cpu_count() or 1) // nproc)
    env.setdefault("OMP_NUM_THREADS", str(per_rank))
    env["TESSERA_NUM_THREADS"] = str(per_rank)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)  # inside an allocation these would make every rank read SLURM's rank instead
    return env


def rank_envs(nproc: int, threads: int | None, port: int) -> list[dict[str, str]]:
    """torchrun's variables for each of `nproc` ranks on this node (rendezvous on 127.0.0.1:`port`)."""
    base = launch_env(nproc, threads)
    return [{**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
             "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(nproc)]


def run_local(nproc: int, config: str, overrides: Sequence[str], *, command: str = "train",
              extra: Sequence[str] = (), threads: int | None = None, grace_s: float = 120.0,
              output: IO[Any] | None = None) -> int:
    """Validate, then run `tessera COMMAND CONFIG overrides extra` on `nproc` local ranks; the exit code.

    `output`: a file for the ranks' stdout and stderr (default: this process's).
    """
    from framework.base.ports import free_port
    from launch.supervise import supervise

    code = validate(config, overrides, nproc).checkpoint.requeue_exit_code
    cmd = rank_command([command, config, *overrides, *extra])
    return supervise([cmd] * nproc, rank_envs(nproc, threads, free_port()), grace_s=grace_s, requeue_exit_code=code,
                     output=output)


def cmd_local(args: argparse.Namespace) -> int:
    extra = ["--stop-at", str(args.stop_at)] if args.stop_at is not None else []
    if args.dry_run:
        validate(args.config, args.overrides, args.nproc)
        print(f"{args.nproc} x", " ".join(rank_command(["train", args.config, *args.overrides, *extra])))
        return 0
    return run_local(args.nproc, args.config, args.overrides, extra=extra, threads=args.threads,
                     grace_s=args.grace)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `local` under `tessera launch` (called by launch.cli)."""
    p = sub.add_parser("local", help="run a config on N supervised local ranks (CPU or GPU)",
                       description="Validate the layout for N ranks, then run `tessera train CONFIG` on each.")
    p.add_argument("--nproc", type=int, required=True, help="ranks on this node (the world size)")
    p.add_argument("config", help="YAML config, e.g. configs/smoke/smoke.yaml")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default cores / N)")
    p.add_argument("--stop-at", type=int, default=None, help="stop (and checkpoint) after this step; resume later")
    p.add_argument("--grace", type=float, default=120.0,
                   help="seconds the ranks get to save and exit after a forwarded signal before they are killed")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.set_defaults(func=cmd_local)
