"""Communication logger (bytes per collective per axis, ring wire factors) and the model-state memory report."""

from __future__ import annotations

import torch
import torch.distributed as dist

from framework.parallel.comm import CommLogger, wire_factor
from framework.parallel.memory import model_state_report
from framework.testing import run_distributed
from models.config import model_config
from models.decoder import build_model


def _body(rank: int, world: int) -> tuple[dict, dict]:
    group = dist.new_group(list(range(world)))
    log = CommLogger({group: "dp_shard"})
    with log.active():
        dist.all_reduce(torch.ones(10), group=group)  # 40 bytes
        out = torch.empty(8 * world)
        dist.all_gather_into_tensor(out, torch.ones(8), group=group)  # full buffer 32 * world bytes
        dist.all_reduce(torch.ones(3))  # default group -> "world"
    dist.all_reduce(torch.ones(5), group=group)  # outside the block: not counted
    return dict(log.wire), dict(log.calls)


def test_logger_counts_bytes_per_axis_with_ring_factors() -> None:
    wire, calls = run_distributed(_body, 2, timeout_s=120)[0]
    assert calls == {("dp_shard", "all_reduce"): 1, ("dp_shard", "all_gather_into_tensor"): 1,
                     ("world", "all_reduce"): 1}
    assert wire[("dp_shard", "all_reduce")] == 40 * 2 * (2 - 1) / 2
    assert wire[("dp_shard", "all_gather_into_tensor")] == 64 * (2 - 1) / 2
    assert wire_factor("all_reduce", 8) == 2 * 7 / 8 and wire_factor("send", 4) == 1.0


def test_memory_report_counts_params_grads_and_adam_states() -> None:
    cfg = model_config("test-tiny")
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = sum(p.numel() for p in model.parameters())
    model(torch.randint(0, cfg.vocab_size, (1, 8))).sum().backward()
    opt.step()
    report = model_state_report([model], [opt])
    assert report["params"] == 4 * n and report["params/float32"] == 4 * n
    assert report["grads"] == 4 * n
    assert report["optimizer"] == 8 * n  # exp_avg + exp_avg_sq; the scalar step counters are left out
    assert report["total"] == 16 * n
