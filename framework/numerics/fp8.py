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

import torch
from torch import nn

from framework.numerics.config import FP8Config
from models.decoder import Decoder

log = logging.getLogger(__name__)


def convertible(fqn: str, module: nn.Module, cfg: FP8Config) -> bool:
    """Whether the linear at `fqn` trains in FP8: not excluded by an FQN component, big and aligned enough."""
    if not isinstance(module, nn.Linear) or set(fqn.split(".")) & set(cfg.exclude):
        return False
    dims = (module.in_features, module.out_features)
    return all(d >= cfg.min_dim and d % 16 == 0 for d in dims)


def convert_to_fp8(model: Decoder, cfg: FP8Config, device: torch.device | None = None) -> int:
    """Swap the chosen linears of `model` for torchao's Float8Linear in place; returns how many. `device`: where
    the weights will run (a meta model's); by default where they are."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    device = device or next(model.parameters()).device
    emulate = device.type != "cuda"  # torch._scaled_mm needs an FP8 GPU
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe), emulate=emulate)
    chosen = {fqn for fqn, m in model.named_modules() if convertible(fqn, m, cfg)}
    kept = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn not in chosen]
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in chosen, config=config)
    log.info("train.fp8 (%s%s): %d linears in FP8; kept in bf16: %s", cfg.recipe, ", emulated" if emulate else "",
             len(chosen), ", ".join(kept) or "none")
    return len(chosen)

