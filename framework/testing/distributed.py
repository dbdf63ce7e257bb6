"""Run a function on N ranks for tests: gloo on CPU (NCCL where GPUs exist), forked processes, one call.

    results = run_distributed(fn, world_size=4, arg=...)   # fn(rank, world_size, arg=...) on every rank

Each rank runs in a forked child with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set and the default process
group initialized. Return values come back per rank (they must pickle). When any rank raises, every rank's
traceback is collected and re-raised in the parent as one `DistributedTestError`, with the root cause first:
errors raised inside collectives (a peer died, a timeout) are sorted after ordinary exceptions, because they
are almost always a consequence, not the cause.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from framework.base.ports import free_port

_COLLECTIVE_MARKERS = ("gloo", "nccl", "Connection closed", "Connection reset", "timed out", "Timeout",
                       "ProcessGroup", "c10d", "Broken pipe", "peer")


class DistributedTestError(AssertionError):
    """One or more ranks failed; the message holds every failing rank's traceback, root cause first."""


@dataclass
class _RankOutcome:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    collective: bool = False


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _is_collective_error(exc: BaseException, text: str) -> bool:
    if isinstance(exc, dist.DistBackendError | TimeoutError | ConnectionError):
        return True
    head = text.strip().splitlines()[-1] if text.strip() else ""
    return any(m in head for m in _COLLECTIVE_MARKERS)


def _compile_in_process() -> None:
    """Make inductor compile inside this forked rank instead of through the parent's worker pool.

    A pytest process that compiled with inductor before forking owns a pool of compile workers; the fork copies the
    pool's handles but not its threads, so a rank that submits to it waits forever (seen on a cold compile cache:
    the rank hung in `AsyncCompile.wait` until the harness killed it). One compile thread means no pool.
    """
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.compile_threads = 1  # type: ignore[attr-defined]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, timeout_s: float,
           threads: int, env: dict[str, str], kwargs: dict[str, Any], queue: Any) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(threads)
    _compile_in_process()
    outcome: _RankOutcome
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, **kwargs)
        outcome = _RankOutcome(rank, True, value)
    except BaseException as exc:  # every failure must reach the parent, SystemExit included
        text = traceback.format_exc()
        outcome = _RankOutcome(rank, False, error=text, collective=_is_collective_error(exc, text))
    try:
        queue.put(outcome)
        # put() hands the object to a feeder thread; os._exit below would kill it before the bytes are written.
        queue.close()
        queue.join_thread()
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *, backend: str | None = None,
                    timeout_s: float = 300.0, threads: int = 1, env: dict[str, str] | None = None,
                    **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` forked ranks and return their results by rank.

    Args:
        fn: the test body; it finds the default process group initialized.
        world_size: number of ranks.
        backend: "gloo" or "nccl"; default NCCL when CUDA is available, else gloo.
        timeout_s: collective timeout of the process group and the overall wait for the ranks.
        threads: `torch.set_num_threads` per rank (1 keeps 8 ranks on 2 cores from thrashing).
        env: extra environment variables for the ranks.
        **kwargs: passed to `fn` (they are inherited through fork, so they need not pickle).

    Raises:
        DistributedTestError: any rank raised or did not report in time; all tracebacks, root cause first.
    """
    backend = backend or default_backend()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, backend, timeout_s, threads, env or {},
                                              kwargs, queue), daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, _RankOutcome] = {}
    deadline = time.monotonic() + timeout_s + 30
    crashed_at: float | None = None
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                o = queue.get(timeout=0.5)
                outcomes[o.rank] = o
                continue
            except queue_mod.Empty:
                pass
            if all(p.exitcode is not None for p in procs):
                break  # everyone is gone; whoever did not report crashed hard
            # A rank that crashed hard (segfault, os._exit) never reports and its peers may block on it:
            # give them a short grace to fail in their collectives, then stop waiting.
            if crashed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                crashed_at = time.monotonic()
            if crashed_at is not None and time.monotonic() - crashed_at > 20:
                break
    finally:
        for p in procs:
            p.join(timeout=0.5 if len(outcomes) < world_size else 10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        if r not in outcomes:
            why = f"exit code {p.exitcode}" if p.exitcode not in (None, 0) else "did not report within the timeout"
            outcomes[r] = _RankOutcome(r, False, error=f"rank {r} {why}\n", collective=p.exitcode in (None, 0))
    failed = [o for o in outcomes.values() if not o.ok]
    if failed:
        failed.sort(key=lambda o: (o.collective, o.rank))
        parts = [f"--- rank {o.rank}{' (collective-side)' if o.collective else ''} ---\n{o.error}" for o in failed]
        raise DistributedTestError(f"{len(failed)} of {world_size} ranks failed; root cause first:\n"
                                   + "\n".join(parts))
    return [outcomes[r].value for r in range(world_size)]
