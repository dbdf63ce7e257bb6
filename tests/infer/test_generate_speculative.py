"""Speculative decoding with MTP drafts: the greedy output and its logits are the plain decode's, the drafts are
what the training path's MTP modules predict at every step, and the acceptance count is the one a hand-built
model gives."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from framework.base.errors import ConfigError
from framework.infer.generate import DecodeTrace, SamplingConfig, generate
from models.config import model_config
from models.decoder import Decoder, build_model
from models.mtp import MTPModule

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = [[5, 17, 9, 300, 41, 7], [88], [3, 3, 3, 120]]
LOGIT_TOL = 2e-5  # as tests/infer/test_generate_logits.py: cache vs recompute differ by ~1e-6 here
N_NEW = 12







def _sharpened(preset: str, depth: int = 2) -> Decoder:
    """A tiny MTP model with its matrices scaled up, so attention and logits are far from uniform."""
    model = build_model(model_config(preset, mtp_depth=depth), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embeddings" not in name:
                p.mul_(4.0)
    return model.eval()


def _decode(model: Decoder, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], DecodeTrace]:
    trace = DecodeTrace(keep=True)
    cfg = SamplingConfig(**{"max_new_tokens": N_NEW, **kw})  # type: ignore[arg-type]
    return generate(model, prompts, cfg, trace=trace), trace


@pytest.mark.parametrize("preset", ["test-tiny", "test-mla"])  # test-mla: MLA's latent cache, main and MTP
def test_drafts_leave_greedy_tokens_and_logits_unchanged(preset: str) -> None:
    model = _sharpened(preset)
    plain, plain_trace = _decode(model, PROMPTS)
    eos = plain[1][4]  # row 1 stops after 5 tokens: the batch's acceptance then follows the live rows only
    plain_eos = generate(model, PROMPTS, SamplingConfig(max_new_tokens=N_NEW), eos_id=eos)
    assert len(plain_eos[1]) == 5 and len(plain_eos[0]) == N_NEW
    for use_cache in (True, False):
        for draft in (1, 2):
            out, trace = _decode(model, PROMPTS, draft_tokens=draft, use_cache=use_cache)
            assert out == plain, (use_cache, draft)
            assert 1 + trace.forwards + trace.accepted == N_NEW  # each verification commits accepted + 1
            assert len(trace.logits) == N_NEW
            for step, (a, b) in enumerate(zip(trace.logits, plain_trace.logits, strict=True)):
                err = (a - b).abs().max().item()
                assert err <= LOGIT_TOL, f"cache {use_cache} draft {draft} token {step}: logits off by {err:.2e}"
            cfg = SamplingConfig(max_new_tokens=N_NEW, draft_tokens=draft, use_cache=use_cache)
            assert generate(model, PROMPTS, cfg, eos_id=eos) == plain_eos


@pytest.mark.parametrize("preset", ["test-tiny", "test-mla"])
def test_cached_drafts_equal_the_training_path_at_every_step(preset: str) -> None:
    """Each step's draft logits (MTP caches rolled back and refilled) equal the MTP modules' training forward on
    the whole row (no cache, no padding) at the newest committed position, the drafts appended as labels."""
    model = _sharpened(preset)
    out, trace = _decode(model, PROMPTS, draft_tokens=2)
    assert len(trace.drafts) >= 5
    seen: list[torch.Tensor] = []
    hook = model.output.register_forward_hook(lambda m, i, o: seen.append(o))  # type: ignore[union-attr]
    width = max(len(p) for p in PROMPTS)
    with torch.no_grad():
        for n, logits_BQV in trace.drafts:
            for row, prompt in enumerate(PROMPTS):
                seq = prompt + out[row][:n + 1 - width]  # t_0..t_n of this row, without its left padding
                drafts = logits_BQV[row].argmax(-1).tolist()
                full = torch.tensor([seq + drafts])
                t = full.shape[1] - 1
                h = model.final_hidden(full[:, :-1], None, torch.arange(t)[None])
                seen.clear()
                model.mtp(h, h, full[:, 1:], model.tok_embeddings, model.output, model.rope[:t], None)  # type: ignore[misc]
                for k in range(logits_BQV.shape[1]):
                    ref = seen[k][0, len(seq) - 2]  # depth k + 1 at position n - 1
                    err = (logits_BQV[row, k] - ref).abs().max().item()
                    assert err <= LOGIT_TOL, f"step n={n} row {row} depth {k + 1}: draft logits off by {err:.2e}"
    hook.remove()


def test_acceptance_count_of_a_hand_built_model() -> None:
    """A bigram model (attention outputs zeroed: each position sees only its own token) greedily follows a table
    t -> g(t). MTP depth 1 reads only the embedding (eh_proj = [0 | I], an identity block: its attention and MLP
    outputs zeroed), so it drafts f1(t_n), f1(t) = argmax head(norm(enorm(Emb t))): right where the main model's
    MLP does not change the argmax. Depth 2 reads the embedding through I + noise, drafting f2(d_1). Drafts are
    accepted while they equal the greedy tokens: counted here, step by step, from f1, f2 and the plain output."""
    model = build_model(model_config("test-tiny", mtp_depth=2), seed=5).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attention.wo.weight") or (name.startswith("mtp.") and name.endswith("w2.weight")):
                p.zero_()
            elif name.endswith("w2.weight"):
                p.mul_(2.0)  # the main model's MLP: its table g differs from f1 on some tokens
        assert model.mtp is not None and model.tok_embeddings is not None and model.output is not None
        depths = [cast(MTPModule, model.mtp.depths[k]) for k in ("1", "2")]
        for depth, noise in zip(depths, (0.0, 0.1), strict=True):
            depth.eh_proj.weight.zero_()
            depth.eh_proj.weight[:, 64:] = torch.eye(64) + noise * torch.randn(64, 64, generator=gen)
        emb = model.tok_embeddings.weight
        tables = []
        for depth in depths:
            x = depth.eh_proj(torch.cat([torch.zeros_like(emb), depth.enorm(emb)], dim=-1))
            tables.append(model.output(depth.norm(x)).argmax(-1).tolist())
    f1, f2 = tables
    prompt, n_new = [7, 300, 41], 24
    plain = generate(model, [prompt], SamplingConfig(max_new_tokens=n_new))[0]
    forwards = drafted = 0
    produced, pattern, newest = 1, [], []
    while produced < n_new:
        q = min(2, n_new - produced - 1)
        d1 = f1[plain[produced - 1]]  # depth 1 reads the newest committed token
        a = 0
        if q >= 1 and d1 == plain[produced]:
            a = 1
            if q >= 2 and f2[d1] == plain[produced + 1]:
                a = 2
        if q:
            newest.append(len(prompt) + produced - 1)
        forwards, drafted, produced = forwards + 1, drafted + q, produced + a + 1
        pattern.append(a)
    # accepted per verification: 0 1 2 1 0 1 1 1 1 2 1 0 (every outcome occurs)
    assert {0, 1, 2} <= set(pattern), pattern
    for use_cache in (True, False):
        out, trace = _decode(model, [prompt], draft_tokens=2, use_cache=use_cache, max_new_tokens=n_new)
        assert out[0] == plain
        assert (trace.forwards, trace.drafted, trace.accepted) == (forwards, drafted, sum(pattern))
        assert [n for n, _ in trace.drafts] == newest  # where each step drafted from: the accepted counts in turn
        # a batch: rows accept different counts, each row's output is still its own greedy one
        batch, trace = _decode(model, PROMPTS, draft_tokens=2, use_cache=use_cache, max_new_tokens=n_new)
        assert batch == generate(model, PROMPTS, SamplingConfig(max_new_tokens=n_new)) and trace.accepted > 0


def test_refusals_name_the_field() -> None:
    model = build_model(model_config("test-tiny")).eval()
    with pytest.raises(ConfigError, match=r"model\.mtp_depth=0"):
        generate(model, PROMPTS, SamplingConfig(max_new_tokens=2, draft_tokens=1))
    with pytest.raises(ConfigError, match="temperature"):
        SamplingConfig(draft_tokens=1, temperature=0.7).validate()
