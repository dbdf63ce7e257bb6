"""Where this process sits in a distributed job: read from torchrun's or SLURM's environment.

`dist_env()` is the one place the trainer learns its rank, world size and rendezvous address. Three sources:

- torchrun (`TORCHELASTIC_RUN_ID` set, or `RANK` + `WORLD_SIZE` without SLURM): RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT. Under `srun torchrun`
  torchrun wins: SLURM_PROCID then numbers the torchrun agents (one per node), not the training ranks.
- SLURM (`srun python ...`, one task per rank): SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS,
  SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE, SLURM_NODEID, SLURM_NODELIST (expanded by
  `scontrol show hostnames`), SLURM_JOB_ID, SLURM_RESTART_COUNT. MASTER_ADDR defaults to the first host of the
  step's node list; MASTER_PORT, when unset, is derived from the job id so two jobs sharing a node differ.
- single: one process, rank 0 of 1.

Values from different sources that disagree (a stale RANK exported into an `srun` step, say) raise a
`LaunchError` naming both values and the fix, before any process group blocks on a rendezvous that can never
complete.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Literal

from framework.base.errors import TesseraError

Source = Literal["torchrun", "slurm", "single"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# Job-derived ports fall in [20000, 30000): below Linux's ephemeral range (32768-60999), so a port chosen for
# the rendezvous is not already taken by some outgoing connection on the first node.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000


class LaunchError(TesseraError):
    """The launch environment (torchrun, SLURM, sbatch options) is inconsistent or cannot run the layout."""


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. `restart_count` counts whole-job restarts: SLURM requeues under
    SLURM, else torchrun's elastic restarts; `elastic_restart_count` is always torchrun's own counter."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: Source
    job_id: str | None = None
    restart_count: int = 0
    elastic_restart_count: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Write RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT into `environ`
        (default `os.environ`) so `torch.distributed.init_process_group(init_method="env://")` works."""
        target = os.environ if environ is None else environ
        target.update({
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        })


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchError(f"{name} is not set; launch with torchrun or srun, which set it, or export it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer; unset it or fix the launcher that set it") from None


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's compressed tasks-per-node list: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"tasks-per-node list {spec!r} is malformed at {part!r}; expected e.g. '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(host: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", host)
    if not m:
        return [host]
    head, tail, out = host[: m.start()], host[m.end():], []
    for item in m.group(1).split(","):
        lo, _, hi = item.partition("-")
        # Zero padding follows the lower bound's width: gpu[008-010] -> gpu008 gpu009 gpu010.
        values = [lo] if not hi else [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
        out += [h for v in values for h in _expand_one(head + v + tail)]
    return out


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM host list ('n[1-2],gpu[008-010]') without scontrol; used when scontrol is absent."""
    try:
        return [h for part in _split_top(nodelist) for h in _expand_one(part)]
    except ValueError:
        raise LaunchError(f"host list {nodelist!r} is malformed; expected e.g. 'node[001-004],login1'") from None


def scontrol_hostnames(nodelist: str) -> list[str]:
    """Expand a host list with `scontrol show hostnames` (SLURM's own parser), falling back to ours."""
    if shutil.which("scontrol") is None:
        return expand_hostlist(nodelist)
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise LaunchError(f"`scontrol show hostnames {nodelist}` failed: {out.stderr.strip()}; check SLURM_NODELIST")
    return out.stdout.split()


def slurm_master_port(job_id: str) -> int:
    """A rendezvous port derived from the job id, so jobs sharing a first node pick different ports."""
    digits = re.sub(r"\D", "", job_id)  # array jobs: '1234_7' -> 12347
    return SLURM_PORT_BASE + int(digits or 0) % SLURM_PORT_SPAN


def _check_range(what: str, value: int, size: int, size_name: str) -> None:
    if not 0 <= value < size:
        raise LaunchError(f"{what}={value} must be in [0, {size_name}={size}); the launcher's variables disagree, "
                          f"relaunch with torchrun or srun instead of exporting them by hand")


def _agree(environ: Mapping[str, str], torch_name: str, slurm_name: str, slurm_value: int) -> None:
    """A torchrun-style variable left in an srun step must match SLURM's value, or ranks would collide."""
    if environ.get(torch_name, "") != "" and _int(environ, torch_name) != slurm_value:
        raise LaunchError(
            f"{torch_name}={environ[torch_name]} disagrees with {slurm_name}={slurm_value} in this SLURM step; "
            f"unset {torch_name} before srun, or launch with `srun torchrun` so torchrun owns the ranks")


def _torchrun_env(environ: Mapping[str, str]) -> DistEnv:
    world = _int(environ, "WORLD_SIZE")
    rank = _int(environ, "RANK")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    local_rank = _int(environ, "LOCAL_RANK", rank % local_world if local_world else 0)
    if world < 1 or local_world < 1 or local_world > world:
        raise LaunchError(f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}: need 1 <= LOCAL_WORLD_SIZE <= "
                          f"WORLD_SIZE; fix torchrun's --nnodes/--nproc-per-node")
    _check_range("RANK", rank, world, "WORLD_SIZE")
    _check_range("LOCAL_RANK", local_rank, local_world, "LOCAL_WORLD_SIZE")
    elastic = _int(environ, "TORCHELASTIC_RESTART_COUNT", 0)
    in_slurm = environ.get("SLURM_JOB_ID") is not None
    return DistEnv(
        rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=_int(environ, "GROUP_RANK", rank // local_world), source="torchrun",
        master_addr=environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        master_port=_int(environ, "MASTER_PORT", DEFAULT_MASTER_PORT),
        job_id=environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID"),
        restart_count=_int(environ, "SLURM_RESTART_COUNT", 0) if in_slurm else elastic,
        elastic_restart_count=elastic)


def _slurm_env(environ: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> DistEnv:
    world = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", 1))
    rank = _int(environ, "SLURM_PROCID")
    local_rank = _int(environ, "SLURM_LOCALID", 0)
    node_rank = _int(environ, "SLURM_NODEID", 0)
    spec = (environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
            or environ.get("SLURM_NTASKS_PER_NODE") or str(world))
    per_node = expand_tasks_per_node(spec)
    _check_range("SLURM_PROCID", rank, world, "SLURM_NTASKS")
    _check_range("SLURM_NODEID", node_rank, len(per_node), "number of nodes in the tasks-per-node list")
    if len(per_node) > 1 and sum(per_node) != world:
        raise LaunchError(f"tasks per node {spec!r} sum to {sum(per_node)} but SLURM_NTASKS={world}; "
                          f"the job's --nodes/--ntasks-per-node disagree, fix the sbatch options")
    local_world = per_node[node_rank] if len(per_node) > 1 else per_node[0]
    _check_range("SLURM_LOCALID", local_rank, local_world, "tasks on this node")
    for torch_name, slurm_name, value in (("RANK", "SLURM_PROCID", rank), ("WORLD_SIZE", "SLURM_NTASKS", world),
                                          ("LOCAL_RANK", "SLURM_LOCALID", local_rank)):
        _agree(environ, torch_name, slurm_name, value)
    job_id = environ.get("SLURM_JOB_ID")
    addr = environ.get("MASTER_ADDR")
    if not addr:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
            or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise LaunchError("SLURM_NODELIST is not set and MASTER_ADDR is unset; run the ranks with srun "
                              "inside an allocation, or export MASTER_ADDR")
        hosts = hostnames(nodelist)
        if not hosts:
            raise LaunchError(f"SLURM_NODELIST={nodelist!r} expands to no host; export MASTER_ADDR")
        addr = hosts[0]
    port = _int(environ, "MASTER_PORT", slurm_master_port(job_id) if job_id else DEFAULT_MASTER_PORT)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
                   node_rank=node_rank, master_addr=addr, master_port=port, source="slurm", job_id=job_id,
                   restart_count=_int(environ, "SLURM_RESTART_COUNT", 0))


def dist_env(environ: Mapping[str, str] | None = None,
             hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> DistEnv:
    """Read this process's rank, world size and rendezvous address from torchrun, SLURM or defaults.

    Args:
        environ: the environment to read (default `os.environ`); tests pass a dict.
        hostnames: expands a SLURM host list; default `scontrol show hostnames` (pure parser without scontrol).

    Returns:
        A frozen `DistEnv`. `source` says which launcher set it.

    Raises:
        LaunchError: variables are missing, malformed, out of range, or torchrun and SLURM values disagree.
    """
    env = os.environ if environ is None else environ
    under_torchrun = bool(env.get("TORCHELASTIC_RUN_ID")) or (
        "RANK" in env and "WORLD_SIZE" in env and "SLURM_PROCID" not in env)
    if under_torchrun:
        return _torchrun_env(env)
    # The batch shell itself has SLURM_PROCID=0 but no step; only an srun task (a step) is a rank.
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return _slurm_env(env, hostnames)
    return DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                   master_addr=env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
                   master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT), source="single",
                   job_id=env.get("SLURM_JOB_ID"), restart_count=_int(env, "SLURM_RESTART_COUNT", 0))


def cuda_device_index(local_rank: int, local_world_size: int, device_count: int, visible: str | None) -> int:
    """The GPU this rank drives: `local_rank % device_count`.

    All GPUs visible (one process per GPU): local rank i drives GPU i. A site that binds one GPU per task
    (`--gpu-bind`, `--gpus-per-task`; CUDA_VISIBLE_DEVICES names one device per task) shows each rank one
    device: index 0. Anything else would put two ranks on one GPU, which NCCL refuses (or hangs on).

    Args:
        visible: CUDA_VISIBLE_DEVICES as this process sees it (None when unset).

    Raises:
        LaunchError: no GPU is visible, or fewer GPUs than ranks on this node without a per-task binding.
    """
    if device_count < 1:
        raise LaunchError(f"rank with LOCAL_RANK={local_rank} sees no CUDA device (CUDA_VISIBLE_DEVICES="
                          f"{visible!r}); ask SLURM for GPUs (--gpus-per-node) or run on CPU with gloo")
    bound_per_task = device_count == 1 and visible is not None and len(visible.split(",")) == 1
    if device_count < local_world_size and not bound_per_task:
        raise LaunchError(
            f"{local_world_size} ranks on this node but {device_count} GPU(s) visible to LOCAL_RANK={local_rank} "
            f"(CUDA_VISIBLE_DEVICES={visible!r}): two ranks would share a GPU, which NCCL refuses; start one rank "
            f"per GPU (--procs-per-node {device_count}, or torchrun --nproc-per-node {device_count})")
    return local_rank % device_count


__all__ = ["DistEnv", "LaunchError", "cuda_device_index", "dist_env", "expand_hostlist", "expand_tasks_per_node",
           "slurm_master_port"]
