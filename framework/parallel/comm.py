"""Communication logger: bytes per collective per mesh axis per step.

While active, a dispatch mode sees every collective at the operator level, whoever issued it:
- `c10d.*` ops: every `ProcessGroup` method dispatches one (`dist.all_reduce` of DDP-style sync and
  clipping, FSDP2's `all_gather_single` / `reduce_scatter_single`, pipeline `isend`/`irecv`,
  `batch_isend_irecv`), so FSDP2 is counted whichever `torch.distributed` function it binds;
- `_c10d_functional.*` ops: DTensor tensor parallelism and the autograd-aware all-to-all of expert parallelism.
A dispatch mode is popped while it handles an op, so the `c10d` op a functional collective runs underneath is
not seen again: each collective is counted exactly once. Each call is attributed to the mesh axis whose process
group it ran on and recorded as the full buffer it moves (the all-gathered output, the reduce-scattered input)
and, with ring algorithms, its wire bytes per rank: all-reduce 2(N-1)/N x buffer, all-gather / reduce-scatter /
all-to-all / broadcast (N-1)/N x buffer, send/recv 1 x buffer.

Timing (`CommLogger.timings`, one `CollectiveTiming` per call in issue order; `seconds` and `exposed_s` per
(axis, op) in `summary()`): how long each collective was in flight and how much of it the compute side waited.
- CPU (gloo): `seconds` runs from the issue to completion (the work's future, or the end of the wait that
  finished it); `exposed_s` is the time the issuing side spent blocked in `Work.wait()` until completion
  (`wait_tensor` for functional collectives). A synchronous call (FSDP2's reduce-scatter, an all-gather
  without async unshard) waits at once: exposed = seconds. An async all-gather prefetched a unit ahead waits
  only for what is left.
- CUDA (NCCL): `Work.wait()` does not block the host, so both come from device events: `seconds` from an event
  on the issuing stream before the op to one after its wait (which makes that stream wait on NCCL's); for a
  collective issued on the compute (default) stream the compute stream stalls for all of it, for one issued on
  a side stream (FSDP2's all-gather and reduce-scatter streams) `exposed_s` is the stall of the compute stream
  at its next `wait_event` (an event before and after the wait). The per-step sum is exact; a stall is
  attributed to the latest collective issued before it. Resolved, with one synchronize, when read.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from framework.parallel.comm_timing import (
    CollectiveTiming,
    _close_events,
    _device_event,
    _storage,
    _WaitHooks,
    payload,
)

# op name -> (recorded kind, schema argument holding the full buffer); barriers move no data and are left out.
_C10D: dict[str, tuple[str, str]] = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "recv_any_source_": ("recv", "tensors"),
}
# Functional collectives take the local input; an all-gather's full buffer is group_size x that.
_FUNCTIONAL: dict[str, str] = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast", "isend": "send", "irecv": "recv",
}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


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
    """Counts bytes per (axis, op). `axes` maps process groups to axis names (others are 'world' or 'other')."""

    def __init__(self, axes: dict[Any, str] | None = None) -> None:
        # Keyed by group name: sub-mesh lookups may hand back different Python wrappers of one process group.
        self.axes = {_name(g): axis for g, axis in (axes or {}).items()}
        # and by members, for a group of the same ranks under another name: a second engine in one process (the
        # ground-truth test's world) ran its TP collectives on the tp group an earlier layout had created
        self.axes_by_ranks = {r: axis for g, axis in reversed(list((axes or {}).items())) if (r := _ranks(g))}
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.payload: dict[tuple[str, str], int] = defaultdict(int)
        self.wire: dict[tuple[str, str], float] = defaultdict(float)
        self.dtypes: dict[tuple[str, str], set[torch.dtype]] = defaultdict(set)
        """The dtypes of the buffers each (axis, op) actually moved (e.g. FSDP's bf16 parameter all-gathers)."""
        self.buffers: dict[tuple[str, str], set[tuple[torch.dtype, tuple[int, ...]]]] = defaultdict(set)
        """The distinct (dtype, shape) of the full buffers each (axis, op) moved (ZeRO++'s int8 ones, say)."""
        self.timings: list[CollectiveTiming] = []
        """Every collective since the last reset, in issue order (the bucket timeline; module docstring)."""

    def axis_of(self, group: Any) -> str:
        if group is not None and _name(group) in self.axes:
            return self.axes[_name(group)]  # checked first: an axis spanning the world may use the WORLD group
        if group is None or _name(group) == _name(dist.group.WORLD):
            return "world"
        axis = self.axes_by_ranks.get(_ranks(group))
        if axis is not None:
            self.axes[_name(group)] = axis
            return axis
        return "other"

    def record(self, op: str, group: Any, full_bytes: int, dtypes: set[torch.dtype] | None = None,
               buffers: set[tuple[torch.dtype, tuple[int, ...]]] | None = None) -> CollectiveTiming:
        n = group.size() if group is not None else dist.get_world_size()
        key = (self.axis_of(group), op)
        timing = CollectiveTiming(key[0], op, full_bytes, time.perf_counter())
        self.timings.append(timing)
        self.dtypes[key] |= dtypes or set()
        self.buffers[key] |= buffers or set()
        self.calls[key] += 1
        self.payload[key] += full_bytes
        self.wire[key] += full_bytes * wire_factor(op, n)
        return timing

    @contextlib.contextmanager
    def active(self) -> Iterator[CommLogger]:
        """Count every collective issued inside the block (on this thread and the autograd threads it drives)."""
        with _CollectiveCounter(self):
            yield self

    def reset(self) -> None:
        self.calls.clear()
        self.payload.clear()
        self.wire.clear()
        self.dtypes.clear()
        self.buffers.clear()
        self.timings.clear()

    def resolved_timings(self) -> list[CollectiveTiming]:
        """`timings`, with device events synchronized so `seconds` / `exposed_s` can be read."""
        devices = {t.device for t in self.timings if t.device is not None}
        for device in devices:
            torch.get_device_module(device).synchronize(device)
        return list(self.timings)

    def summary(self) -> dict[str, float]:
        """Flat metrics: comm/<axis>/<op>/{bytes,wire_bytes,calls,seconds,exposed_s}, and comm/exposed_s in all.

        seconds / exposed_s sum the collectives whose completion is known (module docstring)."""
        out: dict[str, float] = {}
        for (axis, op), n in self.calls.items():
            out[f"comm/{axis}/{op}/calls"] = n
            out[f"comm/{axis}/{op}/bytes"] = self.payload[(axis, op)]
            out[f"comm/{axis}/{op}/wire_bytes"] = self.wire[(axis, op)]
            out[f"comm/{axis}/{op}/seconds"] = out[f"comm/{axis}/{op}/exposed_s"] = 0.0
        for t in self.resolved_timings():
            seconds = t.seconds
            if seconds == seconds:  # not NaN
                out[f"comm/{t.axis}/{t.op}/seconds"] += seconds
            out[f"comm/{t.axis}/{t.op}/exposed_s"] += t.exposed_s
        if self.timings:
            out["comm/exposed_s"] = sum(t.exposed_s for t in self.timings)
        return out

    def wire_bytes(self, axes: tuple[str, ...] | None = None, ops: tuple[str, ...] | None = None) -> float:
        return sum(v for (axis, op), v in self.wire.items()
                   if (axes is None or axis in axes) and (ops is None or op in ops))


class _CollectiveCounter(TorchDispatchMode):
    """Records `c10d` and `_c10d_functional` ops on the logger; every other op passes straight through."""

    def __init__(self, logger: CommLogger) -> None:
        super().__init__()
        self.logger = logger
        self.functional: dict[int, CollectiveTiming] = {}  # output storage -> its functional collective

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo compiles under this mode (else it skips every compiled frame and comm_log runs eager): the
        mode is off while dynamo traces, on while the compiled code runs, whose collectives are op calls too."""
        return True

    def __enter__(self) -> _CollectiveCounter:
        _WaitHooks.install()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _WaitHooks.uninstall()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        if namespace in _FUNCTIONAL_NAMESPACES and func._schema.name.endswith("::wait_tensor"):
            return self._wait_tensor(func, args, kwargs)
        if namespace != "c10d" and namespace not in _FUNCTIONAL_NAMESPACES:
            return func(*args, **kwargs)
        timing, buffer = self._record(func, namespace, args, kwargs)
        start = _device_event(buffer)
        out = func(*args, **kwargs)
        if timing is not None:
            _WaitHooks.track(timing, out, start, buffer, self.functional)
        return out

    def _wait_tensor(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        timing = self.functional.pop(_storage(args[0] if args else kwargs.get("tensor")), None)
        if timing is not None and timing.events is not None:
            _close_events(timing)
        elif timing is not None:
            timing.done = time.perf_counter()
            timing.exposed += timing.done - t0
        return out

    def _record(self, func: Any, namespace: str, args: Any, kwargs: dict[str, Any]
                ) -> tuple[CollectiveTiming | None, torch.Tensor | None]:
        name = func._schema.name.split("::")[-1]
        bound = {a.name: payload(v) for a, v in (*zip(func._schema.arguments, args), *kwargs.items())}
        if namespace == "c10d":
            if name not in _C10D:
                return None, None
            kind, buffer = _C10D[name]
            group = _unbox(bound.get("process_group"))
            full = bound.get(buffer)
            return self.logger.record(kind, group, _nbytes(full), _dtypes(full), _buffers(full)), _first(full)
        if name not in _FUNCTIONAL:
            return None, None
        kind = _FUNCTIONAL[name]
        group = _unbox(bound.get("group_name"))
        local = bound.get("input", bound.get("inputs", bound.get("tensor")))
        size = _nbytes(local)
        buffers = _buffers(local)
        if kind == "all_gather":
            size *= int(bound["group_size"])
            buffers = {(dtype, (int(bound["group_size"]), *shape)) for dtype, shape in buffers}
        return self.logger.record(kind, group, size, _dtypes(local), buffers), _first(local)


def _first(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        return next((t for t in map(_first, x) if t is not None), None)
    return None


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _dtypes(x: Any) -> set[torch.dtype]:
    if isinstance(x, torch.Tensor):
        return {x.dtype}
    if isinstance(x, (list, tuple)):
        return set().union(*(_dtypes(t) for t in x)) if x else set()
    return set()


def _buffers(x: Any) -> set[tuple[torch.dtype, tuple[int, ...]]]:
    if isinstance(x, torch.Tensor):
        return {(x.dtype, tuple(x.shape))}
    if isinstance(x, (list, tuple)):
        return set().union(*(_buffers(t) for t in x)) if x else set()
    return set()


def _unbox(group: Any) -> dist.ProcessGroup | None:
    """The ProcessGroup behind an op argument: a TorchScript-boxed group or a group name."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        from torch._C._distributed_c10d import _resolve_process_group

        resolve: Any = _resolve_process_group  # takes a GroupName (a str NewType in newer torch)
        return resolve(group)
    return dist.ProcessGroup.unbox(group)


def _ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a group (empty where they cannot be read, e.g. a TorchScript-boxed fake group)."""
    try:
        return tuple(dist.get_process_group_ranks(_unbox(group)))  # type: ignore[arg-type]
    except Exception:
        return ()


def _name(group: Any) -> str:
    try:
        return str(group.group_name)
    except Exception:
        return str(id(group))


def layout_axes(mesh: Any, parts: Any) -> dict[Any, str]:
    """{process group: axis name} for every group a training engine's collectives run on: the mesh's axes, the
    expert mesh's ep and edp groups (MoE; the expert units' FSDP and Muon traffic runs on edp) and ZeRO++'s."""
    from framework.parallel.mesh import _EXPERT_MESH, AXES, EP_AXES
    from framework.parallel.zero import zeropp_axes

    axes = mesh_axes(mesh, AXES) | zeropp_axes(parts)
    ep_mesh = getattr(mesh, _EXPERT_MESH, None)
    if ep_mesh is not None:
        axes |= {g: a for g, a in mesh_axes(ep_mesh, EP_AXES).items() if a in ("ep", "edp")}
    return axes


def mesh_axes(mesh: Any, names: tuple[str, ...]) -> dict[Any, str]:
    """{process group: axis name} for the size > 1 axes of `mesh`, and its dp_shard x tp group ("dp_shard_tp",
    Muon's overlapped owner exchange under FSDP x TP) where `ParallelDims.build_mesh` made one."""
    from framework.parallel.mesh import dp_tp_group

    out: dict[Any, str] = {}
    for name in names:
        if mesh[name].size() > 1:
            out[mesh[name].get_group()] = name
    if dp_tp_group(mesh) is not None:
        out[dp_tp_group(mesh)] = "dp_shard_tp"
    return out
