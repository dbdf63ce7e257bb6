"""Context parallelism by exchange (allgather, ring, all_to_all): activation bytes per rank against the planner's
formulas, cp bytes on the wire and time of one block's forward + backward, all exchanges in the same run.

    PYTHONPATH=. python bench/context_parallel.py [--seq 8192] [--write docs/benchmarks/context_parallel.md]

One 4-rank gloo spawn. For cp = 1, 2, 4 (sub-groups of the 4 ranks) and each parallel.cp_comm every rank runs one
decoder block of the GQA test model on its load-balanced chunks (framework/parallel/context.py), fp32:
- activation bytes: storages autograd keeps after the forward (bench/plan_measure.py `saved_bytes`), per rank,
  against the planner's `layer_bytes` for that exchange; allgather's (b, 1, s/cp, s) additive mask, shared by
  every layer of a forward (`cp_mask_bytes`), is listed apart;
- cp wire bytes of one forward + backward (framework/parallel/comm.py `CommLogger`, collectives and P2P);
- time: median of a few forward + backward passes, per exchange in the same run.
Byte counts are exact and do not depend on machine load; times do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py`: bench.* from the root

KEY = "context-parallel"
HEADING = "## Context parallelism: activations, K/V traffic and time by exchange"
CPS = (1, 2, 4)
COMMS = ("allgather", "ring", "all_to_all")
REPEATS = 5


def _measure(rank: int, world: int, seq: int, batch: int) -> dict[str, dict[str, float]]:
    import statistics
    import time

    import torch.distributed as dist

    from bench.plan_measure import saved_bytes
    from framework.parallel.comm import CommLogger
    from framework.parallel.context import ContextParallel, local_indices
    from models.config import model_config
    from models.decoder import Block, build_model

    torch.set_num_threads(1)
    cfg = model_config("test-tiny", max_seq_len=seq, n_layers=1)
    table = build_model(cfg).rope
    out: dict[str, dict[str, float]] = {}
    groups = {cp: [dist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)] for cp in CPS if cp > 1}
    for cp in CPS:
        for comm in COMMS if cp > 1 else ("none",):
            if rank >= cp:
                dist.barrier()
                continue
            torch.manual_seed(0)
            block = Block(cfg, 0)
            x_leaf = torch.randn(batch, seq // cp, cfg.hidden, requires_grad=True)
            mask: torch.Tensor | None = None
            rope = table
            logger = None
            if cp > 1:
                group = groups[cp][0]
                ctx = ContextParallel(group, comm=comm)
                rope = table[local_indices(seq, cp, rank)]
                if comm == "allgather":
                    mask = ctx.shard(torch.zeros(batch, seq + 1, dtype=torch.long), None)[2]["attn_mask"]
                block.attention.context_attention = getattr(ctx, comm)
                logger = CommLogger({group: "cp"})
            static = [t for t in (rope, x_leaf, mask) if t is not None]
            act, _ = saved_bytes(block, lambda: x_leaf * 1.0,  # noqa: B023 (both called at once)
                                 lambda x: block(x, rope, mask),  # noqa: B023
                                 static=static)
            row = {"act": float(act), "mask": float(mask.nbytes if mask is not None else 0)}
            if logger is not None:
                with logger.active():
                    block(x_leaf * 1.0, rope, mask).square().mean().backward()
                summary = logger.summary()
                row["kv_wire"] = sum(v for k2, v in summary.items() if k2.endswith("/wire_bytes"))
            times = []
            for _ in range(REPEATS):
                if cp > 1:  # the cp group's ranks start each repeat together; the others wait at the world barrier
                    dist.barrier(group=groups[cp][0])
                start = time.perf_counter()
                block(x_leaf * 1.0, rope, mask).square().mean().backward()
                times.append(time.perf_counter() - start)
            row["time"] = statistics.median(times)
            row["spread"] = (max(times) - min(times)) / row["time"]
            out[f"{cp} {comm}"] = row
            dist.barrier()
    return out


def formulas(seq: int, batch: int) -> dict[str, float]:
    from framework.plan.layout import Layout, Precision, Workload
    from framework.plan.memory import layer_bytes
    from models.config import model_config

    cfg = model_config("test-tiny", max_seq_len=seq, n_layers=1)
    out = {}
    for cp in CPS:
        for comm in COMMS if cp > 1 else ("none",):
            work = Workload(cfg, seq, batch, precision=Precision.named("fp32"),
                            cp_comm=comm if cp > 1 else "ring")  # type: ignore[arg-type]
            out[f"{cp} {comm}"] = layer_bytes(work, Layout(cp=cp, micro_batch=batch), "none")
    return out


def report(seq: int, batch: int, measured: list[dict[str, dict[str, float]]]) -> str:
    want = formulas(seq, batch)
    mib = 1 << 20
    lines = [HEADING, "",
             f"`PYTHONPATH=. python bench/context_parallel.py --seq {seq}` (2026-12-06): one block of the GQA "
             f"`test-tiny` model (hidden 64, 4 heads, 2 KV heads), batch {batch}, seq {seq}, fp32, on each cp rank "
             f"(gloo, 1 thread per rank, 4 ranks on a shared 2-core machine). Bytes are exact; time is the median "
             f"of {REPEATS} forward + backward per rank (max over ranks), spread = (max - min) / median.", "",
             "| cp | exchange | activations / rank (max over ranks) | planner `layer_bytes` | ratio | mask | cp wire "
             "bytes / rank / step | time fwd+bwd | vs allgather | spread |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key in want:
        rows = [m[key] for m in measured if key in m]
        act = max(r["act"] for r in rows)
        t = max(r["time"] for r in rows)
        cp = key.split()[0]
        ref = max(m[f"{cp} allgather"]["time"] for m in measured if f"{cp} allgather" in m) if cp != "1" else t
        lines.append(
            f"| {cp} | {key.split()[1]} | {act / mib:.2f} MiB | {want[key] / mib:.2f} MiB | {act / want[key]:.4f} | "
            f"{rows[0]['mask'] / mib:.2f} MiB | {rows[0].get('kv_wire', 0.0) / mib:.2f} MiB | {t * 1e3:.0f} ms | "
            f"{t / ref:.2f} | {max(r['spread'] for r in rows):.2f} |")
    lines += ["", "allgather keeps the gathered K and V for all s keys and a (b, 1, s/cp, s) mask; the ring keeps "
              "only its local K/V (blocks in flight are transient) and no mask; all_to_all keeps the whole sequence "
              "on h/cp heads (the local block's bytes while KV heads split over cp). The ring's backward sends the "
              "K/V blocks again and the fp32 dK/dV accumulators cp times (hence more wire bytes than the "
              "all-gather's reduce-scatter).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.sections import replace_section
    from framework.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args(argv)
    measured: Any = run_distributed(_measure, 4, timeout_s=900, seq=args.seq, batch=args.batch)
    text = report(args.seq, args.batch, measured)
    print(text)
    if args.write:
        replace_section(args.write, KEY, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
