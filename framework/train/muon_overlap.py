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
backward runs once the unit's gradients are reduced. A unit of several blocks (parallel.fsdp_layers_per_unit)
hooks each of its modules, and the first of them to run forward wraps its input, as FSDP registers its
post-backward there only; an MoE layer's experts are a unit of their own inside their block's (over the edp ranks),
sending their pieces once that unit's reduce-scatter is done. Each unit sends only the parameters its own
reduce-scatter finalizes. On the GPU the all-to-all first waits for FSDP's post-reduce event (the gradients are
written on FSDP's reduce stream). Parameters no hook covers (the root unit's) are sent at the step. Under pp the
pipeline stage runs each stage's last backward with FSDP's gradient sync on and arms the hook around it
(framework/parallel/pipeline.py `_Stage`), so the same hook point serves there. Under FSDP x TP a unit's pieces
go in one all-to-all over the dp_shard x tp ranks to one owner among them (`overlap_exchange`), not through the
plain exchange's tp all-gather. Under tp without an FSDP shard group there is no FSDP hook to follow:
`AccumulatedExchange` launches each block once its tp-split matrices' gradients are final (post-accumulate-grad
hooks, or the DDP sync's listener under dp_replicate). Where the layout does not allow it, `overlap_problem`
says why and the plain exchange runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import DTensor

from framework.parallel.config import ParallelConfig
from framework.parallel.ddp import ReplicatedGradSync
from framework.parallel.mesh import ParallelDims
from framework.parallel.pipeline_schedules import schedule_spec
from framework.parallel.whole_matrix import WholeMatrices
from framework.train.config import TrainConfig
from framework.train.muon import Muon
from models.config import ModelConfig

log = logging.getLogger(__name__)


def overlap_problem(train_cfg: TrainConfig, pcfg: ParallelConfig, dims: ParallelDims, model_cfg: ModelConfig
                    ) -> str | None:
    """Why this layout runs the plain exchange (None: it overlaps)."""
    if train_cfg.optimizer != "muon" or not train_cfg.muon.overlap:
        return "train.muon.overlap is off" if train_cfg.optimizer == "muon" else "not Muon"
    no_fsdp = pcfg.zero_stage == 0 or dims.fsdp_size == 1
    if no_fsdp and dims.tp == 1:
        return "no FSDP shard group and no tp: the matrices are whole on every rank, nothing is exchanged"
    if no_fsdp and dims.pp > 1:
        return "tp x pp without FSDP: the pipeline schedule's backward arms no post-accumulate-grad hook"
    if dims.pp > 1 and schedule_spec(pcfg.pp_schedule).split_backward:
        return (f"pp > 1 with {pcfg.pp_schedule}: a zero-bubble schedule's weight pass, which makes a stage's "
                "gradients final, runs outside FSDP's per-unit post-backward")
    # ep > 1 (MoE), parallel.fsdp_layers_per_unit > 1 and ZeRO++ qgZ overlap. A stacked expert weight is whole
    # along ep and cut only by its own FSDP unit over the edp ranks: it leaves after that unit's reduce-scatter.
    # Experts summed by `MoEParallel.after_backward` (dp_shard 1: no FSDP on them) are cut by nothing (tp does
    # not split experts), so they are never exchanged: their update is made at the step, after that sum (and
    # without tp, MoE refusing cp > 1, dp_shard 1 leaves no FSDP shard group: the clause above). A grouped unit
    # launches from the first of its modules that runs (`_entered`); qgZ's custom reduce-scatter runs inside
    # FSDP's post-backward, which returns with the final gradients (on the GPU: before its post-reduce event).
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
    """Launches each FSDP unit's exchanged Muon gradients from backward, on the armed (last) micro-batch only.

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
        exchanged = {id(opt._whole.params[i]) for opt in optimizers for i in opt._exchanged()}
        for part in parts:
            for state, modules in fsdp_units(part):
                params = [p for p in unit_params(state) if id(p) in exchanged]
                if not params:  # e.g. experts whole on their rank (a 1-rank edp group): nothing to send
                    continue
                for module in modules:
                    module.register_forward_pre_hook(self._pre_forward(state, params), prepend=True)

    def arm(self, last: bool) -> None:
        """Before each micro-batch's backward: only the last one's gradients are final (ZeRO-1 reduces then)."""
        self.armed = last

    def grads_divided(self, part: nn.Module, divisor: int) -> None:
        """The pipeline schedule divided `part`'s gradients by `divisor` after they left: its owners repeat it."""
        for opt in self._of_part.get(id(part), []):
            opt.grads_divided(divisor)

    def _pre_forward(self, state: Any, params: Sequence[torch.Tensor]) -> Any:
        optimizers = _holding(self.optimizers, params)  # one per model part: a pipeline rank's stages have several

        def launch() -> None:
            if not self.armed:
                return
            # FSDP wrote the reduced gradients on its reduce-scatter stream (HSDP: all-reduce stream) and recorded
            # this event after the last write (torch 2.13 `foreach_reduce`; qgZ's custom reduce-scatter runs on
            # that stream too, its all-to-alls ordered there as c10d orders a synchronous collective with the
            # current stream; under pp the stage's last backward reduces through the same post-backward). The
            # all-to-all below reads them on the current stream, so it waits first, by the call FSDP itself
            # makes before reusing them (`_wait_for_post_backward`; a no-op on CPU). Wherever FSDP clears the
            # event it first makes the current stream wait on it, so None means that stream is ordered after the
            # writes already. The device handle is the unit's, whose streams FSDP used.
            for group in state._fsdp_param_groups:
                if group._post_reduce_event is not None:
                    group.device_handle.current_stream().wait_event(group._post_reduce_event)
                for fp in group.fsdp_params:  # parallel.cpu_offload: a non-blocking copy to host memory, which
                    if fp.grad_offload_event is not None:  # FSDP itself waits for only at the end of backward
                        fp.grad_offload_event.synchronize()
            for opt in optimizers:  # every rank of a bucket's group holds the same stages: the same launches;
                # a gradient still Partial over tp (summed after backward) goes at the step
                opt.launch([p for p in params if not _partial(p.grad)])

        def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
                return None
            if not args[0].requires_grad or _entered(state):
                return None
            return (_AfterUnitBackward.apply(launch, args[0]), *args[1:])

        return hook


