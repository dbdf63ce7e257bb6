"""Helpers for checkpoint tests: launch real `tessera train` processes (one per rank) and read their metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from framework.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "smoke" / "tiny.yaml")
FAULT_WORKER = str(Path(__file__).with_name("fault_worker.py"))


class Ranks:
    """`world` processes of one training command (rank env as torchrun sets it)."""

    def __init__(self, argv: Sequence[str], world: int, log_dir: Path) -> None:
        port = free_port()
        self.procs = []
        log_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(world):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TESSERA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            for k in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID", "TORCHELASTIC_RUN_ID"):
                env.pop(k, None)
            if world == 1:
                for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                    env.pop(k)
            out = (log_dir / f"rank{rank}.log").open("ab")
            self.procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=out,
                                               stderr=subprocess.STDOUT))
        self.log_dir = log_dir

    def wait(self, timeout: float = 600) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"ranks did not finish in {timeout} s; logs:\n{self.logs()}") from None
        return codes

    def kill(self, sig: int = 9) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)
        for p in self.procs:
            p.wait(timeout=60)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))


def train_argv(run_dir: Path, *overrides: str) -> list[str]:
    return ["-m", "framework.cli", "train", TINY, f"run.dir={run_dir}", "data.seed=7", *overrides]


def fault_argv(fault: str, run_dir: Path, *overrides: str) -> list[str]:
    return [FAULT_WORKER, fault, TINY, f"run.dir={run_dir}", "data.seed=7", *overrides]


def train_losses(run_dir: Path) -> dict[int, float]:
    """Loss by step from metrics.jsonl (later records of a step win, as after a resume)."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if rec.get("type") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def wait_for(cond: Callable[[], bool], ranks: Ranks, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if not ranks.alive():
            raise AssertionError(f"a rank exited early; logs:\n{ranks.logs()}")
        if time.monotonic() > deadline:
            ranks.kill()
            raise AssertionError(f"condition not reached in {timeout} s; logs:\n{ranks.logs()}")
        time.sleep(0.05)


