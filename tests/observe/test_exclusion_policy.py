"""The node-exclusion policy without a cluster: which verdict confirms a node, what is written, when the run stops,
and the `scontrol update` a requeue carries. The real requeue is tests/launch/test_launch_slurm_exclude.py."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from framework.checkpoint.signals import StopSignals
from framework.config import load_config
from framework.observe.config import ExcludeConfig
from framework.observe.exclusion import NodeExclusion, add_exclusion, clear_exclusion, read_exclusions
from launch.env import LaunchError
from launch.exclude import check_shrink, main, update_args
from launch.slurm import SlurmSpec


def _verdict(windows: int, slowdown: float, host: str = "n7") -> dict[str, Any]:
    return {"straggler/max_score": 40.0, "straggler/kind": "rank", "straggler/host": host, "straggler/rank": 5,
            "straggler/section": "backward", "straggler/slowdown": slowdown, "straggler/score": 40.0,
            "straggler/windows": windows}


@pytest.fixture
def signals() -> Any:
    installed = StopSignals().install()
    yield installed
    installed.restore()


def test_a_straggler_confirms_its_node_once_it_held_long_and_slow_enough(tmp_path: Path, signals: Any) -> None:
    policy = NodeExclusion(ExcludeConfig(enabled=True, windows=4, min_slowdown=1.5), tmp_path, rank=0)
    assert policy.on_straggler({"straggler/max_score": 2.0}, 10) == {}  # a quiet window
    assert policy.on_straggler(_verdict(3, 3.0), 30) == {}  # not long enough
    assert policy.on_straggler(_verdict(4, 1.4), 40) == {}  # not slow enough
    assert signals.kind == 0 and not (tmp_path / "exclude.json").exists()
    assert policy.on_straggler(_verdict(4, 2.0), 40) == {"exclude/node": "n7", "exclude/reason": "straggler"}
    entry = read_exclusions(tmp_path)["nodes"]["n7"]
    assert (entry["reason"], entry["by"], entry["step"]) == ("straggler", "policy", 40)
    assert (entry["evidence"]["rank"], entry["evidence"]["section"], entry["evidence"]["slowdown"]) == (5, "backward",
                                                                                                       2.0)
    assert signals.received == signal.SIGUSR1 and signals.signal_name == "node exclusion of n7 (straggler)"
    assert policy.on_straggler(_verdict(5, 2.0, host="n8"), 50) == {}  # one decision per start: the stop is under way


def test_off_or_past_max_nodes_nothing_stops(tmp_path: Path, signals: Any) -> None:
    assert NodeExclusion(ExcludeConfig(), tmp_path, rank=0).on_straggler(_verdict(9, 9.0), 9) == {}
    add_exclusion(tmp_path, "n1", "straggler", {}, "policy", 3)
    add_exclusion(tmp_path, "n2", "bad fan", {}, "manual")  # manual entries do not count towards max_nodes
    policy = NodeExclusion(ExcludeConfig(enabled=True, max_nodes=1), tmp_path, rank=0)
    assert policy.on_straggler(_verdict(9, 9.0), 9) == {"exclude/refused": "n7"}
    assert signals.kind == 0 and sorted(read_exclusions(tmp_path)["nodes"]) == ["n1", "n2"]


def test_a_sniff_failure_confirms_the_slowest_ranks_node_on_request(tmp_path: Path, signals: Any) -> None:
    slow = [{"rank": 2, "test": "p2p", "seconds": 0.02, "median": 0.01, "slowdown": 2.0}]
    hosts = ["a", "a", "b", "b"]
    assert NodeExclusion(ExcludeConfig(enabled=True, sniff=False), tmp_path, 0).on_sniff(slow, hosts, 1) == {}
    out = NodeExclusion(ExcludeConfig(enabled=True), tmp_path, rank=1).on_sniff(slow, hosts, 1)
    assert out == {"exclude/node": "b", "exclude/reason": "sniff"} and signals.kind > 0
    assert not (tmp_path / "exclude.json").exists()  # rank 0 writes the file, every rank stops


def test_the_requeue_update_excludes_every_listed_node_and_shrinks_only_when_asked() -> None:
    alloc = ["n1", "n2", "n3", "n4"]
    assert update_args("7", ["n2", "n9"], alloc, 8, 4, shrink=False) == ["update", "JobId=7", "ExcNodeList=n2,n9"]
    assert update_args("7", ["n2", "n3"], alloc, 8, 4, shrink=True)[3:] == ["NumNodes=2-2", "NumTasks=16",
                                                                            "NumCPUs=64"]
    assert len(update_args("7", ["n9"], alloc, 8, 4, shrink=True)) == 3  # no excluded node in this allocation
    assert len(update_args("7", alloc, alloc, 8, 4, shrink=True)) == 3  # never down to zero nodes


def test_manual_add_and_clear_keep_a_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from framework.cli import main as tessera

    assert tessera(["launch", "exclude", str(tmp_path), "--add", "n5", "--reason", "ECC errors"]) == 0
    assert "n5: manual, ECC errors" in capsys.readouterr().out
    assert clear_exclusion(tmp_path, "all") == ["n5"]
    assert tessera(["launch", "exclude", str(tmp_path)]) == 0 and "no node is excluded" in capsys.readouterr().out
    assert [h["action"] for h in read_exclusions(tmp_path)["history"]] == ["exclude", "clear"]
    with pytest.raises(SystemExit):
        main(["requeue", str(tmp_path)])  # --job is required


def test_shrink_is_refused_before_submission_when_the_smaller_world_does_not_fit() -> None:
    cfg = load_config(Path(__file__).parents[2] / "configs/smoke/tiny-tp2dp2.yaml",
                      ["observe.exclude.enabled=true", "observe.exclude.shrink=true", "parallel.dp_shard=-1"])
    check_shrink(cfg, SlurmSpec(nodes=2, procs_per_node=2))  # 1 node x 2 ranks: tp 2 still fits
    with pytest.raises(LaunchError, match=r"runs on 1 \(1 ranks\), which the layout does not fit"):
        check_shrink(cfg, SlurmSpec(nodes=2, procs_per_node=1))
    with pytest.raises(LaunchError, match="would leave no node"):
        check_shrink(cfg, SlurmSpec(nodes=1, procs_per_node=2))
