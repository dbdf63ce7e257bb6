"""A Muon run stops on one layout and resumes on another, as AdamW runs do (one 4-rank process group).

- Stopped at step 4 on DP4 ZeRO-3 and resumed on DP4 ZeRO-3: steps 5-8 bitwise the uninterrupted DP4 run.
- The same step-4 checkpoint resumed on TP2 x DP2: steps 5-8 within 1e-5 (the suite's resume tolerance,
  tests/checkpoint/test_ckpt_multirank.py) of an uninterrupted TP2 x DP2 run; the momentum buffers, saved like
  AdamW's states as DTensors placed like their parameters, are resharded from Shard(0) over 4 ranks to
  Shard(0/1) over tp inside Shard(0) over 2.
- The communication logger sees Muon's owner exchange: on DP4 ZeRO-3 (where FSDP itself sends no all-to-all)
  rank 0's all-to-all bytes per step are its shards of the hidden matrices (to the owners) plus the whole
  matrices it owns (back to their shards), in fp32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from framework.config import load_config
from framework.testing import run_distributed
from framework.testing.tiny import TINY

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["data.seed=7", "train.steps=8", "checkpoint.interval=4", "train.warmup_steps=2", "train.optimizer=muon",
          "train.muon.ns_dtype=fp32"]
DP4 = ["parallel.dp_shard=4", "parallel.zero_stage=3", "parallel.comm_log=true"]
TP2_DP2 = ["parallel.tp=2", "parallel.dp_shard=2"]


def _records(run: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "train":
            out[rec["step"]] = rec
    return out


def _train(run: Path, layout: list[str], stop_at: int | None = None) -> dict[int, float]:
    from framework.train.trainer import Trainer

    return Trainer(load_config(TINY, [*COMMON, f"run.dir={run}", *layout])).train(stop_at=stop_at).losses


def _on_rank0(fn: Any) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _runs(rank: int, world: int, root: Path) -> dict[str, dict[int, float]]:
    torch.set_num_threads(1)
    out = {"dp4": _train(root / "dp4", DP4), "tp2dp2": _train(root / "tp2dp2", TP2_DP2)}
    _train(root / "stopped", DP4, stop_at=4)
    _on_rank0(lambda: shutil.copytree(root / "stopped", root / "moved"))
    out["dp4_resumed"] = _train(root / "stopped", DP4)
    out["tp2dp2_resumed"] = _train(root / "moved", TP2_DP2)
    return out


def test_muon_stops_on_dp4_zero3_and_resumes_on_dp4_bitwise_and_on_tp2_dp2(tmp_path: Path) -> None:
    runs = run_distributed(_runs, 4, timeout_s=600, root=tmp_path)[0]
    assert sorted(runs["dp4_resumed"]) == [5, 6, 7, 8] and sorted(runs["tp2dp2_resumed"]) == [5, 6, 7, 8]
    assert [runs["dp4_resumed"][s] for s in range(5, 9)] == [runs["dp4"][s] for s in range(5, 9)]
    torch.testing.assert_close(torch.tensor([runs["tp2dp2_resumed"][s] for s in range(5, 9)]),
                               torch.tensor([runs["tp2dp2"][s] for s in range(5, 9)]), atol=1e-5, rtol=0)

    from framework.train.muon import is_muon_param
    from models.decoder import build_model

    cfg = load_config(TINY, COMMON)
    hidden = [p.numel() for n, p in build_model(cfg.model, device="meta").named_parameters() if is_muon_param(n, p)]
    expected = 4 * (sum(hidden) // 4 + sum(hidden[0::4]))  # rank 0 owns parameters 0, 4, 8, ... (round-robin)
    records = _records(tmp_path / "dp4")
    for step in range(2, 9):
        assert records[step]["comm/dp_shard/all_to_all/bytes"] == expected, step
