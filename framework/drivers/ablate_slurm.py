"""`tessera ablate SPEC --slurm`: the ablation as a SLURM job array plus a report job that waits for it.

Scripts are rendered by the slurm launcher (`launch.slurm.render_sbatch`), so they get its environment, its output
file in the ablation directory and its SIGUSR1 checkpoint-and-requeue handling. Array task i runs
`tessera ablate SPEC --out DIR --array-task`, which trains run i of the plan (one process; ablation runs are
scaled down) and skips it when it already finished; the report job (`--report-only`) starts after every task
succeeded (`--dependency=afterok`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from framework.drivers.ablate import AblationSpec, plan_runs


def _program(args: argparse.Namespace, out: Path, *flags: str) -> list[str]:
    sets = [a for s in args.set for a in ("--set", s)]
    return ["-m", "framework.cli", "ablate", str(args.spec), "--out", str(out), *sets, *flags]


def render_array(args: argparse.Namespace, spec: AblationSpec, config_path: Path, out: Path,
                 dependency: str = "afterok:<ARRAY_JOB_ID>") -> tuple[str, str]:
    """The array job script and the report job script (depending on `dependency`)."""
    from framework.config import load_config
    from launch.slurm import SlurmSpec, render_sbatch

    n = len(plan_runs(spec, config_path, out))
    cfg = load_config(config_path, [*spec.overrides, f"run.name={spec.name}", f"run.dir={out}"])
    array = f"--array=0-{n - 1}" + (f"%{args.max_parallel}" if args.max_parallel else "")
    task = SlurmSpec(nodes=1, procs_per_node=1, gpus_per_node=args.gpus, time=args.time, partition=args.partition,
                     extra_sbatch=(array,))
    array_script = render_sbatch(cfg, task, str(config_path), [], sys.executable,
                                 program=_program(args, out, "--array-task"))
    report = SlurmSpec(nodes=1, procs_per_node=1, time="00:30:00", partition=args.partition,
                       extra_sbatch=(f"--dependency={dependency}", "--kill-on-invalid-dep=yes"))
    report_script = render_sbatch(cfg, report, str(config_path), [], sys.executable,
                                  program=_program(args, out, "--report-only"))
    return array_script, report_script


def launch_array(args: argparse.Namespace, spec: AblationSpec, config_path: Path, out: Path) -> int:
    """Write both scripts into `out` (--dry-run) or submit the array and then the dependent report job."""
    from launch.slurm import submit

    out.mkdir(parents=True, exist_ok=True)
    array_script, report_script = render_array(args, spec, config_path, out)
    if args.dry_run:
        (out / "ablate-array.sbatch").write_text(array_script)
        (out / "ablate-report.sbatch").write_text(report_script)
        print(f"wrote {out / 'ablate-array.sbatch'} and {out / 'ablate-report.sbatch'} (not submitted)")
        return 0
    job = submit(array_script, out / "array-job")
    _, report_script = render_array(args, spec, config_path, out, dependency=f"afterok:{job}")
    report_job = submit(report_script, out / "report-job")
    print(f"submitted array job {job} ({spec.name}) and report job {report_job} after it")
    return 0
