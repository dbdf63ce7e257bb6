"""Muon's owner exchange overlapped with backward (`train.muon.overlap`, on where the layout allows).

Without overlap, Muon's step (framework/train/muon.py) updates each rank's momentum pieces, then sends the
Nesterov inputs to the matrices' owners (framework/parallel/whole_matrix.py): the first all-to-all waits for the
whole backward. With overlap, each FSDP unit's raw gradient pieces leave for their owners as soon as FSDP has
reduce-scattered them, from a backward hook, while backward goes on through the earlier blocks:

    block k's backward -> FSDP reduce-scatter (its grads are final) -> async all-to-all to the owners (this file)
    ... the rest of backward ...
    optimizer step: wait; owners unscale/clip as the engine did, update the whole matrices' momentum, run
    Newton-Schulz, send the updates back (the second all-to-all, as before)

Nothing the step decides moves into backward: a step the loss guard or the fp16 scaler skips drops the received
pieces (`Muon.zero_grad`) and no state has changed. The momentum of an exchanged matrix lives on its owner, whole;
checkpoints still hold it placed like the parameter (`Muon.state_dict` sends it back to the pieces first). The
bytes are those of the plain exchange: the raw gradient pieces replace the Nesterov inputs one for one.

The hook: a forward pre-hook on each FSDP unit, ahead of FSDP's own, passes the unit's input through an identity
autograd function, so FSDP's post-backward (which it registers on the same input) runs first and this function's
backward runs once the unit's gradients are reduced. On the GPU the all-to-all first waits for FSDP's
post-reduce event (the gradients are written on FSDP's reduce stream). Parameters no hook covers (the root unit's)
are sent at the step. Under pp the pipeline stage runs each stage's last backward with FSDP's gradient sync on
and arms the hook around it (framework/parallel/pipeline.py `_Stage`), so the same hook point serves there.
Where the layout does not allow it, `overlap_problem` says why and the plain exchange runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from framework.parallel.config import ParallelConfig
from framework.parallel.mesh import ParallelDims
from framework.parallel.pipeline_schedules import schedule_spec
from framework.train.config import TrainConfig
from framework.train.muon import Muon
from models.config import ModelConfig

log = logging.getLogger(__name__)


def overlap_problem(train_cfg: TrainConfig, pcfg: ParallelConfig, dims: ParallelDims, model_cfg: ModelConfig
                    ) -> str | None:
    """Why this layout runs the plain exchange (None: it overlaps)."""
    if train_cfg.optimizer != "muon" or not train_cfg.muon.overlap:
        return "train.muon.overlap is off" if train_cfg.optimizer == "muon" else "not Muon"
    if pcfg.zero_stage == 0 or dims.fsdp_size == 1:
        return ("no FSDP shard group: the matrices are whole on every rank or cut by tp only, and their gradients "
                "are final only after the engine's post-backward reductions")
    if dims.tp > 1:
        return ("tp > 1: tp-split matrices need the secondary all-gather and their tp ranks would each keep the "
                "whole momentum, and tp partial gradients are resolved after backward")
    if dims.pp > 1 and schedule_spec(pcfg.pp_schedule).split_backward:
        return (f"pp > 1 with {pcfg.pp_schedule}: a zero-bubble schedule's weight pass, which makes a stage's "
                "gradients final, runs outside FSDP's per-unit post-backward")
    if model_cfg.moe.enabled and dims.ep > 1:
        return "ep > 1: expert gradients are summed over the expert data ranks after backward"
    if pcfg.fsdp_layers_per_unit > 1:
        return "parallel.fsdp_layers_per_unit > 1: a grouped unit's post-backward has no per-input hook point"
    if pcfg.zero_quantized_gradients:
        return "ZeRO++ qgZ: the quantized reduce-scatter is not a point this hook can follow"
    return None


class _AfterUnitBackward(torch.autograd.Function):
    """Identity; its backward calls `callback` (after every node that consumed the output, FSDP's included)."""

    @staticmethod
    def forward(ctx: Any, callback: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.callback()
        return None, grad


class BackwardExchange:
    """Launches each FSDP unit's Muon gradients from backward, on the armed (last) micro-batch only.

    Without pp the engine arms it per micro-batch. Under pp the pipeline stage does (framework/parallel/pipeline.py
    `_Stage`, a `LastBackwardWatcher`): it arms it around each stage's last backward, which it runs with FSDP's
    gradient sync on, so each unit of the stage launches there; a rank holding several stages (interleaved)
    launches each one's units from that stage's last backward. The schedule then divides the stage's gradients
    by n_micro, which the stage reports (`grads_divided`) for the owners to repeat.
    """

    def __init__(self, optimizers: list[Muon], parts: list[nn.Module], armed: bool = True) -> None:
        self.optimizers = optimizers
        self.armed = armed
        self._of_part = {id(part): _holding(optimizers, part.parameters()) for part in parts}
        muon = {id(p) for opt in optimizers for p in opt._whole.params}
        for part in parts:
            for module in part.modules():
                if module is part or not isinstance(module, FSDPModule):
                    continue
                params = [p for p in module.parameters() if id(p) in muon]
                if params:
                    module.register_forward_pre_hook(self._pre_forward(module, params), prepend=True)

    def arm(self, last: bool) -> None:
        """Before each micro-batch's backward: only the last one's gradients are final (ZeRO-1 reduces then)."""
        self.armed = last

    def grads_divided(self, part: nn.Module, divisor: int) -> None:
        """The pipeline schedule divided `part`'s gradients by `divisor` after they left: its owners repeat it."""
        for opt in self._of_part.get(id(part), []):
            opt.grads_divided(divisor)

    def _pre_forward(self, module: nn.Module, params: Sequence[torch.Tensor]) -> Any:
        optimizers = _holding(self.optimizers, params)  # one per model part: a pipeline rank's stages have several

        def launch() -> None:
            if not self.armed:
                return
            if torch.cuda.is_available():  # FSDP wrote the reduced shards on its reduce stream; under pp too, as the
                # stage's last backward reduces through the same post-backward, which records this event
                for group in module._get_fsdp_state()._fsdp_param_groups:  # type: ignore[operator]
                    event = group._post_reduce_event
                    if event is not None:
                        torch.cuda.current_stream().wait_event(event)
            for opt in optimizers:  # every rank of a bucket's group holds the same stages: the same launches
                opt.launch(params)

        def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
                return None
            if not args[0].requires_grad:
                return None
            return (_AfterUnitBackward.apply(launch, args[0]), *args[1:])

        return hook


def _holding(optimizers: list[Muon], params: Iterable[torch.Tensor]) -> list[Muon]:
    """The optimizers among `optimizers` that step any of `params`."""
    ids = {id(p) for p in params}
    return [opt for opt in optimizers if any(id(p) in ids for p in opt._whole.params)]


def overlap_exchange(optimizers: list[torch.optim.Optimizer], parts: list[nn.Module], train_cfg: TrainConfig,
                     pcfg: ParallelConfig, dims: ParallelDims, model_cfg: ModelConfig) -> BackwardExchange | None:
    """Turn the overlapped exchange on for the Muon optimizers where the layout allows (None: plain exchange)."""
    muon = [opt for opt in optimizers if isinstance(opt, Muon)]
    if not muon:
        return None
    problem = overlap_problem(train_cfg, pcfg, dims, model_cfg)
    if problem is not None:
        if train_cfg.muon.overlap:
            log.info("Muon's owner exchange runs after backward, not overlapped: %s", problem)
        return None
    for opt in muon:
        opt.overlapped = True
    return BackwardExchange(muon, parts, armed=dims.pp == 1)  # under pp each stage arms it (pipeline._Stage)
