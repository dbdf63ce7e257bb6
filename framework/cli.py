"""`tessera` — one CLI with subcommands.

    tessera train CONFIG [a.b.c=value ...]   train (or resume) a run; under torchrun/SLURM every rank runs this
    tessera smoke [overrides]                the end-to-end smoke job on the embedded corpus
    tessera presets                          the model presets, with their shapes and sizes
    tessera <other>                          subcommands registered by subsystems (data, plan, launch, ckpt ...)

Subsystems register their subcommands through a `register(subparsers)` function in the modules listed in
`SUBCOMMAND_MODULES`; registration is cheap (argparse only) — heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from framework.checkpoint import signals as stop_signals

SUBCOMMAND_MODULES = [
    "data_pipeline.cli",
    "framework.checkpoint.cli",
    "framework.infer.cli",
    "framework.drivers.cli",
    "framework.dryrun.cli",
    "framework.observe.doctor",
    "framework.plan.cli",
    "launch.cli",
]

SMOKE_CONFIG = "configs/smoke/smoke.yaml"


def init_distributed(timeout_s: float | None = None) -> None:
    """Initialize the default process group when launched with several ranks (torchrun or srun)."""
    import torch
    import torch.distributed as dist

    from launch.env import cuda_device_index, dist_env

    env = dist_env()
    if not env.is_distributed or dist.is_initialized():
        return
    env.export()  # RANK, WORLD_SIZE, MASTER_ADDR ... for env:// rendezvous, also under srun
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = None
    if backend == "nccl":
        index = cuda_device_index(env.local_rank, env.local_world_size, torch.cuda.device_count(),
                                  os.environ.get("CUDA_VISIBLE_DEVICES"))
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    timeout = float(os.environ.get("TESSERA_COLLECTIVE_TIMEOUT_S", timeout_s or 600))  # env overrides config
    # torch's flight recorder (each rank's last collectives), on gloo too: the hang watchdog dumps it for doctor
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"))
    # device_id binds the communicator to this GPU at once (eager NCCL init: no guess of the device at the
    # first collective, and split groups share the connection)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout),
                            device_id=device)


def check_launched(cfg: Any, config: str, overrides: Sequence[str]) -> None:
    """A layout of several ranks started as one process: say which command runs it (before any setup)."""
    from framework.base.errors import ParallelismError
    from launch.env import dist_env
    from launch.local import ranks_needed

    p = cfg.parallel
    needed = ranks_needed(p)
    if needed > 1 and not dist_env().is_distributed:
        raise ParallelismError(
            f"parallel layout tp={p.tp} pp={p.pp} cp={p.cp} dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} "
            f"needs {needed} ranks but `tessera train` runs as one process here; run it with: tessera launch local "
            f"--nproc {needed} {' '.join([config, *overrides])} (or under SLURM: tessera launch slurm)")


def cmd_train(args: argparse.Namespace) -> int:
    from framework.config import load_config
    from framework.train.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    check_launched(cfg, args.config, args.overrides)
    handlers = stop_signals.active()
    if handlers is not None:
        handlers.requeue_exit_code = cfg.checkpoint.requeue_exit_code
        if not cfg.checkpoint.handle_signals:
            handlers.restore()  # checkpoint.handle_signals=false: the default dispositions
    init_distributed(cfg.checkpoint.collective_timeout_s)
    torch_threads = os.environ.get("TESSERA_NUM_THREADS")
    if torch_threads:
        import torch

        torch.set_num_threads(int(torch_threads))
    result = Trainer(cfg).train(stop_at=args.stop_at)
    import torch.distributed as dist

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if dist.is_initialized():
        # An ordered teardown once every rank is done: left to interpreter exit, the process group was torn down
        # with its threads in no set order, and under load a finished rank could abort at exit (SIGABRT,
        # "terminate called without an active exception", exit 134) after its last checkpoint was committed.
        dist.barrier()
        dist.destroy_process_group()
    if rank0 and result.losses:
        print(f"run {result.run_dir}: steps {result.start_step}->{result.final_step}, "
              f"loss {result.first_loss:.4f} -> {result.last_loss:.4f}, {result.tokens_per_s:.0f} tokens/s")
    elif rank0:
        print(f"run {result.run_dir} is already at step {result.final_step} (train.steps={cfg.train.steps}): "
              f"nothing to train; raise train.steps (docs/CHECKPOINTS.md) or choose a new run.name")
    return result.exit_code


def cmd_smoke(args: argparse.Namespace) -> int:
    from framework.drivers.smoke import run_smoke

    return run_smoke(args.config, args.overrides, nproc=args.nproc)


def cmd_sniff(args: argparse.Namespace) -> int:
    """Sniff tests (framework/observe/sniff.py) on the ranks this command was launched on (srun / torchrun)."""
    import torch
    import torch.distributed as dist

    from framework.base.errors import ConfigError
    from framework.observe.sniff import sniff

    init_distributed()
    if not dist.is_initialized() or dist.get_world_size() < 3:
        raise ConfigError("tessera sniff compares each rank with its peers: launch it on >= 3 ranks, e.g. "
                          "`srun tessera sniff` or `torchrun --nproc-per-node 8 -m framework.cli sniff`")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    report = sniff(device, gemm_n=args.gemm_n, comm_numel=args.numel, stride=args.stride,
                   dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    if dist.get_rank() == 0:
        print("\n".join(report.lines()))
    return 1 if report.slow else 0


def cmd_presets(args: argparse.Namespace) -> int:
    """Every model preset with its shape and parameter count (what `model.preset` and `plan --model` accept)."""
    from models.config import PRESETS, model_config
    from models.flops import num_params

    print(f"{'preset':<16} {'params':>9}  {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} {'vocab':>7}  experts")
    for name in PRESETS:
        c = model_config(name)
        experts = f"{c.moe.n_experts} (top {c.moe.top_k})" if c.moe.enabled else "-"
        n = num_params(c)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        print(f"{name:<16} {size:>9}  {c.n_layers:>6} {c.hidden:>6} {c.n_heads:>5} "
              f"{c.kv_heads:>3} {c.vocab_size:>7}  {experts}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera LLM pretraining framework")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("train", help="train or resume a run from a YAML config")
    p.add_argument("config", help="YAML config, e.g. configs/smoke/smoke.yaml")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides (values parsed as YAML)")
    p.add_argument("--stop-at", type=int, default=None, help="stop (and checkpoint) after this step; resume later")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("smoke", help="end-to-end smoke job on the embedded standard-library corpus")
    p.add_argument("--config", default=SMOKE_CONFIG)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks (default: what the config's layout needs; 1 trains in this process)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_smoke)
    p = sub.add_parser("sniff", help="on every rank of a launched job: GEMM, P2P, all-reduce, all-to-all timings; "
                       "names a rank slower than its peers (exit 1)")
    p.add_argument("--gemm-n", type=int, default=4096, help="side of the square GEMM")
    p.add_argument("--numel", type=int, default=1 << 24, help="elements of the communication buffers")
    p.add_argument("--stride", type=int, default=1, help="P2P partner: rank + stride (GPUs per node: across nodes)")
    p.set_defaults(func=cmd_sniff)
    p = sub.add_parser("presets", help="list the model presets (model.preset=NAME, plan --model NAME)")
    p.set_defaults(func=cmd_presets)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)  # every subsystem is part of every build
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from framework.base.errors import TesseraError
    from framework.base.logs import say_error

    args = build_parser().parse_args(argv)
    # SIGTERM/SIGUSR1/SIGINT end every command with one line and the right code (requeue / 130); the training
    # loop arms these handlers so that there they save first (framework/checkpoint/signals.py).
    handlers = stop_signals.StopSignals(armed=False).install()
    try:
        return int(args.func(args) or 0)
    except TesseraError as err:
        say_error(f"tessera: error: {type(err).__name__}: {err}")  # once per job, not once per rank
        return 2
    except stop_signals.RunStopped as stop:
        say_error(f"tessera: {stop}")
        return stop.exit_code
    finally:
        handlers.restore()


if __name__ == "__main__":
    sys.exit(main())
