"""A stand-in rank for the signal tests of the rendered sbatch script: no torch, no training.

It prints `start <SLURM_PROCID or RANK>`, then exits like the trainer does after a stop signal, 1.5 s after it
(the "save"): 42 after SIGTERM/SIGUSR1, 130 after SIGINT. A second SIGINT is what the trainer treats as "abort
without a checkpoint": this prints `second SIGINT` and exits 99, so a test sees a doubled signal.
"""

import os
import signal
import time

got: list[int] = []


def handler(signum: int, frame: object) -> None:
    print(f"rank got {signal.Signals(signum).name}", flush=True)
    if signum == signal.SIGINT and signal.SIGINT in got:
        print("second SIGINT", flush=True)
        os._exit(99)
    got.append(signum)


for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(sig, handler)
print(f"start {os.environ.get('RANK', os.environ.get('SLURM_PROCID'))}", flush=True)
for _ in range(1200):
    time.sleep(0.1)
    if got:
        time.sleep(1.5)
        os._exit(130 if got[0] == signal.SIGINT else 42)
