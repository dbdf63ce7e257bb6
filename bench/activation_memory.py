"""Activation bytes per layer with Tessera's recompute wrappers (framework/parallel/recompute.py) — none,
selective, full — measured by storage liveness (bench/plan_measure.py) against the formula for Tessera's
own block (framework/plan/activations.py), with Korthikanti et al. 2022's GPT formula sbh(34 + 5as/h) shown
as the reference.

    PYTHONPATH=. python bench/activation_memory.py [--preset smoke-3m] [--seq 128] [--batch 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py`: bench.* from the root


def measure(preset: str, seq: int, batch: int, mode: str) -> int:
    from bench.plan_measure import saved_bytes
    from framework.parallel.recompute import apply_recompute
    from models.config import model_config
    from models.decoder import build_model

    cfg = model_config(preset, n_layers=1)
    model = build_model(cfg, seed=0)
    apply_recompute(model.layers, mode, 1)
    block: nn.Module = model.layers["0"]
    x_leaf = torch.randn(batch, seq, cfg.hidden, requires_grad=True)
    total, _ = saved_bytes(block, lambda: x_leaf * 1.0, lambda x: block(x, model.rope), static=(model.rope, x_leaf))
    return total


def main() -> int:
    from framework.plan.activations import korthikanti_layer_bytes, tessera_layer_bytes
    from models.config import model_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="smoke-3m")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = model_config(args.preset)
    print("| recompute | measured bytes | Tessera formula | ratio | Korthikanti GPT (16-bit) |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("none", "selective", "full"):
        got = measure(args.preset, args.seq, args.batch, mode)
        want = tessera_layer_bytes(cfg, args.seq, args.batch, recompute=mode, act_bytes=4)  # type: ignore[arg-type]
        gpt = korthikanti_layer_bytes(args.seq, args.batch, cfg.hidden, cfg.n_heads, recompute=mode)  # type: ignore[arg-type]
        print(f"| {mode} | {got:,} | {want:,} | {got / want:.4f} | {gpt:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
