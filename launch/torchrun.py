"""torchrun, with Tessera's stop codes: `python -m launch.torchrun <torchrun arguments>`.

Plain torchrun exits 1 whether a worker crashed or the whole group stopped for a preemption, so an sbatch script
cannot tell "requeue me" from "I failed". This runs torchrun's own `main` unchanged and maps its outcome:

- any worker exited with TESSERA_REQUEUE_EXIT_CODE (it saved a checkpoint on SIGTERM/SIGUSR1) -> exit that code;
- every failed worker exited 130 (it saved on SIGINT)                                         -> exit 130;
- the agent itself was stopped by SIGTERM/SIGUSR1 (it forwarded the signal and gave the workers
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to save)                          -> the requeue code; by SIGINT -> 130;
- anything else                                                            -> torchrun's own behaviour.

Inside a SLURM step (SLURM_STEP_ID set) a signal — `scancel --signal=X`, the time limit's `--signal=USR1@T`, or
the sbatch script forwarding one it got — reaches every process of the step, the workers included. torchrun's
agent would then send the same signal to its workers a second time, and a second SIGINT aborts a worker without a
checkpoint (measured: bench/signal_matrix_slurm.py). So there the agent does not handle SIGTERM/SIGINT/SIGUSR1
itself: it notes them and goes on monitoring its workers, which save, exit with their code, and are mapped above.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

INTERRUPT_EXIT_CODE = 130
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


def _signals_left_to_torchrun() -> None:
    """In a SLURM step: take the stop signals out of the set torchrun's agent forwards, and note them instead."""
    for var in ("TORCHELASTIC_SIGNALS_TO_HANDLE", "PET_SIGNALS_TO_HANDLE"):
        names = os.environ.get(var, "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
        os.environ[var] = ",".join(n for n in names if n.strip() not in STOP_SIGNALS) or "SIGHUP"

    def note(signum: int, frame: object) -> None:
        os.write(2, f"[tessera] torchrun agent got {signal.Signals(signum).name}; the workers got it too: "
                    f"waiting for them\n".encode())

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), note)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with `argv`; return the exit code the sbatch script acts on."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from framework.checkpoint import REQUEUE_EXIT_CODE as default_code

    # The sbatch script exports the run's checkpoint.requeue_exit_code.
    REQUEUE_EXIT_CODE = int(os.environ.get("TESSERA_REQUEUE_EXIT_CODE", default_code))
    if os.environ.get("SLURM_STEP_ID") is not None:
        _signals_left_to_torchrun()
    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if REQUEUE_EXIT_CODE in codes:
            print(f"[tessera] workers exited with {sorted(codes)}: requeue requested", file=sys.stderr, flush=True)
            return REQUEUE_EXIT_CODE
        if codes == {INTERRUPT_EXIT_CODE}:
            print("[tessera] workers exited with 130 (interrupted, checkpoint saved)", file=sys.stderr, flush=True)
            return INTERRUPT_EXIT_CODE
        raise
    except SignalException as err:
        if err.sigval in (signal.SIGUSR1, signal.SIGTERM):
            print(f"[tessera] torchrun agent got {signal.Signals(err.sigval).name}; workers were told to save: "
                  f"requeue requested", file=sys.stderr, flush=True)
            return REQUEUE_EXIT_CODE
        if err.sigval == signal.SIGINT:
            print("[tessera] torchrun agent got SIGINT; workers were told to save", file=sys.stderr, flush=True)
            return INTERRUPT_EXIT_CODE
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
