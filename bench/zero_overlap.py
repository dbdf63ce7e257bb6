"""ZeRO-3's exposed communication: the comm logger's bucket timings against the planner's overlap model.

    PYTHONPATH=. nice -n 19 python bench/zero_overlap.py [--ranks 2 4] [--rounds 15] \
        [--write docs/benchmarks/zero_overlap.md]

Per rank count, one spawn of gloo ranks on this machine:
1. Calibration, every round: synchronous all-gathers (and reduce-scatters, for reference) of 16 KiB .. 4 MiB
   over the group into fresh buffers, the median of 5 calls each, fitted as t = alpha + beta x wire bytes
   (wire = (n-1)/n x buffer): the link's latency per ring step alpha / (n-1) and bandwidth 1 / beta, the two
   numbers the planner's comm model takes (`Hardware.latency_us`, the link's GB/s; plan/comm.py `_axis`).
2. The engine's ZeRO-3 (dp_shard = n, fp32, one block per FSDP unit) with parallel.fsdp_prefetch 0 and 1, one
   step of each arm per round, interleaved so load drift hits both. Measured per step: the exposed time of the
   dp_shard all-gathers and reduce-scatters (`CollectiveTiming.exposed_s`: the rank blocked in the wait).
   FSDP2 issues its collectives synchronously on CPU, which would make prefetch a no-op here; both arms switch
   on FSDP2's async unshard (`_set_unshard_async_op`), so the prefetched all-gather runs in gloo's thread
   beside compute as it runs on its own stream on a GPU. The reduce-scatter stays synchronous (FSDP2 has no
   async option for it), so on gloo it blocks compute.
3. Prediction (`framework.plan.estimate.zero3_pass_exposed`, the planner's per-unit model): each collective's
   time from the calibrated alpha/beta and the bytes the logger saw it move; each unit's compute from the same
   round's prefetch-0 timeline (`_units`). Prefetch 0 is FSDP2's default, which prefetches one unit in backward
   anyway (the first run of this bench, modelling it as no prefetch, found backward hiding gathers at prefetch
   0; the planner now models it so). Two variants: the planner as it runs for GPUs (reduce-scatters beside compute) and
   with `blocking_reduce` (what FSDP2 does on gloo). Ratio = predicted / measured median exposed per step.
Noise: the spread (25th-75th percentile over rounds) of the measured exposed time and of the step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "parallel"))

from bench.sections import replace_section

KEY = "zero-overlap"
SECTION = "## ZeRO-3 overlap: measured bucket timings vs the planner"
MODEL = ("model.hidden=256", "model.ffn_hidden=704", "model.n_layers=6", "model.n_heads=4", "model.n_kv_heads=2",
         "data.seq_len=64", "train.precision=fp32", "parallel.zero_stage=3", "parallel.comm_log=true",
         "parallel.fsdp_layers_per_unit=1", "parallel.dp_shard=-1")
SIZES = [1 << k for k in range(14, 23, 2)]  # 16 KiB .. 4 MiB buffers (fp32)
DP_OPS = ("all_gather", "reduce_scatter")


def _calibrate(world: int, reps: int = 5) -> dict[str, Any]:
    """Median seconds of synchronous all-gathers / reduce-scatters by wire bytes, and the alpha-beta fit."""
    import numpy as np
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for op in DP_OPS:
        wires, secs = [], []
        for size in SIZES:
            times = []
            for _ in range(reps):
                # fresh buffers each call, as FSDP2 allocates its gather output and reduce-scatter input per unit
                full, shard = torch.empty(size // 4), torch.zeros(size // 4 // world)
                dist.barrier()
                t0 = time.perf_counter()
                if op == "all_gather":
                    dist.all_gather_into_tensor(full, shard)
                else:
                    dist.reduce_scatter_tensor(shard, full)
                times.append(time.perf_counter() - t0)
            wires.append(size * (world - 1) / world)
            secs.append(statistics.median(times))
        beta, alpha = np.polyfit(np.array(wires), np.array(secs), 1)
        out[op] = {"alpha_s": float(alpha), "beta_s_per_byte": float(beta), "points": list(zip(wires, secs))}
    return out


def _predict(alpha: float, beta: float, wire: float) -> float:
    return max(0.0, alpha) + beta * wire


def _step_timeline(engine: Any, batch: torch.Tensor) -> dict[str, Any]:
    """One forward + backward; the dp_shard collectives in issue order and the forward's end."""
    marks: dict[str, float] = {}
    root = engine.model_parts[0]
    last = root.layers[list(root.layers.keys())[-1]]
    handles = [root.register_forward_hook(lambda *_: marks.__setitem__("fwd_end", time.perf_counter())),
               last.register_forward_hook(lambda *_: marks.__setitem__("blocks_end", time.perf_counter()))]
    engine.comm.reset()
    marks["start"] = t0 = time.perf_counter()
    engine.forward_backward(batch)
    wall = time.perf_counter() - t0
    for handle in handles:
        handle.remove()
    for opt in engine.optimizers:
        opt.zero_grad(set_to_none=True)
    ops = [(t.op, t.bytes, t.issued, t.issued + t.seconds, t.seconds, t.exposed_s)
           for t in engine.comm.resolved_timings() if t.axis == "dp_shard" and t.op in DP_OPS]
    return {"wall": wall, "start": marks["start"], "fwd_end": marks["fwd_end"], "blocks_end": marks["blocks_end"],
            "ops": ops,
            "exposed": sum(o[5] for o in ops), "exposed_all": sum(t.exposed_s for t in engine.comm.timings)}


