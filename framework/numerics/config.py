"""`train.fp8`: FP8 training of the linear layers through torchao (framework/numerics/fp8.py), and which
combinations are refused at config load. Torch-free, like every config module.

    train:
      precision: bf16           # FP8 runs the rest of the model under bf16 autocast
      fp8:
        enabled: true
        recipe: tensorwise      # tensorwise | rowwise (torchao's recipes)
        exclude: [output, router]
        min_dim: 16
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from framework.base.errors import ConfigError

FP8_PROVEN = ("1 process, data parallelism over dp_shard (ZeRO 1-3, FSDP2, FP8 all-gathers) or over dp_replicate "
              "(DDP), tensor parallelism with or without sequence parallelism, pipeline parallelism, and "
              "train.compile without tp or pp")
"""The layouts an FP8 run has a parity test for (tests/parallel/test_fp8_parity.py); the others are refused."""

CP_FP8 = ("FP8 scales each cast by an amax over the whole tensor (tensorwise; rowwise's output gradients over all "
          "tokens), and under cp every rank holds its own share of the sequence as a plain tensor, so each rank "
          "would scale with the amax of its tokens alone: another FP8 run, not the 1-process numerics every proven "
          "layout reproduces (tp reduces its amax over the DTensor mesh; cp has no such mesh)")
MOE_FP8 = ("FP8 experts need torch._scaled_grouped_mm, which has kernels only on CUDA (sm90+), none on the CPU "
           "this project's tests run on, so the experts' FP8 GEMM cannot be proven here")


@dataclass(kw_only=True, frozen=True)
class FP8Config:
    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """tensorwise: one dynamic scale per tensor (fastest, FP8 all-gather possible); rowwise: one per row of each
    GEMM operand (more accurate; torchao's recipe, its scales rounded to powers of 2)."""
    exclude: tuple[str, ...] = ("output", "router")
    """Linears whose FQN has one of these as a dot-separated component stay in bf16: the head and the MoE router
    by default, as the published recipes (torchtitan, Megatron-Bridge) keep them."""
    min_dim: int = 16
    """A linear is converted only when both its in and out features are >= min_dim and multiples of 16 (the FP8
    GEMM's alignment); smaller ones stay bf16, where the casts cost more than the GEMM saves."""

    fsdp_all_gather: bool = False
    """FSDP (dp_shard, ZeRO-3) all-gathers the converted linears' weights in FP8, cast from each fp32 shard with
    one tensorwise scale (torchao's `enable_fsdp_float8_all_gather`): half the bytes of a bf16 all-gather, and the
    cast the GEMM would make anyway. Tensorwise recipe only."""

    def validate(self) -> None:
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            raise ConfigError(f"train.fp8.fsdp_all_gather=true with train.fp8.recipe={self.recipe}: FP8 all-gathers "
                              f"need one scale per weight; set train.fp8.recipe=tensorwise or "
                              f"train.fp8.fsdp_all_gather=false")
        if self.min_dim < 16 or self.min_dim % 16:
            raise ConfigError(f"train.fp8.min_dim={self.min_dim} must be a multiple of 16 and >= 16 (FP8 GEMMs need "
                              f"dimensions divisible by 16); e.g. 16")


def fp8_problem(precision: str, compile: bool, fp8: FP8Config, parallel: Any, model: Any) -> str | None:
    """Why `train.fp8` cannot run this combination (None where it is proven). `parallel` is a ParallelConfig,
    `model` a ModelConfig."""
    if not fp8.enabled:
        return None
    if importlib.util.find_spec("torchao") is None:
        return ("train.fp8.enabled=true needs torchao (pip install 'torchao>=0.18,<0.19', docs/PARALLELISM.md FP8); "
                "install it or set train.fp8.enabled=false")
    if precision != "bf16":
        return (f"train.fp8.enabled=true with train.precision={precision}: the FP8 recipes run everything outside "
                f"the converted linears in bf16; set train.precision=bf16")
    if parallel.cp != 1:
        return (f"train.fp8.enabled=true with parallel.cp={parallel.cp}: {CP_FP8}; set parallel.cp=1 (more "
                f"dp_shard or tp for the memory) or train.fp8.enabled=false")
    unproven: dict[str, Any] = {"parallel.ep": parallel.ep} if parallel.ep != 1 else {}
    if parallel.dp_replicate != 1 and parallel.dp_shard != 1:  # HSDP: a 2-D FSDP mesh
        unproven["parallel.dp_replicate"] = f"{parallel.dp_replicate} with parallel.dp_shard={parallel.dp_shard}"
    if model.moe.enabled:
        return (f"train.fp8.enabled=true with model.moe.enabled=true: {MOE_FP8}; set train.fp8.enabled=false for "
                f"MoE models")
    if compile and (parallel.tp > 1 or parallel.pp > 1):  # proven on 1 process, dp_shard and dp_replicate
        unproven["train.compile"] = f"true with parallel.tp={parallel.tp}, parallel.pp={parallel.pp}"
    if parallel.zero_quantized_weights or parallel.zero_quantized_gradients:
        unproven["parallel.zero_quantized_*"] = True
    if fp8.fsdp_all_gather and (parallel.tp > 1 or parallel.pp > 1):  # proven on dp_shard alone
        unproven["train.fp8.fsdp_all_gather"] = f"true with parallel.tp={parallel.tp}, parallel.pp={parallel.pp}"
    if unproven:
        named = ", ".join(f"{k}={v}" for k, v in unproven.items())
        return (f"train.fp8.enabled=true with {named}: FP8 is proven (matched against the 1-process FP8 run) on "
                f"{FP8_PROVEN} only; set those back to their defaults or train.fp8.enabled=false")
    return None
