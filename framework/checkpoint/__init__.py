"""Distributed checkpoints and fault tolerance (docs/CHECKPOINTS.md).

`REQUEUE_EXIT_CODE` (42) is the exit code of every rank after a SIGTERM/SIGUSR1-triggered save has committed,
and after the hang watchdog fired: the SLURM script (launch/) requeues the job when it sees it. It is the
default of `checkpoint.requeue_exit_code`.
"""

from framework.checkpoint.config import REQUEUE_EXIT_CODE

__all__ = ["REQUEUE_EXIT_CODE"]
