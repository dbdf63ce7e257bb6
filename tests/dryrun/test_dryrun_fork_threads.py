"""The dry run forks one process per rank; a child of a process that ran OpenMP kernels must not use them.

libgomp does not survive fork: a parent that ran a multi-threaded GEMM leaves the child believing the thread pool
exists, and the child's first multi-threaded GEMM waits at the team barrier forever (a ground-truth dry-run child
hung so in a pytest process that had run MoE steps). The children run with one intra-op thread.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from framework.dryrun import run
from framework.testing.tiny import tiny_config


def test_a_dry_run_child_of_a_threaded_parent_computes_with_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(256, 256, dtype=torch.bfloat16)
        assert float((x @ x).float().abs().sum()) > 0  # the parent's OpenMP pool now exists

        def rank_body(*_: Any) -> tuple[int, float]:
            # Checked before the GEMM: with more threads it would hang rather than fail.
            if torch.get_num_threads() != 1:
                raise RuntimeError(f"the dry-run child runs {torch.get_num_threads()} intra-op threads")
            return torch.get_num_threads(), float((x @ x).float().abs().sum())

        monkeypatch.setattr(run, "dry_run_rank", rank_body)
        [(n, total)] = run.dry_run_ranks(tiny_config(None), [0], 1)
        assert n == 1 and total == float((x @ x).float().abs().sum())
    finally:
        torch.set_num_threads(threads)
