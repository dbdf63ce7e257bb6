"""The doctor's hang diagnosis when every rank waits in a collective but they completed different numbers of steps:
the ranks with the fewest completed steps are named as behind, never the one that is ahead. The dumps are written
in the hang watchdog's format (its header line, then faulthandler's stacks, main thread last) with the frames a
rank blocked in torch.distributed has."""

from __future__ import annotations

from pathlib import Path

from framework.observe.doctor import diagnose
from framework.observe.stacks import behind, read_dumps

TORCH = "/venv/lib/python3.11/site-packages/torch/distributed"


def _dump(run: Path, rank: int, last_step: int, collective: str, where: str) -> None:
    (run / "stacks").mkdir(parents=True, exist_ok=True)
    (run / "stacks" / f"rank_{rank}.txt").write_text(
        f"rank {rank} pid {1000 + rank}: no step completed for 61.0 s (checkpoint.watchdog_timeout_s=60); "
        f"last completed step {last_step}\n"
        f"Current thread 0x00007f0000000001 (most recent call first):\n"
        f'  File "/repo/framework/checkpoint/watchdog.py", line 73 in dump\n'
        f'  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner\n\n'
        f"Thread 0x00007f0000000000 (most recent call first):\n"
        f'  File "{TORCH}/distributed_c10d.py", line 2850 in {collective}\n'
        f'  File "{TORCH}/c10d_logger.py", line 81 in wrapper\n'
        f'  File "/repo/framework/train/{where}.py", line 120 in {where}\n'
        f'  File "/repo/framework/train/trainer.py", line 400 in _train\n'
        f'  File "/repo/framework/cli.py", line 50 in <module>\n')


def test_every_rank_in_a_collective_names_the_ranks_with_fewest_steps(tmp_path: Path) -> None:
    _dump(tmp_path, 0, 7, "all_reduce", "clip_grad_norm")
    _dump(tmp_path, 1, 6, "all_reduce", "clip_grad_norm")  # behind: one step fewer
    _dump(tmp_path, 2, 7, "all_reduce", "clip_grad_norm")
    _dump(tmp_path, 3, 8, "broadcast", "load_batch")  # ahead: already waits in the next step's collective
    stacks = read_dumps(tmp_path)
    assert [s.collective for s in stacks] == ["all_reduce", "all_reduce", "all_reduce", "broadcast"]
    assert [s.rank for s in behind(stacks)] == [1]
    (hang,) = [f for f in diagnose(tmp_path) if f.topic == "hang"]
    assert hang.summary.startswith("hung: rank 1 (clip_grad_norm ") and "is behind" in hang.summary, hang.summary
    assert "rank 3" not in hang.summary and "rank 0" not in hang.summary
    assert "all_reduce, broadcast" in hang.summary
    assert any("desync" in e for e in hang.evidence)


def test_every_rank_at_the_same_step_in_a_collective_names_none(tmp_path: Path) -> None:
    for rank in range(3):  # negative control: nobody is behind, the fix points at the network
        _dump(tmp_path, rank, 5, "all_reduce", "clip_grad_norm")
    (hang,) = [f for f in diagnose(tmp_path) if f.topic == "hang"]
    assert "no rank is visibly behind" in hang.summary and "NCCL_DEBUG" in hang.fix
