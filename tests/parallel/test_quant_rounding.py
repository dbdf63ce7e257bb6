"""ZeRO++'s int8 block quantizer (framework/parallel/quant.py) rounds to the nearest level: on the tiny model's real
initial weights, cut into the shards 4 ranks send, every element comes back within half a step (s_b / 2, s_b =
max_b|w| / 127) and the errors have no sign bias; truncating or flooring would give errors up to a whole step,
biased by -s_b/2 towards zero (or down). This is what a loss comparison can only see through noise."""

from __future__ import annotations

import torch

from framework.parallel.quant import dequantize, packed_numel, quantize
from models.config import model_config
from models.decoder import build_model

BLOCK = 256


def test_quantizer_rounds_to_nearest_on_real_weight_shards() -> None:
    model = build_model(model_config("test-tiny"), seed=0)
    errs, signed, steps = [], [], []
    for p in model.parameters():
        if p.dim() < 1 or p.shape[0] % 4:
            continue
        for shard in p.detach().chunk(4, 0):
            flat = shard.reshape(-1)
            packed = quantize(flat, BLOCK)
            assert packed.dtype == torch.int8 and packed.numel() == packed_numel(flat.numel(), BLOCK)
            back = dequantize(packed, flat.numel(), BLOCK).reshape(-1)
            nb = -(-flat.numel() // BLOCK)
            pad = nb * BLOCK - flat.numel()
            s = torch.nn.functional.pad(flat.abs(), (0, pad)).view(nb, BLOCK).amax(1) / 127
            s_el = s.repeat_interleave(BLOCK)[:flat.numel()]
            errs.append((back - flat).abs() / s_el)
            signed.append((back - flat) * flat.sign() / s_el)
            steps.append(s_el)
    err, sgn = torch.cat(errs), torch.cat(signed)
    # |x/s - round(x/s)| <= 1/2, plus fp32 rounding of x/s and of q*s (a few ulps of values <= 127)
    assert err.max().item() <= 0.5 + 1e-4, err.max().item()
    # round-to-nearest errors are uniform on [-1/2, 1/2] steps, mean 0, SD 1/sqrt(12): the mean of N of them
    # lies within 5 / sqrt(12 N) of 0; truncation's mean is -1/4 .. -1/2 (here N ~ 1e5: bound ~0.005)
    n = sgn.numel()
    assert abs(sgn.mean().item()) < 5 / (12 * n) ** 0.5, (sgn.mean().item(), n)
    assert err.mean().item() > 0.2  # negative control: the errors are real (mean 1/4 of a step), not all zero
