"""Pipeline parallelism on torch.distributed.pipelining: stages cut by FQN from a meta-device model.

Every stage is the same `Decoder` class with the layers it does not own deleted from its `ModuleDict` and the
embedding / final norm / head set to None where they belong to another stage, so parameter FQNs
(`layers.5.attention.wq.weight`) are identical in every layout. Pipeline micro-batches are the gradient
accumulation steps; the schedule scales gradients by 1/n_micro (the loss is a per-micro-batch mean).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineSchedule, get_schedule_class

from framework.parallel.config import ParallelConfig
from framework.parallel.mesh import stage_layers
from framework.parallel.pipeline_schedules import schedule_spec, stages_of_rank
from framework.parallel.precision import local_grad
from models.decoder import Decoder


def cut_stage(whole: Decoder, stage: int, layers: Sequence[int], n_stages: int) -> Decoder:
    """A copy of `whole` (normally on the meta device) holding only stage `stage`'s parts.

    With multi-token prediction the last stage keeps a copy of the embedding (same FQN) for the MTP modules,
    which embed the shifted labels; it does not embed its input. `TiedEmbeddings` adds the two copies' gradients.
    """
    part = copy.deepcopy(whole)
    keep = {str(i) for i in layers}
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    part.embeds_input = stage == 0
    if stage != 0 and not (stage == n_stages - 1 and part.mtp is not None):
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
        part.mtp = None
    return part


def local_stages(cfg: ParallelConfig, pp_rank: int, n_layers: int) -> tuple[list[int], list[list[int]], int]:
    """(stage ids of this rank, layers of every stage, number of stages)."""
    n_stages = cfg.pp * cfg.virtual_stages
    layers = stage_layers(n_layers, n_stages, cfg.pp_layer_split)
    return stages_of_rank(pp_rank, cfg.pp, cfg.virtual_stages, cfg.pp_schedule), layers, n_stages


def send_in_compute_dtype(part: nn.Module, stage: int, n_stages: int, dtype: torch.dtype) -> None:
    """Stage boundaries carry activations (and, in backward, their gradients) in the compute dtype `dtype`.

    Under autocast the residual stream is fp32 (fp32 parameters, fp32 adds), so a stage would send fp32: twice the
    bytes of Megatron's pipeline_dtype. A stage's output is cast to `dtype` before the send and the next stage
    casts its input back to fp32, so the stage computes as before and only the boundary rounds (one rounding
    of the compute dtype per boundary, inside the bf16 parity budget). The gradient of the cast is sent in
    `dtype` too. FSDP's mixed precision casts stage inputs itself, so `parallelize` calls this only without it.
    """
    def to_fp32(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    def to_compute(_: nn.Module, __: Any, out: Any) -> Any:
        return out.to(dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    if stage > 0:
        part.register_forward_pre_hook(to_fp32)
    if stage < n_stages - 1:
        part.register_forward_hook(to_compute)


class LastBackwardWatcher(Protocol):
    """Told about each stage's last backward of a step (framework/train/muon_overlap.py `BackwardExchange`)."""

    def arm(self, last: bool) -> None:
        """True just before a stage's last backward, False right after it."""

    def grads_divided(self, part: nn.Module, divisor: int) -> None:
        """The schedule divided `part`'s gradients by `divisor` (1/n_micro) after that backward."""


