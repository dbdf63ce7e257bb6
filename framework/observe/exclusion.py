"""Node exclusion: a confirmed bad node becomes a committed checkpoint, an entry in <run>/exclude.json, a requeue.

A node is confirmed bad (observe.exclude) by
- the straggler detector (framework/observe/straggler.py): a rank or host named for `windows` windows in a row at
  `min_slowdown` times its peers' median; the node is that rank's (or that host's) hostname;
- the sniff tests (framework/observe/sniff.py, observe.sniff): a rank whose GEMM or P2P time is an outlier.
Both verdicts come from one all-gathered table, so every rank reaches the same one at the same step and asks for
the same stop (`StopSignals.request`): the trainer commits a checkpoint and exits with checkpoint.requeue_exit_code,
as after SIGUSR1. Before that, rank 0 writes the node and its evidence into <run>/exclude.json. The `launch slurm`
script requeues the job with every node of that file in its ExcNodeList (launch/exclude.py), and the run resumes
from the checkpoint on the other nodes (a smaller world resumes like any other layout change).

exclude.json: {"nodes": {NODE: {"reason", "step", "evidence", "by", "time"}}, "history": [every decision, applied
requeue and manual change, in order]}. `tessera launch exclude RUN --add NODE / --clear NODE` edits it by hand.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from framework.base.logs import get_logger
from framework.checkpoint import signals as stop_signals
from framework.observe.config import ExcludeConfig

log = get_logger("exclude")

FILE = "exclude.json"


def read_exclusions(run_dir: Path) -> dict[str, Any]:
    """The exclusion file of a run directory ({"nodes": {}, "history": []} when there is none)."""
    path = Path(run_dir) / FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    return {"nodes": dict(data.get("nodes") or {}), "history": list(data.get("history") or [])}


def _write(run_dir: Path, data: dict[str, Any]) -> None:
    path = Path(run_dir) / FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # a reader (the requeue script, a person) never sees half a file


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def add_exclusion(run_dir: Path, node: str, reason: str, evidence: dict[str, Any], by: str,
                  step: int | None = None) -> None:
    """Exclude `node` from the run's next requeue on; `by` is "policy" or "manual"."""
    data = read_exclusions(run_dir)
    entry = {"reason": reason, "step": step, "evidence": evidence, "by": by, "time": _now()}
    data["nodes"][node] = entry
    data["history"].append({"action": "exclude", "node": node, **entry})
    _write(run_dir, data)


def clear_exclusion(run_dir: Path, node: str, why: str = "manual") -> list[str]:
    """Drop `node` ("all": every node) from the exclusion list; returns the nodes dropped."""
    data = read_exclusions(run_dir)
    dropped = sorted(data["nodes"]) if node == "all" else [node] if node in data["nodes"] else []
    for name in dropped:
        del data["nodes"][name]
        data["history"].append({"action": "clear", "node": name, "by": why, "time": _now()})
    _write(run_dir, data)
    return dropped


def log_applied(run_dir: Path, job: str, nodes: list[str], command: list[str], ok: bool) -> None:
    """Record a requeue that carried the exclusion list to SLURM (launch/exclude.py)."""
    data = read_exclusions(run_dir)
    data["history"].append({"action": "requeue", "job": job, "nodes": nodes, "command": " ".join(command),
                            "ok": ok, "time": _now()})
    _write(run_dir, data)


class NodeExclusion:
    """The policy of one rank (module docstring); `on_straggler` and `on_sniff` return record fields."""

    def __init__(self, cfg: ExcludeConfig, run_dir: Path, rank: int) -> None:
        self.cfg, self.run_dir, self.rank = cfg, Path(run_dir), rank
        # Read once, by every rank, before any decision of this start: all ranks count the same.
        before = read_exclusions(run_dir)["nodes"].values() if cfg.enabled else []
        self.by_policy = sum(1 for entry in before if entry.get("by") == "policy")
        self.decided: str | None = None

    def on_straggler(self, verdict: dict[str, Any], step: int) -> dict[str, Any]:
        """A persistent straggler (the straggler/* fields of one window) confirms its host when it has held for
        `windows` windows at `min_slowdown`."""
        if not self.cfg.enabled or "straggler/host" not in verdict:
            return {}
        if verdict["straggler/windows"] < self.cfg.windows or verdict["straggler/slowdown"] < self.cfg.min_slowdown:
            return {}
        evidence = {k.split("/", 1)[1]: v for k, v in verdict.items() if k.startswith("straggler/")}
        return self._decide(str(verdict["straggler/host"]), "straggler", evidence, step)

    def on_sniff(self, slow: list[dict[str, Any]], hosts: list[str], step: int) -> dict[str, Any]:
        """The slowest rank named by the sniff tests confirms its node (`observe.exclude.sniff`)."""
        if not (self.cfg.enabled and self.cfg.sniff and slow):
            return {}
        worst = slow[0]
        return self._decide(hosts[worst["rank"]], "sniff", dict(worst), step)

    def _decide(self, node: str, reason: str, evidence: dict[str, Any], step: int) -> dict[str, Any]:
        if self.decided is not None:  # the stop is under way
            return {}
        if self.by_policy >= self.cfg.max_nodes:
            self.decided = ""
            if self.rank == 0:
                log.warning("exclude: %s would exclude node %s (%s) at step %d, but observe.exclude.max_nodes=%d "
                            "nodes are excluded already: not excluding; the run goes on", reason, node, evidence,
                            step, self.cfg.max_nodes)
            return {"exclude/refused": node}
        self.decided = node
        if self.rank == 0:
            add_exclusion(self.run_dir, node, reason, evidence, "policy", step)
            log.warning("exclude: node %s is bad (%s at step %d: %s); committing a checkpoint and exiting for a "
                        "requeue without it (%s)", node, reason, step, evidence, self.run_dir / FILE)
        signals = stop_signals.active()
        if signals is None:
            log.error("exclude: checkpoint.handle_signals is off, so the run cannot stop itself for the requeue: "
                      "node %s is recorded in %s and excluded at the next requeue", node, self.run_dir / FILE)
        else:
            signals.request(f"node exclusion of {node} ({reason})")
        return {"exclude/node": node, "exclude/reason": reason}
