"""Autoregressive decoding from a Tessera checkpoint: batched prompts, greedy or sampled, with a KV cache.

    model, meta = load_generator(run_dir, device="cpu")
    out = generate(model, [[5, 17, 9], [4]], SamplingConfig(max_new_tokens=32), eos_id=2)

Prompts of different lengths are left-padded into one batch; each row's rotary positions count its own
tokens only (0..len-1) and padding is masked out of attention, so a batched prompt decodes exactly as it would
alone. The cache holds every layer's keys and values after RoPE (models/kv_cache.py): the prompt is one
forward (prefill), then each new token is one forward of length 1. Sampling follows the usual order —
temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020) — from a generator seeded by `seed`, so a
seed reproduces its samples on the same device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from framework.base.errors import ConfigError
from framework.infer.decoding import PAD_ID, DecodeTrace, Output, SamplingConfig, causal_mask, new_cache
from framework.infer.speculative import decode_speculative
from models.decoder import Decoder

__all__ = ["PAD_ID", "DecodeTrace", "SamplingConfig", "filter_logits", "generate", "load_generator", "next_tokens"]

def filter_logits(logits_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set the logits outside the top-k / top-p (nucleus) set to -inf; at least one token always stays."""
    out = logits_BV
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def next_tokens(logits_BV: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    """(B,) next token ids from the last position's logits."""
    logits = logits_BV.float()
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


def _left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) token ids right-aligned, and the (B, P) mask of real (non-pad) tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        if p:
            ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            valid[row, width - len(p):] = True
    return ids.to(device), valid.to(device)


@torch.no_grad()
def generate(model: Decoder, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, eos_id: int | None = None,
             on_token: Callable[[int, int], None] | None = None, trace: DecodeTrace | None = None
             ) -> list[list[int]]:
    """The new tokens of every prompt (without the prompt; with the EOS that ended a row, if any).

    Args:
        model: a one-process `Decoder` (all parts present), in eval mode.
        prompts: token ids, one list per row; rows may differ in length.
        on_token: called as on_token(row, token) for every token a row produces, as it is produced (streaming).
        trace: filled with the forward, draft and acceptance counts (and the logits, if it keeps them).
    """
    cfg.validate()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token; pass non-empty prompts")
    mcfg = model.cfg
    longest = max(len(p) for p in prompts)
    if longest + cfg.max_new_tokens > mcfg.max_seq_len:
        raise ConfigError(f"prompt of {longest} tokens + max_new_tokens={cfg.max_new_tokens} exceeds the model's "
                          f"max_seq_len={mcfg.max_seq_len}; shorten the prompt or lower max_new_tokens")
    device = next(model.parameters()).device
    ids, valid = _left_pad(prompts, device)
    out = Output(ids.shape[0], cfg, eos_id, device, on_token, trace)
    if cfg.draft_tokens:
        decode_speculative(model, ids, valid, cfg, out)
        return out.rows
    gen = torch.Generator().manual_seed(cfg.seed) if cfg.temperature > 0 else None
    cache = new_cache(model, ids.shape[0], ids.shape[1] + cfg.max_new_tokens) if cfg.use_cache else None
    step_ids = ids
    while True:
        positions_all = (valid.long().cumsum(-1) - 1).clamp(min=0)
        if cache is None:
            logits = model(ids, causal_mask(valid, ids.shape[1]), positions=positions_all)
        else:
            t = step_ids.shape[1]
            logits = model(step_ids, causal_mask(valid, t), positions=positions_all[:, -t:], kv_cache=cache)
        token = out.commit(next_tokens(logits[:, -1], cfg, gen), logits[:, -1])
        if out.finished:
            break
        if trace is not None:
            trace.forwards += 1
        ids = torch.cat([ids, token[:, None]], dim=1)
        valid = torch.cat([valid, torch.ones_like(out.done)[:, None]], dim=1)
        step_ids = token[:, None]
    return out.rows


def load_generator(path: Path, step: int | None = None, device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[Decoder, dict[str, Any]]:
    """The one-process model of any checkpoint (any layout: DCP reshards it on load), ready to decode."""
    from framework.checkpoint.hf import load_model, resolve_checkpoint

    module, meta = load_model(resolve_checkpoint(path, step))
    assert isinstance(module, Decoder)
    model = module
    model.to(device=torch.device(device))
    if dtype != torch.float32:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model.eval(), meta


