"""The parallel engine on an MoE decoder (4 experts, top-2) against the 1-process LocalEngine: every layout with
ep, tp, pp in {1, 2} and data parallelism (FSDP, dp_shard = 8 / (tp pp)) filling 8 ranks, in dropless mode (with
a shared expert and aux-loss-free bias balancing) and capacity mode (factor 1.0, with z-loss), 5 AdamW steps with
clipping — loss, aux loss and gradient norm to 1e-5 at every step; and under tp 4 and ep 2 x tp 2 x pp 2 a model
with Qwen3's q/k norms and Qwen2-MoE's shared-expert gate. One process group runs all 18 cases.

The reference routes the same token groups: with global batch 16 and micro-batch 2, data rank r's j-th
micro-batch is the reference's micro-batch r * n_micro + j, so capacity drops are identical."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch

from framework.config import Config, load_config
from framework.testing import run_distributed
from framework.testing.tiny import TINY

WORLD, STEPS = 8, 5
MODES = {
    "dropless": ("model.moe.bias_update_rate=0.01", "model.moe.n_shared_experts=1"),
    "capacity": ("model.moe.capacity_factor=1.0", "model.moe.z_loss_coef=0.001"),
    # Qwen3's per-head q/k norms and Qwen2-MoE's shared-expert gate: replicated weights whose gradient each tp
    # rank holds a share of (its heads; its tokens)
    "gated": ("model.qk_norm=true", "model.moe.n_shared_experts=1", "model.moe.shared_expert_gate=true"),
}
LAYOUTS = [dict(ep=ep, tp=tp, pp=pp) for ep, tp, pp in itertools.product((1, 2), (1, 2), (1, 2))]
MODE_LAYOUTS = {"dropless": LAYOUTS, "capacity": LAYOUTS,
                # only tp > 1 is new for these; tp 4 > 2 KV heads: the k norm on replicated KV heads
                "gated": [dict(ep=1, tp=4, pp=1), dict(ep=2, tp=2, pp=2)]}


def _config(mode: str, layout: dict[str, int] | None = None) -> Config:
    over = ["model.preset=test-moe", "model.n_layers=2", "data.seq_len=16", "model.moe.n_experts=4",
            "model.moe.top_k=2", "train.global_batch_size=16",
            "train.micro_batch_size=2", "train.grad_clip=0.5", "train.warmup_steps=1", "train.lr=3.0e-3",
            *MODES[mode]]
    if layout:
        over += [f"parallel.{k}={v}" for k, v in layout.items()]
    return load_config(TINY, over)


def _batches(cfg: Config) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, cfg.model.vocab_size, (STEPS, cfg.train.global_batch_size, cfg.data.seq_len + 1),
                         generator=gen)


def _train(engine: Any, cfg: Config) -> list[tuple[float, float, float]]:
    from framework.train.lr_schedule import lr_at

    out = []
    data = _batches(cfg)
    for step in range(STEPS):
        rows = cfg.train.global_batch_size // engine.dp_size
        mine = data[step][engine.dp_rank * rows:(engine.dp_rank + 1) * rows]
        loss = engine.forward_backward(mine.reshape(-1, cfg.train.micro_batch_size, mine.shape[-1]))
        norm = engine.clip_grad_norm(cfg.train.grad_clip)
        engine.optimizer_step(lr_at(cfg.train, step))
        out.append((loss, engine.extra_metrics()["moe/aux_loss"], norm))
    return out


@functools.cache
def _reference(mode: str) -> list[tuple[float, float, float]]:
    from framework.train.local_engine import LocalEngine

    cfg = _config(mode)
    return _train(LocalEngine(cfg.model, cfg.train, torch.device("cpu")), cfg)


def _all_layouts(rank: int, world: int) -> dict[str, list[tuple[float, float, float]]]:
    from framework.train.parallel_engine import build_parallel_engine

    out = {}
    for mode in MODES:
        for layout in MODE_LAYOUTS[mode]:
            cfg = _config(mode, layout)
            engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
            out[f"{mode} {layout}"] = _train(engine, cfg)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_moe_engine_matches_single_process() -> None:
    refs = {mode: _reference(mode) for mode in MODES}
    results = run_distributed(_all_layouts, WORLD, timeout_s=900)
    for case, got in results[0].items():
        ref = refs[case.split()[0]]
        for step, (values, expected) in enumerate(zip(got, ref)):
            for what, a, b in zip(("loss", "aux", "grad_norm"), values, expected):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (case, step, what, a, b)
