"""The one list of model transforms (framework/numerics/transforms.py): both engines take their transforms from it
and apply them at the same point of building the model.

A dummy transform registered in the list (as a new transform would be) must reach the 1-process `LocalEngine` and
every rank of two parallel layouts: it sees initialized weights (not meta), blocks not yet wrapped by FSDP, the
TP flag of its site, and the model it transformed is the one that trains (its forward hook runs in the step).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from framework.numerics.transforms import (
    TRANSFORMS,
    ModelTransform,
    Site,
    TransformSettings,
    model_transforms,
    register_transform,
    unregister_transform,
)
from framework.testing import run_distributed
from framework.testing.tiny import TINY

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _probe(model: Any, site: Site) -> None:
    """Record what the model looks like at the point transforms run, and count forwards from now on."""
    model.probe_seen = {
        "tensor_parallel": site.tensor_parallel,
        "on_meta": any(p.is_meta for p in model.parameters()),
        "fsdp_blocks": any(isinstance(b, FSDPModule) for b in model.layers.values()),
    }
    model.probe_forwards = 0

    def count(module: Any, args: Any, out: Any) -> None:
        module.probe_forwards += 1

    model.register_forward_hook(count)


def _build_probe(settings: TransformSettings) -> ModelTransform:
    return ModelTransform("probe", _probe)


@pytest.fixture
def probe() -> Iterator[None]:
    register_transform("probe", _build_probe, before="compile")
    yield
    unregister_transform("probe")
    assert "probe" not in TRANSFORMS


def _one_step(engine: Any, cfg: Any) -> list[dict[str, Any]]:
    rows = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.micro_batch_size, cfg.data.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    engine.forward_backward(rows)
    engine.optimizer_step(1e-3)
    return [{**part.probe_seen, "forwards": part.probe_forwards} for part in engine.model_parts]


def _parallel(rank: int, world: int) -> list[list[dict[str, Any]]]:
    from framework.config import load_config
    from framework.train.parallel_engine import build_parallel_engine

    out = []
    for layout in (["parallel.tp=2", "parallel.dp_shard=1"], ["parallel.dp_shard=2", "parallel.zero_stage=3"]):
        cfg = load_config(TINY, ["train.global_batch_size=8", "train.micro_batch_size=2", *layout])
        engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
        out.append(_one_step(engine, cfg))
    return out


@pytest.mark.distributed
def test_a_registered_transform_is_applied_by_both_engines_at_one_point(probe: None) -> None:
    from framework.config import load_config
    from framework.train.local_engine import LocalEngine

    order = [t.name for t in model_transforms(load_config(TINY, ["train.compile=true"]).train)]
    assert order == ["probe", "compile"]  # `before=` places it; the list is the order of application

    cfg = load_config(TINY, ["train.global_batch_size=4", "train.micro_batch_size=2"])
    local = _one_step(LocalEngine(cfg.model, cfg.train, torch.device("cpu")), cfg)
    assert local == [{"tensor_parallel": False, "on_meta": False, "fsdp_blocks": False, "forwards": 2}]
    tp2, zero3 = zip(*run_distributed(_parallel, 2), strict=True)
    for rank in range(2):
        assert tp2[rank] == [{"tensor_parallel": True, "on_meta": False, "fsdp_blocks": False, "forwards": 2}]
        assert zero3[rank] == [{"tensor_parallel": False, "on_meta": False, "fsdp_blocks": False, "forwards": 2}]


def test_the_listed_transforms_run_on_the_meta_model_for_the_target_device() -> None:
    """fp8 is a module swap applied before sharding (compile is applied later, but runs on meta too): on a meta
    model they allocate nothing, keep every parameter's canonical FQN, and fp8 chooses torch._scaled_mm or its
    emulation by the device the weights will live on, not by meta."""
    pytest.importorskip("torchao")
    from torch._dynamo.eval_frame import OptimizedModule
    from torchao.float8.float8_linear import Float8Linear

    from framework.config import load_config
    from models.decoder import Decoder
    from models.init import canonical_fqn

    cfg = load_config(TINY, ["train.precision=bf16", "train.fp8.enabled=true"])
    compiled = load_config(TINY, ["train.compile=true", "train.compile_backend=aot_eager"])
    transforms = [*model_transforms(cfg.train), *model_transforms(compiled.train)]  # one run may not ask both yet
    assert [t.name for t in transforms] == ["fp8", "compile"]
    assert [t.before_sharding for t in transforms] == [True, False]
    for device, emulated in (("cuda", False), ("cpu", True)):
        with torch.device("meta"):
            model = Decoder(cfg.model)
        before = [fqn for fqn, _ in model.named_parameters()]
        for t in transforms:
            t.apply(model, Site(device_type=device))
        after = list(model.named_parameters())
        assert all(p.is_meta for _, p in after) and [canonical_fqn(f) for f, _ in after] == before
        fp8 = [m for m in model.modules() if isinstance(m, Float8Linear)]
        assert len(fp8) == 7 * cfg.model.n_layers and {m.config.emulate for m in fp8} == {emulated}, device
        assert all(isinstance(b, OptimizedModule) for b in model.layers.values())