def fsdp_units(part: nn.Module) -> list[tuple[Any, list[nn.Module]]]:
    """The FSDP units under `part`'s root unit: (FSDP state, its modules) in module order. A unit of
    `fully_shard([block, block, ...])` (parallel.fsdp_layers_per_unit > 1) has one state over several modules;
    an MoE layer's experts (framework/parallel/expert.py `apply_expert_fsdp`) are a unit inside their block's."""
    root = part._get_fsdp_state() if isinstance(part, FSDPModule) else None  # type: ignore[operator]
    units: dict[int, tuple[Any, list[nn.Module]]] = {}
    for module in part.modules():
        if isinstance(module, FSDPModule) and (state := module._get_fsdp_state()) is not root:  # type: ignore[operator]
            units.setdefault(id(state), (state, []))[1].append(module)
    return list(units.values())


def unit_params(state: Any) -> list[torch.Tensor]:
    """The parameters whose gradients this unit's post-backward reduces (not those of units nested inside it),
    as its modules hold them now (FSDP's lazy init re-reads them from the modules too)."""
    return [getattr(fp._module_info.module, fp._module_info.param_name)
            for group in state._fsdp_param_groups for fp in group.fsdp_params]


def _entered(state: Any) -> bool:
    """Whether another module of this (grouped) unit already entered forward in this pass. FSDP registers its
    post-backward on the inputs of the first module of a unit that runs (torch 2.13 `FSDPParamGroup.pre_forward`:
    only when the group is not yet in FORWARD), and this pre-hook runs before FSDP's, so it wraps exactly the
    input FSDP's post-backward will wrap: the whole unit's gradients are reduced when it fires."""
    return any(group._training_state == TrainingState.FORWARD for group in state._fsdp_param_groups)


def _holding(optimizers: list[Muon], params: Iterable[torch.Tensor]) -> list[Muon]:
    """The optimizers among `optimizers` that step any of `params`."""
    ids = {id(p) for p in params}
    return [opt for opt in optimizers if any(id(p) in ids for p in opt._whole.params)]


