"""Measure, on CPU, what the planner predicts: bytes saved for backward and model-state bytes.

Activations are measured by storage liveness, not by assumption: a dispatch mode records every storage the
forward creates (with a weak reference), the caller drops its own references to intermediate tensors, and
whatever is still alive is held by autograd — saved tensors, the selective-checkpoint cache, or the input a
full checkpoint keeps. This works the same for no recompute, selective and full activation checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from framework.parallel.recompute import selective_context
from framework.plan.activations import AttnKernel, Recompute


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


def hooked_saved_bytes(module: torch.nn.Module, forward: Callable[[], torch.Tensor],
                       static: Iterable[torch.Tensor] = (),
                       unwrap: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> int:
    """Bytes autograd saves during `forward()`, seen through `torch.autograd.graph.saved_tensors_hooks`.

    A second, independent measurement for the no-recompute case (checkpointing installs its own hooks, which hide
    what it keeps — hence `saved_bytes`). Storages are counted once; parameters, buffers and `static` are skipped.
    `unwrap` maps a saved tensor to the tensor holding its memory (a DTensor's local shard).
    """
    skip = {unwrap(t).untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers(), *static)}
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = unwrap(t).untyped_storage()
        if storage.data_ptr() not in skip:
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    assert out.grad_fn is not None
    return sum(sizes.values())


def layer_saved_bytes(block: torch.nn.Module, rope: torch.Tensor, x_leaf: torch.Tensor, *,
                      recompute: Recompute = "none", kernel: AttnKernel = "flash") -> tuple[int, dict[str, int]]:
    """Measured activation bytes of one decoder block's forward on `x_leaf` (B, T, D) under a recompute mode."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint

    def run(x: torch.Tensor) -> torch.Tensor:
        if recompute == "none":
            return block(x, rope)  # type: ignore[no-any-return]
        context_fn: Callable[[], Any] = contextlib.nullcontext
        if recompute == "selective":
            context_fn = selective_context  # the engine's policy (framework/parallel/recompute.py)
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


def _dense_sp_plan(gated: bool) -> dict[str, Any]:
    """Tensor + sequence parallel plan of a dense block (the TP rules of framework/plan/meta.py)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if gated:
        plan["feed_forward.w3"] = ColwiseParallel()
    return plan


def tp_layer_saved_bytes(rank: int, world_size: int, *, preset: str, seq: int, batch: int,
                         overrides: dict[str, Any] | None = None) -> int:
    """On each rank of a process group: saved bytes of one block under TP = world_size with sequence parallelism.

    The block is parallelized with DTensor (`parallelize_module`) and counted through saved_tensors_hooks on the
    local shards (no recompute: checkpointing would hide its tensors from the hooks).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from models.config import model_config
    from models.decoder import build_model

    cfg = model_config(preset, **(overrides or {}))
    model = build_model(cfg)
    block = model.layers["0"]
    parallelize_module(block, init_device_mesh("cpu", (world_size,)), _dense_sp_plan(cfg.mlp == "swiglu"))
    x_full = torch.randn(batch, seq, cfg.hidden, generator=torch.Generator().manual_seed(0))
    x = x_full.chunk(world_size, dim=1)[rank].clone().requires_grad_(True)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined,no-any-return]

    return hooked_saved_bytes(block, lambda: block(x, model.rope), static=[model.rope], unwrap=local)


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


__all__ = ["StorageTracker", "hooked_saved_bytes", "layer_saved_bytes", "model_saved_bytes",
           "model_state_bytes", "saved_bytes", "tp_layer_saved_bytes", "trained_state_bytes"]
