"""Checkpoints through torch.distributed.checkpoint (DCP), committed atomically.

Layout of one checkpoint:
    checkpoints/step_N/            DCP shards (*.distcp) + .metadata: model and optimizer, sharded by FQN
    checkpoints/step_N/meta.json   step, loader state, resolved config, data fingerprint (rank 0)
    checkpoints/step_N/rng/rank_R.json  per-rank RNG states (python, numpy, torch CPU/CUDA) as plain JSON
    checkpoints/latest             the name of the newest committed checkpoint

A save writes under `.tmp-step_N`, then rank 0 renames it to `step_N` and rewrites `latest` (write a temporary
file, then rename): a crash at any point leaves the previous `latest` valid. Nothing is ever unpickled: tensors
come back through DCP and everything else is JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from framework.errors import CheckpointError

LATEST = "latest"
_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as JSON-safe values."""
    np_state: Any = np.random.get_state()
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


def save_checkpoint(root: Path, step: int, parts: Sequence[nn.Module],
                    optimizers: Sequence[torch.optim.Optimizer], meta: dict[str, Any]) -> Path:
    """Save a checkpoint of step `step` under `root` on every rank; commit it atomically; return its path."""
    rank, world = _rank_world()
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    state = {"model": model_state(parts), "optim": optimizer_state(parts, optimizers)}
    dcp.save(state, checkpoint_id=str(tmp))
    (tmp / "rng" / f"rank_{rank}.json").write_text(json.dumps(rng_state()))
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "world_size": world}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, final.name)
    _barrier()
    return final


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` points at, or None when there is none yet."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "meta.json").exists():
        raise CheckpointError(
            f"{pointer} points at {path.name}, which has no meta.json (an incomplete checkpoint); "
            f"point `latest` at a complete step_N directory or delete it to start fresh")
    return path


def read_meta(path: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((path / "meta.json").read_text())
    return meta


def load_checkpoint(path: Path, parts: Sequence[nn.Module],
                    optimizers: Sequence[torch.optim.Optimizer] | None) -> dict[str, Any]:
    """Load model (and optimizer) state in place from `path`, reshaping to the current layout; return meta."""
    rank, world = _rank_world()
    state: dict[str, Any] = {"model": model_state(parts)}
    if optimizers is not None:
        state["optim"] = optimizer_state(parts, optimizers)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as err:
        raise CheckpointError(f"could not load checkpoint {path}: {err}; check the directory is complete") from err
    for part in parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
    if optimizers is not None:
        for part, opt in zip(parts, optimizers, strict=True):
            set_optimizer_state_dict(part, opt, state["optim"], options=_OPTS)
    meta = read_meta(path)
    rng_file = path / "rng" / f"rank_{rank}.json"
    if meta.get("world_size") == world and rng_file.exists():
        set_rng_state(json.loads(rng_file.read_text()))
    return meta


def prune_checkpoints(root: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_last`, keeping every `keep_every`-th step."""
    steps = sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if p.name.split("_")[1].isdigit())
    doomed = [s for s in steps[:-keep_last] if not (keep_every and s % keep_every == 0)]
    removed = []
    for s in doomed:
        p = root / step_dir_name(s)
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed
