"""Single-process Muon (`train.optimizer: muon`) against a reference written here from the published pseudocode,
and against the published `torch.optim.Muon`; the parameter split, the config checks and a skipped step.

Reference: Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks" (github.com/KellerJordan/
Muon, `zeropower_via_newtonschulz5` and `muon_update`), with the update scaled to AdamW's RMS as in Liu et al.
2025, "Muon is Scalable for LLM Training" (Moonlight): W <- W - lr (0.2 sqrt(max(A, B)) O + wd W). AdamW trains
the embedding, head and norms. Written independently of framework/train/muon.py: its own parameter choice, loop,
loss and clipping.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from framework.base.errors import ConfigError
from framework.config import Config
from framework.testing.tiny import tiny_config
from framework.train.local_engine import LocalEngine
from framework.train.muon import Muon, is_muon_param
from models.decoder import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, LR, CLIP = 10, 2e-3, 1.0


def _batches(cfg: Config) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, cfg.model.vocab_size, (STEPS, 2, 2, cfg.data.seq_len + 1), generator=gen)


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95) -> torch.Tensor:
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp(momentum, beta)  # Nesterov
    return zeropower_via_newtonschulz5(update).to(grad.dtype)


def per_head_update(name: str, grad: torch.Tensor, momentum: torch.Tensor, head_dim: int
                    ) -> tuple[torch.Tensor, tuple[int, int]]:
    """`train.muon.per_head`: the attention projections orthogonalized per head block (wq/wk/wv: head_dim rows
    each, wo: head_dim columns each); returns the update and the block shape its scale is taken from."""
    a, b = grad.shape
    if name.endswith(("wq.weight", "wk.weight", "wv.weight")):
        heads = [muon_update(grad[h:h + head_dim], momentum[h:h + head_dim]) for h in range(0, a, head_dim)]
        return torch.cat(heads), (head_dim, b)
    if name.endswith("wo.weight"):
        heads = [muon_update(grad[:, h:h + head_dim], momentum[:, h:h + head_dim]) for h in range(0, b, head_dim)]
        return torch.cat(heads, dim=1), (a, head_dim)
    return muon_update(grad, momentum), (a, b)


def _reference_run(cfg: Config) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(cfg.model, seed=cfg.train.seed)
    named = dict(model.named_parameters())
    hidden = {n: p for n, p in named.items() if p.ndim == 2 and n not in ("tok_embeddings.weight", "output.weight")}
    adamw = torch.optim.AdamW(
        [{"params": [named["output.weight"]], "weight_decay": cfg.train.weight_decay},
         {"params": [p for n, p in named.items() if n not in hidden and n != "output.weight"], "weight_decay": 0.0}],
        lr=LR, betas=(cfg.train.beta1, cfg.train.beta2), eps=cfg.train.eps, foreach=True)
    bufs = {n: torch.zeros_like(p) for n, p in hidden.items()}
    losses = []
    for batch in _batches(cfg):
        total = 0.0
        for mb in batch:
            logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten()) / batch.shape[0]
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP, foreach=True)
        with torch.no_grad():
            adamw.step()
            for n, p in hidden.items():
                assert p.grad is not None
                if cfg.train.muon.per_head:
                    o, shape = per_head_update(n, p.grad, bufs[n], cfg.model.head_dim)
                else:
                    o, shape = muon_update(p.grad, bufs[n]), tuple(p.shape)
                p.mul_(1 - LR * cfg.train.weight_decay)
                p.add_(o, alpha=-LR * 0.2 * math.sqrt(max(shape)))
        model.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in named.items()}


def _engine_run(cfg: Config) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    losses = []
    for batch in _batches(cfg):
        losses.append(engine.forward_backward(batch))
        engine.clip_grad_norm(CLIP)
        engine.optimizer_step(LR)
    return losses, {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_muon_matches_the_published_pseudocode_to_1e_6_over_10_steps() -> None:
    cfg = tiny_config(None, "train.optimizer=muon", "train.muon.ns_dtype=fp32")
    ref_losses, ref_params = _reference_run(cfg)
    losses, params = _engine_run(cfg)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-6, rtol=0)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], atol=1e-6, rtol=0, msg=name)
    # Muon moved the hidden matrices away from where AdamW takes them (the comparison is not AdamW against AdamW).
    adamw_losses, _ = _engine_run(tiny_config(None))
    assert abs(adamw_losses[-1] - losses[-1]) > 1e-3


def test_per_head_blocks_match_the_pseudocode_per_head() -> None:
    """`train.muon.per_head`: each head's block of wq/wk/wv/wo orthogonalized on its own, 10 steps at 1e-6; a
    rectangular head_dim (kv_channels 8 x 4 heads = 32 != hidden 64) so the wo column blocks are (64, 8)."""
    cfg = tiny_config(None, "train.optimizer=muon", "train.muon.ns_dtype=fp32", "train.muon.per_head=true",
                      "model.kv_channels=8")
    ref_losses, ref_params = _reference_run(cfg)
    losses, params = _engine_run(cfg)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-6, rtol=0)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], atol=1e-6, rtol=0, msg=name)
    whole, _ = _engine_run(tiny_config(None, "train.optimizer=muon", "train.muon.ns_dtype=fp32", "model.kv_channels=8"))
    assert abs(whole[-1] - losses[-1]) > 1e-5  # per head is not the whole-matrix update


def test_muon_steps_as_accurately_as_torch_optim_muon_in_bf16() -> None:
    """torch.optim.Muon (torch >= 2.9: Jordan's iteration, always in bf16) with Moonlight's "match_rms_adamw" scale.

    bf16 Newton-Schulz is not bitwise between implementations (torch fuses b A + c A^2 into addmm and clamps the
    norm instead of adding eps), so each step of the engine (bf16, the published default) is checked from the
    same weights, gradient and momentum as torch's step, against the exact (fp64) step of the pseudocode: the
    engine's distance to torch's and to the exact step must stay within 3x torch's own distance to the exact
    step (its bf16 rounding), whereas a wrong momentum, scale or decay is off by the whole update.
    """
    cfg = tiny_config(None, "train.optimizer=muon")
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    opt = engine.optimizers[0]
    hidden = [p for g in opt.param_groups if g["muon"] for p in g["params"]]
    for batch in _batches(cfg)[:4]:
        engine.forward_backward(batch)
        engine.clip_grad_norm(CLIP)
        before = [(p.detach().clone(), p.grad.clone(), opt.state[p]["momentum_buffer"].clone()  # type: ignore[union-attr]
                   if p in opt.state else torch.zeros_like(p)) for p in hidden]
        engine.optimizer_step(LR)
        copies = [w.clone().requires_grad_() for w, _, _ in before]
        muon = torch.optim.Muon(copies, lr=LR, weight_decay=cfg.train.weight_decay, momentum=0.95, nesterov=True,
                                adjust_lr_fn="match_rms_adamw")
        for c, (_, g, buf) in zip(copies, before, strict=True):
            c.grad = g.clone()
            muon.state[c]["momentum_buffer"] = buf.clone()
        muon.step()
        for p, c, (w, g, buf) in zip(hidden, copies, before, strict=True):
            update = zeropower_via_newtonschulz5(g.double().lerp(buf.double().lerp(g.double(), 0.05), 0.95),
                                                 dtype=torch.float64)
            exact = w.double() * (1 - LR * cfg.train.weight_decay) - LR * 0.2 * math.sqrt(max(w.shape)) * update
            torch_err = float((c.detach().double() - exact).norm())
            assert float((p.detach().double() - c.detach().double()).norm()) <= 3 * torch_err
            assert float((p.detach().double() - exact).norm()) <= 3 * torch_err


def test_parameter_split_follows_the_published_recipes() -> None:
    """Hidden matrices (and each expert's, stacked) on Muon; embeddings, head, norms and router on AdamW."""
    cfg = tiny_config(None, "train.optimizer=muon", "model.preset=test-moe", "model.moe.n_shared_experts=1")
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    opt = engine.optimizers[0]
    assert isinstance(opt, Muon)
    ids = {id(p) for g in opt.param_groups if g["muon"] for p in g["params"]}
    names = {n for n, p in engine.model.named_parameters() if id(p) in ids}
    assert names == {n for n, p in engine.model.named_parameters() if is_muon_param(n, p)}
    assert "layers.1.feed_forward.experts.w1" in names and "layers.1.attention.wq.weight" in names
    assert "layers.1.feed_forward.shared_experts.w2.weight" in names
    assert not {n for n in names if "router" in n or "norm" in n or "embeddings" in n or n == "output.weight"}
    # AdamW's decay group keeps the other matrices (router, head), as under train.optimizer=adamw
    assert opt.param_groups[0]["weight_decay"] == cfg.train.weight_decay
    by_id = {id(p): n for n, p in engine.model.named_parameters()}
    decayed = {by_id[id(p)] for p in opt.param_groups[0]["params"]}
    assert decayed == {"output.weight"} | {f"layers.{i}.feed_forward.router.weight" for i in range(4)}


def test_a_skipped_step_leaves_weights_and_momentum_alone() -> None:
    cfg = tiny_config(None, "train.optimizer=muon", "train.muon.ns_dtype=fp32")
    engine = LocalEngine(cfg.model, cfg.train, torch.device("cpu"))
    batches = _batches(cfg)
    engine.forward_backward(batches[0])
    engine.optimizer_step(LR)
    opt = engine.optimizers[0]
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    bufs = {id(p): opt.state[p]["momentum_buffer"].clone() for g in opt.param_groups if g["muon"]
            for p in g["params"]}
    engine.forward_backward(batches[1])
    assert engine.optimizer_step(LR, apply=False) is False  # the loss guard's skip
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(opt.state[p]["momentum_buffer"], bufs[id(p)]) for g in opt.param_groups if g["muon"]
               for p in g["params"])


@pytest.mark.parametrize("override,match", [
    ("train.muon.momentum=1.0", "momentum=1.0 must be in"),
    ("train.muon.ns_steps=0", "ns_steps=0 must be in"),
    ("train.muon.ns_coefficients=[1.0,2.0]", "expected 3 items"),
    ("train.muon.ns_coefficients=[1.0,2.0,.inf]", "three finite numbers"),
    ("train.muon.update_rms=0", "must be > 0"),
    ("parallel.nvme_offload.path=/tmp", "cannot keep its states on NVMe"),
])
def test_bad_muon_settings_are_refused_at_load(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tiny_config(None, "train.optimizer=muon", override)
