"""RoPE scaling: linear / llama3 / yarn as transformers defines them, through export-hf and import-hf.

Each rope type, with a non-default rope_theta: the exported model's transformers logits equal Tessera's to 1e-5
(fp32) at positions past the original context (where the scalings differ), import-hf gives back the same
config and weights, the old `rope_scaling` spelling imports the same, and refused keys fail by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from framework.base.errors import CheckpointError, ConfigError
from framework.checkpoint.hf import config_from_hf, hf_config, load_model, resolve_checkpoint
from framework.cli import main
from framework.config import load_config
from framework.testing.tiny import TINY
from framework.train.trainer import Trainer
from models.config import model_config
from models.rope import inv_freq

SCALINGS: dict[str, list[str]] = {
    "linear": ["model.rope_scaling.type=linear", "model.rope_scaling.factor=4.0"],
    "llama3": ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=4.0",
               "model.rope_scaling.original_max_seq_len=64", "model.rope_scaling.low_freq_factor=1.0",
               "model.rope_scaling.high_freq_factor=4.0"],
    "yarn": ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0",
             "model.rope_scaling.original_max_seq_len=64"],
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_export_logits_match_transformers_and_import_round_trips(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    run, hf_dir, imported = tmp_path / "run", tmp_path / "hf", tmp_path / "imported"
    overrides = ["model.rope_theta=50000.0", *SCALINGS[kind]]
    Trainer(load_config(TINY, [f"run.dir={run}", "train.steps=1", "train.warmup_steps=0", "checkpoint.interval=0",
                               *overrides])).train()
    assert main(["ckpt", "export-hf", str(run), str(hf_dir), "--step", "1"]) == 0
    written = json.loads((hf_dir / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == kind and written["rope_parameters"]["rope_theta"] == 50000.0

    model, _ = load_model(resolve_checkpoint(run, 1))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    assert hf.config.rope_parameters["rope_type"] == kind
    ours_inv = inv_freq(model.cfg.head_dim, 50000.0, model.cfg.rope_scaling).float()  # type: ignore[union-attr]
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, ours_inv, atol=0, rtol=1e-6)
    assert not torch.allclose(ours_inv, inv_freq(model.cfg.head_dim, 50000.0).float())  # type: ignore[union-attr]
    tokens = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(3))  # past 64 original
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-5, rtol=0)

    assert main(["ckpt", "import-hf", str(hf_dir), str(imported)]) == 0
    back, _ = load_model(resolve_checkpoint(imported))
    assert back.cfg.rope_scaling == model.cfg.rope_scaling and back.cfg.rope_theta == 50000.0  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def _hf(**scaling: Any) -> dict[str, Any]:
    cfg = model_config("test-tiny", rope_theta=50000.0)
    out = hf_config(cfg, "llama")
    out.pop("rope_scaling")
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    out.update(scaling)
    return out


def test_transformers_4_rope_scaling_imports_like_rope_parameters() -> None:
    llama31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = config_from_hf(_hf(rope_scaling={"type": "llama3", **llama31}))
    new = config_from_hf(_hf(rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, **llama31}))
    assert old == new and new.rope_scaling.type == "llama3" and new.rope_scaling.original_max_seq_len == 64


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_parameters.rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, r"rope_scaling.rope_type='longrope'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
     r"rope_scaling.low_freq_factor=1.0 is not supported for rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_scaling": {"type": "yarn", "factor": 2.0}},
     r"rope_parameters \(rope_type='linear'\) and rope_scaling \(rope_type='yarn'\) disagree"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' cannot be imported"),
    ({"sliding_window": 4096}, r"sliding_window=4096"),
    ({"qk_layernorm": True}, r"key 'qk_layernorm' is not known"),
])
def test_import_refuses_unsupported_keys_by_name(change: dict[str, Any], match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        config_from_hf(_hf(**change))


def test_bad_scaling_config_fails_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="original_max_seq_len=0: type='llama3' needs"):
        model_config("test-tiny", rope_scaling={"type": "llama3", "factor": 8.0})
    assert model_config("llama3.1-405b").rope_scaling.factor == 8.0