def _units(step: dict[str, Any]) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:
    """From a prefetch-0 timeline: forward [(gather bytes, compute s)] and backward [(gather bytes, reduce bytes,
    compute s)] per unit in execution order.

    Forward at prefetch 0 overlaps nothing on CPU (each unit's gather is waited at its start), so a unit's compute
    is the gap from its gather's completion to the next one's issue (the head: from the last block's end to the
    forward's). Backward does overlap even then (FSDP2 prefetches one unit implicitly), so its compute is the
    backward's wall time less what it was blocked, split over the units as their forwards are.
    """
    fwd_end, end, blocks_end = step["fwd_end"], step["start"] + step["wall"], step["blocks_end"]
    forward = [o for o in step["ops"] if o[2] < fwd_end]
    backward = [o for o in step["ops"] if o[2] >= fwd_end]
    # forward: the root's gather and embedding, one unit per block, then the head (no gather)
    fwd = [(o[1], (nxt[2] if nxt is not None else blocks_end) - o[3])
           for o, nxt in zip(forward, [*forward[1:], None])] + [(0, fwd_end - blocks_end)]
    gathers = [o[1] for o in backward if o[0] == "all_gather"]
    reduces = [o[1] for o in backward if o[0] == "reduce_scatter"]
    if len(gathers) != len(fwd) - 2 or len(reduces) != len(fwd) - 1:
        raise RuntimeError(f"unexpected FSDP timeline: {len(fwd) - 1} forward gathers, backward {len(gathers)} "
                           f"gathers and {len(reduces)} reduce-scatters")
    # backward: the root re-gathered for the head, the last block (not resharded), the other blocks, the root's
    # embedding; the root's reduce-scatter comes last
    compute = (end - fwd_end) - sum(o[5] for o in backward)
    weights = [c for _, c in reversed(fwd)]
    bwd = [(g, r, compute * w / sum(weights))
           for g, r, w in zip([gathers[0], 0, *gathers[1:], 0], [0, *reduces], weights)]
    return fwd, bwd


