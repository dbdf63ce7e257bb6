"""Tensor + sequence parallelism: shard a decoder (or one pipeline stage of it) in place over the `tp` mesh."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from models.decoder import Decoder
from models.moe.layer import MoE
from models.plans import Plan, decoder_block_plan, decoder_top_plan


def _present(module: Decoder, plan: Plan) -> Plan:
    """The plan entries whose module exists (pipeline stages drop the embedding or the head)."""
    out: Plan = {}
    for fqn, style in plan.items():
        target = module
        try:
            for part in fqn.split("."):
                target = getattr(target, part)
        except AttributeError:
            continue
        if target is not None:
            out[fqn] = style
    return out


def apply_tensor_parallel(model: Decoder, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
                          loss_parallel: bool = True) -> None:
    """Shard every block and the embedding/head of `model` in place following models/plans.py.

    Tied embeddings stay tied within one module: the vocab-parallel embedding and the column-parallel head
    both shard the (vocab, hidden) weight on dim 0, so the head is re-pointed at the embedding's DTensor.
    Never torch.compile these blocks: compile + TP gives wrong gradients in torch 2.13 (ARCHITECTURE.md).
    """
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    parallelize_module(model, tp_mesh, _present(model, decoder_top_plan(sequence_parallel, loss_parallel)))
    if tied:
        assert model.output is not None and model.tok_embeddings is not None
        model.output.weight = model.tok_embeddings.weight
    block_plan = decoder_block_plan(sequence_parallel)
    moe_plan = {k: v for k, v in block_plan.items() if not k.startswith("feed_forward")}
    for block in model.layers.values():
        # MoE (issue 5): framework/parallel/expert.py parallelizes an MoE layer's feed-forward
        plan = moe_plan if isinstance(block.feed_forward, MoE) else block_plan  # type: ignore[union-attr]
        parallelize_module(block, tp_mesh, _present(block, plan))  # type: ignore[arg-type]
