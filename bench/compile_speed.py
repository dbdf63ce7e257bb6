"""Compiled vs eager steady-state tokens/s of the smoke model (configs/smoke/smoke.yaml), 1 process, same run.

Three LocalEngines from the same seed, two eager (an A/A pair: their ratio is the method's noise floor) and one
with train.compile=true and the chosen backend, train on the same synthetic batches. After warm-up (the compiled
engine's first step compiles, timed on its own), rounds run one optimizer step of each engine in a shuffled
order, timed by the calling thread's CPU clock with one thread (bench/robust_timing.py: robust to a loaded,
shared machine). Reported: median step CPU time of each, tokens/s, the speed-up eager_i / compiled_i as the
median of per-round paired ratios with a bootstrap 95% interval (and eager_i / eager'_i, the A/A control), the
compile time, dynamo's compiled-graph count before and after the timed rounds (flat: no recompiles in steady
state), and the largest loss difference between the compiled and the eager run.

    python bench/compile_speed.py [--backend inductor] [--rounds 60] [--write docs/benchmarks/compile.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.robust_timing import interleaved, iqr_rel, loadavg, paired_ratio, thread_cpu_s
from bench.sections import replace_section
from framework.config import load_config
from framework.parallel.compile import compiled_frames
from framework.train.local_engine import LocalEngine
from framework.train.lr_schedule import lr_at

KEY = "compile"
HEADING = "## torch.compile vs eager on the smoke model"
AA = "eager (A/A copy)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smoke/smoke.yaml")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--rounds", type=int, default=60, help="interleaved rounds; one step of every engine per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # all work on the calling thread, so its CPU clock sees all of it
    engines, cfgs = {}, {}
    for name, flag in (("eager", "false"), (AA, "false"), ("compiled", "true")):
        cfg = load_config(args.config, [f"train.compile={flag}", f"train.compile_backend={args.backend}",
                                        "data.kind=synthetic"])
        torch.manual_seed(0)
        cfgs[name], engines[name] = cfg, LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    cfg = cfgs["eager"]
    n_micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
    total = 1 + args.warmup + args.rounds
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.model.vocab_size, (total, n_micro, cfg.train.micro_batch_size, cfg.data.seq_len + 1),
                         generator=gen)
    losses: dict[str, list[float]] = {name: [] for name in engines}

    def step(name: str) -> Callable[[], None]:
        engine = engines[name]

        def one() -> None:
            i = len(losses[name])
            losses[name].append(engine.forward_backward(data[i]))
            engine.clip_grad_norm(cfg.train.grad_clip)
            engine.optimizer_step(lr_at(cfg.train, i))
        return one

    fns = {name: step(name) for name in engines}
    load0 = loadavg()
    w0, c0 = time.perf_counter(), thread_cpu_s()
    for fn in fns.values():  # the first step of each: the compiled one compiles its graphs
        fn()
    compile_s, compile_cpu_s = time.perf_counter() - w0, thread_cpu_s() - c0
    frames_first = compiled_frames()
    res = interleaved(fns, args.rounds, warmup=args.warmup)
    frames_after, load1 = compiled_frames(), loadavg()
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    cpu = res.cpu
    med = {name: statistics.median(t) for name, t in cpu.items()}
    diff = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"], strict=True))
    cmd = f"python bench/compile_speed.py --backend {args.backend} --rounds {args.rounds} --warmup {args.warmup}"
    lines = [f"`{cmd}` (torch {torch.__version__}, CPU, 1 thread; {args.config}: {cfg.model.preset}, {tokens} "
             f"tokens per step; load average {load0} -> {load1}; the thread clock saw {res.coverage:.1%} of the "
             f"process's CPU time in the timed steps). {args.rounds} rounds of one optimizer step per engine in a "
             f"shuffled order, timed by the calling thread's CPU clock (bench/robust_timing.py); speed-up = median "
             f"over rounds of the paired ratio eager_i / this_i with a bootstrap 95% interval; `{AA}` is a second "
             f"eager engine in the same rounds (the A/A control: the method's noise floor).", "",
             "| engine | step, CPU ms (median) | IQR / median | tokens/s (CPU time) | wall ms (median) | "
             "speed-up vs eager [95% CI] |", "|---|---|---|---|---|---|"]
    for name in engines:
        lines.append(f"| {name} | {med[name] * 1e3:.1f} | {iqr_rel(cpu[name]):.0%} | {tokens / med[name]:.0f} | "
                     f"{statistics.median(res.wall[name]) * 1e3:.1f} | {paired_ratio(cpu['eager'], cpu[name])} |")
    speedup = paired_ratio(cpu["eager"], cpu["compiled"])
    lines += ["", f"Noise floor (A/A): eager / its copy = {paired_ratio(cpu['eager'], cpu[AA])}. Compiled speed-up "
              f"{speedup}: the interval {'holds' if speedup.lo <= 1 <= speedup.hi else 'excludes'} 1.",
              "", f"First step of all three engines (the compiled one compiles its {args.backend} graphs): "
              f"{compile_s:.1f} s wall, {compile_cpu_s:.1f} s CPU; compiled graphs after the first step / after the "
              f"timed rounds: {frames_first} / {frames_after}; largest loss difference compiled vs eager over "
              f"{len(losses['compiled'])} steps: {diff:.1e}."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(args.write, KEY, f"{HEADING}\n\n{text}\n")


if __name__ == "__main__":
    main()
