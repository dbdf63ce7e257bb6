"""A tensor-memory tracker that reads the same on real tensors (a gloo step) and fake ones (the dry run).

    tracker = MemoryTracker()
    with tracker:                       # a dispatch mode: sees every op's outputs, whoever issued it
        ...
        tracker.start_window()          # peak from here on (the measured step)
        with tracker.phase("forward"):  # allocations are labelled by the phase they happen in
            ...

What it counts: every storage an op returns, from its creation until its last reference dies (a weak
reference on the storage; torch keeps a storage's Python object alive as long as the storage lives), at its
byte size. FSDP2 grows and frees its all-gathered parameters by resizing storages it keeps
(`alloc_storage` / `free_storage`), which no op dispatch shows; those two functions are wrapped while the
tracker is active. Wrapper subclasses (DTensor) count their local tensors.

Categories: a storage's label is the phase it was created in ("forward" covers the whole forward-backward call;
what the autograd engine allocates inside it is "backward"), overridden by what created it — the output of
an all-to-all ("all_to_all"), a pipeline receive ("pipeline_recv"), FSDP's all-gathered parameters
("fsdp_gathered") — and relabelled by `label` (the step runner names parameters, gradients and optimizer
states before the window). At each new peak the per-category bytes are copied: the breakdown *at* the peak.
What it does not count: memory outside tensors (NCCL buffers, kernel workspace, the caching allocator's
rounding and fragmentation); framework/dryrun/report.py adds those as stated terms.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

_FSDP_MODULES = ("torch.distributed.fsdp._fully_shard._fsdp_param",
                 "torch.distributed.fsdp._fully_shard._fsdp_param_group")
# op name (last part of the schema name) -> the schema argument holding the buffer it fills, and its label
_FILLS: dict[str, tuple[str, str]] = {
    "alltoall_base_": ("output", "all_to_all"),
    "alltoall_": ("output_tensors", "all_to_all"),
    "recv_": ("tensors", "pipeline_recv"),
    "_allgather_base_": ("output_tensor", "collective_buffers"),
    "allgather_into_tensor_coalesced_": ("outputs", "collective_buffers"),
    "_reduce_scatter_base_": ("input_tensor", "collective_buffers"),
    "reduce_scatter_tensor_coalesced_": ("inputs", "collective_buffers"),
}


class OverBudget(Exception):
    """Live tensor bytes passed the tracker's limit: the step cannot fit, and tracing it further is wasted time."""

    def __init__(self, total: int, by_label: dict[str, int], phase: str) -> None:
        super().__init__(f"{total} live tensor bytes in phase {phase}")
        self.total, self.by_label, self.phase = total, by_label, phase


@dataclass
class _Entry:
    nbytes: int
    label: str
    ref: Any


