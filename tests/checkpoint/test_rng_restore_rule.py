"""The RNG rule of `load_checkpoint` (framework/checkpoint/dcp.py): a resume on the world size the checkpoint was
saved with restores every RNG (python, numpy, torch) to the saved draw, so the run continues bitwise; after a
layout change (another world size) or for an imported model (`restore_rng=False`) every rank keeps the RNG it
was seeded with. The reference is the draws themselves: the next numbers after the save, recorded before."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from framework.checkpoint.dcp import load_checkpoint, save_checkpoint


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def _save(root: Path) -> tuple[Path, tuple[float, float, float], torch.nn.Module]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = save_checkpoint(root, 4, [model], [opt], {"note": "rng"})
    after_save = _draws()  # what a run that never stopped draws next
    return path, after_save, model


def test_same_world_restores_the_saved_draws(tmp_path: Path) -> None:
    path, after_save, model = _save(tmp_path)
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    control = _draws()
    assert control != after_save  # control: reseeding really moved every generator
    meta = load_checkpoint(path, [model], None)
    assert meta["world_size"] == 1 and meta["step"] == 4
    assert _draws() == after_save


def test_another_world_or_an_imported_model_keeps_its_own_rng(tmp_path: Path) -> None:
    path, after_save, model = _save(tmp_path)
    for edit in ("world", "import"):
        if edit == "world":  # saved by 2 ranks, resumed on 1: a layout change
            meta = json.loads((path / "meta.json").read_text())
            (path / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))
        random.seed(9)
        np.random.seed(9)
        torch.manual_seed(9)
        want = _draws()
        random.seed(9)
        np.random.seed(9)
        torch.manual_seed(9)
        load_checkpoint(path, [model], None, restore_rng=edit == "world")
        assert _draws() == want != after_save, edit
