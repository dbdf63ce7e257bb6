"""Read the next batch while the current step runs: a thread assembles it (pinned on accelerators) and, on an
accelerator, copies it to the device on a side stream; the batches are bitwise those of the wrapped loader.

    loader = PrefetchingLoader(BatchLoader(...), device)
    batch = loader.next_batch()      # already on `device`; the one after it is being read now

`consumed_samples` and the state dict are the wrapped loader's as of the batches handed out (never the one read
ahead), so checkpoints and rollbacks see exactly what the step saw; `load_state_dict` drops the read-ahead.
An accelerator copy from pageable memory with `non_blocking=True` is synchronous (the driver stages it), which
is why the thread pins the batch first: from pinned memory the side-stream copy overlaps the step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from data_pipeline.read.loader import BatchLoader


class PrefetchingLoader:
    """`BatchLoader`'s interface (`next_batch`, `consumed_samples`, `state_dict`, `load_state_dict`), one batch
    read ahead on a background thread."""

    def __init__(self, loader: BatchLoader, device: torch.device | str = "cpu") -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.accelerated = self.device.type != "cpu"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-prefetch")
        self._ahead: tuple[int, Future[tuple[torch.Tensor, Any]]] | None = None
        self._stream: Any = None
        if self.accelerated:
            self._stream = torch.get_device_module(self.device).Stream(device=self.device)

    @property
    def consumed_samples(self) -> int:
        return self.loader.consumed_samples

    @property
    def samples(self) -> Any:
        return self.loader.samples

    @samples.setter
    def samples(self, value: Any) -> None:
        """Swap the wrapped loader's samples (a test's poisoned data, a new mixture); the read-ahead came from the
        old ones, so it is dropped."""
        self.loader.samples = value
        self._ahead = None

    def __getattr__(self, name: str) -> Any:  # global_batch_size, n_micro, dp_rank, ... of the wrapped loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _read(self, consumed: int) -> tuple[torch.Tensor, Any]:
        """On the thread: the batch at `consumed`, pinned and sent to the device on the side stream (an event
        marks the copy's end)."""
        batch = self.loader.batch_at(consumed)
        if not self.accelerated:
            return batch, None
        module = torch.get_device_module(self.device)
        batch = batch.pin_memory()
        with module.stream(self._stream):
            on_device = batch.to(self.device, non_blocking=True)
            done = self._stream.record_event()
        return on_device, (done, batch)  # the pinned host copy lives until the copy is waited on

    def _launch(self, consumed: int) -> None:
        self._ahead = (consumed, self._pool.submit(self._read, consumed))

    def next_batch(self) -> torch.Tensor:
        """The wrapped loader's next batch (on `device`); starts reading the one after it."""
        consumed = self.loader.consumed_samples
        if self._ahead is None or self._ahead[0] != consumed:
            self._launch(consumed)
        assert self._ahead is not None
        batch, pending = self._ahead[1].result()
        if pending is not None:
            module = torch.get_device_module(self.device)
            current = module.current_stream(self.device)
            current.wait_event(pending[0])
            batch.record_stream(current)  # the side stream's allocation is used on the compute stream
        self.loader.consumed_samples = consumed + self.loader.global_batch_size
        self._launch(self.loader.consumed_samples)
        return batch

    def quarantine_batch(self, start: int) -> list[int]:
        """The wrapped loader's quarantine (spike triage); the batch read ahead may hold quarantined samples, so it
        is dropped and read again where the loader now points."""
        self._ahead = None
        return self.loader.quarantine_batch(start)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loader.load_state_dict(sd)
        self._ahead = None  # read at the old position: next_batch reads again where the state points

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None
