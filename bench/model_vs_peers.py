"""Per-layer forward+backward time of Tessera's transformer block against torchtitan's and OLMo-core's, same run.

Every block has the same shape (Llama: RMSNorm, GQA with RoPE through SDPA causal attention, SwiGLU; fp32,
CPU), built by each project's own code: torchtitan 0.3.0's `Llama3TransformerBlock` (fused QKV and
`ComplexRoPE`, as its Llama presets) and OLMo-core 3.0.0's `TransformerBlock` (`TransformerConfig.llama_like`,
the default attention backend). Rounds interleave the three blocks so machine noise hits all alike; the figure
is the median time of one forward+backward of one layer, and the ratio Tessera / peer (< 1: Tessera faster).
A component breakdown times the two hot paths the issue named (RoPE on q and k; GQA attention) on their own.

The peers are installed only in this bench's scratch directory, never in the project's environment:

    python -m pip install --no-deps --target /tmp/fastpath_peers/site torchtitan==0.3.0 ai2-olmo-core==3.0.0 \
        spmd_types==0.2.3 cached-path dataclass-extensions bettermap tyro torch_checkpointing
    python -m pip install --target /tmp/fastpath_peers/site2 cached-path docstring_parser typeguard shtab
    python -m pip install --no-deps --target /tmp/fastpath_peers/site3 triton==3.9.0   # torchtitan imports it
    PYTHONPATH=.:/tmp/fastpath_peers/site:/tmp/fastpath_peers/site2:/tmp/fastpath_peers/site3 \
        python bench/model_vs_peers.py [--preset smoke-3m] [--batch 8] [--seq 256] [--rounds 7] \
        [--write docs/BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sections import replace_section
from models.config import ModelConfig, model_config
from models.decoder import Block
from models.layers import apply_rope, rope_tables


def tessera_block(cfg: ModelConfig, seq: int) -> Callable[[torch.Tensor], torch.Tensor]:
    block = Block(cfg, 0)
    rope = rope_tables(cfg.head_dim, seq, cfg.rope_theta)
    return lambda x: block(x, rope)


def torchtitan_block(cfg: ModelConfig, seq: int) -> Callable[[torch.Tensor], torch.Tensor]:
    from torchtitan.models.common import ComplexRoPE, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    init = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02), "bias": torch.nn.init.zeros_}
    norm = {"weight": torch.nn.init.ones_}
    block = Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=cfg.hidden, param_init=norm),
        ffn_norm=RMSNorm.Config(normalized_shape=cfg.hidden, param_init=norm),
        attention=make_gqa_config(dim=cfg.hidden, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads, wqkv_param_init=init,
                                  wo_param_init=init, inner_attention=ScaledDotProductAttention.Config(),
                                  fuse_qkv=True, rope=ComplexRoPE.Config(dim=cfg.head_dim, max_seq_len=seq,
                                                                         theta=cfg.rope_theta)),
        feed_forward=make_ffn_config(dim=cfg.hidden, hidden_dim=cfg.ffn, w1_param_init=init, w2w3_param_init=init),
    ).build()
    for module in block.modules():
        if hasattr(module, "_init_self_buffers"):
            module._init_self_buffers(buffer_device=torch.device("cpu"))
    return lambda x: block(x, None)


def olmo_core_block(cfg: ModelConfig, seq: int) -> Callable[[torch.Tensor], torch.Tensor]:
    from olmo_core.nn.feed_forward import FeedForwardConfig
    from olmo_core.nn.transformer import TransformerConfig

    tcfg = TransformerConfig.llama_like(d_model=cfg.hidden, vocab_size=cfg.vocab_size, n_layers=1,
                                        n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads, rope_theta=int(cfg.rope_theta),
                                        feed_forward=FeedForwardConfig(hidden_size=cfg.ffn, bias=False))
    block = tcfg.block.build(d_model=cfg.hidden, block_idx=0, n_layers=1)
    return lambda x: block(x)


def _fwd_bwd_ms(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x).square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _components(cfg: ModelConfig, x_shape: tuple[int, int], iters: int) -> dict[str, dict[str, float]]:
    """RoPE of q and k, and GQA attention, each as Tessera does it and as the peers do (torchtitan's code)."""
    from torchtitan.models.common.rope import ComplexRoPE

    b, t = x_shape
    h, k, e = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, t, h, e, generator=gen, requires_grad=True)
    kk = torch.randn(b, t, k, e, generator=gen, requires_grad=True)
    v = torch.randn(b, t, k, e, generator=gen, requires_grad=True)
    table = rope_tables(e, t, cfg.rope_theta)
    tt_rope = ComplexRoPE(ComplexRoPE.Config(dim=e, max_seq_len=t, theta=cfg.rope_theta))

    def rope_tessera(_: torch.Tensor) -> torch.Tensor:
        return apply_rope(q, table).sum() + apply_rope(kk, table).sum()

    def rope_torchtitan(_: torch.Tensor) -> torch.Tensor:
        qo, ko = tt_rope(q, kk)
        return qo.sum() + ko.sum()

    def attn_tessera(_: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, enable_gqa=h != k)

    def attn_repeat(_: torch.Tensor) -> torch.Tensor:  # Tessera before issue 20
        r = h // k
        return F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2).repeat_interleave(r, 1),
                                              v.transpose(1, 2).repeat_interleave(r, 1), is_causal=True)

    fns = {"rope: tessera": rope_tessera, "rope: torchtitan": rope_torchtitan,
           "gqa attention: tessera (enable_gqa)": attn_tessera, "gqa attention: repeat_interleave": attn_repeat}
    return {name: {"ms": _fwd_bwd_ms(fn, q, iters)} for name, fn in fns.items()}


