"""`resolve_partial_grads` turns pending-sum (Partial) DTensor gradients into replicas and leaves every other
gradient alone (plain tensors, sharded DTensors, missing gradients). One gloo rank is enough to see the
placements change."""

from __future__ import annotations

import torch

from framework.testing import run_distributed


def _body(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from framework.parallel.precision import resolve_partial_grads

    mesh = init_device_mesh("cpu", (1,))
    plain = torch.nn.Parameter(torch.ones(4))
    plain.grad = torch.full((4,), 2.0)
    none = torch.nn.Parameter(torch.ones(4))
    shard = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Shard(0)]))
    shard.grad = DTensor.from_local(torch.full((4,), 3.0), mesh, [Shard(0)])
    part = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Replicate()]))
    part.grad = DTensor.from_local(torch.full((4,), 5.0), mesh, [Partial()])
    before_plain, before_shard = plain.grad, shard.grad
    resolve_partial_grads([plain, none, shard, part])
    assert plain.grad is before_plain and none.grad is None and shard.grad is before_shard
    assert isinstance(part.grad, DTensor) and torch.equal(part.grad.to_local(), torch.full((4,), 5.0))
    return [type(pl).__name__ for pl in part.grad.placements]


def test_partial_gradients_become_replicas_and_others_stay() -> None:
    (placements,) = run_distributed(_body, 1, timeout_s=60)
    assert placements == ["Replicate"]


def test_loss_scaler_defaults_and_growth_follow_torch_grad_scaler() -> None:
    """The engines' one loss scaler must grow and back off as torch's GradScaler does."""
    from framework.numerics.precision import LossScaler

    ref = torch.amp.GradScaler("cpu")
    ours = LossScaler(True)
    assert (ours.scale, ours.growth_factor, ours.backoff_factor, ours.growth_interval) == (
        ref.get_scale(), ref.get_growth_factor(), ref.get_backoff_factor(), ref.get_growth_interval())
    for _ in range(ref.get_growth_interval() - 1):
        ours.update(False)
    assert ours.scale == 2.0**16
    ours.update(False)  # the growth_interval-th good step doubles it
    assert ours.scale == 2.0**17 and ours.good_steps == 0
    for _ in range(5):
        ours.update(False)
    ours.update(True)  # an overflow backs off and restarts the count of good steps, as GradScaler does
    assert ours.scale == 2.0**16 and ours.good_steps == 0


def test_scale_grads_scales_every_gradient_and_factor_one_touches_nothing() -> None:
    """Unscaling (1 / loss scale) and clipping (max_norm / norm) go through scale_grads."""
    from framework.parallel.precision import scale_grads

    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    ps[0].grad, ps[1].grad = torch.tensor([1.0, -2.0, 4.0]), None
    scale_grads(ps, 0.25)
    assert torch.equal(ps[0].grad, torch.tensor([0.25, -0.5, 1.0])) and ps[1].grad is None
    scale_grads(ps, 1.0)
    assert torch.equal(ps[0].grad, torch.tensor([0.25, -0.5, 1.0]))


def test_clip_factor_clips_as_torch_clip_grad_norm() -> None:
    """The parallel engine clips by `clip_factor`; the 1-process engine by torch's `clip_grad_norm_`. Both must scale
    the same gradients to the same values. Tolerance: torch forms its factor in fp32 (two roundings) and we in fp64
    (one rounding to fp32 at the multiply), so the results differ by at most ~3 units of fp32 roundoff (2**-24);
    rtol 3e-7. A norm of ~0.3 makes torch's eps of 1e-6 a 3e-6 relative change, ten times that tolerance, so a
    dropped or negated eps fails."""
    from framework.parallel.precision import clip_factor, scale_grads

    gen = torch.Generator().manual_seed(0)
    for target_norm, max_norm in [(0.3, 0.1), (0.3, 0.25), (0.3, 1.0), (7.0, 1.0)]:
        grads = [torch.randn(shape, generator=gen) for shape in [(64, 32), (32,), (17, 5)]]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        grads = [g * (target_norm / total) for g in grads]
        ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for r, o, g in zip(ref, ours, grads):
            r.grad, o.grad = g.clone(), g.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=True))
        scale_grads(ours, clip_factor(norm, max_norm))
        for r, o in zip(ref, ours):
            assert o.grad is not None and r.grad is not None
            torch.testing.assert_close(o.grad, r.grad, rtol=3e-7, atol=0.0)
        if max_norm >= target_norm:  # below the bound nothing is scaled: bitwise the gradients as they were
            assert all(torch.equal(o.grad, g) for o, g in zip(ours, grads))
