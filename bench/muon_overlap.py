"""Muon's owner exchange overlapped with backward vs after it: exposed all-to-all time and step time.

    PYTHONPATH=. nice -n 19 python bench/muon_overlap.py [--rounds 12] [--ranks 4] [--layers 8] [--moe]
        [--layout dp-zero3|tp2-dp2|tp2-zero3]

smoke-3m's shape (configs/smoke/smoke.yaml's model; `--layers` blocks) as DP4 ZeRO-3 on 4 gloo ranks, Muon with fp32
Newton-Schulz, two engines in one process group: `train.muon.overlap=true` (each block's gradient pieces leave
for their owners from backward, framework/train/muon_overlap.py) and `false` (the exchange after backward),
stepped alternately, the same order on every rank. Per step on rank 0, from the communication logger's
timeline (framework/parallel/comm.py): the exposed seconds of the trip to the owners (every all-to-all but the
step's last, the return trip, which both modes run after backward) and the bytes of all of them; and the step's
wall seconds. Ratios overlap / plain: median of the per-round ratios, with a bootstrap 95% interval.
`--moe`: smoke-moe's shape instead (8 experts, a shared one, the first layer dense) under EP2, so the experts are
FSDP units of their own over a 2-rank edp group and send their pieces there from their own post-backward; the
trip to the owners is then every Muon all-to-all but the last per axis (dp_shard, edp), the dispatcher's (ep)
left out. `--layout tp2-dp2`: TP2 x dp_replicate 2 without FSDP, 1 MiB DDP buckets, the exchange over tp;
`tp2-zero3`: TP2 x DP2 ZeRO-3, overlapped over dp_shard x tp in one hop, plain with the tp all-gather first
(which the plain figure leaves out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.robust_timing import loadavg, paired_ratio
from bench.zeropp import markov_batches

MODES = {"overlapped": "train.muon.overlap=true", "plain": "train.muon.overlap=false"}
LAYOUTS = {"dp-zero3": lambda world: [f"parallel.dp_shard={world}", "parallel.zero_stage=3"],
           "tp2-dp2": lambda world: ["parallel.tp=2", f"parallel.dp_replicate={world // 2}", "parallel.dp_shard=1",
                                     "parallel.zero_stage=0", "parallel.ddp_bucket_mb=1"],
           "tp2-zero3": lambda world: ["parallel.tp=2", f"parallel.dp_shard={world // 2}", "parallel.zero_stage=3"]}


def _worker(rank: int, world: int, rounds: int, layers: int, moe: bool, layout: str) -> dict[str, Any]:
    from framework.dryrun.step import comm_logger
    from framework.testing.tiny import tiny_config
    from framework.train.parallel_engine import build_parallel_engine

    torch.set_num_threads(1)
    engines = {}
    for name, flag in MODES.items():
        model = ("model.preset=smoke-moe", "parallel.ep=2") if moe else ("model.preset=smoke-3m",)
        cfg = tiny_config(None, *model, f"model.n_layers={layers}", "data.kind=synthetic",
                          "data.seq_len=128", "train.global_batch_size=8", "train.micro_batch_size=2",
                          "train.optimizer=muon", "train.muon.ns_dtype=fp32", *LAYOUTS[layout](world),
                          "parallel.comm_log=true", flag)
        engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
        comm = engine.comm = comm_logger(engine)  # the dry run's: it also names the expert mesh's ep and edp groups
        engines[name] = (engine, cfg, comm)
    rows = markov_batches(1, 8, 128, engines["plain"][1].model.vocab_size)[0]
    out: dict[str, dict[str, list[float]]] = {n: {"to_owner_exposed": [], "wall": [], "bytes": []} for n in MODES}
    for r in range(rounds + 1):  # round 0 warms up
        for name in (MODES if r % 2 else reversed(list(MODES))):
            engine, cfg, comm = engines[name]
            dp = engine.dp_size
            batch = rows[engine.dp_rank * 8 // dp:(engine.dp_rank + 1) * 8 // dp].reshape(-1, 2, 129)
            comm.reset()
            start = time.perf_counter()
            engine.forward_backward(batch)
            engine.clip_grad_norm(cfg.train.grad_clip)
            engine.optimizer_step(1e-3)
            wall = time.perf_counter() - start
            a2a = [t for t in comm.resolved_timings() if t.op == "all_to_all" and t.axis != "ep"]
            returns = {t.axis: i for i, t in enumerate(a2a)}.values()  # each axis's last: the return trip
            if r:
                out[name]["to_owner_exposed"].append(sum(t.exposed_s for i, t in enumerate(a2a) if i not in returns))
                out[name]["wall"].append(wall)
                out[name]["bytes"].append(sum(t.bytes for t in a2a))
    return out


def main() -> None:
    from framework.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--moe", action="store_true", help="smoke-moe under EP2 (expert units over edp)")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="dp-zero3")
    args = ap.parse_args()
    load = loadavg()
    res = run_distributed(_worker, args.ranks, timeout_s=1200, rounds=args.rounds, layers=args.layers,
                          moe=args.moe, layout=args.layout)[0]
    print(f"`PYTHONPATH=. nice -n 19 python bench/muon_overlap.py --rounds {args.rounds} --ranks {args.ranks} "
          f"--layers {args.layers}{' --moe' if args.moe else ''} --layout {args.layout}` ({date.today().isoformat()}, "
          f"CPU gloo, load average {load})")
    for key in ("to_owner_exposed", "wall"):
        med = {n: statistics.median(res[n][key]) for n in MODES}
        print(f"{key}: overlapped {med['overlapped'] * 1e3:.2f} ms, plain {med['plain'] * 1e3:.2f} ms, "
              f"overlapped / plain {paired_ratio(res['overlapped'][key], res['plain'][key])}")
    print(f"all-to-all bytes per step on rank 0: overlapped {set(res['overlapped']['bytes'])}, "
          f"plain {set(res['plain']['bytes'])}")


if __name__ == "__main__":
    main()
