"""One rank of a full-size world in this process: torch.distributed's `fake` backend and FakeTensorMode.

    with fake_world(rank=r, world_size=2048, stage_input=meta) as fake:
        with fake:
            engine = ParallelEngine(...)    # the real recipe; every tensor a FakeTensor, no bytes allocated

The fake backend accepts every collective and moves nothing, so a rank's code runs unchanged while its peers
do not exist; FakeTensorMode gives every tensor its shape, dtype and device without storage. Four places in
torch and in the step read *values* that only a real world has; each is answered here, stated, and checked
where it can be:

1. `DeviceMesh` computes coordinates from an integer rank tensor (`nonzero`): mesh arithmetic runs outside
   FakeTensorMode (it is rank arithmetic, never data).
2. The pipeline's warm-up vote (`_PipelineSchedule._warmup_p2p`): stages without static shapes vote DYNAMIC
   and a real world agrees on DYNAMIC when any does; here every stage is given the mode its own metadata asks
   for (`InferenceMode.needs_dynamic`), which is the vote's result when all stages are built alike.
3. Cross-rank pipeline metadata (`PipelineStage._recv_meta`): the previous stage's output is the residual
   stream, (micro-batch, local sequence, hidden) in fp32; the next stage's gradient has the same metadata. What
   this rank's stages *send* is checked against that assumption, so a wrong guess stops the dry run
   (`DryRunError`) instead of measuring a different program; with every rank class dry-run, each stage's
   input is checked by its predecessor's send.
4. Scalars read from tensors (`.item()`, `float(loss)`, AdamW's step count): data-dependent reads of fake
   tensors answer 1 (a finite loss and gradient norm of 1: no clipping branch, no fp16 overflow skip).

And one bookkeeping fix: `to_empty` swaps fake or DTensor parameters in place (`torch.utils.swap_tensors`),
which weak references from FakeTensorMode's conversion caches forbid; those caches are emptied when a swap
meets one (they only save re-conversions).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from framework.base.errors import TesseraError


class DryRunError(TesseraError):
    """The dry run could not rehearse this layout faithfully (an assumption of framework/dryrun/fake.py failed)."""


@dataclass(frozen=True)
class StageInput:
    """What a pipeline stage receives from its predecessor: the residual stream of one micro-batch."""

    micro_batch: int
    tokens: int
    """Local sequence length: seq_len / cp, / tp under sequence parallelism."""
    hidden: int
    dtype: torch.dtype = torch.float32


@dataclass
class FakeWorld:
    """The fake-tensor mode to run the rank under, and what its pipeline stages sent (checked on the way)."""

    mode: FakeTensorMode
    sent_meta: list[str] = field(default_factory=list)


class DataDependentScalars(TorchDispatchMode):
    """Point 4 of the module docstring: a scalar read of a fake tensor answers 1."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is torch.ops.aten._local_scalar_dense.default:
                return 1.0 if args[0].dtype.is_floating_point else 1
            raise


def _tensor_meta(stage_input: StageInput, requires_grad: bool) -> Any:
    from torch.distributed.pipelining._utils import _TensorMeta

    shape = torch.Size([stage_input.micro_batch, stage_input.tokens, stage_input.hidden])
    stride = (stage_input.tokens * stage_input.hidden, stage_input.hidden, 1)
    return _TensorMeta(shape=shape, stride=stride, dtype=stage_input.dtype, requires_grad=requires_grad)


def _describe(metas: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(m.shape), m.dtype) for m in metas if m is not None]


def _drop_weak_caches(t: torch.Tensor) -> None:
    """Empty every weak-keyed or weak-valued cache that refers to `t` (FakeTensorMode's conversion caches)."""
    import gc

    for ref in weakref.getweakrefs(t):
        for table in gc.get_referrers(ref):
            for owner in gc.get_referrers(table) if isinstance(table, dict) else ():
                if isinstance(owner, (weakref.WeakValueDictionary, WeakIdKeyDictionary)):
                    owner.clear()


@contextlib.contextmanager
def _patched(world: FakeWorld, stage_input: StageInput | None) -> Iterator[None]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining._utils import InferenceMode, _StageBackwardMeta, _StageForwardMeta
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import PipelineStage

    saved = [(DeviceMesh, "__init__", DeviceMesh.__init__), (DeviceMesh, "mesh", DeviceMesh.__dict__["mesh"]),
             (_PipelineSchedule, "_warmup_p2p", _PipelineSchedule._warmup_p2p),
             (PipelineStage, "_recv_meta", PipelineStage._recv_meta),
             (PipelineStage, "_send_meta", PipelineStage._send_meta),
             (torch.utils, "swap_tensors", torch.utils.swap_tensors)]
    mesh_init, mesh_get = DeviceMesh.__init__, DeviceMesh.__dict__["mesh"].fget

    def init_outside_fake(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    def mesh_outside_fake(self: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            return mesh_get(self)  # type: ignore[no-any-return]

    def warmup(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        dynamic = any(InferenceMode.needs_dynamic(s._user_meta, has_backward) for s in stages)
        for s in stages:
            s._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    def recv_meta(self: Any, src_stage: int) -> Any:
        if stage_input is None:
            raise DryRunError("a pipeline stage asked for its peer's metadata but the dry run has no stage input")
        if src_stage < self.stage_index:
            return _StageForwardMeta(forward_metas=(_tensor_meta(stage_input, True),))
        return _StageBackwardMeta(backward_metas=(_tensor_meta(stage_input, False),))

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        metas = getattr(meta, "forward_metas", None) or getattr(meta, "backward_metas", ())
        got = _describe(metas)
        assert stage_input is not None
        want = _describe([_tensor_meta(stage_input, False)])
        world.sent_meta.append(f"stage {self.stage_index} -> {dst_stage}: {got}")
        if got != want:
            raise DryRunError(
                f"pipeline stage {self.stage_index} sends {got} to stage {dst_stage}, but the dry run gave its "
                f"stages {want} as their input (framework/dryrun/fake.py point 3): the measured program would "
                f"differ from the real one; report this layout")

    swap = torch.utils.swap_tensors

    def swap_unmemoized(t1: torch.Tensor, t2: torch.Tensor) -> None:
        # `to_empty` swaps fake or DTensor parameters in place, which a weak reference from FakeTensorMode's
        # real-to-fake conversion caches forbids; the caches only save re-conversions, so they start afresh
        try:
            swap(t1, t2)
        except RuntimeError:
            for t in (t1, t2):
                _drop_weak_caches(t)
            swap(t1, t2)

    torch.utils.swap_tensors = swap_unmemoized
    DeviceMesh.__init__ = init_outside_fake  # type: ignore[method-assign]
    DeviceMesh.mesh = property(mesh_outside_fake)  # type: ignore[method-assign, assignment]
    _PipelineSchedule._warmup_p2p = warmup  # type: ignore[method-assign]
    PipelineStage._recv_meta = recv_meta  # type: ignore[method-assign]
    PipelineStage._send_meta = send_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, stage_input: StageInput | None = None) -> Iterator[FakeWorld]:
    """The default process group as rank `rank` of `world_size` on the fake backend, torch patched as the module
    docstring says; torn down (and torch restored) on exit.

    Raises:
        DryRunError: a default process group already exists in this process.
    """
    if dist.is_initialized():
        raise DryRunError("a process group is already initialized in this process; the dry run needs its own "
                          "(run it in a fresh process: tessera dryrun)")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    world = FakeWorld(FakeTensorMode(allow_non_fake_inputs=True))
    try:
        with _patched(world, stage_input):
            yield world
    finally:
        dist.destroy_process_group()
