"""Multi-token prediction against a reference computed by hand from DeepSeek-V3's equations (sec. 2.2) on a
tiny model: each depth's loss from truncated sequences built straight from the token row (t_{i+k} in, t_{i+k+1}
out, positions i < T - k), never through the labels-shifting and ignore-masking the module uses; the logged
per-depth losses and the gradients of main + lambda / D * sum_k L_k must match."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.base.errors import ParallelismError
from framework.testing.tiny import tiny_config
from models import build_model, model_config
from models.mtp import mtp_metrics, set_mtp_loss_scale


def _reference(model: torch.nn.Module, rows: torch.Tensor, weight: float) -> tuple[torch.Tensor, list[float]]:
    """main loss + lambda / D * sum_k L_k, and each L_k, written from the paper with the model's modules."""
    x, t = rows[:, :-1], rows.shape[1] - 1
    h = model.tok_embeddings(x)
    for layer in model.layers.values():
        h = layer(h, model.rope)
    h = model.norm(h)
    main = F.cross_entropy(model.output(h).flatten(0, 1), rows[:, 1:].flatten())
    depth_losses = []
    for k, module in model.mtp.depths.items():
        k = int(k)
        n = t - k  # positions i with a token t_{i+k+1} to predict
        emb = model.tok_embeddings(rows[:, k:k + n])
        h = module.block(module.eh_proj(torch.cat([module.hnorm(h[:, :n]), module.enorm(emb)], -1)), model.rope)
        logits = model.output(module.norm(h))
        depth_losses.append(F.cross_entropy(logits.flatten(0, 1), rows[:, k + 1:k + 1 + n].flatten()))
    mtp = torch.stack(depth_losses).mean() * weight
    return main + mtp, [float(v.detach()) for v in depth_losses]


@pytest.mark.parametrize("preset", ["test-tiny", "test-mla"])
def test_mtp_loss_and_gradients_equal_hand_computed_reference(preset: str) -> None:
    cfg = model_config(preset, mtp_depth=2, mtp_loss_weight=0.3)
    model = build_model(cfg, seed=4)
    rows = torch.randint(0, cfg.vocab_size, (2, 25), generator=torch.Generator().manual_seed(3))
    ref_total, ref_depths = _reference(model, rows, 0.3)
    ref_total.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    set_mtp_loss_scale([model], 1.0)
    logits = model(rows[:, :-1], mtp_labels=rows[:, 1:])
    F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
    got = mtp_metrics([model])
    assert list(got) == ["mtp/loss_1", "mtp/loss_2"]
    torch.testing.assert_close(list(got.values()), ref_depths, atol=1e-5, rtol=1e-6)
    assert set(want) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(n.startswith("mtp.depths.2.") and want[n].abs().sum() > 0 for n in want)


def test_inference_forward_skips_mtp_and_layouts_it_cannot_run_are_refused() -> None:
    cfg = model_config("test-tiny", mtp_depth=1)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    torch.testing.assert_close(model(x), model(x, mtp_labels=x))  # the logits are the main head's either way
    assert mtp_metrics([model])["mtp/loss_1"] > 0 and mtp_metrics([model]) == {}  # taken once, then reset
    tiny_config(None, "model.mtp_depth=1", "parallel.cp=2")  # labels shifted on whole rows (tests/parallel)
    tiny_config(None, "model.mtp_depth=1", "parallel.pp=2")  # the last stage holds them (tests/parallel)
    tiny_config(None, "model.mtp_depth=1", "parallel.pp=2", "model.tied_embeddings=true")  # 1F1B: the tied head
    with pytest.raises(ParallelismError, match=r"model\.tied_embeddings=true and parallel\.pp=2 under "
                                               r"pp_schedule=ZBVZeroBubble \(split backward\)"):
        tiny_config(None, "model.mtp_depth=1", "parallel.pp=2", "model.tied_embeddings=true",
                    "parallel.pp_schedule=ZBVZeroBubble")
