"""Expert parallelism (all-to-all dispatch over `ep`, sequence-sharded routing under `tp`) against the
single-process LocalEngine: loss, aux loss and gradient norm per step, dropless and capacity modes.

One process group of 4 ranks runs every case: dropless mode with (ep, tp) in {1, 2}^2 and data parallelism
filling the rest, gradients synchronized by hand (dense: mean over the data ranks; experts: `ExpertGradSync`
over the edp ranks); capacity mode under FSDP2 (experts sharded over the edp ranks by `apply_expert_fsdp`); and
the global-batch balancing loss; and group-limited (node-limited) sigmoid routing. Only the MoE layers are
tensor-parallel here (the rest of the block stays replicated), so this checks framework/parallel/expert.py on its
own; the full matrix through the parallel engine (TP blocks, FSDP, pipeline stages) is
tests/moe/test_moe_engine_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from framework.engine import cross_entropy
from framework.parallel.config import ParallelConfig
from framework.parallel.expert import (
    ExpertGradSync,
    apply_expert_fsdp,
    apply_expert_parallel,
    expert_parameters,
    set_data_reduce,
    sum_over,
)
from framework.parallel.mesh import ParallelDims
from framework.testing import run_distributed
from framework.train.config import TrainConfig
from framework.train.local_engine import LocalEngine
from framework.train.optim import build_optimizer
from models import model_config
from models.config import ModelConfig
from models.decoder import Decoder
from models.moe.step import moe_metrics, set_aux_loss_scale, update_routing_bias

WORLD, STEPS, LR, SEQ = 4, 3, 1e-2, 16
MODES = {
    "dropless": dict(n_shared_experts=1, bias_update_rate=0.01),
    "capacity": dict(n_shared_experts=1, capacity_factor=1.0, z_loss_coef=1e-3),
    # node-limited routing (DeepSeek-V3): 2 groups = the 2 ep ranks' experts, each token's experts on one rank
    "grouped": dict(n_experts=8, n_groups=2, topk_groups=1, router="sigmoid", routed_scale=2.5,
                    bias_update_rate=0.01, n_shared_experts=1),
}


def _cfg(**moe: object) -> ModelConfig:
    return model_config("test-moe", moe={"n_experts": 4, "top_k": 2, "expert_hidden": 64, **moe})


def _batches(seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (4, 2, SEQ + 1), generator=g) for _ in range(STEPS)]  # 4 groups of 2 sequences


def _reference(cfg: ModelConfig, batches: list[torch.Tensor]) -> list[tuple[float, ...]]:
    eng = LocalEngine(cfg, TrainConfig(seed=11, lr=LR), torch.device("cpu"))
    out = []
    for batch in batches:
        loss = eng.forward_backward(batch)
        norm = eng.clip_grad_norm(0.0)
        experts = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for n, p in eng.model.named_parameters()
                                if ".experts." in n))
        eng.optimizer_step(LR)
        out.append((loss, eng.extra_metrics()["moe/aux_loss"], norm, experts))
    return out


def _full_grad_sq(model: torch.nn.Module, only: str = "") -> float:
    total = 0.0
    for name, p in model.named_parameters():
        if p.grad is not None and only in name:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            total += float(g.double().pow(2).sum())
    return total


def _run_layout(rank: int, cfg: ModelConfig, ep: int, tp: int, batches: list[torch.Tensor], fsdp: bool = False
                ) -> list[tuple[float, ...]]:
    dims = ParallelDims.from_config(ParallelConfig(ep=ep, tp=tp), WORLD, cfg)
    mesh = dims.build_mesh("cpu")
    ep_mesh = dims.build_ep_mesh(mesh)
    with torch.device("meta"):
        model = Decoder(cfg)
    apply_expert_parallel(model, ep_mesh=ep_mesh["ep"] if ep > 1 else None, tp_mesh=mesh["tp"] if tp > 1 else None,
                          sequence_parallel=False)
    model.to_empty(device="cpu")
    model.init_weights(11)
    if fsdp:  # ZeRO-3 style: experts over the edp ranks, everything else over the data ranks
        apply_expert_fsdp(model, ep_mesh["edp"], dims.dp_size)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    dp_group = mesh["dp_shard"].get_group()
    reduce = sum_over([dp_group])
    set_data_reduce(model, reduce)
    experts = expert_parameters(model)
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]
    edp = ep_mesh["edp"].get_group() if dims.edp_size > 1 else None
    sync_experts = ExpertGradSync(experts, edp, dims.dp_size)
    opt = build_optimizer([model], TrainConfig(seed=11, lr=LR), torch.device("cpu"))
    dp_rank = dims.dp_rank(rank)
    out = []
    for batch in batches:
        n_micro = batch.shape[0] // dims.dp_size
        mine = batch[dp_rank * n_micro:(dp_rank + 1) * n_micro]
        set_aux_loss_scale([model], 1.0 / mine.shape[0])
        local = 0.0
        for i, mb in enumerate(mine):
            if fsdp:
                model.set_requires_gradient_sync(i == len(mine) - 1)  # type: ignore[operator]
            loss = cross_entropy(model(mb[:, :-1]), mb[:, 1:]) / mine.shape[0]
            loss.backward()
            local += float(loss.detach())
        if not fsdp:
            for p in dense:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=dp_group)
                g.div_(dims.dp_size)
            sync_experts()
        norm = math.sqrt(_full_grad_sq(model))
        expert_norm = math.sqrt(_full_grad_sq(model, ".experts."))
        t = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(t, group=dp_group)
        aux = moe_metrics([model], reduce)["moe/aux_loss"]
        for group in opt.param_groups:
            group["lr"] = LR
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_routing_bias([model], reduce)
        out.append((float(t) / dims.dp_size, aux, norm, expert_norm))
    return out


def _all_cases(rank: int, world: int, batches: list[torch.Tensor]) -> dict[str, list[tuple[float, ...]]]:
    torch.manual_seed(0)
    results = {}
    for ep in (1, 2):
        for tp in (1, 2):
            results[f"dropless ep{ep} tp{tp}"] = _run_layout(rank, _cfg(**MODES["dropless"]), ep, tp, batches)
    # capacity mode under FSDP, experts FSDP-sharded over the edp ranks (the engine test covers every layout)
    results["capacity ep2 tp2"] = _run_layout(rank, _cfg(**MODES["capacity"]), 2, 2, batches, fsdp=True)
    results["grouped ep2 tp2"] = _run_layout(rank, _cfg(**MODES["grouped"]), 2, 2, batches)
    # dp = 4: rank r routes group r; the counts of the balancing loss are summed over the 4 data ranks
    results["global_batch ep2 tp1"] = _run_layout(rank, _cfg(aux_loss_scope="global_batch"), 2, 1, batches)
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_matches_single_process() -> None:
    batches = _batches()
    refs = {mode: _reference(_cfg(**moe), batches) for mode, moe in MODES.items()}
    # global-batch scope: one reference micro-batch holds the 4 data ranks' groups (counts summed over them)
    refs["global_batch"] = _reference(_cfg(aux_loss_scope="global_batch"), [b.reshape(1, 8, SEQ + 1) for b in batches])
    per_rank = run_distributed(_all_cases, WORLD, batches=batches, timeout_s=600)
    for rank_results in per_rank:
        for case, got in rank_results.items():
            ref = refs[case.split()[0]]
            for step, (values, expected) in enumerate(zip(got, ref)):
                # loss, aux loss, gradient norm, gradient norm of the experts alone
                for what, a, b in zip(("loss", "aux", "grad_norm", "expert_grad_norm"), values, expected):
                    assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (case, step, what, a, b)
