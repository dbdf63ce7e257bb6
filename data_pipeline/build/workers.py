"""Worker processes of the build's stages: pools whose workers die with the build, and forked workers whose
errors come back to the parent."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Any

from data_pipeline.build.progress import Progress
from framework.base.errors import DataError, TesseraError


def die_with_parent() -> None:
    """Pool initializer: the kernel kills this worker when the process that forked it dies (SIGKILL, OOM), so a
    killed build leaves no orphaned workers behind (Linux prctl PR_SET_PDEATHSIG; elsewhere a no-op)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def pool_worker() -> None:
    """Pool initializer: die with the parent (`die_with_parent`), and take the stop signals' default actions: the
    parent handles a stop, and a pool ends its workers with SIGTERM (the handler inherited through fork printed
    "stopped by SIGTERM" from every worker of a passing run)."""
    import signal

    die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


def run_pool(fn: Any, jobs: list[Any], workers: int, desc: str, unit: str = "unit", isolate: bool = False) -> None:
    """Run a stage's units in worker processes; a worker that dies (e.g. OOM-killed) fails the stage loudly
    (BrokenProcessPool) instead of hanging, and the rerun redoes only the unfinished units.

    `isolate`: every unit in a process forked for it alone (`run_forked`), at most `workers` at a time, so a
    unit's peak memory is its own whatever ran before it in the task."""
    if not jobs:
        return
    bar = Progress(desc, unit, total=len(jobs))
    if isolate:
        run_forked(fn, jobs, workers, bar.update)
    elif workers == 1 or len(jobs) == 1:
        for job in jobs:
            fn(job)
            bar.update()
    else:
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("fork"),
                                 initializer=pool_worker) as pool:
            futures = [pool.submit(fn, job) for job in jobs]
            for fut in as_completed(futures):
                fut.result()
                bar.update()
    bar.close()


def run_forked(fn: Any, jobs: Sequence[Any], workers: int, done: Callable[[], None] = lambda: None) -> None:
    """`fn(job)` for each job in a child forked for that job alone, at most `workers` at once.

    Why not one process for all: a numpy-heavy unit leaves the allocator's heap fragmented (glibc raises its
    mmap threshold after the first large free, so the next unit's arrays come from a heap that is not given
    back), and the next unit peaks higher. Measured on the pairs stage (`tessera data build --stages pairs
    --task 0 --tasks 8`, peak RSS): at 10^6 documents, two key ranges in one process 142 MB, forked 119 MB; at
    10^5, one range, 129 and 119 MB. An exception in a child is raised here (a `DataError` stays one); a child
    that dies fails the stage with its signal. When this process is stopped (a signal, an error) its children
    are killed and reaped first."""
    pending = list(jobs)[::-1]
    running: dict[int, tuple[Any, int]] = {}
    try:
        while pending or running:
            while pending and len(running) < max(1, workers):
                job = pending.pop()
                r, w = os.pipe()
                sys.stdout.flush()
                sys.stderr.flush()  # nothing buffered here is written twice by the child
                pid = os.fork()
                if pid == 0:  # the child: run the unit and exit, never return into the caller's stack
                    os.close(r)
                    code = 0
                    try:
                        die_with_parent()
                        fn(job)
                    except BaseException as err:
                        code = 1
                        if not isinstance(err, TesseraError):
                            traceback.print_exc()
                        os.write(w, _pickled_error(err))
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                os.close(w)
                running[pid] = (job, r)
            pid, status = os.waitpid(-1, 0)
            if pid not in running:
                continue  # a child this function did not start
            job, r = running.pop(pid)
            with os.fdopen(r, "rb") as pipe:
                sent = pipe.read()
            code = os.waitstatus_to_exitcode(status)
            if sent:
                raise pickle.loads(sent)  # checked by the child to unpickle (`_pickled_error`)
            if code:
                raise DataError(f"unit {job!r:.80} of {getattr(fn, '__name__', fn)} died "
                                f"({f'signal {-code}' if code < 0 else f'exit status {code}'}); rerun the stage: "
                                "finished units are kept and only the rest are redone")
            done()
    finally:
        for pid, (_, r) in running.items():
            os.close(r)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in running:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _pickled_error(err: BaseException) -> bytes:
    """`err` as the parent of `run_forked` re-raises it, checked to unpickle; small enough for a pipe's buffer
    (the child writes it before it exits, the parent reads it after). An exception that does not survive
    pickling arrives as a DataError (a TesseraError) or RuntimeError naming its type and message."""
    try:
        data = pickle.dumps(err)
        if len(data) < 32_768:
            pickle.loads(data)
            return data
    except Exception:  # an exception holding something unpicklable, or whose __init__ pickle cannot call
        pass
    kind = DataError if isinstance(err, TesseraError) else RuntimeError
    return pickle.dumps(kind(f"{type(err).__name__}: {str(err)[:4000]}"))