class _Stage(PipelineStage):
    """torch's stage, except that with a `watcher` an FSDP stage's last backward of the step reduces its gradients.

    torch runs every micro-batch's backward without gradient sync and reduces the whole stage afterwards
    (`perform_reduce_grad`: each FSDP group's post-backward, then the division by n_micro). Here the stage's last
    full backward runs with FSDP's sync switched on by the same setters torch's reduction and the non-pipelined
    engine's last micro-batch use (`set_micro_batch_sync`), so each FSDP unit reduce-scatters inside backward as
    its gradients complete, the sum being the same (every earlier micro-batch accumulated unsharded, the last
    adds to it, then one reduce-scatter). `perform_reduce_grad` then finds no unreduced gradient (FSDP's
    post-backward is idempotent) and divides; the watcher hears of the division. Split (zero-bubble) backwards
    keep torch's path: their weight pass is not where FSDP's per-unit hooks reduce.
    """

    def __init__(self, *args: Any, watcher: LastBackwardWatcher | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watcher = watcher

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
                                   ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if (self.watcher is None or not last_backward or backward_type != "full"
                or not isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        self.watcher.arm(True)
        try:
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        finally:
            self.watcher.arm(False)
        return grads, None

    def scale_grads(self, grad_scale_factor: int) -> None:
        super().scale_grads(grad_scale_factor)
        if self.watcher is not None and grad_scale_factor != 1:
            self.watcher.grads_divided(self.submod, grad_scale_factor)


def build_schedule(parts: Sequence[torch.nn.Module], stage_ids: Sequence[int], n_stages: int,
                   pp_group: dist.ProcessGroup, device: torch.device, schedule: str, n_micro: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   watcher: LastBackwardWatcher | None = None) -> _PipelineSchedule:
    """The named schedule over this rank's stages; with `watcher`, FSDP stages reduce in their last backward
    (`_Stage`) and tell the watcher."""
    stages = [_Stage(part, sid, n_stages, device, group=pp_group, watcher=watcher)
              for part, sid in zip(parts, stage_ids)]
    spec = schedule_spec(schedule)
    cls = get_schedule_class(spec.torch_class)
    if spec.shape == "single":
        assert issubclass(cls, PipelineScheduleSingle) and len(stages) == 1
        return cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=True)  # type: ignore[call-arg, arg-type]


def run_schedule(schedule: _PipelineSchedule, stage_ids: Sequence[int], n_stages: int, inputs: torch.Tensor,
                 labels: torch.Tensor, *, train: bool = True, model_kwargs: dict[str, torch.Tensor] | None = None
                 ) -> list[torch.Tensor]:
    """One step (or forward-only pass) over the whole rank batch; returns the last stage's per-micro losses.

    `model_kwargs` (whole-batch tensors, e.g. document ids) reach every stage's forward: the schedule splits
    keyword arguments into micro-batches along dim 0 exactly as it splits the inputs, on every rank, so later
    stages get them without any send/receive (each rank of a replica holds the replica's batch).
    """
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    losses: list[torch.Tensor] = []
    args: tuple[Any, ...] = (inputs,) if first else ()
    kwargs: dict[str, Any] = dict(model_kwargs or {})
    if last:
        kwargs.update(target=labels, losses=losses)
    if train:
        schedule.step(*args, **kwargs, **outputs_not_kept(schedule))
    else:
        schedule.eval(*args, **kwargs)
    return losses


def outputs_not_kept(schedule: _PipelineSchedule) -> dict[str, Any]:
    """The `step` argument that stops the last stage from keeping every micro-batch's output (the logits).

    By default torch's schedules append each micro-batch's output to `output_chunks` and merge them when the
    step returns; the engine reads only the losses, so on the last stage that kept one logits tensor per
    micro-batch alive until the next step began (3.9 GiB per rank on Llama-3.1-405B). `return_outputs=False`
    (torch >= 2.10, every schedule class) stops the saving; the output a backward needs is still held by the
    stage's own forward cache until that micro-batch's backward. Older torch has no such argument: outputs kept.
    """
    accepts = "return_outputs" in inspect.signature(schedule.step).parameters
    return {"return_outputs": False} if accepts else {}


class TiedEmbeddings:
    """A tied embedding and head on different pipeline stages: each holds its own copy, and after backward the
    two gradient pieces are added so both copies take the same step (as the 1-process model's one tensor). The
    last stage's embedding copy for multi-token prediction is synced the same way (`head` is then that copy, or
    the tied head, which is the same tensor there).

    A V schedule puts stage 0 and the last stage on pp rank 0 (added in place); otherwise they sit on pp ranks 0
    and pp-1 (looped schedules too), which swap their pieces point-to-point. Middle ranks take no part.
    """

    def __init__(self, embedding: torch.Tensor | None, head: torch.Tensor | None, local: bool,
                 pp_group: dist.ProcessGroup, peer: int) -> None:
        self.embedding, self.head = embedding, head
        self.local, self.pp_group, self.peer = local, pp_group, peer

    @classmethod
    def between_stages(cls, parts: Sequence[nn.Module], stage_ids: Sequence[int], n_stages: int, schedule: str,
                       pp_mesh: DeviceMesh, pp_rank: int) -> TiedEmbeddings:
        embedding = head = None
        if 0 in stage_ids:
            tok = parts[stage_ids.index(0)].tok_embeddings
            assert isinstance(tok, nn.Embedding)
            embedding = tok.weight
        if n_stages - 1 in stage_ids:
            last = parts[stage_ids.index(n_stages - 1)]
            out = last.output if last.tok_embeddings is None else last.tok_embeddings  # MTP: the embedding copy
            assert isinstance(out, (nn.Linear, nn.Embedding))
            head = out.weight
        pp_ranks = pp_mesh.mesh.flatten().tolist()
        peer = pp_ranks[-1] if pp_rank == 0 else pp_ranks[0]
        return cls(embedding, head, schedule_spec(schedule).shape == "v", pp_mesh.get_group(), peer)

    def sync_grads(self) -> None:
        if self.local:
            if self.embedding is None or self.head is None:
                return  # a middle rank of the V
            g_emb, _ = local_grad(self.embedding)
            g_out, _ = local_grad(self.head)
            g_emb.add_(g_out)
            g_out.copy_(g_emb)
            return
        param = self.embedding if self.embedding is not None else self.head
        if param is None:
            return  # a middle pp rank holds neither copy
        g, _ = local_grad(param)
        other = torch.empty_like(g)
        ops = [dist.P2POp(dist.isend, g, self.peer, self.pp_group),
               dist.P2POp(dist.irecv, other, self.peer, self.pp_group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        g.add_(other)  # a + b == b + a bitwise: both copies stay identical
