"""Per-rank model-state memory report: parameters, gradients, optimizer states, by dtype (local shards only)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def model_state_report(parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
                       ) -> dict[str, int]:
    """Bytes on this rank as {"<kind>/<dtype>": bytes, "<kind>": bytes, "total": bytes}.

    kind is params, grads or optimizer. Tensors are counted once (tied weights, FSDP views of one buffer).
    FSDP2's unsharded (all-gathered) parameters are transient and counted by `unsharded_param_bytes`.
    """
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = defaultdict(int)

    def add(kind: str, t: torch.Tensor) -> None:
        t = _local(t)
        key = (t.data_ptr(), t.numel())
        if key in seen or t.numel() == 0:
            return
        seen.add(key)
        size = t.numel() * t.element_size()
        out[f"{kind}/{str(t.dtype).removeprefix('torch.')}"] += size
        out[kind] += size
        out["total"] += size

    for part in parts:
        for p in part.parameters():
            add("params", p)
            if p.grad is not None:
                add("grads", p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    add("optimizer", value)
    return dict(out)


def unsharded_bytes(parts: Sequence[nn.Module]) -> tuple[int, int]:
    """(bytes of FSDP2's allocated all-gathered parameters, bytes of gradients accumulated on them (ZeRO-1
    no-sync micro-batches)); (0, 0) when resharded or without FSDP."""
    total = grads = 0
    for part in parts:
        for module in part.modules():
            state = getattr(module, "_get_fsdp_state", None)
            if state is None:
                continue
            group = state()._fsdp_param_group
            if group is None:
                continue
            for fp in group.fsdp_params:
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is None:
                    continue
                if unsharded.untyped_storage().size() > 0:
                    total += unsharded.numel() * unsharded.element_size()
                if unsharded.grad is not None:
                    grads += unsharded.grad.numel() * unsharded.grad.element_size()
    return total, grads
