"""Compiled vs eager steady-state tokens/s of the smoke model (configs/smoke/smoke.yaml), 1 process, same run.

Two LocalEngines from the same seed (train.compile=false and =true with the chosen backend) train on the same
synthetic batches; after warm-up (the compiled engine's first steps compile), rounds alternate between them so
machine noise hits both alike. Reported: median step time of each, tokens/s, the ratio compiled / eager, the
compile (first-step) time, dynamo's compiled-graph count before and after the timed rounds (flat: no
recompiles in steady state), and the largest loss difference between the two runs.

    python bench/compile_speed.py [--backend inductor] [--rounds 6] [--steps 5] [--write docs/BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sections import replace_section
from framework.config import load_config
from framework.parallel.compile import compiled_frames
from framework.train.local_engine import LocalEngine
from framework.train.lr_schedule import lr_at

HEADING = "## torch.compile vs eager on the smoke model (issue 20)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smoke/smoke.yaml")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="steps per engine per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines, cfgs = {}, {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        cfg = load_config(args.config, [f"train.compile={flag}", f"train.compile_backend={args.backend}",
                                        "data.kind=synthetic"])
        cfgs[name], engines[name] = cfg, LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    cfg = cfgs["eager"]
    n_micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
    total = args.warmup + args.rounds * args.steps
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.model.vocab_size, (total, n_micro, cfg.train.micro_batch_size, cfg.data.seq_len + 1),
                         generator=gen)
    losses: dict[str, list[float]] = {name: [] for name in engines}
    times: dict[str, list[float]] = {name: [] for name in engines}
    step_of = dict.fromkeys(engines, 0)

    def run(name: str, n: int, timed: bool) -> None:
        engine = engines[name]
        for _ in range(n):
            step = step_of[name]
            t0 = time.perf_counter()
            losses[name].append(engine.forward_backward(data[step]))
            engine.clip_grad_norm(cfg.train.grad_clip)
            engine.optimizer_step(lr_at(cfg.train, step))
            if timed:
                times[name].append(time.perf_counter() - t0)
            step_of[name] += 1

    t0 = time.perf_counter()
    run("compiled", 1, False)
    compile_s = time.perf_counter() - t0
    run("compiled", args.warmup - 1, False)
    run("eager", args.warmup, False)
    frames_before = compiled_frames()
    for _ in range(args.rounds):
        for name in engines:
            run(name, args.steps, True)
    frames_after = compiled_frames()
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    med = {name: statistics.median(t) for name, t in times.items()}
    spread = {name: (statistics.quantiles(t, n=4)[2] - statistics.quantiles(t, n=4)[0]) / med[name]
              for name, t in times.items()}
    diff = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"], strict=True))
    cmd = (f"python bench/compile_speed.py --backend {args.backend} --rounds {args.rounds} --steps {args.steps} "
           f"--threads {args.threads}")
    lines = [f"`{cmd}` (torch {torch.__version__}, CPU, {args.threads} thread(s); {args.config}: "
             f"{cfg.model.preset}, {tokens} tokens per step). Median step over {args.rounds} alternating rounds x "
             f"{args.steps} steps; spread = interquartile range / median.", "",
             "| engine | step (ms) | tokens/s | spread |", "|---|---|---|---|"]
    for name in engines:
        lines.append(f"| {name} | {med[name] * 1e3:.1f} | {tokens / med[name]:.0f} | {spread[name]:.0%} |")
    lines += ["", f"compiled / eager tokens/s: **{med['eager'] / med['compiled']:.3f}**; first compiled step "
              f"(compiles {args.backend} graphs) {compile_s:.1f} s; compiled graphs before / after the timed rounds: "
              f"{frames_before} / {frames_after}; largest loss difference compiled vs eager over {total} steps: "
              f"{diff:.1e}."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(args.write, HEADING, f"{HEADING}\n\n{text}\n")


if __name__ == "__main__":
    main()
