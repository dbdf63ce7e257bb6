"""Selective recompute keeps the MoE experts' grouped-GEMM outputs: backward runs no forward GEMM again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from framework.parallel.recompute import apply_recompute
from models.config import model_config
from models.decoder import build_model
from models.moe import grouped_mm_available


class _CountGrouped(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += func is torch.ops.aten._grouped_mm.default
        return func(*args, **(kwargs or {}))


def _grouped_mm_calls(mode: str) -> int:
    cfg = model_config("test-moe", moe={"experts_impl": "grouped_mm"})
    model = build_model(cfg, seed=0)
    apply_recompute(model.layers, mode)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with _CountGrouped() as counter:
        model(tokens).float().pow(2).mean().backward()
    return counter.calls


@pytest.mark.skipif(not grouped_mm_available(torch.device("cpu"), torch.float32), reason="no torch._grouped_mm")
def test_selective_recompute_does_not_rerun_the_grouped_gemms() -> None:
    plain, selective, full = (_grouped_mm_calls(m) for m in ("none", "selective", "full"))
    assert full > plain  # full recompute runs each block's forward GEMMs again: the count can see a recompute
    assert selective == plain, (plain, selective, full)
