"""The signal matrix on the real 2-node SLURM test cluster, where requeue and srun's signal forwarding differ from a
local launch: SIGTERM, SIGUSR1 and SIGINT, each sent once to the batch script ("the launcher", `scancel --batch
--signal=X`) and once to the job's steps ("the ranks", `scancel --signal=X`), in both launch modes (srun of ranks,
srun of torchrun), at a seeded random step.

    PYTHONPATH=. python bench/signal_matrix_slurm.py [--seed 0] [--steps 30] [--write docs/CHECKPOINTS.md]

Starts the cluster of tests/launch/slurm_cluster.py (a controller and the emulated nodes n1, n2; needs root and
SLURM, as the tests do), and submits every case with `tessera launch slurm configs/smoke/tiny.yaml --nodes 2
--procs-per-node 1` (DP2 over gloo, one rank on each node), all side by side, next to an uninterrupted `tessera
launch local --nproc 2` reference of the same config. Each case: wait until metrics.jsonl shows the random step,
send the signal, and when the job's first start has ended check the ranks' exit code (as the script logs it: 42
after SIGTERM/SIGUSR1, 130 after SIGINT), that the newest committed checkpoint is the stop step and the last logged
step with no partial `.tmp-*` checkpoint, and that no process of the run (`run.dir=...` in its command line) is alive
20 s after the step ended. SIGTERM/SIGUSR1 jobs must then be requeued once (`Restarts=1`; the bench lifts SLURM's
121 s requeue hold), resume from the stop step, complete, and log losses bitwise equal to the reference at every
step; SIGINT jobs must end FAILED with exit code 130 and not be requeued.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "launch"))  # slurm_cluster.py, reused by path

from slurm_cluster import SlurmCluster, ensure_installed, job_env  # noqa: E402

from framework.checkpoint import REQUEUE_EXIT_CODE  # noqa: E402
from framework.testing.signals import (  # noqa: E402
    Launch,
    checkpoint_state,
    local_argv,
    losses,
    processes_left,
    processes_of,
)

KEY = "signal-matrix-slurm"
SECTION = "## The signal matrix on SLURM (bench/signal_matrix_slurm.py)"
TINY = str(ROOT / "configs" / "smoke" / "tiny.yaml")
INTERVAL = 4
MODES = ("srun", "torchrun")
SIGNALS = ("TERM", "USR1", "INT")
TARGETS = ("launcher", "ranks")
WANT = {"TERM": REQUEUE_EXIT_CODE, "USR1": REQUEUE_EXIT_CODE, "INT": 130}
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")
TIMEOUT_S = 900.0  # the whole polling loop


def overrides(run: Path, steps: int) -> list[str]:
    return [f"run.dir={run}", f"train.steps={steps}", f"checkpoint.interval={INTERVAL}", "train.warmup_steps=2",
            "data.seed=7", "train.eval_interval=0", "train.log_interval=1", "train.global_batch_size=8",
            "parallel.dp_shard=2"]


@dataclass
class Case:
    mode: str
    signal: str
    target: str
    at: int
    dir: Path
    job: str = ""
    phase: str = "submitted"  # submitted -> signalled -> ended -> released -> done
    sent_after: int = 0
    sent_t: float = 0.0
    ended_t: float = 0.0
    code: int | None = None
    stop: int | None = None
    last_logged: int = 0
    partial: list[str] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    state: str = ""
    restarts: int = 0
    resumed: int | None = None
    final_code: int | None = None
    loss_match: str = "-"
    notes: list[str] = field(default_factory=list)

    @property
    def run(self) -> Path:
        return self.dir / "run"

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.signal}-{self.target}"

    @property
    def requeue(self) -> bool:
        return WANT[self.signal] == REQUEUE_EXIT_CODE

    def log(self) -> str:
        path = self.run / f"slurm-{self.job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def ok(self) -> bool:
        first = (self.code == WANT[self.signal] and self.stop is not None and self.stop == self.last_logged
                 and self.sent_after <= self.stop <= self.sent_after + 2 and not self.partial and not self.left)
        if self.requeue:
            return (first and self.state == "COMPLETED" and self.restarts == 1 and self.resumed == self.stop
                    and self.final_code == 0 and self.loss_match == "bitwise")
        return first and self.state == "FAILED" and self.restarts == 0 and "requeueing" not in self.log()


def submit(cluster: SlurmCluster, case: Case, steps: int, env: dict[str, str]) -> None:
    case.dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "framework.cli", "launch", "slurm", TINY, "--nodes", "2", "--procs-per-node", "1",
           "--cpus-per-rank", "1", "--time", "15", "--signal-lead", "60", "--mode", case.mode, "--sbatch-arg=--hold",
           *overrides(case.run, steps)]
    out = subprocess.run(cmd, cwd=case.dir, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{case.name}: launch slurm failed:\n{out.stderr}")
    case.job = out.stdout.split()[-1]


def exit_codes(log: str) -> list[int]:
    return [int(c) for c in re.findall(r"\[tessera\] ranks exited with (\d+)", log)]


def jobs(cluster: SlurmCluster) -> dict[str, tuple[str, int]]:
    """Every job's (state, restarts), from one `scontrol show job` (finished jobs stay there for MinJobAge)."""
    out = {}
    for line in cluster.run("scontrol", "-o", "show", "job", check=False).splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "JobId" in fields:
            out[fields["JobId"]] = (fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", "0")))
    return out


def advance(cluster: SlurmCluster, case: Case, now_jobs: dict[str, tuple[str, int]],
            reference: dict[int, float] | None) -> None:
    """Advance one case by what its job shows now (called in a polling loop)."""
    now = time.monotonic()
    state, restarts = now_jobs.get(case.job) or (cluster.job_state(case.job), 0)
    if case.phase == "submitted":
        seen = max(losses(case.run), default=0)
        if seen >= case.at:
            cluster.run("scancel", *(["--batch"] if case.target == "launcher" else []), f"--signal={case.signal}",
                        case.job)
            case.phase, case.sent_after, case.sent_t = "signalled", seen, now
        elif state in FINAL:
            case.phase, case.state = "done", state
            case.notes.append(f"ended {case.state} before step {case.at}")
    elif case.phase == "signalled":
        codes = exit_codes(case.log())
        if codes or state in FINAL or (state == "PENDING" and restarts >= 1):
            case.phase, case.ended_t = "ended", now
            case.code = codes[0] if codes else None
            if not codes:
                case.notes.append(f"no `ranks exited` line; job {state}")
            case.stop, case.partial = checkpoint_state(case.run)
            case.last_logged = max(losses(case.run), default=0)
    elif case.phase == "ended":
        if processes_of(case.run) and now - case.ended_t < 20:
            return
        case.left = case.left or processes_left(case.run, within_s=0)
        if state in FINAL:
            finish(cluster, case, reference)
        elif state == "PENDING" and restarts >= 1 and not cluster._completing():
            time.sleep(2.0)  # see SlurmCluster.release_requeued: a launch within 1 s of the kill is refused
            cluster.run("scontrol", "update", f"JobId={case.job}", "StartTime=now")
            case.phase = "released"
    elif case.phase == "released":
        if state in FINAL:
            finish(cluster, case, reference)


def finish(cluster: SlurmCluster, case: Case, reference: dict[int, float] | None) -> None:
    case.phase, case.state = "done", cluster.job_state(case.job)
    case.restarts = cluster.restarts(case.job)
    log = case.log()
    codes = exit_codes(log)
    case.final_code = codes[-1] if len(codes) > 1 else None
    resumed = re.findall(r"resumed from step_(\d+)", log)
    case.resumed = int(resumed[-1]) if resumed else None
    if not case.requeue or reference is None:
        return
    got = losses(case.run)
    if got == reference:
        case.loss_match = "bitwise"
    elif sorted(got) == sorted(reference):
        case.loss_match = f"max diff {max(abs(got[s] - reference[s]) for s in reference):.1e}"
    else:
        missing = sorted(set(reference) - set(got))
        case.loss_match = f"steps missing {missing[:5]}"


def table(cases: list[Case], args: argparse.Namespace, load: str, seconds: float, ref_ok: bool) -> str:
    lines = [SECTION, "",
             f"`PYTHONPATH=. python bench/signal_matrix_slurm.py --seed {args.seed} --steps {args.steps}` "
             f"(configs/smoke/tiny.yaml as DP2, `tessera launch slurm --nodes 2 --procs-per-node 1 --cpus-per-rank "
             f"1`, checkpoint every {INTERVAL} steps, on the 2-node test cluster of tests/launch/slurm_cluster.py; "
             f"all {len(cases)} jobs submitted side by side with the `launch local --nproc 2` reference; "
             f"{seconds:.0f} s on the shared 2-core machine, load average {load}). `to`: launcher = "
             f"`scancel --batch --signal=X` (the batch script), ranks = `scancel --signal=X` (the job's steps). "
             f"`sent after`: the step metrics.jsonl showed when the signal was sent (seeded random); `stop`: the "
             f"newest committed checkpoint after the first start, which must be its last logged step; `exit`: the "
             f"ranks' code as the script logged it (want); `left`: processes of the run alive 20 s after the step "
             f"ended; `exit s`: from the signal to the step's end as the bench's 0.5 s poll saw it (the `ranks exited` "
             f"line; 12 jobs of 2 ranks on 2 cores). Then the job: its final state, `Restarts`, the "
             f"step the requeued start resumed from, and its losses vs the uninterrupted `launch local` run.", "",
             "| mode | signal | to | sent after | stop | exit (want) | partial | left | exit s | job | restarts | "
             "resumed | losses vs local | ok |",
             "| --- | --- | --- | ---: | ---: | --- | --- | ---: | ---: | --- | ---: | ---: | --- | --- |"]
    for c in cases:
        exit_s = f"{c.ended_t - c.sent_t:.1f}" if c.ended_t else "-"
        note = f" ({'; '.join(c.notes)})" if c.notes else ""
        lines.append(f"| {c.mode} | SIG{c.signal} | {c.target} | {c.sent_after} | {c.stop} | {c.code} "
                     f"({WANT[c.signal]}) | {', '.join(c.partial) or 'none'} | {len(c.left)} | {exit_s} | "
                     f"{c.state or '-'}{note} | {c.restarts} | {c.resumed if c.resumed is not None else '-'} | "
                     f"{c.loss_match} | {'yes' if c.ok else '**NO**'} |")
    lines += ["", f"Reference `launch local --nproc 2`: {'all steps logged' if ref_ok else '**FAILED**'}. "
              "`ok` needs every check of the row.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="seeds the random signal steps")
    ap.add_argument("--steps", type=int, default=30, help="steps of each run (the signal comes at step 3-12)")
    ap.add_argument("--write", type=Path, help="replace this section of the file (docs/CHECKPOINTS.md)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    ensure_installed()
    root = Path(tempfile.mkdtemp(prefix="tessera-slurm-"))
    os.chmod(root, 0o755)  # munged (user munge) must traverse every directory above its socket
    cluster = SlurmCluster(root / "cluster")
    (root / "cluster").mkdir()
    env = {**cluster.env, **job_env(), "OMP_NUM_THREADS": "1", "TESSERA_NUM_THREADS": "1"}
    cases = [Case(m, s, t, rng.randint(3, 12), root / f"{m}-{s}-{t}") for m in MODES for s in SIGNALS
             for t in TARGETS]
    try:
        cluster.start()
        ref_run = root / "local" / "run"
        ref_run.parent.mkdir()
        ref = Launch(local_argv(2, TINY, ref_run, overrides(ref_run, args.steps)), ref_run, root / "local.log")
        for case in cases:
            submit(cluster, case, args.steps, env)
            print(f"{case.name}: job {case.job}, signal after step {case.at}", flush=True)
        reference: dict[int, float] | None = None
        for case in cases:  # submitted held (--hold), so none runs ahead while the others are submitted
            cluster.run("scontrol", "release", case.job)
        deadline = time.monotonic() + TIMEOUT_S
        while any(c.phase != "done" for c in cases) and time.monotonic() < deadline:
            if reference is None and ref.proc.poll() is not None:
                reference = losses(ref_run)
                print(f"reference exited {ref.proc.returncode}, steps {len(reference)}", flush=True)
            now_jobs = jobs(cluster)
            for case in cases:
                if case.phase in ("released",) and reference is None:
                    continue  # finish() needs the reference; wait for it
                before = case.phase
                advance(cluster, case, now_jobs, reference)
                if case.phase != before:
                    print(f"{time.monotonic() - t0:6.1f} s {case.name}: {before} -> {case.phase}", flush=True)
            time.sleep(0.5)
        ref.wait(timeout=600)
        reference = losses(ref_run)
        for case in cases:
            if case.phase != "done":
                case.notes.append(f"timed out in phase {case.phase}")
                print(f"--- {case.name} job {case.job}\n{case.log()[-3000:]}", flush=True)
        ref_ok = ref.proc.returncode == 0 and sorted(reference) == list(range(1, args.steps + 1))
    finally:
        cluster.stop()
    for case in cases:
        if not case.ok:
            print(f"--- {case.name} job {case.job} (not ok)\n{case.log()[-4000:]}", flush=True)
    load = f"{load} at start, {' / '.join(f'{x:.1f}' for x in os.getloadavg())} at the end"
    text = table(cases, args, load, time.monotonic() - t0, ref_ok)
    print(text)
    if args.write:
        from bench.sections import replace_section

        replace_section(args.write, KEY, text)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if ref_ok and all(c.ok for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
