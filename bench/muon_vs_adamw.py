"""Muon vs AdamW: step time on the smoke model (one process) and on one parallel layout, and loss curves.

    PYTHONPATH=. nice -n 19 python bench/muon_vs_adamw.py [--steps 150] [--rounds 20] [--ranks 4]
                               [--png docs/muon_vs_adamw_loss.png] [--write docs/BENCHMARKS.md]

1. Loss curves: smoke-3m (2.4M parameters, configs/smoke/smoke.yaml's model, seq 128, 8 sequences per step, lr
   3e-3 cosine) trained from the same weights on the same learnable stream (a fixed random Markov chain,
   bench/zeropp.py) with AdamW and with Muon (`train.optimizer=muon`, published defaults: bf16 Newton-Schulz,
   Moonlight's AdamW-RMS scale, so the same lr and weight decay).
2. Step time, one process: whole training steps (forward, backward, clip, optimizer) of AdamW, a second AdamW
   (A/A: the method's noise floor), Muon with bf16 NS (default) and with fp32 NS, strictly interleaved rounds
   timed by per-thread CPU time (bench/robust_timing.py); median of paired ratios with a bootstrap 95% interval.
3. Step time, a parallel layout: the same model as DP4 ZeRO-3 on 4 gloo ranks (`--ranks 4`; 2: DP2), the same
   four engines built in one process group, interleaved in the same order on every rank;
   wall seconds of rank 0 (a step waits for the other ranks) and Muon's owner-exchange bytes per step from the
   communication logger.
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

from bench.curves import plot_loss_curves
from bench.robust_timing import interleaved, loadavg, paired_ratio
from bench.sections import replace_section
from bench.zeropp import markov_batches

SECTION = "## Muon vs AdamW: step time and loss"
BASE = ["model.preset=smoke-3m", "data.kind=synthetic", "data.seq_len=128", "train.global_batch_size=8",
        "train.micro_batch_size=2", "train.lr=3.0e-3", "train.weight_decay=0.1"]
CASES = {"AdamW": [], "AdamW (A/A)": [], "Muon (bf16 NS)": ["train.optimizer=muon"],
         "Muon (fp32 NS)": ["train.optimizer=muon", "train.muon.ns_dtype=fp32"]}


def _config(steps: int, *extra: str) -> Any:
    from framework.testing.tiny import tiny_config

    return tiny_config(None, *BASE, f"train.steps={steps}", f"train.warmup_steps={min(20, steps // 5)}", *extra)


def _step(engine: Any, cfg: Any, batch: torch.Tensor, lr: float) -> float:
    loss = engine.forward_backward(batch)
    engine.clip_grad_norm(cfg.train.grad_clip)
    engine.optimizer_step(lr)
    return loss


def loss_curves(steps: int) -> dict[str, list[float]]:
    from framework.train.local_engine import LocalEngine
    from framework.train.lr_schedule import lr_at

    out = {}
    for name in ("AdamW", "Muon (bf16 NS)"):
        cfg = _config(steps, *CASES[name])
        data = markov_batches(steps, 8, 128, cfg.model.vocab_size).view(steps, 4, 2, 129)
        engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
        out[name] = [_step(engine, cfg, data[s], lr_at(cfg.train, s)) for s in range(steps)]
    return out


def local_times(rounds: int) -> dict[str, list[float]]:
    from framework.train.local_engine import LocalEngine

    cfg0 = _config(100)
    batch = markov_batches(1, 8, 128, cfg0.model.vocab_size).view(4, 2, 129)
    fns = {}
    for name, extra in CASES.items():
        cfg = _config(100, *extra)
        engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
        fns[name] = lambda e=engine, c=cfg: _step(e, c, batch, 1e-3)  # type: ignore[misc]
    return interleaved(fns, rounds).cpu


def _parallel_worker(rank: int, world: int, rounds: int) -> dict[str, Any]:
    from framework.parallel.comm import CommLogger, mesh_axes
    from framework.parallel.mesh import AXES
    from framework.train.parallel_engine import build_parallel_engine

    torch.set_num_threads(1)
    layout = [f"parallel.dp_shard={world}", "parallel.zero_stage=3"]
    engines, fns = {}, {}
    for name in CASES:
        cfg = _config(100, *layout, *CASES[name])
        engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
        rows = markov_batches(1, 8, 128, cfg.model.vocab_size)[0]
        mine = rows[engine.dp_rank * 8 // world:(engine.dp_rank + 1) * 8 // world].reshape(-1, 2, 129)
        engines[name] = engine
        fns[name] = lambda e=engine, c=cfg, b=mine: _step(e, c, b, 1e-3)  # type: ignore[misc]
    wall = interleaved(fns, rounds, seed=1).wall  # the same seed: every rank runs the same order
    muon = engines["Muon (fp32 NS)"]
    muon.comm = CommLogger(mesh_axes(muon.mesh, AXES))
    fns["Muon (fp32 NS)"]()
    a2a = {k: v for k, v in muon.comm.payload.items() if k[1] == "all_to_all"}
    return {"wall": wall, "all_to_all_bytes": sum(a2a.values())}


def _row(name: str, samples: dict[str, list[float]], ref: str = "AdamW") -> str:
    med = statistics.median(samples[name])
    ratio = paired_ratio(samples[name], samples[ref]) if name != ref else None
    return f"| {name} | {med * 1e3:.0f} | {ratio if ratio else '1 (reference)'} |"


def report(curves: dict[str, list[float]], local: dict[str, list[float]], par: dict[str, Any], args: Any,
           load: str) -> str:
    cmd = (f"PYTHONPATH=. nice -n 19 python bench/muon_vs_adamw.py --steps {args.steps} --rounds {args.rounds} "
           f"--ranks {args.ranks} --png {args.png}")
    tail = {k: statistics.mean(v[-20:]) for k, v in curves.items()}
    lines = [SECTION, "",
             f"`{cmd}` ({date.today().isoformat()}, CPU, torch {torch.__version__}, load average {load} on a "
             f"shared 2-core machine; bench docstring). Ratios: median of paired per-round ratios against AdamW "
             f"with a bootstrap 95% interval; the AdamW (A/A) row is the method's noise.", "",
             "| smoke-3m, one process | median step, ms (thread CPU) | / AdamW |", "|---|---|---|",
             *[_row(n, local) for n in local], "",
             f"| smoke-3m, DP{args.ranks} ZeRO-3 ({args.ranks} gloo ranks) | median step, ms (wall, rank 0) "
             f"| / AdamW |", "|---|---|---|",
             *[_row(n, par["wall"]) for n in par["wall"]], "",
             f"Muon's owner exchange on DP{args.ranks}: {par['all_to_all_bytes']:,} all-to-all bytes per step on "
             f"rank 0 (its shards of the hidden matrices out, the matrices it owns back; communication logger).",
             f"Loss after {args.steps} steps (mean of the last 20): AdamW {tail['AdamW']:.4f}, Muon "
             f"{tail['Muon (bf16 NS)']:.4f} (same weights, batches, lr and weight decay).",
             f"This CPU has {'no ' if not _native_bf16() else ''}native bf16 matmul (avx512_bf16/amx_bf16), so "
             f"the bf16 Newton-Schulz rows pay for emulation; the fp32 rows are Muon's cost here. On GPUs the "
             f"published bf16 path is the fast one (not measured: no GPU in this run).", "",
             f"![Muon vs AdamW loss]({Path(args.png).name})", ""]
    return "\n".join(lines)


def _native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def main() -> None:
    from framework.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--ranks", type=int, choices=(2, 4), default=4)
    ap.add_argument("--png", default="docs/muon_vs_adamw_loss.png")
    ap.add_argument("--write", default="", help="replace this bench's section of the given markdown file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    load = loadavg()
    local = local_times(args.rounds)
    par = run_distributed(_parallel_worker, args.ranks, timeout_s=3600, rounds=args.rounds)[0]
    curves = loss_curves(args.steps)
    plot_loss_curves(curves, args.png, 'smoke-3m on a Markov-chain stream: AdamW vs Muon (same lr, weight decay)')
    text = report(curves, local, par, args, f"{load}-{loadavg()}")
    print(text)
    print(f"wall {time.time() - start:.0f} s")
    if args.write:
        replace_section(Path(args.write), SECTION, text)


if __name__ == "__main__":
    main()
