"""Per-layer forward+backward time of Tessera's transformer block against torchtitan's and OLMo-core's, same run.

Every block has the same shape (Llama: RMSNorm, GQA with RoPE through SDPA causal attention, SwiGLU; fp32,
CPU), built by each project's own code: torchtitan 0.3.0's `Llama3TransformerBlock` (fused QKV and
`ComplexRoPE`, as its Llama presets) and OLMo-core 3.0.0's `TransformerBlock` (`TransformerConfig.llama_like`,
the default attention backend). Measured so that a loaded, shared machine does not decide the figure
(bench/robust_timing.py): one thread, the calling thread's CPU time, one forward+backward of every block per
round in a shuffled order, many rounds; the ratio Tessera / peer (< 1: Tessera faster) is the median of the
per-round paired ratios with a bootstrap 95% interval, and a second, identical Tessera block in the same rounds
(the A/A control) shows the method's noise floor. A component breakdown times the two hot paths most
specific to each block (RoPE on q and k; GQA attention) on their own, the same way.

The peers are installed only in this bench's scratch directory, never in the project's environment:

    python -m pip install --no-deps --target /tmp/fastpath_peers/site torchtitan==0.3.0 ai2-olmo-core==3.0.0 \
        spmd_types==0.2.3 cached-path dataclass-extensions bettermap tyro torch_checkpointing
    python -m pip install --target /tmp/fastpath_peers/site2 cached-path docstring_parser typeguard shtab
    python -m pip install --no-deps --target /tmp/fastpath_peers/site3 triton==3.9.0   # torchtitan imports it
    PYTHONPATH=.:/tmp/fastpath_peers/site:/tmp/fastpath_peers/site2:/tmp/fastpath_peers/site3 \
        python bench/model_vs_peers.py [--preset smoke-3m] [--batch 8] [--seq 256] [--rounds 200] \
        [--write docs/benchmarks/model_hot_paths.md]
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

from bench.robust_timing import interleaved, iqr_rel, loadavg, paired_ratio
from bench.sections import replace_section
from models.config import ModelConfig, model_config
from models.decoder import Block
from models.layers import apply_rope, rope_tables

Built = tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]


def tessera_block(cfg: ModelConfig, seq: int) -> Built:
    block = Block(cfg, 0)
    rope = rope_tables(cfg.head_dim, seq, cfg.rope_theta)
    return block, lambda x: block(x, rope)


def torchtitan_block(cfg: ModelConfig, seq: int) -> Built:
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
    return block, lambda x: block(x, None)


def olmo_core_block(cfg: ModelConfig, seq: int) -> Built:
    from olmo_core.nn.feed_forward import FeedForwardConfig
    from olmo_core.nn.transformer import TransformerConfig

    tcfg = TransformerConfig.llama_like(d_model=cfg.hidden, vocab_size=cfg.vocab_size, n_layers=1,
                                        n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads, rope_theta=int(cfg.rope_theta),
                                        feed_forward=FeedForwardConfig(hidden_size=cfg.ffn, bias=False))
    block = tcfg.block.build(d_model=cfg.hidden, block_idx=0, n_layers=1)
    return block, lambda x: block(x)


def _fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    """One forward+backward of a block on `x` (a scalar loss of its output)."""
    return lambda: fn(x).square().mean().backward()


def _components(cfg: ModelConfig, x_shape: tuple[int, int]) -> tuple[dict[str, Callable[[], None]], list[torch.Tensor]]:
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

    def rope_tessera() -> None:
        (apply_rope(q, table).sum() + apply_rope(kk, table).sum()).backward()

    def rope_torchtitan() -> None:
        qo, ko = tt_rope(q, kk)
        (qo.sum() + ko.sum()).backward()

    def attn_tessera() -> None:
        F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=h != k).sum().backward()

    def attn_repeat() -> None:  # the former Tessera path: k and v repeated to the query heads
        r = h // k
        F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2).repeat_interleave(r, 1),
                                       v.transpose(1, 2).repeat_interleave(r, 1), is_causal=True).sum().backward()

    return ({"rope: tessera": rope_tessera, "rope: torchtitan": rope_torchtitan,
             "gqa attention: tessera (enable_gqa)": attn_tessera, "gqa attention: repeat_interleave": attn_repeat},
            [q, kk, v])


KEY = "model-hot-paths"
HEADING = "## Model hot paths vs torchtitan and OLMo-core"
AA = "tessera (A/A copy)"


def _drop_grads(modules: list[torch.nn.Module], tensors: list[torch.Tensor]) -> Callable[[], None]:
    def drop() -> None:
        for m in modules:
            m.zero_grad(set_to_none=True)
        for t in tensors:
            t.grad = None
    return drop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smoke-3m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=200, help="interleaved rounds; one fwd+bwd per block per round")
    ap.add_argument("--component-rounds", type=int, default=200)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # all work on the calling thread, so its CPU clock sees all of it
    torch.set_num_interop_threads(1)
    cfg = model_config(args.preset)
    torch.manual_seed(0)
    tessera, tessera_aa = tessera_block(cfg, args.seq), tessera_block(cfg, args.seq)
    blocks = {"tessera": tessera, AA: tessera_aa, "torchtitan": torchtitan_block(cfg, args.seq),
              "olmo-core": olmo_core_block(cfg, args.seq)}
    x = torch.randn(args.batch, args.seq, cfg.hidden, requires_grad=True)
    modules = [module for module, _ in blocks.values()]
    load0 = loadavg()
    t0 = time.perf_counter()
    res = interleaved({n: _fwd_bwd(fn, x) for n, (_, fn) in blocks.items()}, args.rounds,
                      before=_drop_grads(modules, [x]))
    parts, leaves = _components(cfg, (args.batch, args.seq))
    res_parts = interleaved(parts, args.component_rounds, before=_drop_grads([], leaves))
    elapsed, load1 = time.perf_counter() - t0, loadavg()
    cpu = res.cpu
    cmd = (f"python bench/model_vs_peers.py --preset {args.preset} --batch {args.batch} --seq {args.seq} "
           f"--rounds {args.rounds} --component-rounds {args.component_rounds}")
    lines = [f"`{cmd}` (torch {torch.__version__}, fp32 CPU, 1 thread; shape: hidden {cfg.hidden}, "
             f"{cfg.n_heads} heads / {cfg.kv_heads} kv heads, ffn {cfg.ffn}, batch {args.batch} x seq {args.seq}; "
             f"load average {load0} -> {load1}, {elapsed:.0f} s wall; the thread clock saw "
             f"{min(res.coverage, res_parts.coverage):.1%} of the process's CPU time in the timed calls). Each round "
             f"runs one forward+backward of every block in a shuffled order (bench/robust_timing.py); times are the "
             f"calling thread's CPU time. "
             f"Ratio = median over rounds of the paired ratio Tessera_i / peer_i, with a bootstrap 95% interval; "
             f"`{AA}` is a second Tessera block in the same rounds, so its ratio is the method's noise floor.", "",
             "| block | fwd+bwd per layer, CPU ms (median) | IQR / median | wall ms (median) | "
             "Tessera / this [95% CI] |", "|---|---|---|---|---|"]
    for name in blocks:
        lines.append(f"| {name} | {statistics.median(cpu[name]) * 1e3:.2f} | {iqr_rel(cpu[name]):.0%} | "
                     f"{statistics.median(res.wall[name]) * 1e3:.2f} | {paired_ratio(cpu['tessera'], cpu[name])} |")
    aa = paired_ratio(cpu["tessera"], cpu[AA])
    lines += ["", f"Noise floor (A/A): Tessera / its copy = {aa}. "
              + "; ".join(paired_ratio(cpu["tessera"], cpu[peer]).verdict("Tessera", peer)
                          for peer in ("torchtitan", "olmo-core")) + "."]
    pc = res_parts.cpu
    lines += ["", "| hot path (fwd+bwd, same tensors) | CPU ms (median) | IQR / median | ratio to the row below it "
              "[95% CI] |", "|---|---|---|---|"]
    names = list(parts)
    for i, name in enumerate(names):
        pair = str(paired_ratio(pc[name], pc[names[i + 1]])) if i % 2 == 0 else ""
        lines.append(f"| {name} | {statistics.median(pc[name]) * 1e3:.2f} | {iqr_rel(pc[name]):.0%} | {pair} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(args.write, KEY, f"{HEADING}\n\n{text}\n")


if __name__ == "__main__":
    main()
