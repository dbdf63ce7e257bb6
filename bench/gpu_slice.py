"""The production 70B layout's rank-0 slice, built with real tensors on one device, against the planner.

Rank 0 of configs/pretrain/llama3-70b-128n-h100.yaml (TP8 x PP4 x FSDP32, ZeRO-3, seq 8192, 1,024 ranks) joins a
world of 1,024 on torch's `fake` backend (framework/dryrun/fake.py: every collective is accepted and moves
nothing), so its shards, gathered units, activations and optimizer step are real allocations on the device while
its peers do not exist. One warm-up step, then one measured step (framework/dryrun/step.py `measure_step`):
the allocator's peak (CUDA) and the live-tensor tracker's peak beside the planner's rank-0 prediction
(framework/plan/memory.py `rank_memory`, the terms `tessera plan` prints) and its model states.

The global batch is cut to dp x pp micro-batches (4 per data rank, the 1F1B steady state; the planner's peak does
not depend on the micro-batch count beyond pp) so the two steps take seconds. Values after a fake collective are
uninitialized memory: the loss is meaningless, the bytes are not. Run in its own process (a process group of its
own); bench/gpu_bench.py starts it and reads the JSON line it prints last.

    python bench/gpu_slice.py            # on the GPU
    python bench/gpu_slice.py --dry      # CPU, the same layout with a tiny model (the CI run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = "configs/pretrain/llama3-70b-128n-h100.yaml"
WORLD = 1024
TINY_MODEL = ["model.preset=test-tiny", "model.hidden=128", "model.n_heads=8", "model.n_kv_heads=8",
              "model.ffn_hidden=256", "model.n_layers=4", "model.vocab_size=512", "data.seq_len=64"]
"""The dry run's model: the same layout (tp 8 divides heads, vocab and ffn; one block per pipeline stage)."""


def slice_overrides(dry: bool) -> list[str]:
    from framework.config import load_config
    from framework.parallel.mesh import ParallelDims

    base = [*TINY_MODEL, "run.device=cpu", "train.precision=fp32"] if dry else []
    cfg = load_config(CONFIG, base)
    dims = ParallelDims.from_config(cfg.parallel, WORLD, cfg.model)
    return [*base, f"train.global_batch_size={dims.dp_size * dims.pp * cfg.train.micro_batch_size}"]


def measure(dry: bool) -> dict[str, Any]:
    from framework.config import load_config
    from framework.dryrun.fake import fake_world
    from framework.dryrun.planner import layout_of
    from framework.dryrun.run import _batch, stage_input
    from framework.dryrun.step import measure_step
    from framework.dryrun.tracker import MemoryTracker
    from framework.parallel.mesh import ParallelDims
    from framework.plan.memory import rank_memory, rank_params, resident_state_bytes
    from framework.train.parallel_engine import ParallelEngine

    cfg = load_config(CONFIG, slice_overrides(dry))
    device = torch.device("cpu" if dry else "cuda")
    dims = ParallelDims.from_config(cfg.parallel, WORLD, cfg.model)
    t0 = time.perf_counter()
    with fake_world(0, WORLD, stage_input(cfg, dims)):
        if device.type == "cuda":
            torch.cuda.set_device(0)
            torch.cuda.reset_peak_memory_stats()
        mesh = dims.build_mesh(device.type, experts=cfg.model.moe.enabled)
        tracker = MemoryTracker()
        with tracker:
            engine = ParallelEngine(cfg.model, cfg.train, cfg.parallel, device, dims, mesh)
            step = measure_step(engine, _batch(cfg, engine.n_micro, real=True).to(device), tracker, 0)
        allocator = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    work, lay = layout_of(cfg, WORLD)
    plan = rank_memory(work, lay, 0)
    states = resident_state_bytes(rank_params(work.model, lay, 0), lay, work.precision)
    measured_states = sum(step.states.get(k, 0) for k in ("params", "grads", "optimizer"))
    gib = 2.0**30
    row: dict[str, Any] = {
        "case": "llama3-70b rank 0 (pp0, tp0, dp0) of 1024", "config": CONFIG, "dry": dry,
        "layout": f"tp{dims.tp} pp{dims.pp} dp_shard{dims.dp_shard} zero{cfg.parallel.zero_stage}",
        "seq": cfg.data.seq_len, "n_micro": engine.n_micro, "seconds": time.perf_counter() - t0,
        "tracker_peak_gib": step.peak / gib, "allocator_peak_gib": allocator / gib if allocator else None,
        "planner_peak_gib": sum(plan.values()) / gib, "planner_terms_gib": {k: v / gib for k, v in plan.items()},
        "states_gib": measured_states / gib, "planner_states_gib": states / gib,
    }
    measured = row["allocator_peak_gib"] or row["tracker_peak_gib"]
    row["planner_over_measured"] = row["planner_peak_gib"] / measured
    row["states_ratio"] = states / measured_states if measured_states else None
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    print(json.dumps(measure(args.dry)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
