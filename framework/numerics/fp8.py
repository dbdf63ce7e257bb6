"""FP8 training of the linear layers through torchao (`train.fp8`), one entry of the model-transform list.

torchao's `convert_to_float8_training` swaps each chosen `nn.Linear` for a `Float8Linear`: the weights stay fp32
parameters (same FQNs, so checkpoints load into and from bf16 runs and export to Hugging Face unchanged), and each
GEMM casts its operands to FP8 with dynamic scales — e4m3 for inputs and weights, e5m2 (tensorwise) or e4m3
(rowwise) for output gradients — and accumulates in higher precision. Off CUDA (and in tests) torchao's emulation
runs the same casts and a plain matmul of the dequantized values, so the numerics are FP8's on CPU.

torchao is optional: this module is imported only when `train.fp8.enabled`, which config load refuses without it.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from framework.numerics.config import FP8Config
from models.decoder import Decoder
from models.plans import Plan

log = logging.getLogger(__name__)


def convertible(fqn: str, module: nn.Module, cfg: FP8Config) -> bool:
    """Whether the linear at `fqn` trains in FP8: not excluded by an FQN component, big and aligned enough."""
    if not isinstance(module, nn.Linear) or set(fqn.split(".")) & set(cfg.exclude):
        return False
    dims = (module.in_features, module.out_features)
    return all(d >= cfg.min_dim and d % 16 == 0 for d in dims)


def convert_to_fp8(model: Decoder, cfg: FP8Config, device_type: str) -> int:
    """Swap the chosen linears of `model` for torchao's Float8Linear in place; returns how many.

    `model` may be on the meta device (a parallel stage before TP): the swap keeps the parameter objects, so their
    initialization and sharding come after it. `device_type` is where the model will run.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulate = device_type != "cuda"  # torch._scaled_mm needs an FP8 GPU
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=cfg.fsdp_all_gather)
    chosen = {fqn for fqn, m in model.named_modules() if convertible(fqn, m, cfg)}
    kept = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn not in chosen]
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in chosen, config=config)
    log.info("train.fp8 (%s%s): %d linears in FP8; kept in bf16: %s", cfg.recipe, ", emulated" if emulate else "",
             len(chosen), ", ".join(kept) or "none")
    return len(chosen)



def fp8_tp_plan(module: nn.Module, plan: Plan, tp_mesh: DeviceMesh, cfg: FP8Config) -> Plan:
    """The TP plan for `module` whose chosen linears are Float8Linear: under the tensorwise recipe, torchao's FP8
    styles, which cast a linear's input to FP8 before the sequence-parallel all-gather (half the bytes of bf16)
    and its output gradient before the backward one; the shared input of several linears (attention's wq, wk, wv;
    the MLP's w1, w3) is cast once, by `PrepareFloat8ModuleInput`, where every linear under that module is FP8.
    The scales are the 1-process ones: a tensorwise amax over a sharded DTensor is reduced over tp. The rowwise
    recipe keeps the plain styles (bf16 all-gathers; torchao's FP8 styles assume one scale per tensor), as do
    linears left in bf16, and so does gloo, which has no float8 collectives ("Invalid scalar type"): there each
    Float8Linear casts after the bf16 all-gather, the same values up to the input's rounding to bf16 first."""
    if cfg.recipe != "tensorwise" or not float8_collectives(tp_mesh):
        return plan
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    out: Plan = {}
    for fqn, style in plan.items():
        target = module.get_submodule(fqn)
        linears = [m for m in target.modules() if isinstance(m, nn.Linear)]
        fp8 = bool(linears) and all(isinstance(m, Float8Linear) for m in linears)
        new: ParallelStyle = style
        if fp8 and type(style) is ColwiseParallel:
            new = Float8ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                        use_local_output=style.use_local_output)
        elif fp8 and type(style) is RowwiseParallel:
            new = Float8RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                        use_local_output=style.use_local_output)
        elif fp8 and type(style) is PrepareModuleInput and style.input_kwarg_layouts == {}:
            new = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                           desired_input_layouts=style.desired_input_layouts,
                                           use_local_output=style.use_local_output)
        out[fqn] = new
    return out


def float8_collectives(mesh: DeviceMesh) -> bool:
    """Whether `mesh`'s backend moves float8 tensors (NCCL and the dry run's fake backend do; gloo does not)."""
    return dist.get_backend(mesh.get_group()) != "gloo"
