"""`tessera doctor RUN_DIR` — read a run directory and say what went wrong, with the evidence and the fix.

    tessera doctor runs/smoke [--json] [--checksums]

It reads only what every run writes (config.yaml, metrics.jsonl, train.log and any other *.log/*.out/*.err,
stacks/rank_R.txt from the hang watchdog, checkpoints/) and checks, in order: a hang (which collective or
pipeline transfer, which rank is behind), refused or unusual resumes, checkpoint health (manifests), loss
(NaN/inf, spikes and the guard's skips and rollbacks, plateau), memory growing across steps, a data-bound loop,
throughput drops, damaged metrics lines and deliberate stops (Ctrl-C, SIGTERM). Findings are `error` (the run
failed or will), `warning` (it is wasting time or diverging) or `info` (worth knowing, not a fault). Exit code 1
when there is an error or a warning.
See docs/TROUBLESHOOTING.md for each diagnosis at length.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from framework.observe.stacks import behind, read_dumps

# Thresholds (documented in docs/TROUBLESHOOTING.md).
DATA_BOUND_SHARE = 0.25
"""A loop whose data time is more than this share of the step time waits on its input."""
SLOW_FACTOR = 0.6
"""A throughput drop: at least SLOW_RUN consecutive steps below this fraction of the run's median tokens/s."""
SLOW_RUN = 3
MEMORY_GROWTH_MB = 32.0
MEMORY_GROWTH_FRACTION = 0.10
PLATEAU_STEPS = 50
PLATEAU_DROP = 0.01


@dataclass
class Finding:
    level: str
    """error, warning or info."""
    topic: str
    summary: str
    evidence: list[str] = field(default_factory=list)
    fix: str = ""


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan  # strict-JSON writers put NaN/inf as null or a string


