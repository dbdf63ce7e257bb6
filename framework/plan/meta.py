"""Count parameters per rank exactly from a meta-device build of the model, to check the planner's formulas.

The model is built with `models.decoder.build_model(cfg, device="meta")` (nothing is allocated, so the large
presets cost only Python objects), and each parameter's local shape under a layout follows the TP plans of
models/plans.py (read from them, not restated): column-parallel wq/wk/wv/w1/w3 (MLA's q_proj/q_b_proj/kv_b_proj)
shard dim 0 (and their biases), row-parallel wo/w2 (MLA's o_proj) shard dim 1 (their biases are replicated), the
vocab-parallel embedding and output shard the vocab dim, norms (and MLA's down-projections) are replicated; routed
experts are split over ep. Pipeline ownership comes from the FQN (`layers.<i>.`, `tok_embeddings`, `norm`,
`output`) and `framework.plan.memory.rank_chunks`.
"""

from __future__ import annotations

import math

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from framework.plan.layout import Layout
from framework.plan.memory import rank_chunks
from models.config import ModelConfig
from models.plans import decoder_block_plan, decoder_top_plan

_BLOCK = {**decoder_block_plan(sequence_parallel=False), **decoder_block_plan(sequence_parallel=False, attention="mla")}
COLWISE = tuple(fqn.rsplit(".", 1)[-1] for fqn, style in _BLOCK.items() if isinstance(style, ColwiseParallel))
ROWWISE = tuple(fqn.rsplit(".", 1)[-1] for fqn, style in _BLOCK.items() if isinstance(style, RowwiseParallel))
VOCAB_PARALLEL = tuple(decoder_top_plan(sequence_parallel=False, loss_parallel=True))
"""The embedding (row-wise over the vocabulary) and the head (column-wise over it): dim 0 is the vocab."""


def local_numel(fqn: str, shape: tuple[int, ...], tp: int, ep: int) -> int:
    """Elements of parameter `fqn` (full shape `shape`) on one rank under tensor degree tp and expert degree ep."""
    parts = fqn.split(".")
    module, leaf = (parts[-2] if len(parts) >= 2 else ""), parts[-1]
    dims = list(shape)
    if ".experts." in fqn or fqn.split(".")[-1].startswith("experts_"):
        dims[0] //= ep  # routed experts stacked on dim 0, one group per ep rank
        return math.prod(dims)
    if module in COLWISE or fqn.startswith(VOCAB_PARALLEL):
        dims[0] //= tp
    elif module in ROWWISE and leaf == "weight":
        dims[1] //= tp
    return math.prod(dims)


def owner_chunk(fqn: str, cfg: ModelConfig, n_chunks: int) -> int:
    """The pipeline chunk that owns parameter `fqn`."""
    if fqn.startswith("layers."):
        return int(fqn.split(".")[1]) // (cfg.n_layers // n_chunks)
    if fqn.startswith("tok_embeddings"):
        return 0
    return n_chunks - 1  # final norm, output head


def meta_rank_params(cfg: ModelConfig, lay: Layout) -> list[int]:
    """Parameters held by each pipeline rank (0 .. pp-1) under `lay`, counted from a meta-device build.

    Tied embeddings count once on a rank holding both ends and once on each of two different ranks, as the
    pipeline keeps a copy of the shared weight on both the first and the last stage.
    """
    import torch

    from models.decoder import build_model

    with torch.device("meta"):
        model = build_model(cfg, device="meta")
    n_chunks = lay.pp * lay.virtual
    chunk_rank = {c: r for r in range(lay.pp) for c in rank_chunks(lay, r)}
    counts = [0] * lay.pp
    for fqn, param in model.named_parameters(remove_duplicate=False):
        rank = chunk_rank[owner_chunk(fqn, cfg, n_chunks)]
        if fqn.startswith("output.") and cfg.tied_embeddings and chunk_rank[0] == rank:
            continue  # the same tensor as tok_embeddings.weight, already counted on this rank
        counts[rank] += local_numel(fqn, tuple(param.shape), lay.tp, lay.ep)
    return counts


__all__ = ["COLWISE", "ROWWISE", "VOCAB_PARALLEL", "local_numel", "meta_rank_params", "owner_chunk"]
