"""Per-document attention for packed sequences: document ids, restarting positions and the block-causal mask.

A packed row concatenates documents, each ending with the end-of-document (EOD) token. With document masking
a token attends only to earlier tokens of its own document (Megatron's `reset_attention_mask`, torchtitan's
document mask), so a packed row computes what each document would compute alone. The EOD token belongs to the
document it ends. With `reset_positions` the rotary position restarts at 0 after every EOD (Megatron's
`reset_position_ids`); RoPE scores depend only on the distance between tokens, so under the mask this changes
the logits by rounding only — it matters without the mask, or for absolute position embeddings.

The model receives the document ids (B, T) int64 — not the (B, 1, T, T) mask — because they are small enough to
travel with every pipeline micro-batch as a keyword argument; the mask is built once per forward pass from them.
Shape legend: B batch, T sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentMasking:
    """How a packed row is split into documents (resolved from `data.document_mask` / `data.reset_position_ids`).

    Attributes:
        eod_id: The token id that ends every document.
        mask: Attend only within one's own document (block-diagonal causal mask).
        reset_positions: Restart rotary positions at 0 at the start of every document.
    """

    eod_id: int
    mask: bool = True
    reset_positions: bool = False

    def model_kwargs(self, inputs_BT: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword arguments of `Decoder.forward` for input tokens `inputs_BT` (chunkable along dim 0)."""
        doc_BT = document_ids(inputs_BT, self.eod_id)
        out: dict[str, torch.Tensor] = {}
        if self.mask:
            out["doc_ids"] = doc_BT
        if self.reset_positions:
            out["positions"] = document_positions(doc_BT)
        return out


def model_kwargs(documents: DocumentMasking | None, inputs_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """`documents.model_kwargs(inputs_BT)`, or no keyword arguments when document masking is off."""
    return documents.model_kwargs(inputs_BT) if documents is not None else {}


def document_ids(tokens_BT: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Index of the document each token belongs to within its row (0, 1, ...); an EOD ends its document."""
    is_eod = (tokens_BT == eod_id).long()
    return torch.cumsum(is_eod, dim=1) - is_eod  # EODs strictly before each token


def document_positions(doc_BT: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document (restarting at 0 where the document id changes)."""
    b, t = doc_BT.shape
    idx = torch.arange(t, device=doc_BT.device).expand(b, t)
    starts = torch.ones_like(doc_BT, dtype=torch.bool)
    starts[:, 1:] = doc_BT[:, 1:] != doc_BT[:, :-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - first


def block_causal_mask(doc_BT: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query i may attend key j: j <= i and both in the same document.

    O(T^2) bytes per row, broadcast over heads (so tensor parallelism's head shards share it). Every query sees
    at least itself, so no softmax row is empty.
    """
    t = doc_BT.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_BT.device).tril()
    same = doc_BT[:, :, None] == doc_BT[:, None, :]
    return (same & causal)[:, None]


__all__ = ["DocumentMasking", "block_causal_mask", "document_ids", "document_positions", "model_kwargs"]
