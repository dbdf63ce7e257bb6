"""Checkpoints through torch.distributed.checkpoint (DCP), committed atomically and verified on load.

Layout of one checkpoint:
    checkpoints/step_N/                 DCP shards (*.distcp) + .metadata: model and optimizer, sharded by FQN
    checkpoints/step_N/meta.json        step, loader state, resolved config, data fingerprint, guard state
    checkpoints/step_N/rng/rank_R.json  per-rank RNG states (python, numpy, torch CPU/CUDA) as plain JSON
    checkpoints/step_N/manifest.json    size and xxh3 checksum of every file above (written last)
    checkpoints/latest                  the name of the newest committed checkpoint

A save writes under `.tmp-step_N` (`begin_save`, `write_shards`), then rank 0 writes meta.json and the
manifest, renames the directory to `step_N` and rewrites `latest` through a temporary file (`commit`): a crash
at any point leaves the previous `latest` valid. Loading reshards to the current layout (DCP plans by FQN and
global offsets). Nothing is ever unpickled: tensors come back through `weights_only=True`, DCP metadata through
an allow-listed unpickler (framework/checkpoint/storage.py), everything else is JSON.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from framework.base.errors import CheckpointError
from framework.checkpoint.manifest import VerifyMode, write_manifest
from framework.checkpoint.storage import SafeFileSystemReader, SafeLoadPlanner

LATEST = "latest"
TMP_PREFIX = ".tmp-"
_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

ProcessGroup = dist.ProcessGroup | None


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def step_of(path: Path) -> int | None:
    """The step of a `step_N` directory name, None for anything else."""
    head, _, tail = path.name.partition("_")
    return int(tail) if head == "step" and tail.isdigit() else None


def rank_world(pg: ProcessGroup = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(pg), dist.get_world_size(pg)
    return 0, 1


def barrier(pg: ProcessGroup = None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=pg)


def model_state(parts: Sequence[nn.Module]) -> dict[str, Any]:
    """The model state of every pipeline part, merged by FQN (FQNs are unique across stages)."""
    out: dict[str, Any] = {}
    for part in parts:
        out.update(get_model_state_dict(part, options=_OPTS))
    return out


def optimizer_state(parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part, opt in zip(parts, optimizers, strict=True):
        out.update(get_optimizer_state_dict(part, opt, options=_OPTS))
    return out


def training_state(parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    return {"model": model_state(parts), "optim": optimizer_state(parts, optimizers)}


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as JSON-safe values."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]
    py_state = random.getstate()
    state: dict[str, Any] = {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


# --- save ----------------------------------------------------------------------------------------------------
def begin_save(root: Path, step: int, pg: ProcessGroup = None) -> Path:
    """Create the empty `.tmp-step_N` directory (rank 0) and write this rank's RNG state; return its path."""
    rank, _ = rank_world(pg)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    barrier(pg)
    (tmp / "rng" / f"rank_{dist.get_rank() if dist.is_initialized() else 0}.json").write_text(
        json.dumps(rng_state()))
    return tmp


def dcp_cause(err: BaseException) -> str:
    """One line for a DCP failure: torch's CheckpointException carries each rank's exception and traceback."""
    prefix = ""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (exc, _) = next(iter(err.failures.items()))
        prefix, err = f"rank {rank}: ", exc
    text = str(err)
    if isinstance(err, pickle.UnpicklingError):  # torch's message advises an unsafe retry: never do that
        detail = (text.partition("WeightsUnpickler error:")[2].strip().splitlines() or ["unpickling failed"])[0]
        return (f"{prefix}the tensor data is corrupt or not plain tensors ({detail}); Tessera only loads tensors "
                f"safely: restore the file or resume from another checkpoint")
    if not text.strip() and isinstance(err, EOFError):
        text = "a file ends early (truncated)"
    return f"{prefix}{type(err).__name__}: {text.splitlines()[0] if text.strip() else '(no message)'}"