HEADING = "## Model hot paths vs torchtitan and OLMo-core (issue 20)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smoke-3m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = model_config(args.preset)
    torch.manual_seed(0)
    blocks = {"tessera": tessera_block(cfg, args.seq), "torchtitan": torchtitan_block(cfg, args.seq),
              "olmo-core": olmo_core_block(cfg, args.seq)}
    x = torch.randn(args.batch, args.seq, cfg.hidden, requires_grad=True)
    for fn in blocks.values():  # warm-up (allocator, kernels)
        _fwd_bwd_ms(fn, x, 2)
    samples: dict[str, list[float]] = {name: [] for name in blocks}
    for _ in range(args.rounds):
        for name, fn in blocks.items():
            samples[name].append(_fwd_bwd_ms(fn, x, args.iters))
    med = {name: statistics.median(s) for name, s in samples.items()}
    spread = {name: (max(s) - min(s)) / statistics.median(s) for name, s in samples.items()}
    parts = _components(cfg, (args.batch, args.seq), args.iters * args.rounds)
    cmd = (f"python bench/model_vs_peers.py --preset {args.preset} --batch {args.batch} --seq {args.seq} "
           f"--rounds {args.rounds} --iters {args.iters} --threads {args.threads}")
    lines = [f"`{cmd}` (torch {torch.__version__}, fp32 CPU, {args.threads} thread(s); shape: hidden {cfg.hidden}, "
             f"{cfg.n_heads} heads / {cfg.kv_heads} kv heads, ffn {cfg.ffn}, batch {args.batch} x seq {args.seq}). "
             f"Median of {args.rounds} interleaved rounds x {args.iters} iterations; spread = (max-min)/median "
             f"of the round medians.", "",
             "| block | fwd+bwd per layer (ms) | spread | Tessera / this |", "|---|---|---|---|"]
    for name in blocks:
        lines.append(f"| {name} | {med[name]:.2f} | {spread[name]:.0%} | {med['tessera'] / med[name]:.3f} |")
    lines += ["", "| hot path (fwd+bwd, same tensors) | ms |", "|---|---|"]
    lines += [f"| {name} | {row['ms']:.2f} |" for name, row in parts.items()]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(args.write, HEADING, f"{HEADING}\n\n{text}\n")


if __name__ == "__main__":
    main()
