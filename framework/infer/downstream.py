"""In-loop downstream evaluation: score the tasks of `cfg.eval` on the current weights, on any layout.

Scoring needs whole-sequence logits per choice, which a pipeline stage does not have; so every rank assembles
the one-process model from the engine's parts (FSDP/TP/EP shards gathered as full tensors, pipeline stages
exchanged over the `pp` axis), scores its share of the items (item i on rank i mod world) and one all-reduce
sums the per-item results. Every rank thus reaches the same figures, at the cost of one model copy per rank
while evaluating: fine for the models a CPU/one-node eval loop scores; a model that does not fit one device
should be scored offline from its checkpoint instead.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.base.errors import DataError
from framework.base.logs import get_logger
from framework.infer import stdlib_task
from framework.infer.config import EvalConfig
from framework.infer.tasks import Task, load_task, metrics, parse_item, score_items
from models.config import ModelConfig

log = get_logger("downstream")


def one_process_model(parts: list[nn.Module], model_cfg: ModelConfig, device: torch.device,
                      pp_group: dist.ProcessGroup | None = None) -> nn.Module:
    """The whole model, unsharded, on `device`: the engine's own module when it already is one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from models.decoder import Decoder
    from models.init import canonical_fqn

    if len(parts) == 1 and pp_group is None and not any(isinstance(p, DTensor) for p in parts[0].parameters()):
        return parts[0]
    state: dict[str, torch.Tensor] = {}
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")  # warns per 2-D-sharded tensor gathered
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for part in parts:
            full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            state.update({canonical_fqn(k): v.detach().cpu() for k, v in full.items()
                          if isinstance(v, torch.Tensor)})
    finally:
        quiet.setLevel(level)
    if pp_group is not None:
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, state, group=pp_group)
        for s in stages:
            state.update(s)
    model = Decoder(model_cfg)
    model.load_state_dict(state)
    return model.to(device).eval()


class DownstreamEval:
    """The tasks of one run, loaded once; `evaluate(engine)` gives their metrics (the same on every rank)."""

    def __init__(self, cfg: EvalConfig, data: Any, seq_len: int, val_fraction: float, vocab_size: int,
                 run_dir: Path, rank: int) -> None:
        self.cfg, self.seq_len = cfg, seq_len
        self.unconditional = [int(data.eos_id)] if cfg.mutual_info and data.eos_id >= 0 else None
        encode = None
        if data.tokenizer_path and cfg.tasks:  # a run without tasks never opens the tokenizer
            from data_pipeline.tokenizer import Tokenizer

            encode = Tokenizer(data.tokenizer_path).encode
        self.tasks: list[Task] = []
        for spec in cfg.tasks:
            if spec == stdlib_task.NAME:
                self.tasks.append(self._stdlib(data, val_fraction, vocab_size, encode, run_dir, rank))
            else:
                self.tasks.append(load_task(spec, encode, vocab_size, cfg.max_items))

    def _stdlib(self, data: Any, val_fraction: float, vocab_size: int, encode: Any, run_dir: Path,
                rank: int) -> Task:
        if not data.build_dir or encode is None:
            raise DataError(f"eval.tasks names {stdlib_task.NAME!r}, which is built from the held-out documents of "
                            f"a corpus build; this run's data has none (synthetic?) — use data.kind=stdlib or "
                            f"give JSONL task files")
        items = stdlib_task.build_nextline_task(data.build_dir, val_fraction, n_items=self.cfg.stdlib_items,
                                                seed=self.cfg.seed, max_choice_tokens=self.seq_len // 2)
        path = run_dir / "eval_tasks" / f"{stdlib_task.NAME}.jsonl"
        if rank == 0:
            stdlib_task.write_task(items, path)  # for inspection; every rank built the same items in memory
        return Task(stdlib_task.NAME, [parse_item(it, encode, vocab_size) for it in items], str(path))

    def evaluate(self, engine: Any, model_cfg: ModelConfig, step: int) -> dict[str, float]:
        if not self.tasks:
            return {}
        t0 = time.perf_counter()
        mesh = getattr(engine, "mesh", None)
        pp_group = mesh["pp"].get_group() if mesh is not None and mesh["pp"].size() > 1 else None
        model = one_process_model(list(engine.model_parts), model_cfg, engine.device, pp_group)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        was_training = model.training
        model.eval()
        out: dict[str, float] = {}
        try:
            for task in self.tasks:
                mine = list(range(rank, len(task.items), world))
                rows = torch.zeros(len(task.items), 4, dtype=torch.float64)
                if mine:
                    rows[mine] = score_items(model, [task.items[i] for i in mine], self.seq_len,
                                             self.cfg.batch_size, engine.device, self.unconditional)
                if world > 1:
                    rows = rows.to(engine.device)
                    dist.all_reduce(rows)
                    rows = rows.cpu()
                out.update(metrics(task.name, rows, all(it.cloze for it in task.items)))
        finally:
            model.train(was_training)
        out["downstream/time_s"] = time.perf_counter() - t0
        for task in self.tasks:
            key = f"downstream/{task.name}/acc"
            extra = "".join(f", {k} {out[f'downstream/{task.name}/{k}']:.4f}" for k in ("acc_norm", "acc_mutual_info")
                            if f"downstream/{task.name}/{k}" in out)
            log.info("downstream step %d: %s acc %.4f ± %.4f%s (%d items)", step, task.name, out[key],
                     out[key + "_stderr"], extra, len(task.items))
        return out
