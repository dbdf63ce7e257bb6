"""Measure, on CPU, what the planner predicts: bytes saved for backward and model-state bytes.

Activations are measured by storage liveness, not by assumption: a dispatch mode records every storage the
forward creates (with a weak reference), the caller drops its own references to intermediate tensors, and
whatever is still alive is held by autograd — saved tensors, the selective-checkpoint cache, or the input a
full checkpoint keeps. This works the same for no recompute, selective and full activation checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from framework.plan.activations import AttnKernel, Recompute

# The selective-recompute policy the planner's formula assumes: keep matmul outputs and fused attention
# outputs, recompute everything else (norms, RoPE, the kv-head repeat, activations, the math-SDPA core).
SELECTIVE_SAVE_OPS: tuple[str, ...] = (
    "aten.mm.default", "aten.addmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """`create_selective_checkpoint_contexts` policy: save `SELECTIVE_SAVE_OPS` outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if str(op) in SELECTIVE_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass
class _Record:
    ref: StorageWeakRef
    nbytes: int
    op: str


@dataclass
class StorageTracker(TorchDispatchMode):
    """Records every storage created by ops inside it (except `static` data pointers: parameters, buffers)."""

    static: set[int] = field(default_factory=set)
    records: dict[int, _Record] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
                continue
            storage = leaf.untyped_storage()
            ptr = storage.data_ptr()
            old = self.records.get(ptr)
            # A freed storage's address is reused by later allocations: the newest live storage wins.
            if ptr and ptr not in self.static and (old is None or old.ref.expired()):
                self.records[ptr] = _Record(StorageWeakRef(storage), storage.nbytes(), str(func))
        return out

    def live(self, exclude: Iterable[torch.Tensor] = ()) -> dict[str, int]:
        """Bytes of recorded storages still alive, by the op that created them (`exclude`: e.g. the output)."""
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        by_op: dict[str, int] = {}
        for ptr, rec in self.records.items():
            if ptr not in skip and not rec.ref.expired():
                by_op[rec.op] = by_op.get(rec.op, 0) + rec.nbytes
        return by_op


def _static_ptrs(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


def saved_bytes(module: torch.nn.Module, make_input: Callable[[], torch.Tensor],
                forward: Callable[[torch.Tensor], torch.Tensor], static: Iterable[torch.Tensor] = ()
                ) -> tuple[int, dict[str, int]]:
    """Bytes autograd keeps after `forward(make_input())`, excluding parameters, buffers and the output.

    The input is created inside the tracked region (from a leaf that requires grad) and released before the
    count, so it counts only when something keeps it for backward. `static`: other constant tensors (the
    RoPE table, the leaf) whose views must not count.
    """
    ptrs = _static_ptrs(module) | {t.untyped_storage().data_ptr() for t in static}
    tracker = StorageTracker(static=ptrs)
    with tracker:
        x = make_input()
        out = forward(x)
        del x
    by_op = tracker.live(exclude=[out])
    assert out.grad_fn is not None  # keeps the graph (and its saved tensors) alive until here
    return sum(by_op.values()), by_op


def layer_saved_bytes(block: torch.nn.Module, rope: torch.Tensor, x_leaf: torch.Tensor, *,
                      recompute: Recompute = "none", kernel: AttnKernel = "flash") -> tuple[int, dict[str, int]]:
    """Measured activation bytes of one decoder block's forward on `x_leaf` (B, T, D) under a recompute mode."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    def run(x: torch.Tensor) -> torch.Tensor:
        if recompute == "none":
            return block(x, rope)  # type: ignore[no-any-return]
        context_fn: Callable[[], Any] = contextlib.nullcontext
        if recompute == "selective":
            context_fn = functools.partial(create_selective_checkpoint_contexts, selective_policy)
            return checkpoint(block, x, rope, use_reentrant=False, context_fn=context_fn)  # type: ignore[no-any-return]
        return checkpoint(block, x, rope, use_reentrant=False)  # type: ignore[no-any-return]

    backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(backend):
        return saved_bytes(block, lambda: x_leaf * 1.0, run, static=(rope, x_leaf))


def model_saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, dict[str, int]]:
    """Measured activation bytes of a whole decoder forward plus cross-entropy on `tokens` (B, T+1)."""
    vocab = model.cfg.vocab_size  # type: ignore[union-attr]

    def forward(x: torch.Tensor) -> torch.Tensor:
        logits = model(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))

    return saved_bytes(model, tokens.clone, forward, static=(tokens,))


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states on this rank (local shards of DTensors), by kind.

    Tensors are counted once (tied weights); the per-parameter `step` counters of AdamW are reported apart.
    """
    def local(t: torch.Tensor) -> torch.Tensor:
        to_local = getattr(t, "to_local", None)
        return to_local() if to_local is not None else t

    seen: set[tuple[int, int]] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0, "optimizer_step": 0}

    def add(kind: str, t: torch.Tensor) -> None:
        t = local(t)
        # Keyed by address and size, not by storage: FSDP2 keeps a unit's shards as views of one flat buffer.
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            out[kind] += t.numel() * t.element_size()

    for p in model.parameters():
        add("params", p)
        if p.grad is not None:
            add("grads", p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    add("optimizer_step" if key == "step" else "optimizer", value)
    return out


def trained_state_bytes(preset: str, *, shard: bool = False, seq: int = 16, batch: int = 2) -> dict[str, int]:
    """Model-state bytes on this rank after one AdamW step of a small preset model on CPU (fp32).

    With `shard=True` (inside an initialized process group) every block and the root are wrapped with FSDP2
    `fully_shard` over all ranks — ZeRO-3: parameters, gradients and optimizer states sharded.
    """
    from models.config import model_config
    from models.decoder import build_model

    torch.manual_seed(0)
    cfg = model_config(preset)
    model = build_model(cfg)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return model_state_bytes(model, opt)


__all__ = ["SELECTIVE_SAVE_OPS", "StorageTracker", "layer_saved_bytes", "model_saved_bytes", "model_state_bytes",
           "saved_bytes", "selective_policy", "trained_state_bytes"]
