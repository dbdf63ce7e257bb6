"""`tessera launch slurm`: render an sbatch script from a config, check it against the layout and the cluster, submit.

The rendered script is meant to be read by a person before it is submitted (`--dry-run`). What it does:

- asks for `nodes` x `procs_per_node` ranks (GPUs only when `gpus_per_node` > 0), appends SLURM's output to
  `runs/<run.name>/slurm-%j.out` so the log survives requeues, and asks SLURM to send SIGUSR1 `signal_lead_s`
  seconds before the time limit (`--signal=USR1@lead`; it reaches every process of the step);
- runs the ranks either directly (`srun python -m framework.cli train ...`, one task per rank, `launch.env`
  reads SLURM's variables) or through torchrun (`srun` one agent per node, c10d rendezvous on the first node);
- on SIGUSR1 or SIGTERM the trainer saves a checkpoint and exits with `checkpoint.requeue_exit_code` (42); the script
  sees it and requeues the job (`python -m launch.exclude requeue`: `scontrol requeue`, plus the nodes of the run's
  exclude.json in the job's ExcNodeList), and the restarted job resumes from `latest` in the same run directory; after
  SIGINT the ranks save and exit 130, which the script passes on (not requeued);
- a signal sent to the script itself (`scancel --batch`) is forwarded to every rank (`_forward_block`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from framework.base.errors import ParallelismError
from framework.config import Config
from framework.parallel.mesh import ParallelDims
from launch.env import SLURM_PORT_BASE, SLURM_PORT_SPAN, LaunchError


def requeue_exit_code(cfg: Config) -> int:
    """The code the trainer exits with after a SIGUSR1 save (checkpoint.requeue_exit_code)."""
    return cfg.checkpoint.requeue_exit_code


Mode = Literal["srun", "torchrun"]
# Signals torchrun's agent traps and forwards to its workers. Its default (SIGTERM, SIGINT, SIGHUP, SIGQUIT) lacks
# SIGUSR1, and an agent killed by an unhandled SIGUSR1 would take its workers down mid-checkpoint.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


@dataclass(frozen=True)
class SlurmSpec:
    """What to ask SLURM for; built from the CLI flags (see `launch.cli`)."""

    nodes: int
    procs_per_node: int
    gpus_per_node: int = 0
    cpus_per_rank: int = 1
    """Cores per rank; 0: the node's cores shared among its ranks, counted by the job itself at start
    (SLURM_CPUS_ON_NODE / procs_per_node on the exclusive node) when `sinfo` could not tell them beforehand."""
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    mode: Mode = "srun"
    signal_lead_s: int = 300
    """Seconds before the time limit at which SIGUSR1 asks the trainer to save and requeue."""
    extra_sbatch: tuple[str, ...] = ()
    """Further `#SBATCH` options, verbatim (e.g. --qos=high, --constraint=h100)."""


def parse_time_s(text: str) -> int:
    """Seconds in a SLURM time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    m = _TIME.match(text.strip())
    if not m:
        raise LaunchError(f"--time={text!r} is not a SLURM time; use e.g. 90 (minutes), 04:00:00 or 2-00:00:00")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
    if b is None:
        return (a or 0) * 60
    if c is None:
        return (a or 0) * 60 + b
    return (a or 0) * 3600 + b * 60 + c


