"""ZeRO-0 / DDP: gradients averaged over the replica group in buckets, all-reduced while backward still runs.

    sync = ReplicatedGradSync(params, group, size, bucket_bytes=25 * 2**20)
    sync.arm(last_micro_batch)   # before each micro-batch's backward (the engine's own micro-batch loop)
    loss.backward()              # a bucket's async all-reduce starts as soon as its last gradient is accumulated
    sync()                       # after backward: launch what is left, wait, divide by size, copy back
    sync.listeners.append(fn)    # optional: fn(bucket's params) once their averaged gradients are back

Buckets follow torch DDP and Megatron (~25-40 MB): parameters in reverse registration order (close to the order
backward produces their gradients), cut per dtype and device where a bucket would pass `bucket_bytes`. A bucket
is launched from the post-accumulate-grad hook of its last parameter on the armed (last) micro-batch, so the
all-reduce of late layers overlaps the backward of early ones; gradients accumulate untouched across the earlier
micro-batches. Unarmed (a pipeline schedule owns the backward loop and scales gradients after it), every bucket
is launched at `__call__`, still one bucket at a time in flight rather than one concatenation of every gradient.

With `listeners` (Muon's owner exchange over tp, framework/train/muon_overlap.py), a bucket is finished (waited,
averaged, copied back) from backward as soon as the next bucket launches, and the listeners get its parameters
there: their gradients are final from then on, one bucket's backward after their all-reduce started. The rest
are finished, and announced, at `__call__`. On CUDA that finish runs on a side stream which first waits for the
current one (where the bucket's copy was enqueued), so backward's compute never waits for an all-reduce; the
listeners run inside that stream's context (a collective they launch is ordered after the averaged gradients),
and `__call__` makes the current stream wait for the side stream before anything reads a gradient. The streams
are the device module's (`torch.get_device_module`), so CPU runs the same code on torch.cpu's no-op stream.

Every replica builds the same buckets from the same parameters and the same backward graph, so buckets launch in
one order on every rank (the one requirement of issuing collectives from hooks). The sync must run before any
other gradient rewrite (TP partial sums, the MoE expert sum): the copy back writes the averaged bucket into the
gradient as it stood when the bucket launched, and those rewrites are linear, so running them after is exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    dtype: torch.dtype
    device: torch.device
    ready: int = 0
    flat: torch.Tensor | None = None
    work: dist.Work | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    done: bool = False  # waited, averaged and copied back this step


def plan_buckets(params: Sequence[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Parameters (unique, reverse order) cut into buckets of at most `bucket_bytes` of one dtype and device each;
    a parameter larger than the cap is a bucket of its own."""
    unique = list({id(p): p for p in reversed(list(params))}.values())
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[nn.Parameter], int]] = {}
    out: list[list[nn.Parameter]] = []
    for p in unique:
        local = _local(p.data)
        key = (local.dtype, local.device)
        nbytes = local.numel() * local.element_size()
        members, size = open_.get(key, ([], 0))
        if members and size + nbytes > bucket_bytes:
            out.append(members)
            members, size = [], 0
        open_[key] = ([*members, p], size + nbytes)
    out.extend(members for members, _ in open_.values())
    return out


class ReplicatedGradSync:
    """Average gradients over `group` (`size` replicas) in buckets, overlapped with backward when armed."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, size: int,
                 bucket_bytes: float = 25 * 2**20, overlap: bool = True) -> None:
        self.group, self.size, self.overlap = group, size, overlap
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        for members in plan_buckets(params, bucket_bytes):
            first = _local(members[0].data)
            bucket = _Bucket(members, first.dtype, first.device)
            self.buckets.append(bucket)
            for p in members:
                self._bucket_of[id(p)] = bucket
                if overlap:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        self.armed = False
        self.listeners: list[Callable[[list[nn.Parameter]], None]] = []
        """Each called with a bucket's parameters once their averaged gradients are back (module docstring)."""
        self._inflight: list[_Bucket] = []  # launched from backward, not yet finished, in launch order
        self._side: Any = None  # the device module's Stream (torch.cpu's is a no-op: CPU runs the same code)
        self._hooked = 0
        self.launched_in_backward = 0
        """Buckets the last step launched from backward hooks (the rest at `__call__`)."""

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    def arm(self, last: bool) -> None:
        """Before a micro-batch's backward: launch buckets from hooks only on the last one (after accumulation)."""
        self.armed = last and self.overlap

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
            self._hooked += 1
            if self.listeners:  # the buckets launched before this one have had its backward to arrive
                earlier, self._inflight = self._inflight, [bucket]
                for b in earlier:
                    self._finish(b)

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        # Sized from the gradients, not the parameters: a DTensor's gradient may be placed unlike its parameter
        # (TP's vocab-sharded embedding gets a replicated gradient). A missing gradient is zeros of its
        # parameter's size, so a bucket has one size on every replica.
        grads = [_local(p.grad) if p.grad is not None else None for p in bucket.params]
        sizes = [g.numel() if g is not None else _local(p.data).numel() for p, g in zip(bucket.params, grads)]
        flat = torch.empty(sum(sizes), dtype=bucket.dtype, device=bucket.device)
        views = []
        for piece, g in zip(flat.split(sizes), grads):
            if g is None:
                piece.zero_()
            else:
                views.append(piece.view_as(g))
        present = [g for g in grads if g is not None]
        torch._foreach_copy_(views, present)
        bucket.flat, bucket.views = flat, views
        bucket.work = dist.all_reduce(flat, group=self.group, async_op=True)

    @torch.no_grad()
    def _finish(self, bucket: _Bucket) -> None:
        """Wait for the bucket's all-reduce, average, copy back into the gradients; tell the listeners."""
        assert bucket.work is not None and bucket.flat is not None
        side: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.listeners and torch._C._current_graph_task_id() != -1:
            module = torch.get_device_module(bucket.flat.device)
            self._side = self._side or _new_stream(bucket.flat.device)
            self._side.wait_stream(module.current_stream(bucket.flat.device))
            side = module.stream(self._side)
        with side:
            bucket.work.wait()
            bucket.flat.div_(self.size)
            grads = [_local(p.grad) for p in bucket.params if p.grad is not None]
            torch._foreach_copy_(grads, bucket.views)
            bucket.done = True
            for listener in self.listeners:
                listener(bucket.params)

    @torch.no_grad()
    def __call__(self) -> None:
        """After backward: launch the buckets not yet launched, then wait for each, average and copy back."""
        try:
            for bucket in self.buckets:
                if bucket.work is None:
                    self._launch(bucket)
            for bucket in self.buckets:
                if not bucket.done:
                    self._finish(bucket)
            if self._side is not None:  # the buckets finished from backward wrote the gradients on the side stream
                device = self.buckets[0].device
                torch.get_device_module(device).current_stream(device).wait_stream(self._side)
        finally:
            for bucket in self.buckets:
                bucket.ready, bucket.flat, bucket.work, bucket.views, bucket.done = 0, None, None, [], False
            self._inflight = []
            self.armed, self.launched_in_backward, self._hooked = False, self._hooked, 0


def _new_stream(device: torch.device) -> Any:
    """A new stream of `device`'s module (torch.cpu's takes no device: it has the one no-op stream)."""
    module = torch.get_device_module(device)
    return module.Stream() if device.type == "cpu" else module.Stream(device)
