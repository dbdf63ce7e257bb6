"""Which loss-scale state a resume takes (framework/numerics/precision.py `LossScaler.load_state_dict`), when the
checkpoint and the run disagree on precision (train.precision may change on resume):

- an fp16 run resumed from a checkpoint without a loss scale (a bf16 or fp32 run's, or an HF import's step 0:
  the engines pass None or {}) starts from its configured scale, as a fresh run does;
- a bf16 or fp32 run resumed from an fp16 checkpoint keeps the scale 1: the parallel engine multiplies every
  loss by `scaler.scale` whatever `enabled` says, so a scale taken from the checkpoint would scale it.

The reference for the disabled case is torch's GradScaler, whose rule the scaler follows: disabled, it ignores
a loaded state, reports scale 1 and unscales nothing."""

from __future__ import annotations

import torch

from framework.numerics.precision import LossScaler

FP16_CHECKPOINT = {"scale": 1024.0, "growth_tracker": 7}


def test_an_fp16_run_without_a_saved_scale_starts_from_its_configured_one() -> None:
    fresh = LossScaler(True, init_scale=2.0**12, growth_interval=50)
    for missing in (None, {}):
        scaler = LossScaler(True, init_scale=2.0**12, growth_interval=50)
        scaler.load_state_dict(missing)
        assert (scaler.scale, scaler.good_steps) == (fresh.scale, fresh.good_steps) == (4096.0, 0)
    scaler.load_state_dict(FP16_CHECKPOINT)  # control: a saved scale is taken
    assert (scaler.scale, scaler.good_steps) == (1024.0, 7)


def test_a_bf16_run_ignores_an_fp16_checkpoints_scale_as_grad_scaler_does() -> None:
    ref = torch.amp.GradScaler("cpu", enabled=False)
    ref.load_state_dict(dict(FP16_CHECKPOINT, backoff_factor=0.5, growth_factor=2.0, growth_interval=2000))
    scaler = LossScaler(False)
    scaler.load_state_dict(FP16_CHECKPOINT)
    assert scaler.scale == ref.get_scale() == 1.0 and scaler.good_steps == 0
    assert scaler.state_dict() == {} and not scaler.enabled
    loss = torch.tensor(2.5)
    assert torch.equal(scaler.scale_loss(loss), loss) and loss * scaler.scale == loss  # both engines' forms


def test_a_disabled_scaler_reports_no_overflow_and_leaves_gradients_alone() -> None:
    # `LossScaler(False)` is the identity: the 1-process engine unscales (clip_grad_norm) under bf16 and fp32
    # too, so a disabled scaler that reported an overflow would skip steps for any caller not re-checking
    # `enabled`; GradScaler(enabled=False).unscale_ is a no-op as well. An inf gradient included: nothing to report.
    grads = [torch.tensor([1.5, -2.0]), torch.tensor([float("inf")])]
    before = [g.clone() for g in grads]
    assert LossScaler(False).unscale_(grads) is False
    assert all(torch.equal(g, b) for g, b in zip(grads, before))
    assert LossScaler(True, init_scale=4.0).unscale_(grads) is True  # control: enabled, the inf is found
    assert torch.equal(grads[0], torch.tensor([0.375, -0.5]))
