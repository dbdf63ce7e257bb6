"""Per-rank model-state memory report: parameters, gradients, optimizer states, by dtype.

Two kinds of bytes, reported apart because the ZeRO paper counts them apart:
- persistent states (`model_state_report`): what a rank keeps between steps — under FSDP the local shard of
  each parameter (ZeRO's fp32 master copy) and of its gradient, plus the optimizer states;
- FSDP's working copies (`unsharded_bytes`, `unsharded_by_unit`): all-gathered parameters and the unsharded
  gradients autograd writes before they are reduce-scattered. Mid-step, a module's parameters *are* these
  working copies, so they are found through FSDP's parameter groups, never through `module.parameters()`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def fsdp_units(parts: Sequence[nn.Module]) -> Iterator[tuple[str, Any]]:
    """(FQN of the first module of the unit, FSDPParamGroup) for every FSDP unit, each once."""
    seen: set[int] = set()
    for part in parts:
        for fqn, module in part.named_modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is None:
                continue
            group = get_state()._fsdp_param_group
            if group is None or id(group) in seen:
                continue
            seen.add(id(group))
            yield fqn or "<root>", group


def _fsdp_params(parts: Sequence[nn.Module]) -> Iterator[Any]:
    for _, group in fsdp_units(parts):
        yield from group.fsdp_params


def model_state_report(parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
                       ) -> dict[str, int]:
    """Persistent bytes on this rank as {"<kind>/<dtype>": bytes, "<kind>": bytes, "total": bytes}.

    kind is params, grads or optimizer. Tensors are counted once (tied weights, views of one buffer). FSDP
    parameters count as their local shard and its gradient, whether or not the unit is all-gathered right now.
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

    managed: set[int] = set()
    for fp in _fsdp_params(parts):
        managed.update(id(p) for p in (fp.sharded_param, getattr(fp, "_unsharded_param", None)) if p is not None)
        add("params", fp.sharded_param)
        if fp.sharded_param.grad is not None:
            add("grads", fp.sharded_param.grad)
    for part in parts:
        for p in part.parameters():
            if id(p) in managed:
                continue
            add("params", p)
            if p.grad is not None:
                add("grads", p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    add("optimizer", value)
    return dict(out)


def working_copy_bytes(fp: Any) -> tuple[int, int]:
    """(all-gathered parameter bytes, unsharded gradient bytes) of one FSDPParam, (0, 0) when resharded."""
    param = getattr(fp, "_unsharded_param", None)
    if param is None:  # never all-gathered yet
        return 0, 0
    local = _local(param)
    params = local.numel() * local.element_size() if local.untyped_storage().nbytes() > 0 else 0
    grads = 0
    for g in (param.grad, fp.unsharded_accumulated_grad):  # the latter: reduce_dtype accumulation
        if g is not None:
            g = _local(g)
            grads += g.numel() * g.element_size()
    return params, grads


def unsharded_by_unit(parts: Sequence[nn.Module]) -> dict[str, tuple[int, int]]:
    """{unit FQN: (bytes of its all-gathered parameters, bytes of its unsharded gradients)} for units holding any."""
    out: dict[str, tuple[int, int]] = {}
    for fqn, group in fsdp_units(parts):
        sizes = [working_copy_bytes(fp) for fp in group.fsdp_params]
        params, grads = sum(s[0] for s in sizes), sum(s[1] for s in sizes)
        if params or grads:
            out[fqn] = (params, grads)
    return out


def unsharded_bytes(parts: Sequence[nn.Module]) -> tuple[int, int]:
    """(bytes of FSDP's allocated all-gathered parameters, bytes of the unsharded gradients on them); (0, 0)
    when every unit is resharded or without FSDP."""
    units = unsharded_by_unit(parts).values()
    return sum(u[0] for u in units), sum(u[1] for u in units)
