"""Parameter names and initial values, independent of layout: `canonical_fqn` strips wrapper prefixes, and every
parameter's initial value comes from a generator seeded by (run seed, canonical FQN), so a model built under any
parallel layout holds bitwise the 1-process model's parameters. Used by the decoder, the MoE step helpers, the
parallel engine and the checkpoint code (which is why it is not in models/decoder.py)."""

from __future__ import annotations

import hashlib
import math

import torch

from models.config import ModelConfig


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full value `full` into `param`: its local shard when `param` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                                  src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


def fqn_seed(seed: int, fqn: str) -> int:
    """A 63-bit generator seed from the run seed and a parameter's canonical FQN."""
    canonical = canonical_fqn(fqn)
    digest = hashlib.sha256(f"{seed}:{canonical}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_fqn(fqn: str) -> str:
    """Strip wrapper prefixes (activation checkpointing, torch.compile) so names match the plain model."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "module."):
        fqn = fqn.replace(junk, "")
    return fqn


def initial_value(cfg: ModelConfig, fqn: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value (fp32, CPU) of parameter `fqn`.

    Norm weights are ones, biases zeros; embeddings and input projections N(0, init_std); output projections of
    each block (`wo`, `w2`) N(0, init_std / sqrt(2 n_layers)) when `depth_scaled_init` (GPT-2, Megatron).
    """
    name = canonical_fqn(fqn)
    if cfg.tied_embeddings and name == "output.weight":
        name = "tok_embeddings.weight"  # a pipeline's last stage holds its own copy of the tied weight
    parts = name.split(".")
    leaf = parts[-1]
    if len(parts) >= 2 and parts[-2].endswith("norm"):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias" or leaf.endswith("_bias"):
        return torch.zeros(shape)
    std = cfg.init_std
    if cfg.depth_scaled_init and (".wo." in name or ".w2" in name or name.endswith(".w2")):
        std = std / math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator().manual_seed(fqn_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)
