"""One rank of a stand-in trainer for the launcher's preemption path (real SLURM, real torchrun, real signals).

It does what the trainer's contract says and nothing more: steps in lockstep (an all_reduce per step); on SIGUSR1
every rank agrees at the next step, "saves" (rank 0 writes the step reached), and exits with the requeue code;
started again (SLURM_RESTART_COUNT=1) it resumes from that step and runs to the end, exiting 0.
"""

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launch.env import dist_env

STEPS = 80
torch.set_num_threads(1)
env = dist_env()
env.export()
out = Path(os.environ["TESSERA_TEST_OUT"])
stop = torch.zeros(1)
signal.signal(signal.SIGUSR1, lambda *_: stop.fill_(1.0))
dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=60))
saved = out / "saved_step"
step = int(saved.read_text()) if saved.exists() else 0
start = step
while step < STEPS:
    flag = stop.clone()
    dist.all_reduce(flag)  # every rank stops at the same step, whichever rank the signal reached first
    if flag.item() > 0:
        if env.rank == 0:
            saved.write_text(str(step))
        dist.barrier()  # the "checkpoint" is committed before any rank exits
        code = int(os.environ.get("TESSERA_REQUEUE_EXIT_CODE", "42"))
        dist.destroy_process_group()
        raise SystemExit(code)
    step += 1
    if env.rank == 0:
        (out / "progress").write_text(str(step))
    time.sleep(0.05)
record = {"rank": env.rank, "start": start, "end": step, "restart": env.restart_count, "source": env.source}
(out / f"done{env.rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
