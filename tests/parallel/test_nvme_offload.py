"""NVMe offload of AdamW's states: bitwise the in-memory optimizer, checkpoints exact, bad paths refused.

The reference is the same engine with the in-memory `torch.optim.AdamW(foreach=False)` (train.optimizer_impl=
for_loop): the offloaded optimizer runs that kernel per tensor, so losses and grad norms must be *equal*.
Two spawns: one rank (the parallel engine on a world of 1) and DP2 ZeRO-3; each runs the reference, the
offloaded run with read-ahead/write-behind (small groups, 2 buffers), the same inline (overlap off), and a resume
from the offloaded run's step-10 checkpoint; the DP2 spawn also loads the 1-rank checkpoint (reshard on load)
and runs DP2 ZeRO-1 and TP2 both ways for 10 steps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_parity import batches, layout_overrides, make_config, rank_batch

from framework.base.errors import ConfigError
from framework.parallel.offload import NVMeOffloadConfig, check_offload_path, mount_of
from framework.testing import run_distributed

STEPS, SAVE_AT = 20, 10
Run = list[tuple[float, float]]


def _overrides(world: int, nvme: Path | None, **kw: Any) -> tuple[str, ...]:
    layout: dict[str, Any] = {"dp_shard": world, "zero_stage": 3} if world > 1 else {"dp_shard": 1}
    out = (*layout_overrides(layout), "train.optimizer_impl=for_loop")
    if nvme is not None:
        opts = {"path": str(nvme), "buffer_count": 2, "group_mb": 0.05, **kw}  # ~10 groups on the tiny model
        out += tuple(f"parallel.nvme_offload.{k}={v}" for k, v in opts.items())
    return out


def _steps(engine: Any, cfg: Any, data: torch.Tensor, start: int, stop: int) -> Run:
    from framework.train.lr_schedule import lr_at

    out = []
    for step in range(start, stop):
        loss = engine.forward_backward(rank_batch(data[step], engine.dp_rank, engine.dp_size,
                                                  cfg.train.micro_batch_size))
        norm = engine.clip_grad_norm(cfg.train.grad_clip)
        engine.optimizer_step(lr_at(cfg.train, step))
        out.append((loss, norm))
    return out


def _worker(rank: int, world: int, root: str, one_rank_ckpt: str = "") -> dict[str, Any]:
    from framework.checkpoint.dcp import load_checkpoint, optimizer_state, save_checkpoint
    from framework.parallel.offload import NVMeAdamW
    from framework.train.parallel_engine import build_parallel_engine

    torch.set_num_threads(1)
    nvme = Path(root) / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    cpu = torch.device("cpu")

    def engine(overrides: tuple[str, ...]) -> tuple[Any, Any]:
        cfg = make_config(overrides)
        return build_parallel_engine(cfg.model, cfg.train, cfg.parallel, cpu), cfg

    out: dict[str, Any] = {}
    ref, cfg = engine(_overrides(world, None))
    data = batches(cfg, STEPS)
    out["ref"] = _steps(ref, cfg, data, 0, SAVE_AT)
    out["ref_ckpt"] = str(save_checkpoint(Path(root) / "ref", SAVE_AT, ref.model_parts, ref.optimizers, {}))
    out["ref"] += _steps(ref, cfg, data, SAVE_AT, STEPS)

    off, cfg = engine(_overrides(world, nvme))
    assert all(isinstance(o, NVMeAdamW) for o in off.optimizers)
    out["offload"] = _steps(off, cfg, data, 0, SAVE_AT)
    saved = save_checkpoint(Path(root) / "off", SAVE_AT, off.model_parts, off.optimizers, {})
    out["ckpt"] = str(saved)
    out["offload"] += _steps(off, cfg, data, SAVE_AT, STEPS)
    opt = off.optimizers[0]
    spans = max(sum(any(q is p for q, _, _ in g.pieces) for g in opt.groups) for p in opt._params())
    out["io"] = (opt.bytes_read, opt.bytes_written, opt.numel, len(opt.groups), spans)

    inline, cfg = engine(_overrides(world, nvme, overlap=False, buffer_count=1))
    out["inline"] = _steps(inline, cfg, data, 0, STEPS)

    resumed, cfg = engine(_overrides(world, nvme))
    load_checkpoint(saved, resumed.model_parts, resumed.optimizers)
    out["resumed"] = _steps(resumed, cfg, data, SAVE_AT, STEPS)

    if one_rank_ckpt:  # a 1-rank checkpoint resharded onto this layout: the loaded states are the saved ones
        loaded, cfg = engine(_overrides(world, nvme))
        load_checkpoint(Path(one_rank_ckpt), loaded.model_parts, loaded.optimizers)
        state = optimizer_state(loaded.model_parts, loaded.optimizers)
        out["resharded"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).numpy().copy()  # by value
                            for k, v in state.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    if world == 2:  # the other stages and TP's DTensor shards (Shard(0) and Shard(1)): 10 steps each way
        for layout in ({"dp_shard": 2, "zero_stage": 1}, {"tp": 2, "dp_shard": 1}):
            runs = []
            for path in (None, nvme):  # TP's embedding: a Shard(0) weight with a Replicate gradient
                extra = tuple(f"parallel.nvme_offload.{k}={v}" for k, v in
                              {"path": path, "group_mb": 0.05}.items()) if path else ()
                e, c = engine((*layout_overrides(layout), "train.optimizer_impl=for_loop", *extra))
                runs.append(_steps(e, c, data, 0, 10))
            out[str(layout)] = runs
    try:
        engine(_overrides(world, nvme / "missing"))
    except ConfigError as err:
        out["missing"] = str(err)
    for e in (off, inline, resumed):
        for o in e.optimizers:
            o.close()
    return out


def _check(results: list[dict[str, Any]], world: int) -> None:
    for rank, r in enumerate(results):
        assert len(r["ref"]) == STEPS
        assert r["offload"] == r["ref"], f"rank {rank}: offloaded run differs from in-memory AdamW"
        assert r["inline"] == r["ref"], f"rank {rank}: overlap off differs"
        assert r["resumed"] == r["ref"][SAVE_AT:], f"rank {rank}: resume from the offloaded checkpoint differs"
        read, written, numel, n_groups, spans = r["io"]
        assert n_groups > 3, "the test must exercise several groups (read-ahead and write-behind)"
        assert spans > 1, "some parameter must span groups (updated in pieces)"
        assert read == written == 8 * numel * STEPS, "each step reads and writes exp_avg + exp_avg_sq once"
        assert "nvme_offload.path" in r["missing"] and "missing" in r["missing"] and "mkdir -p" in r["missing"]


@pytest.mark.distributed
def test_offloaded_adamw_is_bitwise_in_memory_adamw_and_resumes_exactly(tmp_path: Path) -> None:
    from framework.checkpoint.convert import read_full_state

    one = run_distributed(_worker, 1, timeout_s=300, root=str(tmp_path / "w1"))
    _check(one, 1)
    saved_off = read_full_state(Path(one[0]["ckpt"]))
    saved_ref = read_full_state(Path(one[0]["ref_ckpt"]))
    states = [k for k in saved_ref if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert states and sorted(saved_off) == sorted(saved_ref)  # the same DCP entries as in-memory AdamW
    for k in states:
        assert torch.equal(saved_off[k], saved_ref[k]), k

    two = run_distributed(_worker, 2, timeout_s=300, root=str(tmp_path / "w2"),
                          one_rank_ckpt=one[0]["ckpt"])
    _check(two, 2)
    for layout in ("{'dp_shard': 2, 'zero_stage': 1}", "{'tp': 2, 'dp_shard': 1}"):
        ref, off = two[0][layout]
        assert off == ref, f"{layout}: offloaded run differs from in-memory AdamW"
    for k in states:  # the optimizer-state key is optim.state.<fqn>.<name>
        key = k.removeprefix("optim.")
        assert torch.equal(torch.from_numpy(two[0]["resharded"][key]), saved_off[k]), k
    assert two[0]["ref"] != one[0]["ref"]  # DP2 sums in another order: the bitwise checks are not vacuous


# --- before step 1: bad settings ---------------------------------------------------------------------------------
MOUNTS = """/dev/nvme0n1p1 / ext4 rw 0 0
server:/export /shared nfs4 rw,relatime 0 0
10.0.0.1@tcp:/scratch /lustre lustre rw 0 0
/dev/nvme1n1 /shared/local xfs rw 0 0
"""


def test_network_filesystems_are_named_from_the_mount_table(tmp_path: Path) -> None:
    assert mount_of(Path("/shared/run"), MOUNTS) == ("/shared", "nfs4")
    assert mount_of(Path("/shared/local/x"), MOUNTS) == ("/shared/local", "xfs")
    assert mount_of(Path("/lustre/u/ckpt"), MOUNTS) == ("/lustre", "lustre")
    fake = MOUNTS.replace(" / ext4", f" {tmp_path} lustre")
    with pytest.raises(ConfigError, match=rf"network file system \(lustre mounted at {tmp_path}\).*node-local"):
        check_offload_path(str(tmp_path), 1, fake)
    check_offload_path(str(tmp_path), 1, MOUNTS.replace(" / ext4", f" {tmp_path} ext4"))  # local: accepted


def test_bad_paths_and_sizes_fail_with_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nvme_offload.path='.*nope' does not exist.*mkdir -p"):
        check_offload_path(str(tmp_path / "nope"), 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_offload_path(str(tmp_path / "file"), 1)
    with pytest.raises(ConfigError, match=r"GiB free but the optimizer states need 8388608.00 GiB"):
        check_offload_path(str(tmp_path), 2**53)
    if os.geteuid() == 0:  # root writes through permission bits: use a file system that refuses file creation
        unwritable = "/sys/fs"
    else:
        unwritable = str(tmp_path / "ro")
        os.mkdir(unwritable, 0o500)
    with pytest.raises(ConfigError, match="is not writable"):
        check_offload_path(unwritable, 1)


def test_offload_keys_are_validated_and_the_one_process_engine_checks_before_step_1(tmp_path: Path) -> None:
    from framework.train.trainer import build_engine

    for key, value in (("buffer_count", 0), ("group_mb", 0)):
        with pytest.raises(ConfigError, match=f"nvme_offload.{key}={value}"):
            make_config((f"parallel.nvme_offload.{key}={value}",)).validate()
    with pytest.raises(ConfigError, match="does not exist"):
        build_engine(make_config((f"parallel.nvme_offload.path={tmp_path / 'gone'}",)), torch.device("cpu"))
    engine = build_engine(make_config((f"parallel.nvme_offload.path={tmp_path}",)), torch.device("cpu"))
    assert type(engine.optimizers[0]).__name__ == "NVMeAdamW"
    assert NVMeOffloadConfig().enabled is False


def test_a_truncated_states_file_is_a_one_line_error_naming_it(tmp_path: Path) -> None:
    from framework.base.errors import CheckpointError
    from framework.train.trainer import build_engine

    engine = build_engine(make_config((f"parallel.nvme_offload.path={tmp_path}",)), torch.device("cpu"))
    opt = engine.optimizers[0]
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    os.truncate(opt.file, os.path.getsize(opt.file) // 2)  # a drive that lost the file's tail
    with pytest.raises(CheckpointError, match=rf"{opt.file} ends at byte \d+, before the \d+ bytes.*rerun"):
        opt.step()
