"""Communication logger: bytes per collective per mesh axis per step.

While active, wraps the `torch.distributed` collectives (FSDP2, DDP-style all-reduce, pipeline p2p, clipping)
and watches functional collectives (`_c10d_functional.*`, used by DTensor tensor parallelism) with a dispatch
mode. Each call is attributed to the mesh axis whose process group it ran on and recorded as the payload
bytes the op moves through this rank and, with ring algorithms, its wire bytes per rank:
all-reduce 2(N-1)/N x buffer, all-gather / reduce-scatter (N-1)/N x full buffer, all-to-all (N-1)/N x buffer,
send/recv 1 x buffer.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_WRAPPED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
            "send", "recv", "isend", "irecv", "all_gather")


def wire_factor(op: str, n: int) -> float:
    """Bytes on the wire per rank per byte of the (full) buffer, ring algorithms."""
    if n <= 1:
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n
    if op in ("send", "recv", "isend", "irecv", "p2p"):
        return 1.0
    return (n - 1) / n


class CommLogger:
    """Counts bytes per (axis, op). `axes` maps process groups to axis names (others are 'other')."""

    def __init__(self, axes: dict[Any, str] | None = None) -> None:
        # Keyed by group name: sub-mesh lookups may hand back different Python wrappers of one process group.
        self.axes = {_name(g): axis for g, axis in (axes or {}).items()}
        self.groups = {_name(g): g for g in (axes or {})}
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.payload: dict[tuple[str, str], int] = defaultdict(int)
        self.wire: dict[tuple[str, str], float] = defaultdict(float)
        self._originals: dict[str, Callable[..., Any]] = {}

    def axis_of(self, group: Any) -> str:
        if group is not None and _name(group) in self.axes:
            return self.axes[_name(group)]  # checked first: an axis spanning the world may use the WORLD group
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return "other"

    def record(self, op: str, group: Any, full_bytes: int) -> None:
        n = dist.get_world_size(group) if group is not None else dist.get_world_size()
        key = (self.axis_of(group), op)
        self.calls[key] += 1
        self.payload[key] += full_bytes
        self.wire[key] += full_bytes * wire_factor(op, n)

    def _wrap(self, name: str) -> None:
        original = getattr(dist, name)
        self._originals[name] = original

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
            if name in ("all_gather_into_tensor", "all_to_all_single") and tensor is not None:
                size = tensor.numel() * tensor.element_size()  # the output is the full buffer
            elif name == "reduce_scatter_tensor":
                inp = args[1] if len(args) > 1 else kwargs["input"]
                size = inp.numel() * inp.element_size()
            elif name == "all_gather" and args:
                size = sum(t.numel() * t.element_size() for t in args[0])
            else:
                size = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            if name in ("send", "recv", "isend", "irecv") and group is None and len(args) > 2:
                group = args[2]
            self.record(name, group, size)
            return original(*args, **kwargs)

        setattr(dist, name, wrapper)

    @contextlib.contextmanager
    def active(self) -> Iterator[CommLogger]:
        """Count every collective issued inside the block."""
        for name in _WRAPPED:
            self._wrap(name)
        mode = _FunctionalCollectives(self)
        try:
            with mode:
                yield self
        finally:
            for name, original in self._originals.items():
                setattr(dist, name, original)
            self._originals.clear()

    def reset(self) -> None:
        self.calls.clear()
        self.payload.clear()
        self.wire.clear()

    def summary(self) -> dict[str, float]:
        """Flat metrics: comm/<axis>/<op>/{bytes,wire_bytes,calls}."""
        out: dict[str, float] = {}
        for (axis, op), n in self.calls.items():
            out[f"comm/{axis}/{op}/calls"] = n
            out[f"comm/{axis}/{op}/bytes"] = self.payload[(axis, op)]
            out[f"comm/{axis}/{op}/wire_bytes"] = self.wire[(axis, op)]
        return out

    def wire_bytes(self, axes: tuple[str, ...] | None = None) -> float:
        return sum(v for (axis, _), v in self.wire.items() if axes is None or axis in axes)


class _FunctionalCollectives(TorchDispatchMode):
    """Sees the `_c10d_functional` ops DTensor issues; group names are resolved to axes by the logger."""

    def __init__(self, logger: CommLogger) -> None:
        super().__init__()
        self.logger = logger
        self.by_name = logger.groups

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if str(func).startswith("_c10d_functional.") and "wait" not in name and args:
            t = args[0]
            group = self.by_name.get(args[-1]) if isinstance(args[-1], str) else None
            if isinstance(t, torch.Tensor) and group is not None:
                n = dist.get_world_size(group)
                size = t.numel() * t.element_size() * (n if "all_gather" in name else 1)
                self.logger.record(name.replace("_tensor", "").replace("_into", ""), group, size)
        return func(*args, **kwargs)


def _name(group: Any) -> str:
    try:
        return str(group.group_name)
    except Exception:
        return str(id(group))


def mesh_axes(mesh: Any, names: tuple[str, ...]) -> dict[Any, str]:
    """{process group: axis name} for the size > 1 axes of `mesh`."""
    out: dict[Any, str] = {}
    for name in names:
        if mesh[name].size() > 1:
            out[mesh[name].get_group()] = name
    return out
