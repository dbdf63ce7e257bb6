"""The full stop-signal matrix, so no stop path goes untested: every signal, to the launcher and to one rank, at random
steps and in the middle of a checkpoint save, on 1 process, 2 and 4 ranks; the checks of
tests/launch/test_launch_signals.py on each case.

    PYTHONPATH=. nice -n 19 python bench/signal_matrix.py [--worlds 1 2 4] [--seed 0] [--write docs/CHECKPOINTS.md]

For each world size: an uninterrupted reference run, then one run directory interrupted again and again — SIGTERM,
SIGUSR1 and SIGINT each to the launcher and to the last rank after a random 1-3 steps, then each of the three in the
middle of the next interval checkpoint's save (tests/launch/signal_site: a rank signals its launcher from inside
the save) — and a last start that finishes the run. 1 process is `tessera train` itself (the launcher and the
rank are one process: one case per signal); 2 ranks are DP2 and 4 ranks TP2 x DP2 through `tessera launch local`.
Each case checks: the exit code (42 after SIGTERM/SIGUSR1, 130 after SIGINT); the newest committed checkpoint is
the stop step and the last logged step, and no partial `.tmp-*` checkpoint remains; the stop step is within 2
steps of the step the signal was sent after (the ranks agree on the next step boundary); no process of the run
is alive 20 s after the launcher exited. The last start's losses must equal the reference's bitwise.

The SLURM rows are bench/signal_matrix_slurm.py (every signal to the batch script and to the ranks, both launch
modes, on the real 2-node test cluster); this script does not start a cluster.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.checkpoint import REQUEUE_EXIT_CODE
from framework.testing.signals import (
    ROOT,
    Launch,
    checkpoint_state,
    local_argv,
    losses,
    processes_left,
    rank_pid,
    train_argv,
)

KEY = "signal-matrix"
SECTION = "## The signal matrix (bench/signal_matrix.py)"
TINY = str(ROOT / "configs" / "smoke" / "tiny.yaml")
INTERVAL = 4
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
LAYOUT = {1: [], 2: ["parallel.dp_shard=2"], 4: ["parallel.tp=2", "parallel.dp_shard=2"]}
TIMEOUT_S = 1800.0  # per wait: a loaded shared machine at nice 19 starts a rank slowly
WANT = {signal.SIGTERM: REQUEUE_EXIT_CODE, signal.SIGUSR1: REQUEUE_EXIT_CODE, signal.SIGINT: 130}


@dataclass
class Case:
    world: int
    signal: str
    target: str
    sent_after: int
    code: int
    want: int
    stop: int | None
    last_logged: int
    partial: list[str]
    left: list[int]
    exit_s: float
    traceback: bool

    @property
    def ok(self) -> bool:
        in_save = self.target.endswith("in save")
        near = self.stop is not None and (self.stop == self.sent_after if in_save else
                                           self.sent_after <= self.stop <= self.sent_after + 2)
        return (self.code == self.want and near and self.stop == self.last_logged and not self.partial
                and not self.left and not self.traceback)


def overrides(world: int, steps: int) -> list[str]:
    return [f"train.steps={steps}", f"checkpoint.interval={INTERVAL}", "train.warmup_steps=2", "data.seed=7",
            "train.eval_interval=0", "train.log_interval=1", "train.global_batch_size=8", *LAYOUT[world]]


def start(world: int, run: Path, log: Path, steps: int, env: dict[str, str] | None = None) -> Launch:
    argv = (train_argv(TINY, run, overrides(world, steps)) if world == 1 else
            local_argv(world, TINY, run, overrides(world, steps)))
    return Launch(argv, run, log, env)


def finish_case(world: int, sig: signal.Signals, target: str, at: int, launch: Launch, t0: float) -> Case:
    code = launch.wait(timeout=TIMEOUT_S)
    exit_s = time.monotonic() - t0
    stop, partial = checkpoint_state(launch.run)
    logged = max(losses(launch.run), default=0)
    left = processes_left(launch.run, within_s=20)
    return Case(world, sig.name, target, at, code, WANT[sig], stop, logged, partial, left, exit_s,
                "Traceback" in launch.output())


def run_world(world: int, rng: random.Random, root: Path, steps: int) -> tuple[list[Case], bool]:
    """Every case on one world size; the cases and whether the final losses equal the reference bitwise."""
    ref = root / f"w{world}-ref"
    first = start(world, ref, root / f"w{world}-ref.log", steps)
    assert first.wait(timeout=TIMEOUT_S) == 0, first.output()[-4000:]
    reference = losses(ref)
    run = root / f"w{world}-run"
    cases: list[Case] = []
    targets = ["process"] if world == 1 else ["launcher", f"rank {world - 1}"]
    done = 0
    for sig in SIGNALS:
        for target in targets:
            launch = start(world, run, root / f"w{world}-{sig.name}-{target.replace(' ', '')}.log", steps)
            at = done + rng.randint(1, 3)
            launch.wait_for_step(at, timeout=TIMEOUT_S)
            pid = rank_pid(run, world - 1) if target.startswith("rank") else launch.proc.pid
            t0 = time.monotonic()
            os.kill(pid, sig)
            cases.append(finish_case(world, sig, target, at, launch, t0))
            print(cases[-1], flush=True)
            done = cases[-1].stop or done
    for sig in SIGNALS:  # in the middle of the next interval checkpoint's save
        save_step = (done // INTERVAL + 1) * INTERVAL
        env = {"TESSERA_TEST_SIGNAL_IN_SAVE": f"{save_step}:{sig.name}",
               "TESSERA_TEST_SIGNAL_RANK": str(world - 1) if world > 1 else "0",
               **({"TESSERA_TEST_SIGNAL_TO": "self"} if world == 1 else {})}
        launch = start(world, run, root / f"w{world}-{sig.name}-save.log", steps, env)
        where = ("process" if world == 1 else "launcher") + " in save"
        case = finish_case(world, sig, where, save_step, launch, float("nan"))  # sent from inside: no send time
        commits = re.findall(r"checkpoint \S+/step_(\d+) committed", launch.output())
        case.partial += [] if commits == [str(save_step)] else [f"commits {commits}"]
        cases.append(case)
        print(case, flush=True)
        done = case.stop or done
    last = start(world, run, root / f"w{world}-last.log", steps)
    assert last.wait(timeout=TIMEOUT_S) == 0, last.output()[-4000:]
    return cases, losses(run) == reference and sorted(reference) == list(range(1, steps + 1))


def table(results: dict[int, tuple[list[Case], bool]], args: argparse.Namespace, load: str, seconds: float) -> str:
    lines = [SECTION, "",
             f"`PYTHONPATH=. nice -n 19 python bench/signal_matrix.py --worlds {' '.join(map(str, args.worlds))} "
             f"--seed {args.seed} --steps {args.steps}` (configs/smoke/tiny.yaml, checkpoint every {INTERVAL} steps; "
             f"1 process = `tessera train`, 2 ranks DP2, 4 ranks TP2 x DP2 through `tessera launch local`; "
             f"{seconds:.0f} s on the shared 2-core machine, load average {load}). Each row is one start of the "
             f"same run directory, "
             f"signalled after a random step (`sent after`; for `in save`, during the save of that step's "
             f"checkpoint); `stop` is the newest committed checkpoint, which must be the last logged step; `exit s` is "
             f"from the signal to the launcher's exit.", "",
             "| ranks | signal | to | sent after | stop | exit code (want) | partial | left after 20 s | exit s | ok |",
             "| ---: | --- | --- | ---: | ---: | --- | --- | ---: | ---: | --- |"]
    for world, (cases, _) in results.items():
        for c in cases:
            exit_s = "-" if math.isnan(c.exit_s) else f"{c.exit_s:.1f}"
            lines.append(f"| {world} | {c.signal} | {c.target} | {c.sent_after} | {c.stop} | {c.code} ({c.want}) | "
                         f"{', '.join(c.partial) or 'none'} | {len(c.left)} | {exit_s} | "
                         f"{'yes' if c.ok else '**NO**'} |")
    lines += ["", "Rerun to the end after all the stops, losses vs the uninterrupted run of the same world size: " +
              ", ".join(f"{w} rank{'s' if w > 1 else ''} {'bitwise equal' if eq else '**DIFFERENT**'}"
                        for w, (_, eq) in results.items()) + ".", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], choices=sorted(LAYOUT))
    ap.add_argument("--seed", type=int, default=0, help="seeds the random signal steps")
    ap.add_argument("--steps", type=int, default=40, help="steps of the run (every case takes 1-4 of them)")
    ap.add_argument("--write", type=Path, help="replace this section of the file (docs/CHECKPOINTS.md)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="signal-matrix-") as tmp:
        results = {w: run_world(w, rng, Path(tmp), args.steps) for w in args.worlds}
    load = f"{load} at start, {' / '.join(f'{x:.1f}' for x in os.getloadavg())} at the end"
    text = table(results, args, load, time.monotonic() - t0)
    print(text)
    if args.write:
        from bench.sections import replace_section

        replace_section(args.write, KEY, text)
    return 0 if all(c.ok for cases, eq in results.values() for c in cases) and all(
        eq for _, eq in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
