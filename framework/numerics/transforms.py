"""The one ordered list of model transforms, applied by both engines at the same point of building a model.

A transform changes how a built model computes without changing its parameters' values or FQNs' meaning:
torch.compile and FP8 linears. `LocalEngine` applies the list to its whole model right after initialization;
`parallelize` applies it to each pipeline stage at the same point of the recipe (after TP/EP/CP and activation
checkpointing, before FSDP wraps the blocks), so the 1-process reference runs exactly the transforms a layout
runs. A `meta_safe` transform (fp8; not compile yet, see `_compile`) runs there on the meta model, and the
weights are allocated and drawn after FSDP, as shards; any other makes `parallelize` initialize them before it
(then an FSDP rank holds full weights at start). Adding one is a `register_transform` call:

    register_transform("probe", build_probe, before="compile")

Each entry builds its transform from the run's `TransformSettings` (the train section satisfies it) or returns
None when the run does not ask for it; `model_transforms` lists the ones a run applies, in table order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from framework.numerics.config import FP8Config
from models.decoder import Decoder


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
    device: torch.device | None = None
    """Where the weights will live; None: where they are. A meta-safe transform reads the device from here."""


@dataclass(frozen=True)
class ModelTransform:
    name: str
    apply: Callable[[Decoder, Site], Any]
    """Transform a Decoder (or pipeline stage) in place."""
    meta_safe: bool = False
    """It only rewrites modules and never reads a weight's value or device, so `parallelize` may apply it to the
    meta model: FSDP then shards on meta and each rank allocates and draws only its shards. A transform that is
    not meta-safe (the default) sees initialized weights, and FSDP ranks of such runs hold full weights at start."""


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


def _compile(settings: TransformSettings) -> ModelTransform | None:
    """`train.compile`: each block compiled (framework/parallel/compile.py)."""
    if not settings.compile:
        return None
    from framework.parallel.compile import compile_blocks

    backend = settings.compile_backend
    return ModelTransform("compile", lambda model, site: compile_blocks(
        model.layers, backend, tensor_parallel=site.tensor_parallel, fullgraph=not site.graph_breaks),
        meta_safe=False)
    # Not meta-safe yet, although torch.compile only traces at the first forward: built on meta, the TP2 x MoE
    # compiled layout (tests/parallel/test_compile.py) changed its step-0 grad norm by 5e-4 relative (forward
    # bitwise the same); every other compiled layout stayed bitwise. Until that is attributed, compiled runs
    # initialize before FSDP (their FSDP ranks draw full weights at start).


def _fp8(settings: TransformSettings) -> ModelTransform | None:
    """`train.fp8`: chosen linears train in FP8 through torchao (fp8.py); before compile, which traces them."""
    if not settings.fp8.enabled:
        return None
    from framework.numerics.fp8 import convert_to_fp8

    cfg = settings.fp8
    # torchao swaps modules and keeps the weight Parameters (torchtitan converts its meta model the same way)
    return ModelTransform("fp8", lambda model, site: convert_to_fp8(model, cfg, device=site.device), meta_safe=True)


register_transform("fp8", _fp8)
register_transform("compile", _compile)