def read_records(run_dir: Path, damaged: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of metrics.jsonl that are JSON objects with an integer `step` where they have one; every other
    line (cut by a kill, binary bytes, an array, `"step": "seven"`) is skipped and, when `damaged` is given,
    listed there as "line N: why"."""
    path = run_dir / "metrics.jsonl"
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            why = "not JSON"
        else:
            step = record.get("step", 0) if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                out.append(record)
                continue
            why = "not a JSON object" if not isinstance(record, dict) else f"step {step!r} is not a whole number"
        if damaged is not None:
            last = " (the last line: cut by a kill)" if n == len(lines) and why == "not JSON" else ""
            damaged.append(f"line {n}{last}: {why}: {line[:80]!r}")
    return out


def read_logs(run_dir: Path) -> list[tuple[str, int, str]]:
    """(file, line number, text) of every log line in the run directory."""
    files = sorted({*run_dir.glob("*.log"), *run_dir.glob("logs/**/*.log"), *run_dir.glob("*.out"),
                    *run_dir.glob("*.err"), *run_dir.glob("logs/**/*.out"), *run_dir.glob("logs/**/*.err")})
    return [(str(f.relative_to(run_dir)), n, line) for f in files if f.is_file()
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)]


# --- checks -----------------------------------------------------------------------------------------------------
def check_flight(run_dir: Path) -> list[Finding]:
    """The flight records (framework/observe/flight.py): the collective, group and rank(s) a hang waits for."""
    from framework.observe.flight import describe, read_flight, stuck_collectives

    stuck = stuck_collectives(read_flight(run_dir))
    if not stuck:
        return []
    first = stuck[0]
    missing = ", ".join(str(r) for r in first.missing)
    return [Finding("error", "hang", f"hung in {first.op} on group {first.group}: rank(s) {missing} never issued it",
                    [describe(s) for s in stuck],
                    f"read the stack of rank(s) {missing} (stacks/rank_R.txt): what it does instead of {first.op}; a "
                    f"rank dead or missing from every record points at its host (tessera doctor on its log)")]


def check_hang(run_dir: Path) -> list[Finding]:
    stacks = read_dumps(run_dir)
    if not stacks:
        return check_flight(run_dir)
    late = behind(stacks)
    evidence = [f"rank {s.rank}: last completed step {s.last_step}, idle {s.idle_s:.0f} s, "
                + (f"waiting in {s.collective} called from {s.where}" if s.collective else f"at {s.where}")
                for s in stacks]
    waiting = sorted({s.collective for s in stacks if s.collective})
    if late:
        culprit = ", ".join(f"rank {s.rank} ({s.where})" for s in late)
        summary = (f"hung: {culprit} is behind; the other ranks wait in {', '.join(waiting) or 'a collective'}"
                   if len(late) < len(stacks) else f"hung outside any collective: {culprit}")
        fix = ("look at what the rank behind is doing at that frame (a data read, a filesystem stall, an "
               "infinite loop, a slow host); ranks that finished fewer steps point to uneven work or a desync. "
               "py-spy dump --pid on the live process shows native frames too")
    else:
        summary = f"hung: every rank waits in {', '.join(waiting)} at the same step (no rank is visibly behind)"
        fix = ("a collective that never completes on every rank: a network or NCCL problem — rerun with "
               "NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=COLL), check NCCL_SOCKET_IFNAME / the fabric, and that every "
               "rank issues the same collectives in the same order")
    if len(waiting) > 1:
        evidence.append(f"ranks wait in different collectives ({', '.join(waiting)}): the ranks' call orders "
                        f"diverged (a desync)")
    for f in check_flight(run_dir):  # the flight record names the collective, its group and who never issued it
        summary, evidence = f"{summary}; flight record: {f.summary.removeprefix('hung ')}", [*f.evidence, *evidence]
    return [Finding("error", "hang", summary, evidence, fix)]


_RESUMED = re.compile(r"resumed from (step_\d+)")
_REFUSED = re.compile(r"CheckpointError: (.*)")


def check_resumes(run_dir: Path, logs: list[tuple[str, int, str]]) -> list[Finding]:
    out: list[Finding] = []
    resumed = [(f, n, m.group(1)) for f, n, line in logs if (m := _RESUMED.search(line))]
    if resumed:
        out.append(Finding("info", "resume", f"resumed {len(resumed)} time(s): "
                           + ", ".join(r[2] for r in resumed), [f"{f}:{n}" for f, n, _ in resumed]))
    for f, n, line in logs:
        if (m := _REFUSED.search(line)):
            out.append(Finding("error", "resume", f"a start was refused: {m.group(1)[:300]}", [f"{f}:{n}"],
                               "the message names the differing field: restore it, start a new run.name, or set "
                               "the checkpoint.allow_* override it names if the change is intended"))
        elif "skipping checkpoint" in line:
            out.append(Finding("warning", "resume", "a checkpoint failed verification and was skipped on resume",
                               [f"{f}:{n}: {line.strip()[:300]}"],
                               "the run resumed from an older checkpoint and repeats steps; check the storage "
                               "(tessera ckpt inspect RUN) and keep checkpoint.keep_last >= 2"))
        elif "resuming across a change" in line:
            out.append(Finding("warning", "resume", "resumed across an overridden config/data change",
                               [f"{f}:{n}: {line.strip()[:300]}"],
                               "intended only when the change is; the loss curve before and after is not comparable"))
    return out


def check_checkpoints(run_dir: Path, checksums: bool = False) -> list[Finding]:
    from framework.base.errors import CheckpointError
    from framework.checkpoint import dcp as ckpt
    from framework.checkpoint.manager import verify_checkpoint

    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    out: list[Finding] = []
    bad = []
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: ckpt.step_of(p) or 0)
    for p in steps:
        try:
            verify_checkpoint(p, "checksum" if checksums else "size")
        except CheckpointError as err:
            bad.append(f"{p.name}: {err}")
    if bad:
        out.append(Finding("error", "checkpoint", f"{len(bad)} of {len(steps)} checkpoint(s) fail their manifest "
                           "check", bad, "a resume falls back to the newest valid one; delete the broken ones "
                           "after checking the storage (tessera ckpt inspect RUN)"))
    latest = root / ckpt.LATEST
    if latest.exists() and not (root / latest.read_text().strip()).is_dir():
        out.append(Finding("error", "checkpoint", f"`latest` names {latest.read_text().strip()!r}, which does not "
                           "exist", [str(latest)], "resume picks the newest valid step_N; rewrite latest or "
                           "remove it"))
    partial = sorted(p.name for p in root.glob(f"{ckpt.TMP_PREFIX}*"))
    if partial:
        out.append(Finding("warning", "checkpoint", f"{len(partial)} uncommitted save(s) left behind (the process "
                           "died while saving)", partial, "harmless: the next start removes them; if it keeps "
                           "happening, the save outlives the job's time limit or the disk fills"))
    return out


def _train(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train records of the run as it reads now (the last record of each step wins after a rollback)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("type") == "train" and "step" in r:
            by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]


def _spike_layers(records: list[dict[str, Any]], top: int = 3) -> list[Finding]:
    """Per spike the triage replayed: the layers whose output RMS was largest (the triage record's layer_act_rms)."""
    out = []
    for r in (r for r in records if r.get("type") == "triage"):
        # metrics.jsonl holds a non-finite value as null: it stays a non-finite layer here (ranked first)
        rms = [(math.inf if v is None else _num(v), str(i)) for i, v in enumerate(r.get("layer_act_rms") or [])
               if v is None or _num(v) >= 0]
        grads = list(r.get("layer_grad_norm") or [])
        grads = [(math.inf if v is None else _num(v), str(i) if i < len(grads) - 1 else "rest")
                 for i, v in enumerate(grads)]
        lines = [f"{what} {_ranked(vals, top)}" for what, vals in (("output RMS:", rms), ("gradient norm:", grads))
                 if vals]
        if not lines:
            continue
        top_act = ", ".join(i for _, i in sorted(rms, key=_worst)[:top]) or "-"
        top_grad = ", ".join(i for _, i in sorted(grads, key=_worst)[:top]) or "-"
        out.append(Finding("info", "loss", f"spike at step {r.get('step')} ({r.get('verdict')}): largest activations "
                           f"in layer(s) {top_act}; largest gradients in layer(s) {top_grad}", lines,
                           "a layer far above the others at a data spike points at what the samples excite (read the "
                           "quarantined samples); at a hardware verdict, at the device that computed it"))
    return out


def _worst(value_name: tuple[float, str]) -> float:
    """Sort key, largest first; a non-finite value (NaN included) first of all."""
    return -value_name[0] if math.isfinite(value_name[0]) else -math.inf


def _ranked(values: list[tuple[float, str]], top: int) -> str:
    mid = median(v for v, _ in values if math.isfinite(v)) if any(math.isfinite(v) for v, _ in values) else 0.0
    return "; ".join(f"layer {i} {v:.4g}" + (f" ({v / mid:.1f}x the median)" if mid > 0 and math.isfinite(v) else "")
                     for v, i in sorted(values, key=_worst)[:top])


def check_loss(records: list[dict[str, Any]]) -> list[Finding]:
    out: list[Finding] = []
    train = [r for r in records if r.get("type") == "train"]
    nonfinite = [r for r in train if not math.isfinite(_num(r.get("loss"))) or not math.isfinite(
        _num(r.get("grad_norm")))]
    skipped = [r for r in train if r.get("skipped") and r.get("guard")]
    spikes = [r for r in skipped if r.get("guard") == "spike"]
    rollbacks = [r for r in records if r.get("type") == "rollback"]
    if nonfinite:
        out.append(Finding("error" if len(nonfinite) > 3 or rollbacks else "warning", "loss",
                           f"non-finite loss or gradient norm at {len(nonfinite)} step(s)",
                           [f"step {r['step']}: loss {r.get('loss')}, grad_norm {r.get('grad_norm')}"
                            for r in nonfinite[:8]],
                           "lower train.lr or raise warmup, keep train.grad_clip on, use bf16 rather than fp16, and "
                           "look for a bad sample in the skipped window"))
    if spikes:
        out.append(Finding("warning", "loss", f"{len(spikes)} loss spike(s) skipped by the guard",
                           [f"step {r['step']}: loss {_num(r.get('loss')):.4g} "
                            f"(z-score {_num(r.get('guard_zscore')):.1f})" for r in spikes[:8]],
                           "isolated spikes are absorbed by the guard; repeated ones mean the LR is too high for the "
                           "batch size, or bad data: lower train.lr, raise train.warmup_steps, inspect the batches"))
    out += _spike_layers(records)
    if rollbacks:
        out.append(Finding("warning", "loss", f"the guard rolled back {len(rollbacks)} time(s)",
                           [f"at step {r.get('from_step')}: back to {r.get('checkpoint')}, skipped samples "
                            f"{r.get('skipped_samples')}" for r in rollbacks],
                           "the skipped samples are the suspects: decode and read them; lower train.lr"))
    steps = [r for r in _train(records) if math.isfinite(_num(r.get("loss"))) and not r.get("skipped")]
    if len(steps) >= PLATEAU_STEPS:
        k = max(5, len(steps) // 10)
        early = median(_num(r["loss"]) for r in steps[k:2 * k])
        late = median(_num(r["loss"]) for r in steps[-k:])
        if early - late < PLATEAU_DROP * early:
            out.append(Finding("warning", "loss", f"loss plateau: median {early:.4f} around steps "
                               f"{steps[k]['step']}-{steps[2 * k - 1]['step']} vs {late:.4f} over the last {k} steps",
                               [f"{len(steps)} accepted steps, drop {100 * (early - late) / early:.2f}% "
                                f"(< {100 * PLATEAU_DROP:.0f}%)"],
                               "check the LR schedule (train.lr, warmup, min_lr_ratio) in the log, that the data "
                               "are not random or exhausted (epochs), and tessera preflight's overfit stage"))
    return out


def check_memory(records: list[dict[str, Any]]) -> list[Finding]:
    mem = [(int(r["step"]), _num(r["memory_mb"])) for r in _train(records) if "memory_mb" in r]
    if len(mem) < 8:
        return []
    body = mem[max(2, len(mem) // 5):]  # the first steps allocate for good (optimizer state, caches)
    start, end = body[0][1], body[-1][1]
    ups = sum(b[1] > a[1] for a, b in itertools.pairwise(body)) / max(1, len(body) - 1)
    if end - start > max(MEMORY_GROWTH_MB, MEMORY_GROWTH_FRACTION * start) and ups >= 0.5:
        rate = (end - start) / max(1, body[-1][0] - body[0][0])
        return [Finding("warning", "memory", f"memory grows across steps: {start:.0f} -> {end:.0f} MB between steps "
                        f"{body[0][0]} and {body[-1][0]} (+{rate:.1f} MB/step, rising at {100 * ups:.0f}% of steps)",
                        [f"step {s}: {m:.0f} MB" for s, m in body[::max(1, len(body) // 6)]],
                        "something keeps a reference each step: tensors kept for logging without .item()/.detach(), "
                        "a growing list or cache, an autograd graph kept alive; on GPU compare "
                        "torch.cuda.memory_summary() between steps; it will end in an OOM")]
    return []


def _breakdown(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("step_time_s", "data_time_s", "fwd_bwd_time_s", "optim_time_s")
    return {k: sum(_num(r.get(k)) for r in rows) / len(rows) for k in keys}


_SLOW_CAUSE = {
    "data_time_s": "the input slowed down: storage or the loader (see data-bound)",
    "fwd_bwd_time_s": "compute or communication slowed: a throttled/shared device, a slow link or straggler rank, "
                      "or a recompilation",
    "optim_time_s": "the optimizer step slowed: offload traffic or host memory pressure",
}


def check_throughput(records: list[dict[str, Any]]) -> list[Finding]:
    train = [r for r in _train(records) if "step_time_s" in r][1:]  # step 1 pays one-off costs
    if len(train) < 4:
        return []
    out: list[Finding] = []
    mean = _breakdown(train)
    share = mean["data_time_s"] / mean["step_time_s"] if mean["step_time_s"] > 0 else 0.0
    if share > DATA_BOUND_SHARE:
        out.append(Finding("warning", "data", f"data-bound loop: waiting for batches takes {100 * share:.0f}% of "
                           f"the step ({mean['data_time_s']:.3f} of {mean['step_time_s']:.3f} s)",
                           [f"mean data_time_s {mean['data_time_s']:.4f}, fwd_bwd_time_s {mean['fwd_bwd_time_s']:.4f}"],
                           "the loader does not keep up: put the .bin/.idx on local disk, check the filesystem, "
                           "raise the loader's prefetch/workers, or pack longer sequences"))
    tps = [_num(r.get("tokens_per_s")) for r in train]
    ref = median(tps)
    slow = [i for i, t in enumerate(tps) if t < SLOW_FACTOR * ref]
    runs: list[list[int]] = []
    for i in slow:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in (r for r in runs if len(r) >= SLOW_RUN):
        rows = [train[i] for i in run]
        slow_mean = _breakdown(rows)
        grew = max(("data_time_s", "fwd_bwd_time_s", "optim_time_s"),
                   key=lambda k: slow_mean[k] - mean[k])
        out.append(Finding("warning", "throughput", f"throughput drop at steps {rows[0]['step']}-{rows[-1]['step']}: "
                           f"{median(tps[i] for i in run):.0f} tokens/s vs the run's median {ref:.0f}",
                           [f"{grew} rose from {mean[grew]:.4f} to {slow_mean[grew]:.4f} s on average"],
                           _SLOW_CAUSE[grew]))
    return out


RUN_FILES = ("metrics.jsonl", "config.yaml", "checkpoints", "stacks", "nccl_trace")
"""What a run directory holds besides its logs (any one of them is something to diagnose)."""
_STOPPED = re.compile(r"stopping at step (\d+) on (\S+): checkpoint committed; exit code (\d+)")


def check_stops(logs: list[tuple[str, int, str]]) -> list[Finding]:
    """Runs stopped on purpose: Ctrl-C (SIGINT), a scheduler's SIGTERM/SIGUSR1, a second Ctrl-C without a save."""
    out: list[Finding] = []
    for f, n, line in logs:
        if (m := _STOPPED.search(line)):
            step, sig, code = m.groups()
            how = "interrupted (Ctrl-C)" if sig == "SIGINT" else f"stopped by {sig} (preemption, scancel, time limit)"
            out.append(Finding("info", "stop", f"{how} at step {step}, checkpoint committed, exit code {code}",
                               [f"{f}:{n}"], "run the same command again to resume from that step"))
        elif "second interrupt: aborting now" in line:
            out.append(Finding("warning", "stop", "aborted by a second Ctrl-C without a checkpoint", [f"{f}:{n}"],
                               "the run resumes from its last committed checkpoint; the steps after it are redone"))
    return out


def check_metrics_file(damaged: list[str]) -> list[Finding]:
    if not damaged:
        return []
    only_last_cut = len(damaged) == 1 and "(the last line" in damaged[0]
    return [Finding("info" if only_last_cut else "warning", "metrics",
                    f"{len(damaged)} line(s) of metrics.jsonl are damaged and were skipped",
                    damaged[:8], "a last line cut by a kill is harmless; damage elsewhere means something else wrote "
                    "into the file (two runs sharing run.name, a disk error): give each run its own run.name")]


def diagnose(run_dir: Path, checksums: bool = False) -> list[Finding]:
    """Every finding for one run directory, most severe topics first."""
    from framework.base.errors import ConfigError

    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a run directory; pass runs/<run.name> (it holds metrics.jsonl)")
    damaged: list[str] = []
    records, logs = read_records(run_dir, damaged), read_logs(run_dir)
    if not records and not logs and not damaged and not any((run_dir / name).exists() for name in RUN_FILES):
        return [Finding("error", "run", f"{run_dir} holds no run: no metrics.jsonl, config.yaml, logs, stack dumps "
                        f"or checkpoints",
                        [], "pass the run's directory (runs/<run.name>); if it is that, the run never started: "
                        "look at the job's own output (SLURM's slurm-JOBID.out) for why")]
    return [*check_hang(run_dir), *check_resumes(run_dir, logs), *check_checkpoints(run_dir, checksums),
            *check_metrics_file(damaged), *check_loss(records), *check_memory(records),
            *check_throughput(records), *check_stops(logs)]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("doctor", help="diagnose a run directory (hangs, loss, memory, data, checkpoints)")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", action="store_true", help="one JSON object per finding")
    p.add_argument("--checksums", action="store_true", help="verify checkpoint checksums, not only sizes")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    findings = diagnose(args.run_dir, args.checksums)
    problems = [f for f in findings if f.level != "info"]
    if args.json:
        for f in findings:
            print(json.dumps(asdict(f)))
        return 1 if problems else 0
    steps = [r["step"] for r in read_records(args.run_dir) if r.get("type") == "train"]
    print(f"tessera doctor {args.run_dir}: {len(steps)} train records"
          f"{f', last step {max(steps)}' if steps else ''}; "
          f"{len(problems) or 'no'} problem{'s' if len(problems) != 1 else ''} found")
    for f in findings:
        print(f"\n[{f.level}] {f.topic}: {f.summary}")
        for e in f.evidence:
            print(f"    {e}")
        if f.fix:
            print(f"  fix: {f.fix}")
    return 1 if problems else 0
