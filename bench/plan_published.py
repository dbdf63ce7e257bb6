"""Published Megatron-LM layouts the planner must find, as data.

Megatron-LM README (H100 80 GB, seq 4096, vocab 131,072, DP 48): 177B at TP8 PP6 on 2,304 GPUs, global batch
1,152, 44% MFU; 462B at TP8 PP16 on 6,144 GPUs, batch 3,072, 47% MFU. Narayanan et al. 2021 (A100 80 GB,
seq 2048): 1T at TP8 PP64 on 3,072 GPUs, batch 3,072, 52% of peak counting recomputation (hardware FLOPs).
All GPT blocks: LayerNorm, GELU MLP of 4 x hidden, untied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig, model_config


@dataclass(frozen=True)
class PublishedRun:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    global_batch: int
    gpus: int
    gpu: str
    tp: int
    pp: int
    utilization: float
    """The published figure: MFU, or HFU where `hardware_flops`."""
    hardware_flops: bool
    source: str

    def model(self) -> ModelConfig:
        """The GPT-block ModelConfig of this run."""
        return model_config(n_layers=self.layers, hidden=self.hidden, n_heads=self.heads, vocab_size=self.vocab,
                            mlp="gelu", norm="layernorm", tied_embeddings=False, max_seq_len=self.seq)


PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun("GPT 177B", 96, 12288, 96, 131072, 4096, 1152, 2304, "h100-80g", 8, 6, 0.44, False,
                 "Megatron-LM README"),
    PublishedRun("GPT 462B", 112, 18432, 144, 131072, 4096, 3072, 6144, "h100-80g", 8, 16, 0.47, False,
                 "Megatron-LM README"),
    PublishedRun("GPT 1T", 128, 25600, 160, 51200, 2048, 3072, 3072, "a100-80g", 8, 64, 0.52, True,
                 "Narayanan et al. 2021"),
)

__all__ = ["PUBLISHED", "PublishedRun"]
