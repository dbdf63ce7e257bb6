"""Training-loop configuration: batch vocabulary, optimizer, LR schedule, precision."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from framework.base.errors import ConfigError
from framework.numerics.config import FP8Config


@dataclass(kw_only=True, frozen=True)
class MuonConfig:
    """Muon (orthogonalized momentum) for the hidden matrices when `train.optimizer` is muon
    (framework/train/muon.py). The learning rate, schedule and weight decay are `train.*`'s, shared with the
    AdamW that trains the embeddings, the head, norms, biases and the router."""

    momentum: float = 0.95
    """Momentum coefficient mu (Jordan et al. 2024, "Muon: An optimizer for hidden layers"; torch.optim.Muon)."""
    nesterov: bool = True
    """Orthogonalize g + mu (buf - g) (Nesterov) instead of the buffer itself (Jordan et al. 2024)."""
    ns_steps: int = 5
    """Newton-Schulz iterations (Jordan et al. 2024; Moonlight, Liu et al. 2025, uses 5 too)."""
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    """Quintic Newton-Schulz coefficients (a, b, c), tuned for the slope at zero (Jordan et al. 2024)."""
    ns_eps: float = 1e-7
    """Added to the Frobenius norm the iteration starts by dividing by (Jordan et al. 2024)."""
    ns_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the Newton-Schulz matmuls: bf16 as published (Jordan et al. 2024, torch.optim.Muon); fp32 for
    bitwise-comparable runs (the parity tests)."""
    lr_adjust: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """match_rms_adamw: the update of an A x B matrix scaled by update_rms * sqrt(max(A, B)), giving it AdamW's
    update RMS so AdamW's lr and weight decay carry over (Liu et al. 2025, "Muon is Scalable for LLM Training");
    original: sqrt(max(1, A / B)) (Jordan et al. 2024), which wants a ~0.02 learning rate."""
    update_rms: float = 0.2
    """Target update RMS for match_rms_adamw: AdamW's typical 0.2-0.4 (Liu et al. 2025 use 0.2)."""
    per_head: bool = False
    """Orthogonalize the attention projections per head: wq, wk, wv as (head_dim x hidden) row blocks and wo as
    (hidden x head_dim) column blocks, each its own matrix (Newton-Schulz and the update scale per block). No
    published default to cite: off, the whole-matrix rule of Jordan et al. and Liu et al."""
    qk_clip: bool = False
    """QK-clip (MuonClip, Kimi K2, arXiv 2507.20534): after each step, rescale the query and key projections of
    every head whose largest attention logit of the step passed qk_clip_tau, so it would be tau
    (framework/train/qk_clip.py). Off by default: Kimi K2 needed it at 1T parameters, Moonlight did not."""
    qk_clip_tau: float = 100.0
    """QK-clip's threshold on q.k / sqrt(d) (Kimi K2 uses 100)."""
    overlap: bool = True
    """Send each FSDP unit's gradient pieces to their owners during backward, as soon as FSDP has reduced them
    (under tp without FSDP, each block's once final), and keep an exchanged matrix's momentum whole on its owner
    (framework/train/muon_overlap.py). Where the layout does not allow it (a zero-bubble pp schedule, tp x pp
    without FSDP, no FSDP shard group and no tp; `overlap_problem` says why) the exchange runs after backward, as
    with false. Same updates bit for bit and the same bytes either way."""

    def validate(self) -> None:
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"train.muon.momentum={self.momentum} must be in [0, 1); the published value is 0.95")
        if not 1 <= self.ns_steps <= 20:
            raise ConfigError(f"train.muon.ns_steps={self.ns_steps} must be in [1, 20]; the published value is 5")
        if len(self.ns_coefficients) != 3 or not all(math.isfinite(c) for c in self.ns_coefficients):
            raise ConfigError(f"train.muon.ns_coefficients={self.ns_coefficients} must be three finite numbers "
                              f"(a, b, c); the published ones are [3.4445, -4.7750, 2.0315]")
        if not self.qk_clip_tau > 0:
            raise ConfigError(f"train.muon.qk_clip_tau={self.qk_clip_tau} must be > 0; Kimi K2 uses 100")
        if not (self.ns_eps > 0 and self.update_rms > 0):
            raise ConfigError(f"train.muon.ns_eps={self.ns_eps} and train.muon.update_rms={self.update_rms} must be "
                              f"> 0; the published values are 1e-7 and 0.2")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps to train for (the run ends at this step; resuming continues towards it)."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 2
    """Sequences per forward pass on one rank. Accumulation / pipeline micro-batches =
    global_batch_size / (micro_batch_size x data-parallel size)."""
    seed: int = 1234
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    """Final LR of the decay as a fraction of `lr`."""
    schedule: Literal["cosine", "wsd", "constant", "linear"] = "cosine"
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    """WSD (warmup-stable-decay, Hu et al. 2024): fraction of the steps spent in the final decay."""
    weight_decay: float = 0.1
    """Applied to matrices only; norms, biases and embeddings are in the no-decay group."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still logged)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw everywhere; muon: Muon for the 2-D hidden matrices (per expert for stacked experts) and AdamW for the
    embeddings, head, norms, biases and router (`train.muon`, framework/train/muon.py)."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    optimizer_impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """AdamW kernel: auto takes fused on CUDA, foreach elsewhere; a mix of DTensor and plain parameters (TP
    without sequence parallelism) always takes for_loop, the only kernel that runs it."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype for forward/backward; master weights and optimizer states stay fp32."""
    loss_scale_init: float = 2.0**16
    """fp16 only: the initial dynamic loss scale (halved on every overflow, a skipped step)."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: clean steps in a row after which the loss scale doubles."""
    log_interval: int = 1
    eval_interval: int = 0
    """Evaluate every N steps (and at the end); 0 disables periodic evaluation."""
    eval_batches: int = 4
    deterministic: bool = True
    """Deterministic algorithms (bitwise-reproducible runs on CPU)."""
    compile: bool = False
    """torch.compile each transformer block (framework/parallel/compile.py); layouts it is not proved for are
    refused at config load."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """inductor: generated kernels (the speed-up); aot_eager: AOT autograd without codegen (cheap to compile,
    for checks); eager: dynamo only."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 linears through torchao (framework/numerics/fp8.py); combinations not proven are refused at load."""

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"train.steps={self.steps} must be >= 1; set the number of optimizer steps")
        if self.micro_batch_size < 1:
            raise ConfigError(f"train.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.global_batch_size < 1 or self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} must be a positive multiple of "
                f"train.micro_batch_size={self.micro_batch_size}; set it to e.g. "
                f"{max(1, self.global_batch_size // self.micro_batch_size) * self.micro_batch_size}")
        for name in ("lr", "eps", "grad_clip", "min_lr_ratio", "weight_decay", "beta1", "beta2", "decay_fraction"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"train.{name}={getattr(self, name)} must be a finite number")
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0; a typical value is 3e-4")
        if self.eps <= 0:
            raise ConfigError(f"train.eps={self.eps} must be > 0 (Adam divides by sqrt(v) + eps); e.g. 1e-8")
        if self.eval_interval < 0 or self.eval_batches < 1:
            raise ConfigError(f"train.eval_interval={self.eval_interval} must be >= 0 (0: no evaluation) and "
                              f"train.eval_batches={self.eval_batches} >= 1")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]; e.g. 0.1")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ConfigError(
                f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps={self.steps}]; lower it")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"train.decay_fraction={self.decay_fraction} must be in (0, 1]; e.g. 0.2")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay={self.weight_decay} must be >= 0; e.g. 0.1")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"train.beta1={self.beta1}, train.beta2={self.beta2} must be in [0, 1)")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        if not (self.loss_scale_init > 0 and math.isfinite(self.loss_scale_init)):
            raise ConfigError(f"train.loss_scale_init={self.loss_scale_init} must be a finite number > 0; "
                              f"the usual start is 65536.0 (2**16)")
        if self.loss_scale_growth_interval < 1:
            raise ConfigError(f"train.loss_scale_growth_interval={self.loss_scale_growth_interval} must be >= 1 "
                              f"(clean steps before the fp16 loss scale doubles); the usual value is 2000")
        if self.log_interval < 1:
            raise ConfigError(f"train.log_interval={self.log_interval} must be >= 1")
        self.muon.validate()
        self.fp8.validate()