def _worker(rank: int, world: int, rounds: int) -> dict[str, Any]:
    from parallel_parity import make_config

    from framework.plan.estimate import zero3_pass_exposed
    from framework.train.parallel_engine import build_parallel_engine

    engines = {}
    for prefetch in (0, 1):
        cfg = make_config((*MODEL, f"parallel.fsdp_prefetch={prefetch}"))
        engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
        engine.model_parts[0]._set_unshard_async_op(True)
        engines[prefetch] = engine
    gen = torch.Generator().manual_seed(rank)
    micro = cfg.train.micro_batch_size
    batch = torch.randint(0, cfg.model.vocab_size, (1, micro, cfg.data.seq_len + 1), generator=gen)
    steps: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    calibs = []
    for r in range(rounds + 2):
        calib = _calibrate(world)  # every round: the link as loaded now, beside the two arms it predicts
        for prefetch in ((0, 1) if r % 2 == 0 else (1, 0)):
            step = _step_timeline(engines[prefetch], batch)
            if r >= 2:  # two warm-up rounds
                steps[prefetch].append(step)
        if r >= 2:
            calibs.append(calib)
    f = (world - 1) / world

    def secs(nbytes: int, fit: dict[str, Any]) -> float:
        return _predict(fit["alpha_s"], fit["beta_s_per_byte"], nbytes * f) if nbytes else 0.0

    predicted: dict[str, dict[int, list[float]]] = {v: {0: [], 1: []} for v, _, _ in VARIANTS}
    per_op: dict[str, dict[str, float]] = {op: {"measured_s": 0.0, "predicted_s": 0.0, "predicted_own_fit_s": 0.0}
                                           for op in DP_OPS}
    for calib, step0 in zip(calibs, steps[0]):
        ag, rs = calib["all_gather"], calib["reduce_scatter"]
        # Each unit's compute from this round's prefetch-0 timeline, where nothing overlaps.
        fwd_units, bwd_units = _units(step0)
        for variant, blocking, own_fit in VARIANTS:
            rs_fit = rs if own_fit else ag
            for prefetch in (0, 1):
                fwd = zero3_pass_exposed([secs(b, ag) for b, _ in fwd_units], [0.0] * len(fwd_units),
                                         [c for _, c in fwd_units], prefetch)
                # FSDP2 prefetches one unit in backward even at prefetch 0 (framework/plan/estimate.py)
                bwd = zero3_pass_exposed([secs(g, ag) for g, _, _ in bwd_units],
                                         [secs(r, rs_fit) for _, r, _ in bwd_units],
                                         [c for _, _, c in bwd_units], max(prefetch, 1), blocking_reduce=blocking)
                predicted[variant][prefetch].append(fwd + bwd)
        # The alpha-beta part alone: each collective's in-flight time at prefetch 0.
        for op, fit in (("all_gather", ag), ("reduce_scatter", rs)):
            mine = [o for o in step0["ops"] if o[0] == op]
            per_op[op]["measured_s"] += sum(o[4] for o in mine)
            per_op[op]["predicted_s"] += sum(secs(o[1], ag) for o in mine)
            per_op[op]["predicted_own_fit_s"] += sum(secs(o[1], fit) for o in mine)
    return {"calibration": calibs, "steps": steps, "predicted": predicted, "per_op": per_op}


VARIANTS = (("planner (GPU: reduce beside compute)", False, False), ("planner, blocking reduce-scatter", True, False),
            ("planner, blocking, reduce-scatter fit", True, True))
"""(name, blocking_reduce, reduce-scatters timed by their own calibration instead of the all-gather link's)."""


