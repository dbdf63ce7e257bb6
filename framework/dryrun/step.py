"""One measured training step of a `ParallelEngine`: the same code on real tensors (gloo) and fake ones.

    tracker = MemoryTracker()
    with tracker:
        engine = ParallelEngine(...)
        measure = measure_step(engine, batch, tracker)

Two steps run: the first builds what a step creates once (AdamW's states, the pipeline schedule and its
buffers) and is not measured; the second is the steady state, measured whole — forward and backward (through
the schedule under pp), the reductions after backward, clipping, the optimizer step — for its peak of live
tensor bytes (`MemoryTracker`) and every collective it issues (the communication logger's dispatch mode,
framework/parallel/comm.py). The persistent states are read from the engine's own tensors before the second
step: parameters from their local shards (DTensor placements, FSDP's sharded parameters), the optimizer states
from the optimizer, gradients as the second step leaves them after backward.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from framework.dryrun.tracker import MemoryTracker, local_tensors, storage_key
from framework.parallel.comm import CommLogger, layout_axes, wire_factor
from framework.parallel.mesh import AXES


@dataclass
class Collective:
    """One (mesh axis, op) of a step: how often, the full buffers' bytes, the ring wire bytes per rank."""

    axis: str
    op: str
    group_size: int
    calls: int
    bytes: int
    wire_bytes: float
    dtypes: list[str]


@dataclass
class StepMeasure:
    """What one rank holds and moves in one steady-state step."""

    rank: int
    states: dict[str, int]
    """Persistent bytes: params, grads, optimizer, buffers."""
    peak: int
    """Peak live tensor bytes during the measured step."""
    peak_by_label: dict[str, int]
    """The live bytes by category at that peak (framework/dryrun/tracker.py)."""
    peak_phase: str
    collectives: list[Collective] = field(default_factory=list)
    over_budget: bool = False
    """The step was stopped when live bytes passed the budget: `peak` is where it stopped, a lower bound."""
    label_max: dict[str, int] = field(default_factory=dict)
    """Each category's own largest live bytes during the step, at whatever moment (the peak's are a snapshot)."""
    optimizer_rise: int = 0
    """Live bytes the measured step's clipping and optimizer step add at most over what they begin with (Muon's
    owner exchange and Newton-Schulz; framework/plan/muon.py predicts it)."""

    def bytes_by_axis(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.axis] = out.get(c.axis, 0) + c.bytes
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _nbytes(tensors: Iterator[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    seen: set[int] = set()
    total, kept = 0, []
    for t in tensors:
        for local in local_tensors(t):
            st = local.untyped_storage()
            key = storage_key(local)
            if key in seen or st.nbytes() == 0:
                continue
            seen.add(key)
            total += int(st.nbytes())
            kept.append(local)
    return total, kept


def _sharded_params(parts: list[nn.Module]) -> Iterator[torch.Tensor]:
    from framework.parallel.memory import fsdp_units

    managed: set[int] = set()
    for _, group in fsdp_units(parts):
        for fp in group.fsdp_params:
            managed.update(id(p) for p in (fp.sharded_param, getattr(fp, "_unsharded_param", None)) if p is not None)
            yield fp.sharded_param
    for part in parts:
        for p in part.parameters():
            if id(p) not in managed:
                yield p


def state_bytes(engine: Any, tracker: MemoryTracker | None = None) -> dict[str, int]:
    """Persistent bytes of this rank by kind (labelled on `tracker` too): params, grads, optimizer, buffers."""
    parts: list[nn.Module] = engine.model_parts
    params = list(_sharded_params(parts))
    kinds: dict[str, list[torch.Tensor]] = {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer": [v for opt in engine.optimizers for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.numel() > 1],
        "buffers": [b for part in parts for b in part.buffers()],
    }
    out = {}
    for kind, tensors in kinds.items():
        out[kind], kept = _nbytes(iter(tensors))
        if tracker is not None:
            tracker.label(kept, kind)
    return out


@contextlib.contextmanager
def _loss_phase(engine: Any, tracker: MemoryTracker) -> Iterator[None]:
    """Logits and loss under their own label: the head's forward and the engine's cross-entropy."""
    import framework.train.parallel_engine as pe

    original: Callable[..., torch.Tensor] = pe.cross_entropy
    handles = []
    for part in engine.model_parts:
        head = getattr(part, "output", None)
        if isinstance(head, nn.Module):
            handles.append(head.register_forward_pre_hook(lambda *_: tracker.set_phase("logits_loss")))
            handles.append(head.register_forward_hook(lambda *_: tracker.set_phase("forward")))

    def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        with tracker.phase("logits_loss"):
            return original(*args, **kwargs)

    pe.cross_entropy = loss  # type: ignore[assignment]
    try:
        yield
    finally:
        pe.cross_entropy = original
        for h in handles:
            h.remove()


def comm_logger(engine: Any) -> CommLogger:
    """A communication logger naming every axis of the engine's mesh (and the expert mesh, ZeRO++ groups)."""
    return CommLogger(layout_axes(engine.mesh, engine.model_parts))


def _one_step(engine: Any, batch: torch.Tensor, tracker: MemoryTracker, after_backward: Callable[[], None]) -> None:
    with tracker.phase("forward"):
        engine.forward_backward(batch)
    after_backward()
    with tracker.phase("optimizer"):
        engine.clip_grad_norm(engine.train_cfg.grad_clip)
        engine.optimizer_step(engine.train_cfg.lr)


def measure_step(engine: Any, batch: torch.Tensor, tracker: MemoryTracker, rank: int) -> StepMeasure:
    """Run a warm-up step, then measure one (module docstring). `tracker` must be active.

    When the tracker has a limit and live bytes pass it, the step stops there: the measure says so
    (`over_budget`) and holds the bytes at that moment, by category.
    """
    # Tensors caught in reference cycles die when the cyclic collector happens to run, at a different moment on
    # every process; with it off during the two steps the peak is the same every time (and an upper bound).
    gc.collect()
    gc.disable()
    try:
        return _measure_step(engine, batch, tracker, rank)
    except Exception:
        over = tracker.over
        if over is None:
            raise
        tracker.limit = None
        return StepMeasure(rank, state_bytes(engine), over.total, over.by_label, over.phase, over_budget=True)
    finally:
        gc.enable()


def _measure_step(engine: Any, batch: torch.Tensor, tracker: MemoryTracker, rank: int) -> StepMeasure:
    with _loss_phase(engine, tracker):
        _one_step(engine, batch, tracker, lambda: None)
        state_bytes(engine, tracker)
        log = comm_logger(engine)
        grads: dict[str, int] = {}
        tracker.start_window()

        def label_grads() -> None:
            grads.update(state_bytes(engine, tracker))

        with log.active():
            _one_step(engine, batch, tracker, label_grads)
    sizes = {name: engine.mesh[name].size() for name in AXES}
    ep_mesh = getattr(engine.mesh, "_tessera_expert_mesh", None)
    if ep_mesh is not None:
        sizes |= {name: ep_mesh[name].size() for name in ("ep", "edp")}
    collectives = [
        Collective(axis, op, sizes.get(axis, 0), n, log.payload[(axis, op)],
                   log.payload[(axis, op)] * wire_factor(op, sizes.get(axis, 0)),
                   sorted(str(d).removeprefix("torch.") for d in log.dtypes[(axis, op)]))
        for (axis, op), n in sorted(log.calls.items())]
    return StepMeasure(rank, grads, tracker.peak, dict(tracker.peak_by_label), tracker.peak_phase, collectives,
                       label_max=dict(tracker.label_max), optimizer_rise=tracker.rise.get("optimizer", 0))
