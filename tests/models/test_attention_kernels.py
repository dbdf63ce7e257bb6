"""Which attention kernel each mask takes and what it keeps for backward (models/attention.py).

The GPU path for document masks (FlexAttention with a block mask) is checked here by the properties it
guarantees, on CPU: FlexAttention's eager form (the same autograd function the compiled CUDA kernel runs under,
with the math implementation) is allowed on CPU by lifting its device check, and must match the dense CPU
reference, keep no (B, H, T, T) tensor or head-expanded K/V for backward, and skip whole blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import models.attention as attention
import models.decoder as decoder
from models import build_model, model_config
from models.documents import block_causal_mask, document_ids

CFG = model_config("test-tiny")  # 4 layers, 4 query heads, 2 KV heads, head dim 16
B, T, EOD = 2, 256, 511


def _tokens() -> torch.Tensor:
    """Two packed rows: documents of uneven lengths (one crosses the 128-token block edge), one document."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, EOD, (B, T), generator=gen)
    x[0, [40, 150, 170]] = EOD
    return x


@contextmanager
def _saved() -> Iterator[list[torch.Tensor]]:
    out: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        out.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


@pytest.fixture
def flex_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let FlexAttention's eager form run backward on CPU (its math implementation; CUDA compiles the kernel)."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)


def test_no_mask_takes_is_causal_with_kv_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append({"kv_heads": k.shape[1], **kw})
        return real(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    build_model(CFG)(_tokens()[:, :64])
    assert len(calls) == CFG.n_layers
    for call in calls:
        assert call.get("attn_mask") is None and call["is_causal"] and call["enable_gqa"], call
        assert call["kv_heads"] == CFG.kv_heads, call  # K/V at their own head count, not repeated


def _run(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Logits, parameter gradients and the tensors saved for backward of one forward pass with document masks."""
    model.zero_grad()
    with _saved() as saved:
        logits = model(x, doc_ids=document_ids(x, EOD))
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()], saved


def _square_storages(saved: list[torch.Tensor]) -> set[int]:
    """Storages of saved tensors whose last two dims are (T, T): attention scores or masks."""
    return {t.untyped_storage().data_ptr() for t in saved if t.dim() >= 2 and tuple(t.shape[-2:]) == (T, T)}


def test_document_mask_is_built_once_and_kept_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU reference: one mask per forward pass, the same object in every layer, one (T, T) copy kept for
    backward (SDPA would keep a float copy of a bool mask per layer), and no (B, H, T, T) tensor."""
    built: list[Any] = []
    model = build_model(CFG)

    def builder(doc: torch.Tensor) -> Any:
        built.append(attention.document_mask(doc))
        return built[-1]

    model.mask_builder = builder
    seen: list[Any] = []
    for block in model.layers.values():
        block.attention.register_forward_pre_hook(lambda m, args: seen.append(args[2]))
    _, _, saved = _run(model, _tokens())
    assert len(built) == 1 and len(seen) == CFG.n_layers and all(m is built[0] for m in seen)
    assert len(_square_storages(saved)) == 1
    assert not [t.shape for t in saved if t.dim() == 4 and t.shape[1] == CFG.n_heads and t.shape[-1] == T]


def test_block_mask_path_matches_dense_reference_and_saves_no_scores(monkeypatch: pytest.MonkeyPatch,
                                                                     flex_on_cpu: None) -> None:
    model = build_model(CFG, seed=3)
    x = _tokens()
    want_logits, want_grads, _ = _run(model, x)
    monkeypatch.setattr(decoder, "document_mask", lambda doc: attention.document_mask(doc, block_sparse=True))
    model.mask_builder = decoder.document_mask
    got_logits, got_grads, saved = _run(model, x)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not _square_storages(saved)
    # per layer: q and the output at H heads; k and v at the model's K heads (never repeated to H)
    per_head = [t for t in saved if t.dim() == 4 and t.shape[-1] == CFG.head_dim]
    assert sum(t.shape[1] == CFG.n_heads for t in per_head) == 2 * CFG.n_layers
    assert sum(t.shape[1] == CFG.kv_heads for t in per_head) == 2 * CFG.n_layers


def test_block_mask_skips_blocks_and_agrees_with_the_dense_mask() -> None:
    doc = document_ids(_tokens(), EOD)
    block = attention.document_mask(doc, block_sparse=True).block
    torch.testing.assert_close(block.to_dense().bool().any(),
                               torch.tensor(True))  # sanity: visible blocks exist
    dense = attention.dense_document_mask(doc)
    assert torch.equal(dense == 0, block_causal_mask(doc))
    blocks = T // 128
    visited = int(block.kv_num_blocks.sum()) + int(block.full_kv_num_blocks.sum())
    assert visited < B * blocks * blocks  # the causal upper blocks are never visited
    mod = attention.document_mask_mod(doc)
    b, q, kv = torch.meshgrid(torch.arange(B), torch.arange(T), torch.arange(T), indexing="ij")
    assert torch.equal(mod(b, torch.zeros_like(b), q, kv), block_causal_mask(doc)[:, 0])
