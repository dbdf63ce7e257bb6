"""Speculative decoding with the model's own multi-token-prediction modules (DeepSeek-V3 sec. 5.4.3).

The main model has committed tokens t_0..t_n (t_n chosen from position n - 1, not yet fed back). MTP depth k
reads, at position j, the previous depth's hidden state there and the embedding of t_{j+k} (models/mtp.py), so
at the newest position n - 1 the depths draft d_1 = t_{n+1}, ..., d_q one after another, each depth feeding on
the drafts of the depths before it. One forward of the main model over [t_n, d_1, .., d_q] (positions n..n+q)
then gives the greedy token g_i after each prefix; d_1..d_a are accepted while d_i = g_{i-1}, and g_0..g_a are
committed: exactly the tokens greedy decoding would produce one by one (Leviathan et al. 2023, greedy case), so
the drafts change only how many forwards it takes. A batch advances by its live rows' smallest acceptance.

With the KV cache, the main model's cache is cut back to the committed positions after each verification, and
each MTP depth keeps a cache of its own (MLA's compressed latent too: models/kv_cache.py): depth k's positions
j <= n - k read only committed tokens and stay; later ones read drafts and are recomputed at the next step. Every
depth's hidden states are kept by position, since depth k + 1 reads them. Without the cache every step recomputes
the whole sequence at every depth (the reference the cache is tested against).
"""

from __future__ import annotations

from typing import cast

import torch

from framework.base.errors import ConfigError
from framework.infer.decoding import DecodeTrace, Output, SamplingConfig, causal_mask, new_cache
from models.decoder import Decoder
from models.kv_cache import LayerKVCache
from models.mtp import MTPModule


class MTPDrafter:
    """The MTP depths run incrementally over positions: per depth its hidden states, its cache, its frontier."""

    def __init__(self, model: Decoder, depth: int, batch: int, capacity: int, use_cache: bool) -> None:
        assert model.mtp is not None and model.tok_embeddings is not None and model.output is not None
        self.model = model
        self.modules = [cast(MTPModule, model.mtp.depths[str(k)]) for k in range(1, depth + 1)]
        param = next(model.parameters())
        # hidden[0]: the main model's final-normed states; hidden[k]: depth k's block outputs, by position
        self.hidden = [param.new_zeros(batch, capacity, model.cfg.hidden) for _ in range(depth + 1)]
        self.caches: list[LayerKVCache] | None = None
        if use_cache:
            ids = [str(k) for k in range(1, depth + 1)]
            self.caches = [new_cache(model, batch, capacity, ids).layers[i] for i in ids]
        self.exact = [0] * (depth + 1)
        """Depth k's positions below exact[k] read committed tokens only (kept); later ones are redone."""

    def draft(self, tokens_BN: torch.Tensor, valid_BN: torch.Tensor, q: int, trace: DecodeTrace | None = None
              ) -> torch.Tensor:
        """(B, q) draft tokens after the committed `tokens_BN` (t_0..t_n); hidden[0] holds positions < n."""
        n = tokens_BN.shape[1] - 1
        model = self.model
        assert model.tok_embeddings is not None and model.output is not None
        positions = (valid_BN[:, :n].long().cumsum(-1) - 1).clamp(min=0)
        seq, drafts, logits = tokens_BN, [], []
        for k in range(1, q + 1):
            start = self.exact[k] if self.caches is not None else 0
            cache = None
            if self.caches is not None:
                cache = self.caches[k - 1]
                cache.length = start  # positions from `start` on read drafts of an earlier step: redo them
            emb = model.tok_embeddings(seq[:, start + k:n + k])
            h = self.modules[k - 1](self.hidden[k - 1][:, start:n], emb, model.rope[positions[:, start:n]],
                                    causal_mask(valid_BN[:, :n], n - start), kv_cache=cache)
            self.hidden[k][:, start:n] = h
            self.exact[k] = max(n - k + 1, 0)
            logits.append(model.output(self.modules[k - 1].norm(h[:, -1])))
            token = logits[-1].argmax(-1)
            seq = torch.cat([seq, token[:, None]], dim=1)
            drafts.append(token)
        if trace is not None and trace.keep:
            trace.drafts.append((n, torch.stack(logits, dim=1).detach().clone()))
        return torch.stack(drafts, dim=1)


def decode_speculative(model: Decoder, ids: torch.Tensor, valid: torch.Tensor, cfg: SamplingConfig,
                       out: Output) -> None:
    """Greedy decoding of the left-padded `ids` (B, P) with MTP drafts, committing into `out` (module docstring)."""
    depth = model.cfg.mtp_depth
    if model.mtp is None or not 1 <= cfg.draft_tokens <= depth:
        raise ConfigError(f"draft_tokens={cfg.draft_tokens} needs as many multi-token-prediction depths, but "
                          f"model.mtp_depth={depth}; pass draft_tokens in 1..{depth} (0 without MTP modules)")
    assert model.output is not None
    batch, capacity = ids.shape[0], ids.shape[1] + cfg.max_new_tokens
    cache = new_cache(model, batch, capacity) if cfg.use_cache else None
    drafter = MTPDrafter(model, cfg.draft_tokens, batch, capacity, cfg.use_cache)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    h = model.final_hidden(ids, causal_mask(valid, ids.shape[1]), positions, cache)
    drafter.hidden[0][:, :ids.shape[1]] = h
    logits = model.output(h[:, -1])
    tokens, valid = _extend(ids, valid, out.commit(logits.argmax(-1), logits))
    while not out.finished:
        n = tokens.shape[1] - 1
        q = min(cfg.draft_tokens, cfg.max_new_tokens - out.produced - 1)
        fed = torch.cat([tokens[:, n:], drafter.draft(tokens, valid, q, out.trace)], dim=1) if q else tokens[:, n:]
        valid_ext = torch.cat([valid, torch.ones_like(fed[:, 1:], dtype=torch.bool)], dim=1)
        positions = (valid_ext.long().cumsum(-1) - 1).clamp(min=0)
        if cache is None:  # the reference: every position again
            h = model.final_hidden(torch.cat([tokens[:, :n], fed], dim=1), causal_mask(valid_ext, n + q + 1), positions)
            h = h[:, n:]
        else:
            h = model.final_hidden(fed, causal_mask(valid_ext, q + 1), positions[:, n:], cache)
        drafter.hidden[0][:, n:n + q + 1] = h
        logits = model.output(h)  # (B, q + 1, V): position n + i decides the token after d_i
        greedy = logits.argmax(-1)
        match = (fed[:, 1:] == greedy[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # accepted drafts per row
        live = ~out.done
        accepted = int(match[live].min()) if q else 0
        if out.trace is not None:
            out.trace.forwards += 1
            out.trace.drafted += q
            out.trace.accepted += accepted
        for i in range(accepted + 1):
            tokens, valid = _extend(tokens, valid, out.commit(greedy[:, i], logits[:, i]))
            if out.finished:
                break
        if cache is not None:
            cache.truncate(tokens.shape[1] - 1)  # the committed positions fed so far (t_n's successor is not)


def _extend(tokens: torch.Tensor, valid: torch.Tensor, token_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([tokens, token_B[:, None]], dim=1), torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
