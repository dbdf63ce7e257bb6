"""Routed experts as batched SwiGLU weights, computed with a loop over experts or one grouped matmul.

Shape legend: M routed rows (token-expert assignments sorted by expert), E experts held here (all of them on one
device; E / ep under expert parallelism), F expert hidden, D model hidden.
Weights follow nn.Linear's (out, in) convention per expert, so `w1_EFD[e]` is what a dense MLP calls
`w1.weight`; FQNs `experts.w1 / w2 / w3` get N(0, init_std), `w2` depth-scaled (models/init.py `initial_value`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from framework.base.errors import ConfigError

_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands a contiguous gradient on: `_grouped_mm`'s backward rejects the
    zero-stride gradients that, e.g., `.sum()` produces."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale` (set by expert-parallel FSDP, see below)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def group_alignment(dtype: torch.dtype) -> int:
    """Rows per token group that keep every group's start 16 bytes aligned for `torch._grouped_mm`.

    Its CUDA kernels need 16-byte-aligned strides (torch/_meta_registrations.py `check_valid_strides`), and the
    weight gradient is a grouped matmul over the token dimension itself, sliced at the offsets: a group starting
    mid-vector is misaligned there. 16 // element size: 8 rows for bf16 (torchtitan pads to 8 too), 4 for fp32.
    """
    return max(1, 16 // dtype.itemsize)


def pad_groups(counts_E: torch.Tensor, align: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row goes when every expert's group is padded to a multiple of `align` rows.

    Returns (dst_M: each row's index in the padded layout, offs_E: the padded groups' ends as int32, all multiples
    of `align`, padded row count). The count is the static bound rows + E (align - 1), so no host sync is needed.
    """
    counts = counts_E.to(torch.int64)
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts, starts_pad = torch.cumsum(counts, 0) - counts, ends - padded
    expert_M = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts, output_size=rows)
    dst_M = torch.arange(rows, device=counts.device) - starts[expert_M] + starts_pad[expert_M]
    return dst_M, ends.to(torch.int32), rows + len(counts) * (align - 1)


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here and matches the loop, forward and weight gradient (probed once per
    device type and dtype, on aligned groups, one of them empty, as `_grouped` calls it).

    The answer is cached for the process, so the probe must not depend on the caller's autograd state: a first
    call under `no_grad` / `inference_mode` (an MoE forward in an evaluation or in `generate`) would otherwise fail
    the probe's backward and pin every later training forward to the loop.
    """
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
                    align = group_alignment(dtype)
                    x = torch.randn(4 * align, 16, device=device, dtype=dtype)
                    w = torch.randn(3, 16, 16, device=device, dtype=dtype, requires_grad=True)
                    offs = torch.tensor([2 * align, 2 * align, 4 * align], device=device, dtype=torch.int32)
                    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
                    y.backward(torch.ones_like(y))
                    with torch.no_grad():
                        ref = torch.cat([x[:2 * align] @ w[0].T, x[2 * align:] @ w[2].T])
                    grad = w.grad
                    ok = grad is not None and bool(torch.isfinite(grad).all()) and bool(grad[1].eq(0).all()) \
                        and torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


def _local(w: torch.Tensor) -> torch.Tensor:
    """The local expert shard of an expert-parallel DTensor (Shard(0) over `ep`), or `w` itself."""
    to_local = getattr(w, "to_local", None)
    return to_local() if callable(to_local) else w


class GroupedExperts(nn.Module):
    """E SwiGLU experts: y = w2 (silu(w1 x) * w3 x) for the rows routed to each expert."""

    def __init__(self, n_experts: int, hidden: int, expert_hidden: int,
                 impl: Literal["auto", "loop", "grouped_mm"] = "auto") -> None:
        super().__init__()
        self.impl = impl
        self.grad_scale = 1.0
        """Multiplies the weights' gradients: FSDP over the edp ranks averages over edp_size ranks, while the
        expert gradient must be divided by the data-parallel size (gloo has no pre-multiplied reduce-scatter
        for FSDP's gradient_divide_factor), so expert parallelism sets edp_size / dp_size here."""
        self.w1 = nn.Parameter(torch.empty(n_experts, expert_hidden, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, expert_hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, expert_hidden, hidden))

    def use_grouped_mm(self, x_MD: torch.Tensor) -> bool:
        if self.impl == "loop":
            return False
        f, d = self.w1.shape[1], self.w1.shape[2]
        # _grouped_mm needs 16-byte-aligned strides
        aligned = (f * x_MD.element_size()) % 16 == 0 and (d * x_MD.element_size()) % 16 == 0
        ok = aligned and grouped_mm_available(x_MD.device, x_MD.dtype)
        if self.impl == "grouped_mm" and not ok:
            raise ConfigError(
                f"model.moe.experts_impl='grouped_mm' but torch._grouped_mm does not run for {x_MD.dtype} on "
                f"{x_MD.device.type} with hidden={d}, expert_hidden={f}; set model.moe.experts_impl=auto or loop")
        return ok

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Rows `x_MD` sorted by expert, `counts_E[e]` of them for local expert e -> outputs in the same order."""
        w1, w2, w3 = (_local(w).to(x_MD.dtype) for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        if self.use_grouped_mm(x_MD):
            return self._grouped(x_MD, counts_E, w1, w2, w3)
        return self._loop(x_MD, counts_E, w1, w2, w3)

    @staticmethod
    def _loop(x_MD: torch.Tensor, counts_E: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
              ) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(torch.split(x_MD, counts_E.tolist())):
            # experts with no rows still take part, so every expert weight gets a (zero) gradient on every rank
            h = F.silu(rows @ w1[e].T) * (rows @ w3[e].T)
            outs.append(h @ w2[e].T)
        return torch.cat(outs) if outs else x_MD.new_zeros(0, w2.shape[1])

    @staticmethod
    def _grouped(x_MD: torch.Tensor, counts_E: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
                 ) -> torch.Tensor:
        # Every group padded with zero rows to an aligned start (`group_alignment`); zero rows give zero outputs
        # and add nothing to the weight gradients, and are dropped again below.
        dst_M, offs, rows = pad_groups(counts_E, group_alignment(x_MD.dtype), x_MD.shape[0])
        x_PD = x_MD.new_zeros(rows, x_MD.shape[1]).index_copy(0, dst_M, x_MD)
        h1 = _ContiguousGrad.apply(torch._grouped_mm(x_PD, w1.transpose(-2, -1), offs=offs))
        h3 = _ContiguousGrad.apply(torch._grouped_mm(x_PD, w3.transpose(-2, -1), offs=offs))
        h = F.silu(h1) * h3
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs).index_select(0, dst_M)