def write_shards(state: dict[str, Any], tmp: Path, pg: ProcessGroup = None) -> None:
    """Every rank writes its shards of `state` into `tmp` (DCP plans which rank writes replicated tensors).

    Raises:
        CheckpointError: naming `tmp` and the cause (a full disk, a permission), for every DCP failure — torch's
            CheckpointException derives from BaseException and would escape `except Exception`.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
            dcp.save(state, checkpoint_id=str(tmp), process_group=pg, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:
        cause = dcp_cause(err)
        if "unexpected pos" in cause or "No space left" in cause:  # torch's zip writer after a short write
            free = shutil.disk_usage(tmp.parent).free
            cause = (f"no space left on device (or a file-size limit): a shard file could not be written whole, "
                     f"{free / 2**30:.2f} GiB free under {tmp.parent} now [{cause}]")
        raise CheckpointError(f"could not save checkpoint {tmp}: {cause}; check free space and permissions under "
                              f"{tmp.parent}; the previous checkpoint stays `latest`") from err


def commit(root: Path, step: int, meta: dict[str, Any], pg: ProcessGroup = None, keep_last: int = 0,
           keep_every: int = 0) -> Path:
    """After every rank wrote: meta.json + manifest, rename into place, point `latest` at it, prune (rank 0)."""
    rank, _ = rank_world(pg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    final = root / step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    barrier(pg)
    if rank == 0:
        # meta may name another world size (an offline conversion keeps the saving layout's)
        (tmp / "meta.json").write_text(json.dumps({"world_size": world, **meta, "step": step}, indent=1))
        write_manifest(tmp)
        if final.exists():  # an earlier save of this step (before a rollback or a fallback): kept, not deleted
            moved = move_aside(root, [final], "replaced")
            logging.getLogger("tessera.checkpoint").warning(
                "checkpoint %s existed and was moved to %s before this save replaced it", final, moved)
        os.replace(tmp, final)
        if not meta.get("guard_suspect"):  # taken while the loss guard was skipping: kept, never `latest`
            write_latest(root, final.name)
            if keep_last:
                prune_checkpoints(root, keep_last, keep_every, newest=step)
    barrier(pg)
    return final


def save_checkpoint(root: Path, step: int, parts: Sequence[nn.Module],
                    optimizers: Sequence[torch.optim.Optimizer], meta: dict[str, Any], *, keep_last: int = 0,
                    keep_every: int = 0) -> Path:
    """Save a checkpoint of step `step` under `root` on every rank, blocking; commit it atomically."""
    tmp = begin_save(root, step)
    write_shards(training_state(parts, optimizers), tmp)
    return commit(root, step, meta, keep_last=keep_last, keep_every=keep_every)


def write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def remove_partial_saves(root: Path) -> list[Path]:
    """Delete `.tmp-step_N` directories left by a save that was killed (rank 0, before training starts)."""
    stale = sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def prune_checkpoints(root: Path, keep_last: int, keep_every: int, newest: int | None = None) -> list[Path]:
    """Delete committed checkpoints older than `newest` (the one just committed) beyond the newest `keep_last`,
    keeping every `keep_every`-th step. Checkpoints with later steps (an earlier run's, kept after a fallback)
    are never pruned: only a checkpoint that was just superseded can go."""
    steps = sorted(s for p in root.glob("step_*") if (s := step_of(p)) is not None)
    if newest is not None:
        steps = [s for s in steps if s <= newest]
    doomed = [s for s in steps[:-keep_last] if not (keep_every and s % keep_every == 0)]
    removed = []
    for s in doomed:
        p = root / step_dir_name(s)
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def move_aside(root: Path, paths: Sequence[Path], why: str, with_latest: bool = False) -> Path:
    """Move checkpoint directories (and `latest`) into `root/<why>-<time>/` instead of deleting them."""
    dest = root / f"{why}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    dest.mkdir(parents=True)
    for p in [*paths, *([root / LATEST] if with_latest else [])]:
        if p.exists():
            os.replace(p, dest / p.name)
    return dest


# --- load ----------------------------------------------------------------------------------------------------
def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta: dict[str, Any] = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}/meta.json is missing or unreadable ({err}); the checkpoint is "
                              f"incomplete — resume from an earlier step") from err
    return meta


def load_state(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` (tensors in the current layout) in place from checkpoint `path` (DCP reshards)."""
    try:
        # Read (and refuse) the metadata here first: torch's loader logs a traceback per fallback it tries.
        SafeFileSystemReader(str(path)).read_metadata()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                     no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"could not load checkpoint {path}: {dcp_cause(err)}; check the directory is complete "
                              f"and the model matches the checkpoint (tessera ckpt inspect {path})") from err


def load_checkpoint(path: Path, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer] | None,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Load model (and optimizer) state in place from `path`, reshaping to the current layout; return meta.

    RNG states are restored when the world size is the one the checkpoint was saved with (bitwise resume);
    after a layout change every rank keeps the RNG state it was seeded with.
    """
    rank, world = rank_world()
    state: dict[str, Any] = {"model": model_state(parts)}
    if optimizers is not None:
        state["optim"] = optimizer_state(parts, optimizers)
    load_state(path, state)
    for part in parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
    if optimizers is not None:
        for part, opt in zip(parts, optimizers, strict=True):
            set_optimizer_state_dict(part, opt, state["optim"], options=_OPTS)
    meta = read_meta(path)
    rng_file = path / "rng" / f"rank_{rank}.json"
    if restore_rng and meta.get("world_size") == world and rng_file.exists():
        set_rng_state(json.loads(rng_file.read_text()))
    return meta


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` points at (unverified), or None when there is none yet."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    return root / pointer.read_text().strip()


def candidates(root: Path) -> list[Path]:
    """Committed checkpoints to try, best first: the one `latest` names, then every step_N newest first."""
    found = sorted((p for p in root.glob("step_*") if step_of(p) is not None), key=lambda p: -(step_of(p) or 0))
    head = latest_checkpoint(root)
    if head is not None:
        found = [head] + [p for p in found if p.name != head.name]
    return found


__all__ = ["LATEST", "VerifyMode", "barrier", "begin_save", "candidates", "commit", "latest_checkpoint",
           "load_checkpoint", "load_state", "move_aside", "prune_checkpoints", "read_meta", "remove_partial_saves",
           "save_checkpoint", "set_rng_state", "step_dir_name", "training_state", "write_shards"]
