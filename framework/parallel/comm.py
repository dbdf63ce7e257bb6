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
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

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


@dataclass
class CollectiveTiming:
    """One collective: where it ran, what it moved, how long it was in flight and how much of that was waited."""

    axis: str
    op: str
    bytes: int
    issued: float
    """time.perf_counter() at the issue."""
    done: float | None = None
    """perf_counter() at completion (CPU); None until known."""
    exposed: float = 0.0
    """Seconds the issuing side was blocked waiting for it (CPU), or the compute stream stalled on it (CUDA)."""
    events: tuple[Any, Any] | None = None
    """(start, end) device events (CUDA): the in-flight time on the issuing stream."""
    device: torch.device | None = None
    """The accelerator the events were recorded on (None on CPU)."""
    stalls: list[tuple[Any, Any]] = field(default_factory=list)
    """(before, after) events around compute-stream waits attributed to it (CUDA)."""

    @property
    def seconds(self) -> float:
        """Issue to completion; NaN while unknown (never waited and not yet complete)."""
        if self.events is not None:
            start, end = self.events
            return float("nan") if end is None else start.elapsed_time(end) / 1e3
        return float("nan") if self.done is None else self.done - self.issued

    @property
    def exposed_s(self) -> float:
        if self.events is not None:  # stalls still open (never waited) are left out
            return self.exposed + sum(a.elapsed_time(b) for a, b in self.stalls if b is not None) / 1e3
        return self.exposed


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
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
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


class _WaitHooks:
    """While any logger is active: `Work.wait` (and, on accelerators, the compute stream's `wait_event`) note who
    waited how long. Process-wide, installed once however many loggers nest; loggers are per rank (process)."""

    lock = threading.Lock()
    depth = 0
    pending: ClassVar[dict[int, tuple[Any, CollectiveTiming]]] = {}  # id(Work) -> (the Work kept alive, its timing)
    last_side: ClassVar[list[CollectiveTiming]] = []  # accelerators: latest collective issued off the compute stream
    originals: ClassVar[dict[tuple[Any, str], Callable[..., Any]]] = {}  # (class, method) -> what was there before

    @classmethod
    def install(cls) -> None:
        with cls.lock:
            cls.depth += 1
            if cls.depth > 1:
                return
            work_cls = dist.distributed_c10d.Work
            cls.originals[(work_cls, "wait")] = work_cls.wait
            work_cls.wait = cls._work_wait  # type: ignore[method-assign, assignment]

    @classmethod
    def uninstall(cls) -> None:
        with cls.lock:
            cls.depth -= 1
            if cls.depth > 0:
                return
            for (owner, attr), original in cls.originals.items():
                setattr(owner, attr, original)
            cls.originals.clear()
            cls.pending.clear()
            cls.last_side.clear()

    @classmethod
    def track(cls, timing: CollectiveTiming, out: Any, start: Any, buffer: torch.Tensor | None,
              functional: dict[int, CollectiveTiming]) -> None:
        """After the op returned: remember its Work (c10d) or output (functional) so the wait can be timed."""
        work = out[-1] if isinstance(out, (tuple, list)) and out else out
        if isinstance(work, torch.ScriptObject):
            work = dist.distributed_c10d.Work.unbox(work)
        if start is not None and buffer is not None:
            timing.events, timing.device = (start, None), buffer.device
            cls._hook_stream(buffer.device)
        if isinstance(work, dist.distributed_c10d.Work):
            # Keeping this wrapper alive makes pybind hand the caller the same object, so wait() finds it by id.
            cls.pending[id(work)] = (work, timing)
            if timing.events is None:
                with contextlib.suppress(RuntimeError):  # gloo's reduce-scatter works have no future
                    work.get_future().add_done_callback(lambda _: _set_done(timing))
        elif isinstance(out, torch.Tensor):
            functional[_storage(out)] = timing
        if timing.events is not None:
            stream = torch.get_device_module(buffer.device).current_stream(buffer.device)  # type: ignore[union-attr]
            if stream == torch.get_device_module(buffer.device).default_stream(buffer.device):  # type: ignore[union-attr]
                timing.stalls.append((start, None))  # the compute stream itself waits: all of it is exposed
            else:
                cls.last_side[:] = [timing]

    @staticmethod
    def _work_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _WaitHooks.pending.pop(id(work), None)
        t0 = time.perf_counter()
        result = _WaitHooks.originals[(dist.distributed_c10d.Work, "wait")](work, *args, **kwargs)
        if entry is None:
            return result
        timing = entry[1]
        if timing.events is not None:  # device: the end event on the waiting stream, now behind NCCL's
            _close_events(timing)
            return result
        # Blocked until completion: the future's time where the work has one (the waiter's wake-up after it is
        # the host's, not the link's), else the end of the wait.
        t1 = time.perf_counter()
        timing.done = min(timing.done, t1) if timing.done is not None else t1
        timing.exposed += max(0.0, timing.done - t0)
        return result

    @classmethod
    def _hook_stream(cls, device: torch.device) -> None:
        stream_cls = type(torch.get_device_module(device).current_stream(device))
        with cls.lock:
            if (stream_cls, "wait_event") in cls.originals:
                return
            cls.originals[(stream_cls, "wait_event")] = original = stream_cls.wait_event

        def wait_event(stream: Any, event: Any) -> Any:
            module = torch.get_device_module(device)
            if not cls.last_side or stream != module.default_stream(stream.device):
                return original(stream, event)
            before = stream.record_event(module.Event(enable_timing=True))
            result = original(stream, event)
            after = stream.record_event(module.Event(enable_timing=True))
            cls.last_side[0].stalls.append((before, after))
            return result

        stream_cls.wait_event = wait_event


class _DeviceRef:
    """Stands in for a tensor where only the device is needed (`_device_event`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


def _close_events(timing: CollectiveTiming) -> None:
    """After the wait (the current stream now waits on the collective): its end event, closing open stalls."""
    assert timing.events is not None and timing.device is not None
    end = _device_event(_DeviceRef(timing.device))
    timing.events = (timing.events[0], end)
    timing.stalls[:] = [(a, end) if b is None else (a, b) for a, b in timing.stalls]


def _device_event(x: Any) -> Any:
    """A timing event recorded now on the current stream of x's accelerator; None on CPU."""
    if x is None or x.device.type == "cpu":
        return None
    module = torch.get_device_module(x.device)
    return module.current_stream(x.device).record_event(module.Event(enable_timing=True))


def _set_done(timing: CollectiveTiming) -> None:
    now = time.perf_counter()
    timing.done = now if timing.done is None else min(timing.done, now)


def _first(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        return next((t for t in map(_first, x) if t is not None), None)
    return None


def _storage(x: Any) -> int:
    return x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else -1


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