def _combine(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and round, the exposed time averaged over ranks, in all and with the wait for peers taken out.

    perf_counter is CLOCK_MONOTONIC, one clock for every process on the machine, so the last rank's issue of
    each collective is known: what a rank spends blocked before it is waiting for a slower peer (load skew),
    not the link; what it spends blocked after it is the collective itself (the planner's subject).
    """
    out: dict[str, Any] = {"measured": {}, "link_only": {}, "wall": {}, "skew": {}}
    for p in (0, 1):
        n_rounds = len(ranks[0]["steps"][p])
        meas, link, wall, skew = [], [], [], []
        for r in range(n_rounds):
            steps = [res["steps"][p][r] for res in ranks]
            last = [max(s["ops"][j][2] for s in steps) for j in range(len(steps[0]["ops"]))]
            e_all = e_link = waited = 0.0
            for s in steps:
                for j, (_, _, issued, done, _, exposed) in enumerate(s["ops"]):
                    e_all += exposed
                    if exposed > 0:
                        e_link += max(0.0, done - max(done - exposed, last[j]))
                    waited += last[j] - issued
            k = len(steps)
            meas.append(e_all / k)
            link.append(e_link / k)
            skew.append(waited / k)
            wall.append(statistics.mean(s["wall"] for s in steps))
        out["measured"][p], out["link_only"][p], out["wall"][p], out["skew"][p] = meas, link, wall, skew
    out["predicted"] = {v: {p: [statistics.mean(res["predicted"][v][p][r] for res in ranks)
                                for r in range(len(ranks[0]["predicted"][v][p]))] for p in (0, 1)}
                        for v in ranks[0]["predicted"]}
    out["per_op"] = {op: {k: sum(res["per_op"][op][k] for res in ranks) for k in ranks[0]["per_op"][op]}
                     for op in DP_OPS}
    # The alpha-beta part alone, prefetch 0: each collective from the last rank's issue to this rank's completion,
    # against the same round's fit.
    world, fits = len(ranks), ranks[0]["calibration"]
    for op in DP_OPS:
        meas = pred = 0.0
        for r, fit in enumerate(fits):
            steps = [res["steps"][0][r] for res in ranks]
            for j, o in enumerate(steps[0]["ops"]):
                if o[0] != op:
                    continue
                last = max(s["ops"][j][2] for s in steps)
                meas += statistics.mean(max(0.0, s["ops"][j][3] - last) for s in steps)
                pred += _predict(fit["all_gather"]["alpha_s"], fit["all_gather"]["beta_s_per_byte"],
                                 o[1] * (world - 1) / world)
        out["per_op"][op]["after_last_peer_s"] = meas
        out["per_op"][op]["predicted_after_s"] = pred
    out["link"] = {op: [(max(0.0, c[op]["alpha_s"]), 1 / c[op]["beta_s_per_byte"]) for c in fits] for op in DP_OPS}
    return out


def _report(results: dict[int, dict[str, Any]], cmd: str, load: str) -> str:
    lines = [SECTION, "", f"`{cmd}` ({load}). The model: 6 blocks of hidden 256 (0.74 M parameters, 2.9 MB "
             "fp32 each), vocabulary 512, 2 x 64 tokens per rank, fp32 ZeRO-3, one block per FSDP unit. Every "
             "figure is averaged over ranks; each round calibrates the link and runs both arms, so a ratio is "
             "taken within one round; medians over rounds, (25th-75th percentile). Method: the bench's docstring.",
             ""]
    lines += ["| ranks | all-gather link: latency per ring step, bandwidth | per-collective in-flight time at "
              "prefetch 0, measured / alpha-beta: all-gather, reduce-scatter (against its own fit) | the same from "
              "the last rank's issue: all-gather, reduce-scatter |",
              "|---|---|---|---|"]
    for world, res in results.items():
        lat = [a / max(1, world - 1) * 1e6 for a, _ in res["link"]["all_gather"]]
        bw = [b / 1e9 for _, b in res["link"]["all_gather"]]
        po = res["per_op"]
        lines.append(f"| {world} | {_fmt(lat, 0)} us, {_fmt(bw, 2)} GB/s | "
                     f"{po['all_gather']['measured_s'] / po['all_gather']['predicted_s']:.2f}, "
                     f"{po['reduce_scatter']['measured_s'] / po['reduce_scatter']['predicted_s']:.2f} "
                     f"({po['reduce_scatter']['measured_s'] / po['reduce_scatter']['predicted_own_fit_s']:.2f}) | "
                     f"{po['all_gather']['after_last_peer_s'] / po['all_gather']['predicted_after_s']:.2f}, "
                     f"{po['reduce_scatter']['after_last_peer_s'] / po['reduce_scatter']['predicted_after_s']:.2f} |")
    names = list(next(iter(results.values()))["predicted"])
    lines += ["", "| ranks | prefetch | step ms | measured exposed ms | of it after the last peer's issue | "
              + " | ".join(f"predicted: {n}" for n in names) + " | ratio predicted (blocking RS) / measured: all, "
              "after the last peer |", "|---|---|---|---|---|" + "---|" * len(names) + "---|"]
    for world, res in results.items():
        for p in (0, 1):
            meas, link = res["measured"][p], res["link_only"][p]
            blocking = res["predicted"][names[1]][p]
            ratio_all = [a / b for a, b in zip(blocking, meas) if b > 0]
            ratio_link = [a / b for a, b in zip(blocking, link) if b > 0]
            lines.append(f"| {world} | {p} | {_fmt([w * 1e3 for w in res['wall'][p]], 1)} | "
                         f"{_fmt([m * 1e3 for m in meas], 1)} | {_fmt([x * 1e3 for x in link], 1)} | "
                         + " | ".join(_fmt([x * 1e3 for x in res["predicted"][n][p]], 1) for n in names)
                         + f" | {_fmt(ratio_all, 2)}, {_fmt(ratio_link, 2)} |")
    return "\n".join(lines) + "\n"


def _fmt(xs: list[float], digits: int) -> str:
    """median (25th-75th percentile)"""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):.{digits}f} ({q[0]:.{digits}f}-{q[2]:.{digits}f})"


def main() -> None:
    from framework.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    results = {w: _combine(run_distributed(_worker, w, timeout_s=900, rounds=args.rounds)) for w in args.ranks}
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    load = f"load average {' '.join(load_before)} before, {' '.join(load_after)} after, 2 cores"
    cmd = "PYTHONPATH=. nice -n 19 python bench/zero_overlap.py --ranks " + " ".join(map(str, args.ranks)) \
        + f" --rounds {args.rounds}"
    text = _report(results, cmd, load)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.write:
        replace_section(args.write, KEY, text)


if __name__ == "__main__":
    main()