def layout_degrees(cfg: Config, world: int) -> dict[str, int]:
    """The parallel degrees for `world` ranks (dp_shard=-1 inferred), validated against the model the way the
    trainer will (framework.parallel.mesh.ParallelDims), so a layout that cannot run fails before submission."""
    try:
        dims = ParallelDims.from_config(cfg.parallel, world, cfg.model)
    except ParallelismError as err:
        raise ParallelismError(f"--nodes x --procs-per-node = {world} ranks: {err}") from None
    degrees = {"tp": dims.tp, "pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard}
    return degrees | {axis: getattr(dims, axis) for axis in ("cp", "ep") if getattr(dims, axis) > 1}


def validate_spec(cfg: Config, spec: SlurmSpec) -> dict[str, int]:
    """Checks that need no cluster: sizes, time limit vs signal lead, the layout's world size."""
    for name in ("nodes", "procs_per_node"):
        if getattr(spec, name) < 1:
            raise LaunchError(f"--{name.replace('_', '-')}={getattr(spec, name)} must be >= 1")
    if spec.cpus_per_rank < 0:
        raise LaunchError(f"--cpus-per-rank={spec.cpus_per_rank} must be >= 1, or 0 to share the node's cores")
    if spec.gpus_per_node < 0:
        raise LaunchError(f"--gpus-per-node={spec.gpus_per_node} must be >= 0 (0 for CPU-only nodes)")
    if spec.gpus_per_node and spec.procs_per_node != spec.gpus_per_node:
        raise LaunchError(
            f"--procs-per-node={spec.procs_per_node} with --gpus-per-node={spec.gpus_per_node}: one rank drives one "
            f"GPU; drop --procs-per-node or set it to {spec.gpus_per_node}")
    limit = parse_time_s(spec.time)
    if not 0 < spec.signal_lead_s < limit:
        raise LaunchError(
            f"--signal-lead={spec.signal_lead_s}s must be > 0 and shorter than --time={spec.time} ({limit}s), "
            f"or SIGUSR1 would arrive before training starts; lower --signal-lead or raise --time")
    if spec.signal_lead_s > 65535:
        raise LaunchError(f"--signal-lead={spec.signal_lead_s}s exceeds SLURM's maximum of 65535 s; lower it")
    try:
        return layout_degrees(cfg, spec.nodes * spec.procs_per_node)
    except ParallelismError as err:
        p = cfg.parallel
        unit = p.tp * p.pp * p.dp_replicate * p.cp * max(p.dp_shard, 1)

        def fit(n: int) -> bool:
            return (n * spec.procs_per_node) % unit == 0 and (p.dp_shard < 0 or n * spec.procs_per_node == unit)

        fits = [n for n in range(1, 4 * spec.nodes + 1) if fit(n)][:4]
        if not fits or fit(spec.nodes):  # the world size fits; the layout is wrong for the model
            raise
        hint = f" (with {spec.procs_per_node} per node: --nodes {' or '.join(map(str, fits))})"
        raise ParallelismError(f"{err}{hint}") from None


def _partitions() -> dict[str, bool]:
    """Partition name -> is default, from `scontrol show partition -o`."""
    out = subprocess.run(["scontrol", "show", "partition", "-o"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise LaunchError(f"`scontrol show partition` failed: {out.stderr.strip()}; is SLURM reachable from here?")
    parts = {}
    for line in out.stdout.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "PartitionName" in fields:
            parts[fields["PartitionName"]] = fields.get("Default") == "YES"
    return parts


SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "fuse.ceph", "glusterfs",
                      "fuse.glusterfs", "wekafs", "panfs", "fuse.juicefs", "9p")


def filesystem_type(path: Path, mounts: str | None = None) -> str:
    """The fstype of the mount holding `path` (longest mount-point prefix in /proc/mounts); "" if unknown."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return ""
    target = str(path.resolve() if path.exists() else path.absolute())
    best, fstype = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and (target == fields[1] or target.startswith(fields[1].rstrip("/") + "/")) \
                and len(fields[1]) >= len(best):
            best, fstype = fields[1], fields[2]
    return fstype


def node_local_paths(paths: dict[str, Path], mounts: str | None = None) -> list[str]:
    """Warnings for paths a multi-node job's other nodes cannot see: on a local filesystem or a temp dir."""
    warnings = []
    temp_roots = {"/tmp", "/var/tmp", "/dev/shm", os.environ.get("TMPDIR", "/tmp").rstrip("/") or "/tmp"}
    for what, path in paths.items():
        absolute = str(path.absolute())
        fstype = filesystem_type(path, mounts)
        in_temp = any(absolute == r or absolute.startswith(r + "/") for r in temp_roots)
        if in_temp or (fstype and fstype not in SHARED_FILESYSTEMS):
            warnings.append(f"{what}={absolute} looks node-local ({'a temporary directory' if in_temp else ''}"
                            f"{', ' if in_temp and fstype else ''}{fstype or ''}); on a multi-node job the other "
                            f"nodes will not see it — put it on the shared filesystem")
    return warnings


def data_warnings(cfg: Config, nodes: int, refuse: bool) -> list[str]:
    """What the job would train on, when that is likely not what was meant: the embedded stdlib corpus (a smoke
    test's) or synthetic tokens on a multi-node job; a build directory that holds no finished build (refused with
    the DataError when `refuse`: a job submitted that way fails on every rank); a build whose tokenizer does not fit
    model.vocab_size is refused (ConfigError)."""
    data = cfg.data
    if data.kind in ("stdlib", "synthetic") and nodes > 1:
        what = "the embedded standard-library corpus (a smoke test's)" if data.kind == "stdlib" else "random tokens"
        return [f"data.kind={data.kind}: this {nodes}-node job trains on {what}; set data.kind=build and "
                f"data.build_dir to the output of `tessera data build`"]
    if data.kind == "build" and data.build_dir and not (Path(data.build_dir) / "manifest.json").is_file():
        if refuse:
            from data_pipeline.read.prepare import read_manifest

            read_manifest(data.build_dir)  # raises the DataError naming the directory and the fix
        return [f"data.build_dir={data.build_dir} holds no finished build (no manifest.json): set it to the output "
                f"of `tessera data build` before submitting (submission refuses it)"]
    from data_pipeline.read.prepare import check_build_vocab

    check_build_vocab(data, cfg.model.vocab_size)  # a tokenizer larger than the model: refused before submission
    return []


def node_cpus(partition: str | None) -> int | None:
    """CPUs per node of `partition` (the smallest node), from `sinfo`; None when SLURM cannot say."""
    if shutil.which("sinfo") is None:
        return None
    cmd = ["sinfo", "-h", "-o", "%c", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = [int(x.rstrip("+")) for x in out.stdout.split() if x.rstrip("+").isdigit()]
    return min(counts) if out.returncode == 0 and counts else None


def check_cluster(spec: SlurmSpec) -> None:
    """Checks against the live cluster before submission: the partition exists, or a default one does."""
    if shutil.which("scontrol") is None or shutil.which("sbatch") is None:
        raise LaunchError("sbatch/scontrol not found: submit from a SLURM login node, or use --dry-run to print "
                          "the script")
    parts = _partitions()
    if spec.partition is None and not any(parts.values()):
        raise LaunchError(f"no --partition given and this cluster has no default partition; pass --partition, "
                          f"one of: {', '.join(sorted(parts)) or '(none visible)'}")
    if spec.partition is not None and spec.partition not in parts:
        raise LaunchError(f"--partition={spec.partition} does not exist on this cluster; "
                          f"use one of: {', '.join(sorted(parts)) or '(none visible)'}")


def _header(cfg: Config, spec: SlurmSpec, run_dir: str) -> list[str]:
    tasks, cpus = (1, spec.cpus_per_rank * spec.procs_per_node) if spec.mode == "torchrun" \
        else (spec.procs_per_node, spec.cpus_per_rank)
    lines = [f"--job-name={cfg.run.name}", f"--nodes={spec.nodes}", f"--ntasks-per-node={tasks}"]
    lines += [f"--cpus-per-task={cpus}"] if cpus else []  # 0: counted at job start from the node (_env_block)
    if spec.gpus_per_node > 0 or not cpus:
        lines += [*([f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []), "--exclusive",
                  "--mem=0"]
    lines.append(f"--time={spec.time}")
    lines += [f"--partition={spec.partition}"] if spec.partition else []
    lines += [f"--account={spec.account}"] if spec.account else []
    lines += [f"--output={run_dir}/slurm-%j.out", "--open-mode=append", f"--signal=USR1@{spec.signal_lead_s}",
              "--requeue", *spec.extra_sbatch]
    return [f"#SBATCH {line}" for line in lines]


def _env_block(cfg: Config, spec: SlurmSpec, run_dir: str) -> list[str]:
    timeout = cfg.checkpoint.collective_timeout_s
    if spec.cpus_per_rank:
        cpus = [f"CPUS_PER_RANK={spec.cpus_per_rank}"]
    else:
        cpus = ["# Cores per rank: the node's (the job holds it exclusively) shared among its ranks.",
                f"CPUS_PER_RANK=$(( ${{SLURM_CPUS_ON_NODE:-$(nproc)}} / {spec.procs_per_node} ))",
                "[ \"$CPUS_PER_RANK\" -ge 1 ] || CPUS_PER_RANK=1"]
    lines = [
        *cpus,
        "# Threads: each rank gets $CPUS_PER_RANK cores; more OpenMP/MKL threads than cores only thrash.",
        "export OMP_NUM_THREADS=$CPUS_PER_RANK",
        "export TESSERA_NUM_THREADS=$CPUS_PER_RANK",
        f"# Collectives: a rank that dies or hangs fails the job after checkpoint.collective_timeout_s = {timeout:g} s",
        "# instead of burning the allocation (the config decides; exporting TESSERA_COLLECTIVE_TIMEOUT_S overrides).",
    ]
    if spec.gpus_per_node > 0:
        lines += [
            "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # abort communicators on error/timeout (no silent hang)",
            "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
            "export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # less fragmentation",
            "# NCCL flight recorder: each rank keeps its last collectives and dumps them on a timeout, so a hang",
            "# leaves per-rank traces to compare (`python -m torch.distributed.flight_recorder.fr_trace DIR`).",
            "export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}",
            "export TORCH_NCCL_DUMP_ON_TIMEOUT=1",
            f"mkdir -p {run_dir}/nccl_trace",
            f"export TORCH_NCCL_DEBUG_INFO_TEMP_FILE={run_dir}/nccl_trace/rank_",
        ]
    return lines


def _forward_block(spec: SlurmSpec) -> list[str]:
    """Traps that pass a signal sent to this script (`scancel --batch --signal=X`, `--signal=B:X@T`) to the ranks.

    Without them bash dies of SIGTERM/SIGUSR1 (the job FAILS, not requeued, and the ranks get only SLURM's
    cleanup TERM then KILL after KillWait) and ignores SIGINT while srun runs. srun itself is no relay: it turns
    SIGTERM into SIGKILL of the tasks and answers a single SIGINT with a status line. So the trap signals every
    step of the job with scancel (what `scancel --signal=X <job>` does), and `signal_lead_s` later kills the step
    if it still runs; the script then exits with the ranks' code as usual.
    """
    grace = spec.signal_lead_s
    return [
        "# A signal to this script (scancel --batch --signal=X) goes to every rank through scancel: srun would",
        "# SIGKILL the ranks on SIGTERM and only print a status on one SIGINT. The step is killed if it is still",
        f"# running {grace} s (--signal-lead) later; the ranks' code below then decides as usual.",
        "killer=",
        "forward() {",
        '    echo "[tessera] batch script got SIG$1: forwarding it to the ranks at $(date -u +%FT%TZ)"',
        '    scancel --signal="$1" "$SLURM_JOB_ID"',
        '    if [ -z "$killer" ]; then',
        f"        ( trap 'kill $timer 2>/dev/null; exit 0' TERM; sleep {grace} & timer=$!; wait $timer",
        f'          echo "[tessera] ranks still running {grace} s after SIG$1: killing them"; kill -KILL "$step" ) &',
        "        killer=$!",
        "    fi",
        "}",
        "trap 'forward TERM' TERM",
        "trap 'forward USR1' USR1",
        "trap 'forward INT' INT",
    ]


def _launch_block(spec: SlurmSpec, program: list[str]) -> list[str]:
    prog = " ".join(shlex.quote(a) for a in program)
    if spec.mode == "srun":
        return [
            "# One task per rank: launch.env reads SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS and the MASTER_* above.",
            "# srun gets --cpus-per-task again: since SLURM 22.05 it no longer inherits it from sbatch. Each rank is",
            "# bound to its own cores (--cpu-bind=cores: SLURM hands out a task's cores within one socket where",
            "# they fit, so a rank's threads stay on its NUMA node instead of migrating across the machine).",
            "# --ntasks from the nodes this start got: a job requeued onto fewer nodes keeps the old SLURM_NTASKS.",
            f"srun --ntasks=$(( SLURM_JOB_NUM_NODES * {spec.procs_per_node} )) "
            f'--ntasks-per-node={spec.procs_per_node} --cpus-per-task="$CPUS_PER_RANK" --cpu-bind=cores \\',
            f'    "$PYTHON" {prog} &',
        ]
    return [
        "# One torchrun agent per node; c10d rendezvous on the first node. SIGUSR1 must be among the signals the",
        "# agent handles: older torchrun reads TORCHELASTIC_SIGNALS_TO_HANDLE, newer ones overwrite it from",
        "# --signals-to-handle, whose default is PET_SIGNALS_TO_HANDLE. On SIGUSR1 the agent forwards it and gives",
        "# the workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to save before SIGKILL. launch.torchrun is torchrun",
        "# exiting with $TESSERA_REQUEUE_EXIT_CODE when its workers asked for a requeue (plain torchrun exits 1).",
        "# The agent holds all the node's cores (--cpu-bind=none); its workers are not pinned (use srun mode for",
        "# per-rank core binding).",
        f"export TORCHELASTIC_SIGNALS_TO_HANDLE={TORCHRUN_SIGNALS}",
        "export PET_SIGNALS_TO_HANDLE=$TORCHELASTIC_SIGNALS_TO_HANDLE",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={spec.signal_lead_s}",
        'srun --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \\',
        f'    --cpus-per-task=$(( CPUS_PER_RANK * {spec.procs_per_node} )) --cpu-bind=none \\',
        '    "$PYTHON" -m launch.torchrun \\',
        f'    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={spec.procs_per_node} \\',
        '    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\',
        f'    --max-restarts=0 {prog} &',
    ]


def render_sbatch(cfg: Config, spec: SlurmSpec, config_path: str, overrides: list[str], python: str,
                  degrees: dict[str, int] | None = None, program: list[str] | None = None) -> str:
    """The sbatch script for `cfg` (loaded from `config_path` + `overrides`), run with interpreter `python`.

    Paths in the script are relative to the submission directory (`SLURM_SUBMIT_DIR`), except `python`,
    which is the interpreter the caller runs under (`sys.executable`), so the job trains with the same one.
    `program` (the interpreter's arguments) defaults to `-m framework.cli train CONFIG OVERRIDES`.
    """
    degrees = degrees or validate_spec(cfg, spec)
    run_dir = cfg.run.dir or f"runs/{cfg.run.name}"
    world = spec.nodes * spec.procs_per_node
    layout = " x ".join(f"{k} {v}" for k, v in degrees.items())
    program = program or ["-m", "framework.cli", "train", config_path, *overrides]
    shrink = " --shrink" if cfg.observe.exclude.enabled and cfg.observe.exclude.shrink else ""
    hardware = f"{spec.gpus_per_node} GPUs" if spec.gpus_per_node else f"{spec.procs_per_node} CPU ranks"
    lines = [
        "#!/bin/bash",
        f"# Tessera run `{cfg.run.name}`, rendered by `tessera launch slurm` (mode: {spec.mode}).",
        f"# {spec.nodes} nodes x {hardware} per node = {world} ranks = {layout}.",
        f"# Config: {' '.join(shlex.quote(a) for a in [config_path, *overrides])}",
        *_header(cfg, spec, run_dir),
        "",
        "# No `set -e`: the ranks' exit code decides below whether the job is requeued.",
        "set -uo pipefail",
        'cd "$SLURM_SUBMIT_DIR"',
        f"PYTHON={shlex.quote(python)}",
        f"export TESSERA_REQUEUE_EXIT_CODE={requeue_exit_code(cfg)}  # checkpoint.requeue_exit_code: saved on SIGUSR1",
        "",
        "# Rendezvous on the first node; the port comes from the job id (same rule as launch.env).",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT=$(( {SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN} ))",
        "export MASTER_ADDR MASTER_PORT",
        *_env_block(cfg, spec, run_dir),
        "",
        'echo "[tessera] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST' +
        ' ($MASTER_ADDR:$MASTER_PORT) at $(date -u +%FT%TZ)"',
        "",
        *_forward_block(spec),
        *_launch_block(spec, program),
        "step=$!",
        "# `wait` returns early when a trapped signal arrives: wait again until the step has really ended.",
        'wait "$step"; rc=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; rc=$?; done',
        '[ -n "$killer" ] && kill "$killer" 2>/dev/null',
        'echo "[tessera] ranks exited with $rc at $(date -u +%FT%TZ)"',
        'if [ "$rc" -eq "$TESSERA_REQUEUE_EXIT_CODE" ]; then',
        '    echo "[tessera] checkpoint saved on SIGTERM/SIGUSR1: requeueing job $SLURM_JOB_ID"',
        "    # The nodes in the run directory's exclude.json (a bad node the run named, `tessera launch exclude`) go",
        "    # into the requeued job's ExcNodeList; the requeue sends SIGTERM to this script: ignored",
        "    # (launch/exclude.py says why).",
        "    trap '' TERM",
        f'    "$PYTHON" -m launch.exclude requeue {shlex.quote(run_dir)} --job "$SLURM_JOB_ID"{shrink} \\',
        '        || scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def submit(script: str, run_dir: Path) -> str:
    """Write the script into the run directory (SLURM opens slurm-%j.out there) and sbatch it; the job id."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "sbatch.sh"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise LaunchError(f"sbatch rejected {path}: {out.stderr.strip()}; read the script with --dry-run")
    return out.stdout.strip().split(";")[0]


__all__ = ["SlurmSpec", "check_cluster", "layout_degrees", "parse_time_s", "render_sbatch",
           "requeue_exit_code", "submit", "validate_spec"]
