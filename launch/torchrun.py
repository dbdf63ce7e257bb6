"""torchrun, with Tessera's requeue exit code: `python -m launch.torchrun <torchrun arguments>`.

Plain torchrun exits 1 whether a worker crashed or the whole group stopped for a preemption, so an sbatch script
cannot tell "requeue me" from "I failed". This runs torchrun's own `main` unchanged and maps its outcome:

- any worker exited with TESSERA_REQUEUE_EXIT_CODE (it saved a checkpoint on SIGUSR1)  -> exit that code;
- the agent itself received SIGUSR1 (SLURM signals every process of the step; the agent forwarded it and gave
  the workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to save)               -> exit that code;
- anything else                                                             -> torchrun's own behaviour.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with `argv`; return the exit code the sbatch script acts on."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from framework.checkpoint import REQUEUE_EXIT_CODE as default_code

    # The sbatch script exports the run's checkpoint.requeue_exit_code.
    REQUEUE_EXIT_CODE = int(os.environ.get("TESSERA_REQUEUE_EXIT_CODE", default_code))
    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if REQUEUE_EXIT_CODE in codes:
            print(f"[tessera] workers exited with {sorted(codes)}: requeue requested", file=sys.stderr, flush=True)
            return REQUEUE_EXIT_CODE
        raise
    except SignalException as err:
        if err.sigval == signal.SIGUSR1:
            print("[tessera] torchrun agent got SIGUSR1; workers were told to save: requeue requested",
                  file=sys.stderr, flush=True)
            return REQUEUE_EXIT_CODE
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
