"""`train.fp8` (framework/numerics/fp8.py, torchao's emulated FP8 on CPU): what is refused at config load, which
linears convert, and checkpoints: an FP8 run resumes bitwise, a bf16 run resumes from its checkpoint (the weights
are plain fp32 parameters under the 1-process FQNs) and it exports to Hugging Face."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from framework.base.errors import ConfigError
from framework.config import Config, load_config
from framework.testing.tiny import TINY

pytest.importorskip("torchao", reason="train.fp8 needs torchao (pip install 'torchao>=0.18,<0.19')")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FP8 = ["train.precision=bf16", "train.fp8.enabled=true"]


@pytest.mark.parametrize(("overrides", "names"), [
    (["train.fp8.enabled=true"], "train.precision=fp32"),
    ([*FP8, "parallel.cp=2", "parallel.dp_shard=1"], "each rank would scale with the amax of its tokens"),
    ([*FP8, "parallel.dp_replicate=2", "parallel.dp_shard=2"], "parallel.dp_replicate=2 with parallel.dp_shard=2"),
    ([*FP8, "model.preset=test-moe"], "model.moe.enabled=true: FP8 experts need torch._scaled_grouped_mm"),
    ([*FP8, "train.fp8.fsdp_all_gather=true", "parallel.tp=2"], "train.fp8.fsdp_all_gather=true with parallel.tp=2"),
    ([*FP8, "train.fp8.recipe=rowwise", "train.fp8.fsdp_all_gather=true"], "train.fp8.fsdp_all_gather=true with"),
    ([*FP8, "train.compile=true", "parallel.tp=2"], "train.compile=true with parallel.tp=2"),
    ([*FP8, "train.fp8.min_dim=8"], "train.fp8.min_dim=8"),
])
def test_unproven_combinations_are_refused_at_load(overrides: list[str], names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")) as err:
        load_config(TINY, overrides)
    assert "set" in str(err.value) or "e.g." in str(err.value)  # the message names the fix


def test_head_excluded_and_small_linears_stay_bf16() -> None:
    from torchao.float8.float8_linear import Float8Linear

    from framework.numerics.config import FP8Config
    from framework.numerics.fp8 import convert_to_fp8
    from models.config import model_config
    from models.decoder import build_model

    moe = build_model(model_config("test-moe"), seed=0, device=torch.device("cpu"))
    assert convert_to_fp8(moe, FP8Config(enabled=True), "cpu") > 0
    fp8 = {fqn for fqn, m in moe.named_modules() if isinstance(m, Float8Linear)}
    plain = {fqn for fqn, m in moe.named_modules() if type(m) is torch.nn.Linear}
    assert plain == {"output"} and not any("router" in f for f in fp8)  # the router's gate is no nn.Linear either
    cfg = load_config(TINY, FP8)
    wide = build_model(cfg.model, seed=0, device=torch.device("cpu"))
    assert convert_to_fp8(wide, FP8Config(enabled=True, min_dim=64), "cpu") == cfg.model.n_layers * 5  # wk, wv: 32 wide
    named = build_model(cfg.model, seed=0, device=torch.device("cpu"))
    assert convert_to_fp8(named, FP8Config(enabled=True, exclude=("output", "wq")), "cpu") == cfg.model.n_layers * 6
    assert type(named.layers["0"].attention.wq) is torch.nn.Linear


def _losses(run: Path) -> dict[int, float]:
    recs = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in recs if r["type"] == "train"}


def test_fp8_checkpoint_resumes_bitwise_loads_into_bf16_and_exports_to_hf(tmp_path: Path) -> None:
    from framework.checkpoint.hf import load_model, resolve_checkpoint
    from framework.cli import main
    from framework.train.trainer import Trainer

    def cfg(run: Path, *extra: str) -> Config:
        return load_config(TINY, [f"run.dir={run}", "train.steps=4", "checkpoint.interval=2", *FP8, *extra])

    ref, run = tmp_path / "ref", tmp_path / "run"
    whole = Trainer(cfg(ref))
    whole.train()
    Trainer(cfg(run)).train(stop_at=2)
    mixed = tmp_path / "mixed"
    shutil.copytree(run, mixed)
    assert Trainer(cfg(run)).train().start_step == 2
    assert _losses(run) == _losses(ref)  # bitwise
    # The FP8 run's checkpoint holds plain fp32 weights under the 1-process FQNs: a bf16 run resumes from it
    # (its weights bitwise the checkpoint's) and trains on, and it exports to Hugging Face.
    saved, _ = load_model(resolve_checkpoint(ref, 2))
    bf16 = Trainer(cfg(mixed, "train.fp8.enabled=false"))
    assert bf16.resume() and bf16.step == 2
    loaded = bf16.engine.model_parts[0].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in saved.state_dict().items())
    assert not any("Float8" in type(m).__name__ for m in bf16.engine.model_parts[0].modules())
    bf16.train()
    assert sorted(_losses(mixed)) == [1, 2, 3, 4] and all(abs(v) < 100 for v in _losses(mixed).values())
    assert main(["ckpt", "export-hf", str(ref), str(tmp_path / "hf"), "--step", "4"]) == 0
    final, _ = load_model(resolve_checkpoint(ref, 4))
    trained = whole.engine.model_parts[0].state_dict()
    assert all(torch.equal(final.state_dict()[k], trained[k]) for k in trained)