def _partial(grad: torch.Tensor | None) -> bool:
    return isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements)


class AccumulatedExchange:
    """Without an FSDP shard group (tp splits the matrices, Colwise Shard(0) and Rowwise Shard(1)): launches each
    block's Muon gradients over tp from backward on the armed (last) micro-batch, once every exchanged matrix of
    the block has its final gradient: at its AccumulateGrad (a post-accumulate-grad hook), or under dp_replicate
    once the replica sync (framework/parallel/ddp.py) has averaged the bucket that holds it (its listener).

    A gradient still Partial there (summed over tp by the engine after backward, `resolve_partial_grads`) is left
    for the step, which launches what no block sent. Blocks are the decoder's layers, and each other child of a
    model part holding exchanged matrices. Every rank builds the same blocks and backward runs one graph order on
    every tp rank, so the all-to-alls interleave with TP's own backward collectives on the group alike everywhere.
    On the GPU no wait is needed: the hook runs on the stream AccumulateGrad wrote the gradient on (autograd's for
    that node, the current one), and the replica sync calls its listeners inside the stream it averaged on; the
    all-to-all is ordered after the current stream's work when it is enqueued.
    """

    def __init__(self, optimizers: list[Muon], parts: list[nn.Module], replica_sync: ReplicatedGradSync | None
                 ) -> None:
        self.optimizers = optimizers
        self.armed = True
        owner = {id(opt._whole.params[i]): opt for opt in optimizers for i in opt._exchanged()}
        self.blocks: list[tuple[Muon, list[torch.Tensor]]] = []
        self._block_of: dict[int, int] = {}
        for part in parts:
            layers = getattr(part, "layers", None)
            groups = [*(layers.values() if isinstance(layers, nn.ModuleDict) else ()),
                      *(child for name, child in part.named_children() if name != "layers")]
            for group in groups:
                params = [p for p in group.parameters() if id(p) in owner and id(p) not in self._block_of]
                if params:
                    self._block_of |= {id(p): len(self.blocks) for p in params}
                    self.blocks.append((owner[id(params[0])], params))
        self._ready = [0] * len(self.blocks)
        if replica_sync is not None:
            replica_sync.listeners.append(self._arrived)
        else:
            for _, params in self.blocks:
                for p in params:
                    p.register_post_accumulate_grad_hook(lambda q: self._arrived([q]) if self.armed else None)

    def arm(self, last: bool) -> None:
        """Before each micro-batch's backward: only the last one's gradients are final."""
        self.armed = last
        self._ready = [0] * len(self.blocks)

    def _arrived(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            b = self._block_of.get(id(p))
            if b is None:
                continue
            self._ready[b] += 1
            opt, members = self.blocks[b]
            if self._ready[b] == len(members):
                opt.launch([q for q in members if not _partial(q.grad)])


def overlap_exchange(optimizers: list[torch.optim.Optimizer], parts: list[nn.Module], train_cfg: TrainConfig,
                     pcfg: ParallelConfig, dims: ParallelDims, model_cfg: ModelConfig,
                      replica_sync: ReplicatedGradSync | None = None, dp_tp: dist.ProcessGroup | None = None
                     ) -> BackwardExchange | AccumulatedExchange | None:
    """Turn the overlapped exchange on for the Muon optimizers where the layout allows (None: plain exchange).
    Under FSDP x TP the matrices' pieces go over `dp_tp` (ParallelDims.build_mesh's dp_shard x tp group) to one
    owner among those ranks, in one hop: the plain exchange's tp all-gather would have to wait for the gradient
    of the whole unit, and every tp rank of an owner would keep the whole momentum (tp times the memory)."""
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
        if dims.tp > 1 and dims.fsdp_size > 1:
            assert dp_tp is not None, "FSDP x TP needs the dp_shard x tp group of ParallelDims.build_mesh"
            opt._whole = WholeMatrices(opt._muon_params(), opt._blocks, flat=dp_tp)
    if pcfg.zero_stage == 0 or dims.fsdp_size == 1:
        return AccumulatedExchange(muon, parts, replica_sync)
    return BackwardExchange(muon, parts, armed=dims.pp == 1)  # under pp each stage arms it (pipeline._Stage)
