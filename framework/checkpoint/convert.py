"""Offline checkpoint conversion: read any checkpoint on one process, write it back consolidated.

DCP already reshards on load, so a layout change needs no conversion to *train*; `tessera ckpt convert` exists
for what happens off the cluster: one shard file instead of one per rank (copying, archiving, inspection), model
weights cast to bf16 for a smaller artifact, or the optimizer state dropped for a release. Tensors are allocated
from the checkpoint's own metadata, so no model code or config is needed. The result is an ordinary committed
checkpoint (manifest, meta, RNG states copied) that every layout can load.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from framework.checkpoint import dcp as ckpt
from framework.checkpoint.hf import resolve_checkpoint
from framework.checkpoint.manager import verify_checkpoint
from framework.checkpoint.storage import SafeFileSystemReader


def read_full_state(path: Path, model_only: bool = False) -> dict[str, Any]:
    """Every entry of checkpoint `path` as full tensors on CPU, keyed by DCP's flattened names (model.*, optim.*)."""
    metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    state: dict[str, Any] = {}
    for key, md in metadata.items():
        if model_only and not key.startswith("model."):
            continue
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            state[key] = None  # a non-tensor value (optimizer hyper-parameter); DCP fills it in
    ckpt.load_state(path, state)
    return state


def convert_checkpoint(src: Path, out: Path, *, step: int | None = None, dtype: str | None = None,
                       model_only: bool = False) -> Path:
    """Write checkpoint `src` (run/checkpoints/step dir) as one consolidated checkpoint under `out`/checkpoints."""
    path = resolve_checkpoint(src, step)
    verify_checkpoint(path)
    state = read_full_state(path, model_only)
    if dtype is not None:
        cast = getattr(torch, dtype)
        state = {k: v.to(cast) if k.startswith("model.") and isinstance(v, torch.Tensor) and v.is_floating_point()
                 else v for k, v in state.items()}
    meta = ckpt.read_meta(path)
    meta.update(converted_from=str(path), converted_dtype=dtype)
    if model_only:
        meta["model_only"] = True
    root = out / "checkpoints"
    tmp = ckpt.begin_save(root, int(meta["step"]))
    for rng in (path / "rng").glob("rank_*.json"):  # the saved ranks' states, not this process's
        shutil.copy(rng, tmp / "rng" / rng.name)
    ckpt.write_shards(state, tmp)
    return ckpt.commit(root, int(meta["step"]), meta)
