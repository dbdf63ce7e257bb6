"""Requeue a SLURM job with the run's excluded nodes in its ExcNodeList; edit the exclusion list by hand.

    python -m launch.exclude requeue RUN_DIR --job ID [--shrink]   # the rendered sbatch script, on the requeue code
    tessera launch exclude RUN_DIR [--add NODE --reason TEXT | --clear NODE|all] [--job ID]

Why this order, measured on SLURM 22.05 (tests/launch/test_launch_slurm_exclude.py): `scontrol update ExcNodeList`
is refused while the job runs ("Job is no longer pending execution"), so the exclusion goes in right after
`scontrol requeue`, while the job is pending. But a requeue from inside the job kills the batch script at once
(SIGTERM, SIGKILL after KillWait): an update issued after it was lost, and the job restarted on the excluded node.
So this process ignores SIGTERM (inherited by the scontrol it runs) and finishes within KillWait (30 s by
default; the update takes milliseconds). A requeued job waits for BeginTime = now + 121 s, long after the update.

With `shrink` (observe.exclude.shrink, a cluster without spare nodes) the job is also asked for one node fewer per
excluded node of its allocation (NumNodes and NumTasks), else SLURM waits for replacement nodes.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from framework.base.errors import ParallelismError
from framework.config import Config
from framework.observe.exclusion import add_exclusion, clear_exclusion, log_applied, read_exclusions
from launch.env import LaunchError
from launch.slurm import SlurmSpec, layout_degrees


def _scontrol(*args: str) -> tuple[bool, str]:
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def allocation() -> list[str]:
    """This job's nodes (SLURM_JOB_NODELIST expanded); empty outside a job."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    ok, out = _scontrol("show", "hostnames", nodelist) if nodelist else (False, "")
    return out.split() if ok else []


def update_args(job: str, excluded: list[str], alloc: list[str], tasks_per_node: int, cpus_per_task: int,
                shrink: bool) -> list[str]:
    """The `scontrol update` arguments that carry `excluded` into the pending job (and shrink it if asked).

    Shrinking needs NumTasks and NumCPUs too: SLURM 22.05 keeps the job's task and CPU counts of the larger
    allocation, and the job is then never runnable (Reason=BadConstraints; measured)."""
    args = ["update", f"JobId={job}", f"ExcNodeList={','.join(excluded)}"]
    bad = [n for n in alloc if n in excluded]
    if shrink and bad and len(alloc) > len(bad):
        keep = len(alloc) - len(bad)
        args += [f"NumNodes={keep}-{keep}", f"NumTasks={keep * tasks_per_node}",
                 f"NumCPUs={keep * tasks_per_node * cpus_per_task}"]
    return args


def requeue(run_dir: Path, job: str, shrink: bool) -> int:
    """Requeue `job` and put every excluded node of `run_dir` into its ExcNodeList (module docstring)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue below sends it to the whole job, us included
    nodes = sorted(read_exclusions(run_dir)["nodes"])
    alloc = allocation()
    ok, out = _scontrol("requeue", job)
    print(f"[tessera] scontrol requeue {job}: {'ok' if ok else out}", flush=True)
    if not ok:
        return 1
    if not nodes:
        return 0
    tasks, cpus = (int(os.environ.get(v, "1").split("(")[0]) for v in ("SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK"))
    args = update_args(job, nodes, alloc, tasks, cpus, shrink)
    ok, out = _scontrol(*args)
    evidence = read_exclusions(run_dir)["nodes"]
    for node in nodes:
        entry = evidence[node]
        print(f"[tessera] excluding {node} ({entry.get('by')}: {entry.get('reason')} at step {entry.get('step')}: "
              f"{entry.get('evidence')})", flush=True)
    print(f"[tessera] scontrol {' '.join(args)}: {'ok' if ok else out}", flush=True)
    log_applied(run_dir, job, nodes, ["scontrol", *args], ok)
    return 0  # requeued either way; a refused update is in the log and in exclude.json's history


def check_shrink(cfg: Config, spec: SlurmSpec) -> None:
    """With observe.exclude.shrink, the layout must fit the world left after max_nodes exclusions, or the requeued
    job would fail at start: refused before submission."""
    ex = cfg.observe.exclude
    if not (ex.enabled and ex.shrink):
        return
    left = spec.nodes - ex.max_nodes
    if left < 1:
        raise LaunchError(f"observe.exclude.shrink with --nodes {spec.nodes} and observe.exclude.max_nodes="
                          f"{ex.max_nodes} would leave no node; lower max_nodes or turn shrink off")
    try:
        layout_degrees(cfg, left * spec.procs_per_node)
    except ParallelismError as err:
        raise LaunchError(f"observe.exclude.shrink: after excluding {ex.max_nodes} node(s) the job runs on {left} "
                          f"({left * spec.procs_per_node} ranks), which the layout does not fit: {err}; use a "
                          f"layout that fits both (e.g. parallel.dp_shard=-1) or turn shrink off") from None


def cmd_exclude(args: argparse.Namespace) -> int:
    """`tessera launch exclude`: list, add (force) or clear an exclusion; with --job, update the pending job now."""
    run_dir = Path(args.run_dir)
    if args.add:
        add_exclusion(run_dir, args.add, args.reason, {}, "manual")
    if args.clear:
        dropped = clear_exclusion(run_dir, args.clear)
        print(f"cleared: {', '.join(dropped) or 'nothing (not in the list)'}")
    nodes = read_exclusions(run_dir)["nodes"]
    for node, entry in sorted(nodes.items()):
        print(f"{node}: {entry['by']}, {entry['reason']}, step {entry['step']}, {entry['time']}: {entry['evidence']}")
    if not nodes:
        print(f"no node is excluded in {run_dir}")
    if args.job:
        ok, out = _scontrol("update", f"JobId={args.job}", f"ExcNodeList={','.join(sorted(nodes))}")
        print(f"scontrol update JobId={args.job} ExcNodeList={','.join(sorted(nodes))}: {'ok' if ok else out}")
        if not ok:
            print("a running job takes the list at its next requeue (e.g. `scancel --signal=USR1 JOB`: it saves, "
                  "exits with the requeue code and the script applies the list)", file=sys.stderr)
            return 1
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("exclude", help="list, force or clear the nodes a run's SLURM requeues exclude "
                                       "(<run dir>/exclude.json)")
    p.add_argument("run_dir", help="the run directory (run.dir, default runs/<run.name>)")
    p.add_argument("--add", metavar="NODE", help="exclude NODE from the next requeue on (a manual entry)")
    p.add_argument("--reason", default="manual", help="why, kept with a manual entry")
    p.add_argument("--clear", metavar="NODE", help="drop NODE from the list ('all': every node)")
    p.add_argument("--job", help="also set the list on this (pending) SLURM job now")
    p.set_defaults(func=cmd_exclude)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.exclude")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("requeue", help="requeue a job with the run's excluded nodes (the sbatch script)")
    p.add_argument("run_dir")
    p.add_argument("--job", required=True)
    p.add_argument("--shrink", action="store_true", help="one node fewer per excluded node of the allocation")
    args = parser.parse_args(argv)
    return requeue(Path(args.run_dir), args.job, args.shrink)


if __name__ == "__main__":
    sys.exit(main())
