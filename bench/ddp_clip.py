"""DDP's exposed all-reduce time and the gradient clip's time, the old path against the new in one run.

    PYTHONPATH=. nice -n 19 python bench/ddp_clip.py [--rounds 7] [--params-mb 400]

1. Clip (one process): unscale + global norm + clip of a model's gradients (a llama-like block list), the
   per-parameter code the engine had (fp64 copy of each gradient, ~4 ops per parameter; kept below as `_old_*`)
   against `framework.parallel.precision` (torch._foreach_* on the local gradients), interleaved rounds, median.
   Also the largest fp64 tensor each allocates (the old path copies every gradient to fp64 in turn).
2. DDP (2 gloo ranks, dp_replicate=2, zero_stage 0, comm_log on): one step of each arm per round, interleaved —
   old: one bucket of every gradient, all-reduced after backward; new: 25 MiB buckets launched from backward
   hooks. Measured per step: the dp_replicate all-reduce buckets' in-flight seconds and exposed seconds (the
   rank blocked in `Work.wait`), and the step time.
Noise: the 25th-75th percentile over rounds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "parallel"))

from framework.parallel.precision import global_grad_norm, local_grad, scale_grads

MODEL = ("model.hidden=384", "model.ffn_hidden=1024", "model.n_layers=8", "model.n_heads=6", "model.n_kv_heads=2",
         "model.vocab_size=8192", "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.precision=fp32", "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.zero_stage=0",
         "parallel.comm_log=true")


def _old_norm(params: list[torch.Tensor]) -> torch.Tensor:
    sums = [local_grad(p)[0].detach().double().pow(2).sum() for p in params if p.grad is not None]
    return torch.stack(sums).sum().sqrt().float()


def _old_scale(params: list[torch.Tensor], factor: float) -> None:
    for p in params:
        if p.grad is not None:
            local_grad(p)[0].mul_(factor)


def _new_clip(params: list[torch.Tensor]) -> float:
    scale_grads(params, 0.5)
    norm = float(global_grad_norm(params, 1, [], torch.device("cpu")))
    scale_grads(params, min(1.0, 1.0 / (norm + 1e-6)))
    return norm


def _old_clip(params: list[torch.Tensor]) -> float:
    _old_scale(params, 0.5)
    norm = float(_old_norm(params))
    _old_scale(params, min(1.0, 1.0 / (norm + 1e-6)))
    return norm


def _llama_like(params_mb: float) -> list[torch.nn.Parameter]:
    """Blocks of a hidden-1024 llama (7 matrices + 2 norms each) plus an embedding, about `params_mb` MiB."""
    d, f = 1024, 2816
    shapes: list[tuple[int, ...]] = [(32000, d)]
    while sum(math.prod(s) for s in shapes) * 4 < params_mb * 2**20:
        shapes += [(d,), (d, d), (d // 4, d), (d // 4, d), (d, d), (d,), (f, d), (f, d), (d, f)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s))
        p.grad = torch.randn(s, generator=gen)
        out.append(p)
    return out


def bench_clip(rounds: int, params_mb: float) -> dict[str, Any]:
    params = _llama_like(params_mb)
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(rounds):
        for arm, fn in (("old", _old_clip), ("new", _new_clip)):
            for p in params:
                p.grad.normal_()  # type: ignore[union-attr]
            t0 = time.process_time()
            fn(params)
            times[arm].append(time.process_time() - t0)
    ratios = [n / o for n, o in zip(times["new"], times["old"])]
    return {"n_params": len(params), "mb": sum(p.numel() for p in params) * 4 / 2**20, "times": times,
            "ratio": _q(ratios), "old_fp64_mb": max(p.numel() for p in params) * 8 / 2**20,
            "new_fp64_mb": len(params) * 8 / 2**20}


def _ddp_worker(rank: int, world: int, rounds: int) -> dict[str, Any]:
    from parallel_parity import make_config

    from framework.parallel.ddp import ReplicatedGradSync
    from framework.train.parallel_engine import build_parallel_engine

    cfg = make_config(MODEL)
    engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
    new = engine.replica_sync
    assert new is not None and engine.comm is not None
    old = ReplicatedGradSync(new.params, new.group, new.size, bucket_bytes=math.inf, overlap=False)
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, list[tuple[float, float, float, int]]] = {"old": [], "new": []}
    for r in range(rounds + 1):
        for arm, sync in (("old", old), ("new", new)):
            engine.replica_sync = sync
            batch = torch.randint(0, cfg.model.vocab_size, (2, 2, cfg.data.seq_len + 1), generator=gen)
            dist.barrier()
            engine.comm.reset()
            t0 = time.perf_counter()
            engine.forward_backward(batch)
            step = time.perf_counter() - t0
            buckets = [t for t in engine.comm.resolved_timings() if t.axis == "dp_replicate" and t.bytes > 8]
            engine.optimizer_step(1e-4, apply=False)
            if r:  # round 0 warms up
                out[arm].append((sum(t.seconds for t in buckets), sum(t.exposed_s for t in buckets), step,
                                 len(buckets)))
    return out


def bench_ddp(rounds: int) -> dict[str, Any]:
    from framework.testing import run_distributed

    per_rank = run_distributed(_ddp_worker, 2, timeout_s=1800, rounds=rounds)
    res: dict[str, Any] = {}
    for arm in ("old", "new"):
        rows = [row for rank in per_rank for row in rank[arm]]
        res[arm] = {"seconds": _q([r[0] for r in rows]), "exposed": _q([r[1] for r in rows]),
                    "step": _q([r[2] for r in rows]), "buckets": rows[0][3]}
    pairs = [(n[1], o[1]) for rank in per_rank for n, o in zip(rank["new"], rank["old"])]
    res["exposed_ratio"] = _q([n / o for n, o in pairs if o > 0])
    return res


def _q(xs: list[float]) -> tuple[float, float, float]:
    """(median, 25th, 75th percentile)."""
    qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return statistics.median(xs), qs[0], qs[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--params-mb", type=float, default=400.0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["clip", "ddp"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "clip" not in args.skip:
        c = bench_clip(args.rounds, args.params_mb)
        print(f"clip: {c['n_params']} params, {c['mb']:.0f} MiB fp32 gradients; CPU s old median "
              f"{statistics.median(c['times']['old']):.4f}, new {statistics.median(c['times']['new']):.4f}; "
              f"new/old {c['ratio'][0]:.3f} [{c['ratio'][1]:.3f}, {c['ratio'][2]:.3f}]; largest fp64 tensor "
              f"old {c['old_fp64_mb']:.1f} MiB, new {c['new_fp64_mb'] * 1024:.2f} KiB")
    if "ddp" not in args.skip:
        d = bench_ddp(args.rounds)
        for arm in ("old", "new"):
            a = d[arm]
            print(f"ddp {arm}: {a['buckets']} bucket(s); all-reduce in flight {_fmt(a['seconds'])} s, exposed "
                  f"{_fmt(a['exposed'])} s; step {_fmt(a['step'])} s")
        print(f"ddp exposed new/old (paired rounds, both ranks): {_fmt(d['exposed_ratio'])}")


def _fmt(q: tuple[float, float, float]) -> str:
    return f"{q[0]:.4f} [{q[1]:.4f}, {q[2]:.4f}]"


if __name__ == "__main__":
    main()
