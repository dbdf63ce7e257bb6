"""Helpers of the parity tests: layouts as dicts, sub-world meshes inside one spawn, the cached reference."""

from __future__ import annotations

import functools
from typing import Any

import torch

from framework.config import Config, load_config
from framework.parallel.mesh import ParallelDims
from framework.train.documents import resolve_documents
from models.documents import DocumentMasking

TINY = "configs/smoke/tiny.yaml"
STEPS = 5


def make_config(overrides: tuple[str, ...] = ()) -> Config:
    return load_config(TINY, ["train.grad_clip=0.5", "train.warmup_steps=1", "train.lr=3.0e-3", *overrides])


def documents(cfg: Config) -> DocumentMasking | None:
    """data.document_mask / reset_position_ids resolved against the synthetic data's EOS, as the trainer does."""
    from data_pipeline.prepare import prepare_data

    return resolve_documents(cfg.data, prepare_data(cfg.data).eos_id, cfg.model.vocab_size)


def batches(cfg: Config, steps: int = STEPS) -> torch.Tensor:
    """(steps, global_batch, seq_len + 1) random token ids, the same for every layout.

    With document masking about one token in eight is the EOD (documents of ~8 tokens, some of length 1).
    """
    gen = torch.Generator().manual_seed(7)
    shape = (steps, cfg.train.global_batch_size, cfg.data.seq_len + 1)
    out = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    docs = documents(cfg)
    if docs is not None:
        out[torch.rand(shape, generator=torch.Generator().manual_seed(8)) < 0.125] = docs.eod_id
    return out


def rank_batch(step_batch: torch.Tensor, dp_rank: int, dp_size: int, micro: int) -> torch.Tensor:
    rows = step_batch.shape[0] // dp_size
    mine = step_batch[dp_rank * rows:(dp_rank + 1) * rows]
    return mine.reshape(-1, micro, mine.shape[-1])


def train_engine(engine: Any, cfg: Config, steps: int = STEPS) -> list[tuple[float, float]]:
    from framework.train.schedule import lr_at

    out = []
    data = batches(cfg, steps)
    for step in range(steps):
        batch = rank_batch(data[step], engine.dp_rank, engine.dp_size, cfg.train.micro_batch_size)
        loss = engine.forward_backward(batch)
        norm = engine.clip_grad_norm(cfg.train.grad_clip)
        engine.optimizer_step(lr_at(cfg.train, step))
        out.append((loss, norm))
    return out


@functools.cache
def reference(overrides: tuple[str, ...] = ()) -> list[tuple[float, float]]:
    """The 1-process LocalEngine run of the same config (computed once per config and cached)."""
    from framework.train.engine import LocalEngine

    torch.manual_seed(0)
    cfg = make_config(overrides)
    return train_engine(LocalEngine(cfg.model, cfg.train, torch.device("cpu"), documents(cfg)), cfg)


def layout_overrides(layout: dict[str, Any]) -> tuple[str, ...]:
    """`parallel.` overrides from a layout dict; keys with a dot (e.g. train.precision) pass through."""
    return tuple(f"{k}={v}" if "." in k else f"parallel.{k}={v}" for k, v in layout.items())


def extra_overrides(layout: dict[str, Any]) -> tuple[str, ...]:
    """The non-parallel overrides of a layout: they change the reference run."""
    return tuple(f"{k}={v}" for k, v in layout.items() if "." in k)


def layout_world(layout: dict[str, Any]) -> int:
    return int(layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp_shard", 1) * layout.get("dp_replicate", 1)
               * layout.get("cp", 1))


def pack_rounds(layouts: list[dict[str, Any]], world: int = 8) -> list[list[dict[str, Any]]]:
    """Greedy first-fit of layouts into rounds of at most `world` ranks (largest first)."""
    rounds: list[list[dict[str, Any]]] = []
    free: list[int] = []
    for layout in sorted(layouts, key=layout_world, reverse=True):
        n = layout_world(layout)
        for i, left in enumerate(free):
            if n <= left:
                rounds[i].append(layout)
                free[i] -= n
                break
        else:
            rounds.append([layout])
            free.append(world - n)
    return rounds


def run_rounds(rank: int, world: int, rounds: list[list[dict[str, Any]]]) -> list[dict[int, Any]]:
    import torch.distributed as dist

    out = [run_round(rank, world, r) for r in rounds]
    # Rank 0 hosts the TCPStore that gloo groups rendezvous through: a rank that finished early (e.g. rank 0 on a
    # fast layout) must not exit while another still creates its meshes ("Broken pipe" on the store, seen under
    # load with a 1-rank layout at the end of the last round).
    dist.barrier()
    return out


def compare(rounds: list[list[dict[str, Any]]], results: list[list[dict[int, Any]]], atol: float = 1e-5
            ) -> list[str]:
    """Mismatches (as text) of every layout's per-step (loss, grad norm) against its cached reference."""
    bad = []
    for i, layouts in enumerate(rounds):
        merged: dict[int, Any] = {}
        for per_rank in results:
            merged.update(per_rank[i])
        for j, layout in enumerate(layouts):
            ref = reference(extra_overrides(layout))
            tol = atol if "train.precision" not in layout else 5e-3
            for step, (got, want) in enumerate(zip(merged[j], ref, strict=True)):
                if abs(got[0] - want[0]) > tol or abs(got[1] - want[1]) > tol * max(1.0, abs(want[1])):
                    bad.append(f"{layout} step {step}: (loss, grad norm) {got} vs 1-process {want}")
    return bad


def run_round(rank: int, world: int, layouts: list[dict[str, Any]], extra: tuple[str, ...] = ()) -> dict[int, Any]:
    """Run layouts side by side on disjoint rank ranges; every rank builds every mesh (collective calls)."""
    from framework.parallel.engine import ParallelEngine

    torch.set_num_threads(1)
    offset, mine = 0, None
    meshes = []
    for i, layout in enumerate(layouts):
        cfg = make_config(layout_overrides(layout) + extra)
        dims = ParallelDims.from_config(cfg.parallel, layout_world(layout), cfg.model)
        meshes.append(dims.build_mesh("cpu", torch.arange(offset, offset + dims.world_size)))
        if offset <= rank < offset + dims.world_size:
            mine = (i, cfg, dims)
        offset += dims.world_size
    assert offset <= world, f"round needs {offset} ranks, world has {world}"
    if mine is None:
        return {}
    i, cfg, dims = mine
    engine = ParallelEngine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"), dims, meshes[i], documents(cfg))
    return {i: train_engine(engine, cfg)}