def local_tensors(x: Any) -> Iterator[torch.Tensor]:
    """The plain tensors under `x` (a tensor, a wrapper subclass such as DTensor, or a list/tuple/dict of them)."""
    if isinstance(x, torch.Tensor):
        flatten = getattr(x, "__tensor_flatten__", None)
        if flatten is not None and type(x).__name__ != "FakeTensor":
            names, _ = flatten()
            for name in names:
                yield from local_tensors(getattr(x, name))
        else:
            yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from local_tensors(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from local_tensors(item)


def storage_key(t: torch.Tensor) -> int:
    return int(StorageWeakRef(t.untyped_storage()).cdata)


class MemoryTracker(TorchDispatchMode):
    """Live tensor bytes by category, their peak inside the window and the breakdown at that peak."""

    def __init__(self, limit: int | None = None) -> None:
        """`limit`: raise `OverBudget` from the op that takes live bytes past it (None: never)."""
        super().__init__()
        self.limit = limit
        self.over: OverBudget | None = None
        """Set when the limit was passed (the exception may reach the caller wrapped by autograd or pipelining)."""
        self.live: dict[int, _Entry] = {}
        self.by_label: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak = 0
        self.peak_by_label: dict[str, int] = {}
        self.peak_phase = ""
        self.label_max: dict[str, int] = {}
        """Each category's own largest live bytes inside the window, whenever it happened (not only at the peak)."""
        self.rise: dict[str, int] = {}
        """Per phase entered with `phase()`: its highest live bytes over the live bytes at its start (the last
        entry's), e.g. what the optimizer step adds to the states it begins with."""
        self._floor = 0
        self._phase = "setup"
        self._saved: dict[tuple[str, str], Any] = {}

    # --- bookkeeping ------------------------------------------------------------------------------------------
    def add(self, t: torch.Tensor, label: str | None = None) -> None:
        """Count `t`'s storage from now until it dies (no-op when already counted; meta tensors hold nothing)."""
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = int(StorageWeakRef(st).cdata)
        if key in self.live:
            return
        ref = weakref.ref(st, functools.partial(self._freed, key))
        entry = _Entry(int(st.nbytes()), label or self._phase, ref)
        self.live[key] = entry
        self._move(entry.label, entry.nbytes)

    def label(self, tensors: Iterable[torch.Tensor], label: str) -> None:
        """Count `tensors` (their local parts) under `label` from now on, adding them when not yet counted."""
        for t in tensors:
            for local in local_tensors(t):
                if local.device.type == "meta":
                    continue
                key = storage_key(local)
                entry = self.live.get(key)
                if entry is None:
                    self.add(local, label)
                elif entry.label != label:
                    self._move(entry.label, -entry.nbytes, peak=False)
                    entry.label = label
                    self._move(label, entry.nbytes, peak=False)

    def resized(self, t: torch.Tensor, label: str) -> None:
        """`t`'s storage changed size in place (FSDP2's alloc/free of all-gathered parameters)."""
        key = storage_key(t)
        entry = self.live.get(key)
        if entry is None:
            self.add(t, label)
            return
        new = int(t.untyped_storage().nbytes())
        self._move(entry.label, -entry.nbytes, peak=False)
        entry.nbytes, entry.label = new, label
        self._move(label, new)

    def _freed(self, key: int, _ref: Any) -> None:
        self._free(key)

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self._move(entry.label, -entry.nbytes, peak=False)

    def _move(self, label: str, nbytes: int, peak: bool = True) -> None:
        self.by_label[label] += nbytes
        self.total += nbytes
        if nbytes > 0 and self.by_label[label] > self.label_max.get(label, 0):
            self.label_max[label] = self.by_label[label]
        if self._phase in self.rise and self.total - self._floor > self.rise[self._phase]:
            self.rise[self._phase] = self.total - self._floor
        if peak and self.total > self.peak:
            self.peak = self.total
            self.peak_by_label = {k: v for k, v in self.by_label.items() if v}
            self.peak_phase = self._phase
            if self.limit is not None and self.total > self.limit and self.over is None:
                self.over = OverBudget(self.total, dict(self.peak_by_label), self._phase)
                raise self.over

    # --- windows and phases -----------------------------------------------------------------------------------
    def start_window(self) -> None:
        """Measure the peak from now on (what is live now is its floor)."""
        self.peak = self.total
        self.peak_by_label = {k: v for k, v in self.by_label.items() if v}
        self.label_max = dict(self.peak_by_label)
        self.peak_phase = self._phase

    def set_phase(self, name: str) -> None:
        self._phase = name

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, floor, self._phase = self._phase, self._floor, name
        self._floor, self.rise[name] = self.total, 0
        try:
            yield
        finally:
            self._phase, self._floor = before, floor

    # --- the dispatch mode ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name in _FILLS:
            arg, filled = _FILLS[name]
            bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
            self.label(local_tensors(bound.get(arg)), filled)
        # inside the autograd engine (a graph task is running): gradients, backward temporaries, recomputation
        label = "backward" if self._phase == "forward" and torch._C._current_graph_task_id() != -1 else None
        for t in local_tensors(out):
            self.add(t, label)
        return out

    def __enter__(self) -> MemoryTracker:
        import importlib

        for module_name in _FSDP_MODULES:
            module = importlib.import_module(module_name)
            for fn_name, label in (("alloc_storage", "fsdp_gathered"), ("free_storage", "fsdp_gathered")):
                original = getattr(module, fn_name, None)
                if original is None:
                    continue
                self._saved[(module_name, fn_name)] = original
                setattr(module, fn_name, self._wrap_resize(original, label))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import importlib

        super().__exit__(*exc)
        for (module_name, fn_name), original in self._saved.items():
            setattr(importlib.import_module(module_name), fn_name, original)
        self._saved.clear()

    def _wrap_resize(self, original: Any, label: str) -> Any:
        def wrapped(tensor: torch.Tensor) -> None:
            original(tensor)
            self.resized(tensor, label)

        return wrapped
