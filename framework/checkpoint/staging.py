"""Host staging of a checkpoint's state for the background writer.

An asynchronous save must copy the state before training changes it. Cloning on the GPU doubles the model and
optimizer states there for the whole write and hands CUDA tensors to a thread whose writer copies them to the host
with `non_blocking=True` on its own idea of the current device (torchtitan and Megatron stage into pinned host
memory instead). `HostStager.stage` runs on the training thread and returns a state whose every tensor lives on the
host, with the copies complete when it returns:

- the staged tensors are a reusable buffer set, one host tensor per state entry, kept across saves (at most one save
  is in flight, so a buffer is free again when the next save stages);
- pinned (page-locked, so the device copies are asynchronous DMA and one synchronize ends them all) where pinning
  exists (`torch.cuda.is_available()`) and the state fits `pin_budget_bytes`;
- bucketed when it does not (a 100B+ model's rank can hold more state than a node can pin): the destinations are
  pageable host tensors, filled through one pinned bounce buffer of `pin_budget_bytes`, a bucket at a time.

DTensors keep their sharding metadata around a host local shard (what DCP writes), as torch's own staging
(`torch.distributed._state_dict_utils._create_cpu_state_dict`) does.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def pin_available() -> bool:
    """Page-locked host memory exists only with a CUDA runtime."""
    return torch.cuda.is_available()


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialized host tensor, page-locked when `pin` (the one place staging allocates host memory)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def _leaves(state: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        return [(path, state)]
    if isinstance(state, dict):
        return [leaf for k, v in state.items() for leaf in _leaves(v, f"{path}/{k}")]
    if isinstance(state, list | tuple):
        return [leaf for i, v in enumerate(state) for leaf in _leaves(v, f"{path}/{i}")]
    return []


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in `state` (DTensors: their local shards): what staging copies to the host."""
    return sum(_local(t).numel() * _local(t).element_size() for _, t in _leaves(state))


class HostStager:
    """Copies a state tree into host buffers that live across saves (module docstring)."""

    def __init__(self, pin_budget_bytes: int) -> None:
        self.pin_budget_bytes = pin_budget_bytes
        self._buffers: dict[str, torch.Tensor] = {}
        self._bounce: torch.Tensor | None = None

    @property
    def host_bytes(self) -> int:
        """Host memory held between saves: the staged buffers plus the bounce buffer."""
        bounce = self._bounce.numel() if self._bounce is not None else 0
        return bounce + sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def pinned_bytes(self) -> int:
        held = [*self._buffers.values(), *([self._bounce] if self._bounce is not None else [])]
        return sum(b.numel() * b.element_size() for b in held if b.is_pinned())

    def stage(self, state: Any) -> Any:
        """`state` with every tensor copied into its host buffer; the copies have completed on return."""
        leaves = _leaves(state)
        bucketed = state_bytes(state) > self.pin_budget_bytes
        pin = pin_available() and not bucketed
        staged: dict[str, torch.Tensor] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for path, t in leaves:
            src = _local(t).detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.is_pinned() != pin:
                buf = self._buffers[path] = host_empty(tuple(src.shape), src.dtype, pin)
            copies.append((buf, src))
            staged[path] = buf if not isinstance(t, DTensor) else DTensor(buf, t._spec, requires_grad=False)
        for gone in set(self._buffers) - set(staged):
            del self._buffers[gone]
        if bucketed:
            self._copy_bucketed(copies)
        else:
            for buf, src in copies:
                buf.copy_(src, non_blocking=src.device.type != "cpu")
            _synchronize({src.device for _, src in copies})
        return _rebuild(state, staged)

    def _copy_bucketed(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Device -> pinned bounce buffer (asynchronous, one bucket) -> pageable destination, bucket by bucket."""
        size = max(16, self.pin_budget_bytes)
        if self._bounce is None or self._bounce.numel() != size:
            self._bounce = host_empty((size,), torch.uint8, pin_available())
        bounce, used = self._bounce, 0
        pending: list[tuple[torch.Tensor, int, int, int]] = []  # (destination bytes, offset there, in bounce, n)
        devices: set[torch.device] = set()

        def drain() -> None:
            nonlocal used
            _synchronize(devices)
            for dst, at, start, n in pending:
                dst[at:at + n].copy_(bounce[start:start + n])
            pending.clear()
            used = 0

        for buf, src in copies:
            src_bytes, dst_bytes = _as_bytes(src.contiguous()), _as_bytes(buf)
            devices.add(src.device)
            at = 0
            while at < src_bytes.numel():
                n = min(src_bytes.numel() - at, size - used)
                bounce[used:used + n].copy_(src_bytes[at:at + n], non_blocking=src.device.type != "cpu")
                pending.append((dst_bytes, at, used, n))
                at, used = at + n, used + n
                if used == size:
                    drain()
        drain()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def _synchronize(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type != "cpu":
            torch.get_device_module(device).synchronize(device)


def _rebuild(state: Any, staged: dict[str, torch.Tensor], path: str = "") -> Any:
    if isinstance(state, torch.Tensor):
        return staged[path]
    if isinstance(state, dict):
        return {k: _rebuild(v, staged, f"{path}/{k}") for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_rebuild(v, staged, f"{path}/{i}") for i, v in enumerate(state))
    return copy.deepcopy(state)
