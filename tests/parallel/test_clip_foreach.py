"""Gradient clipping and scaling on local shards with torch._foreach_*: a bounded number of ops per clip whatever the
parameter count, no fp64 copy of a gradient, and the values of the exact fp64 reference."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from framework.parallel.precision import global_grad_norm, scale_grads

CPU = torch.device("cpu")


class _Ops(TorchDispatchMode):
    """Every aten op issued at the top level that can launch a kernel (views cannot), with the dtype and size of
    what it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[torch.dtype, int]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        flat = out if isinstance(out, (list, tuple)) else [out]
        self.ops.append((str(func), [(t.dtype, t.numel()) for t in flat if isinstance(t, torch.Tensor)]))
        return out


def _params(n: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """n parameters of mixed shapes and magnitudes spanning 1e-4..1e3 (embedding-like, matrices, norm vectors)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        shape = [(257, 64), (64, 64), (64,), (128, 64)][i % 4]
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=gen) * 10.0 ** float(torch.randint(-4, 4, (), generator=gen))
        out.append(p)
    return out


def _reference_norm(params: list[torch.nn.Parameter]) -> float:
    """Every gradient element squared and summed in fp64: the exact norm."""
    return float(torch.cat([p.grad.double().flatten() for p in params if p.grad is not None]).norm())


def test_clip_op_count_is_bounded_and_nothing_is_copied_to_fp64() -> None:
    counts = {}
    for n in (8, 64):
        params = _params(n)
        with _Ops() as mode:
            global_grad_norm(params, 1, [], CPU)
        counts[n] = len(mode.ops)
        biggest_fp64 = max((numel for _, outs in mode.ops for dtype, numel in outs if dtype == torch.float64),
                           default=0)
        assert biggest_fp64 <= n, f"an fp64 tensor of {biggest_fp64} elements: a gradient copied to fp64"
    assert counts[8] == counts[64] <= 10, counts  # a per-parameter loop issues ~4 ops per parameter


def test_scale_is_one_op_per_dtype_and_bitwise_the_per_parameter_multiply() -> None:
    params = _params(40)
    want = [p.grad.clone() * 0.37 for p in params]  # type: ignore[union-attr]
    with _Ops() as mode:
        scale_grads(params, 0.37)
    assert [name for name, _ in mode.ops] == ["aten._foreach_mul_.Scalar"], mode.ops
    for p, w in zip(params, want):
        assert torch.equal(p.grad, w)  # type: ignore[arg-type]


def test_norm_matches_the_fp64_reference_and_weights_pieces() -> None:
    params = _params(64, seed=3)
    params[5].grad = None  # a parameter without a gradient counts nothing
    want = _reference_norm(params)
    got = float(global_grad_norm(params, 1, [], CPU))
    # Per-tensor norms in fp32 (relative error ~ 1e-7 each), squares summed in fp64.
    assert abs(got - want) <= 1e-6 * want, (got, want)
    # Replicated on 4 copies of a stage (no sharding): each rank's squares count a quarter.
    assert abs(float(global_grad_norm(params, 4, [], CPU)) - want / 2) <= 1e-6 * want
