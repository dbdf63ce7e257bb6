"""The one ordered list of model transforms, applied by both engines at the same point of building a model.

A transform changes how a built, initialized model computes without changing its parameters' values or FQNs'
meaning: torch.compile today, FP8 linears beside it. `LocalEngine` applies the list to its whole model right
after initialization; `parallelize` applies it to each pipeline stage at the same point of the recipe (after
TP/EP/CP, init and activation checkpointing, before FSDP wraps the blocks), so the 1-process reference runs
exactly the transforms a layout runs. Adding one is a `register_transform` call:

    register_transform("probe", build_probe, before="compile")

Each entry builds its transform from the run's `TransformSettings` (the train section satisfies it) or returns
None when the run does not ask for it; `model_transforms` lists the ones a run applies, in table order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from framework.numerics.config import FP8Config
from models.decoder import Decoder
from models.plans import Plan


class TransformSettings(Protocol):
    """What a transform may read of the run (framework/train/config.py `TrainConfig` is one)."""

    @property
    def compile(self) -> bool: ...

    @property
    def compile_backend(self) -> str: ...

    @property
    def fp8(self) -> FP8Config: ...


@dataclass(frozen=True)
class Site:
    """Where a transform runs: the 1-process model or one stage of a parallel layout."""

    tensor_parallel: bool = False
    """The stage's linears are TP-sharded DTensors (compile then compiles sub-layer regions)."""
    graph_breaks: bool = False
    """Blocks call an eager region (the cp ring exchange): compile lets its graphs break there (not fullgraph)."""
    device_type: str = "cpu"
    """Where the model will run (a parallel stage may still be on the meta device when a module swap sees it)."""


@dataclass(frozen=True)
class ModelTransform:
    name: str
    apply: Callable[[Decoder, Site], Any]
    """Transform a Decoder (or pipeline stage) in place."""
    before_sharding: bool = False
    """A module swap that needs no values and must see the modules before TP shards them (FP8's linears: the TP
    styles attach hooks to the modules they shard, so a later swap would drop them). `parallelize` applies it to
    the meta-device stage before step 3; `LocalEngine` at its usual point (no sharding there)."""
    reads_values: bool = True
    """Applied after sharding (not `before_sharding`), it reads the weights' values, so `parallelize` materializes
    the stage before it (FSDP's shards then drawn whole). False for compile, which only wraps the modules and
    traces at the first forward: the stage stays on the meta device until every sharding is done."""
    tp_plan: Callable[[nn.Module, Plan, DeviceMesh], Plan] | None = None
    """How TP must shard the modules this transform swapped: the plan for `module` (a block, a stage's top or
    an MTP depth) with its styles replaced where needed (FP8's styles cast before their all-gathers)."""


Builder = Callable[[TransformSettings], ModelTransform | None]
TRANSFORMS: dict[str, Builder] = {}
"""Every known transform by name, in the order they are applied (fill it through `register_transform`)."""


def register_transform(name: str, build: Builder, *, before: str | None = None) -> None:
    """Add `name` to the list, at the end or just before the entry `before`."""
    if name in TRANSFORMS:
        raise ValueError(f"model transform {name!r} is already registered")
    items = list(TRANSFORMS.items())
    at = [k for k, _ in items].index(before) if before is not None else len(items)
    items.insert(at, (name, build))
    TRANSFORMS.clear()
    TRANSFORMS.update(items)


def unregister_transform(name: str) -> None:
    TRANSFORMS.pop(name)


def model_transforms(settings: TransformSettings) -> list[ModelTransform]:
    """The transforms `settings` asks for, in the order the list applies them."""
    built = (build(settings) for build in TRANSFORMS.values())
    return [t for t in built if t is not None]


def apply_model_transforms(model: Decoder, transforms: Sequence[ModelTransform], site: Site) -> None:
    for transform in transforms:
        transform.apply(model, site)


def restyle_tp_plan(transforms: Sequence[ModelTransform], module: nn.Module, plan: Plan, tp_mesh: DeviceMesh
                    ) -> Plan:
    """`plan` for `module` as every transform that swapped its modules needs it sharded (`ModelTransform.tp_plan`)."""
    for transform in transforms:
        if transform.tp_plan is not None:
            plan = transform.tp_plan(module, plan, tp_mesh)
    return plan


def _compile(settings: TransformSettings) -> ModelTransform | None:
    """`train.compile`: each block compiled (framework/parallel/compile.py)."""
    if not settings.compile:
        return None
    from framework.parallel.compile import compile_blocks

    backend = settings.compile_backend
    return ModelTransform("compile", lambda model, site: compile_blocks(
        model.layers, backend, tensor_parallel=site.tensor_parallel, fullgraph=not site.graph_breaks),
        reads_values=False)


def _fp8(settings: TransformSettings) -> ModelTransform | None:
    """`train.fp8`: chosen linears train in FP8 through torchao (fp8.py); before compile, which traces them."""
    if not settings.fp8.enabled:
        return None
    from framework.numerics.fp8 import convert_to_fp8, fp8_tp_plan

    cfg = settings.fp8
    return ModelTransform("fp8", lambda model, site: convert_to_fp8(model, cfg, site.device_type),
                          before_sharding=True, tp_plan=lambda module, plan, mesh: fp8_tp_plan(module, plan, mesh, cfg))


register_transform("fp8", _fp8)
register_transform("compile", _compile)
