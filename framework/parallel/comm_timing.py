"""Timing of the collectives the communication logger (comm.py) sees: one `CollectiveTiming` per call, completed
from the work's future or the end of the wait that finished it (CPU), or from device events (CUDA); the hooks
on `Work.wait()` and `wait_tensor` that measure how long the compute side waited.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


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


def _storage(x: Any) -> int:
    x = payload(x)
    return x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else -1


def payload(x: Any) -> Any:
    """What a collective moves for `x`: a tensor subclass that wraps others (torchao's Float8TrainingTensor: FP8
    data of the outer shape, its dtype reported as the original bf16, and a scale) sends the inner tensors of its
    own shape, the data, which torchao's collective overrides pass on while the scale stays on the rank."""
    if isinstance(x, (list, tuple)):
        return type(x)(payload(t) for t in x)
    if not is_traceable_wrapper_subclass(x):
        return x
    inner = [getattr(x, name) for name in x.__tensor_flatten__()[0]]
    data = [t for t in inner if isinstance(t, torch.Tensor) and t.shape == x.shape]
    return payload(data[0]) if len(data) == 1 else x  # a DTensor (a shard inside) stays itself

