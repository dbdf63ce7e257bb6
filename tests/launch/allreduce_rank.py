"""One rank of the trivial SLURM job: launch.env -> gloo all_reduce -> a JSON line per rank in $TESSERA_TEST_OUT."""

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launch.env import dist_env

torch.set_num_threads(1)
env = dist_env()
env.export()
dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=60))
value = torch.tensor([float(env.rank + 1)])
dist.all_reduce(value)
gathered: list[object] = [None] * env.world_size
dist.all_gather_object(gathered, socket.gethostname())
record = {"rank": env.rank, "world": env.world_size, "local_rank": env.local_rank, "node_rank": env.node_rank,
          "host": socket.gethostname(), "source": env.source, "sum": value.item(), "hosts": gathered,
          "job_id": env.job_id, "master": f"{env.master_addr}:{env.master_port}"}
with open(Path(os.environ["TESSERA_TEST_OUT"]) / f"rank{env.rank}.json", "w") as f:
    f.write(json.dumps(record))
dist.destroy_process_group()
