"""The planner's Muon matrices (framework/plan/muon.py) against the model: every layer's Muon parameters, as the
optimizer picks them (`is_muon_param`) from a meta-device build, in parameter order and shape, for dense GQA,
MoE with shared experts and their gate, MLA and GPT blocks. The bytes built on them are held to the dry run and
real gloo steps in tests/dryrun/test_ground_truth.py."""

from __future__ import annotations

import pytest
import torch

from framework.plan.layout import Layout, Precision, Workload
from framework.plan.memory import rank_memory
from framework.plan.muon import layer_units, muon_bytes
from framework.train.muon import is_muon_param
from models.config import model_config
from models.decoder import Decoder

MODELS = {
    "dense": model_config("test-tiny"),
    "moe-shared-gate": model_config("test-qwen2-moe"),
    "deepseek-v3": model_config("test-deepseek-v3"),
    "mla": model_config("test-mla"),
    "gpt": model_config("test-tiny", mlp="gelu", norm="layernorm"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layer_units_are_the_models_muon_parameters_in_order(name: str) -> None:
    cfg = MODELS[name]
    with torch.device("meta"):
        model = Decoder(cfg)
    for i in range(cfg.n_layers):
        params = [(n, p) for n, p in model.layers[str(i)].named_parameters() if is_muon_param(n, p)]
        dense, experts = layer_units(cfg, i, ep=1)
        want = [(1, *p.shape) if p.ndim == 2 else tuple(p.shape) for n, p in params if "experts." not in n
                or "shared" in n]
        assert [u for u, _, _ in dense] == want, (i, [n for n, _ in params])
        assert experts == [tuple(p.shape) for n, p in params if "experts." in n and "shared" not in n]


def test_muon_states_replace_adamw_moments_on_the_hidden_matrices() -> None:
    cfg = MODELS["moe-shared-gate"]
    lay = Layout(dp=4, ep=2, zero_stage=3)
    work = Workload(cfg, 256, 8, Precision.named("fp32"), optimizer="muon")
    with torch.device("meta"):
        model = Decoder(cfg)
    hidden = sum(p.numel() for n, p in model.named_parameters() if is_muon_param(n, p) and p.ndim == 2)
    experts = sum(p.numel() for n, p in model.named_parameters() if is_muon_param(n, p) and p.ndim == 3)
    mb = muon_bytes(work, lay, 0)
    # dense matrices shard over dp (4), experts over dp x tp / ep (2) of which each rank holds E / ep
    assert mb.elements == hidden + experts // 2
    assert mb.state_delta == -4 * (hidden / 4 + experts / 2 / 2)
    assert rank_memory(work, lay, 0)["optimizer"] == rank_memory(Workload(cfg, 256, 8, work.precision), lay, 0)[
        "optimizer"] + mb.state_delta
    assert mb.all_to_all.keys() == {"dp_shard", "edp"}
