"""Framework tax: tokens/s of Tessera's training step (Trainer.train_step: loader, engine, clip, AdamW, metrics
record) against a minimal plain-PyTorch loop with the same model, batch and optimizer, measured in the same run,
alternating blocks of steps so machine noise hits both alike.

    PYTHONPATH=. python bench/framework_tax.py [--preset smoke-3m] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
import torch.nn.functional as F


def plain_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> float:
    """The minimal loop; returns seconds."""
    t0 = time.perf_counter()
    for batch in batches:
        for mb in batch:
            logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten()) / batch.shape[0]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> int:
    from framework.config import load_config
    from framework.train.trainer import Trainer
    from models.decoder import build_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="smoke-3m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("configs/smoke/tiny.yaml", [
            f"model.preset={args.preset}", "data.kind=synthetic", "data.seq_len=128", "data.vocab_size=4096",
            "train.global_batch_size=8", "train.micro_batch_size=4", f"run.dir={tmp}/run",
            f"data.cache_dir={tmp}/cache", f"train.steps={args.steps * args.rounds * 2 + 10}",
            "train.optimizer_impl=foreach", "checkpoint.interval=0"])
        trainer = Trainer(cfg)
        model = build_model(cfg.model, seed=cfg.train.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                                weight_decay=cfg.train.weight_decay, foreach=True)
        shape = (2, 4, cfg.data.seq_len + 1)
        batches = [torch.randint(0, cfg.model.vocab_size, shape) for _ in range(args.steps)]
        trainer.train_step()
        plain_loop(model, opt, batches[:2])  # warm both
        t_tessera = t_plain = 0.0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            t_tessera += time.perf_counter() - t0
            t_plain += plain_loop(model, opt, batches)
    tokens = args.steps * args.rounds * cfg.train.global_batch_size * cfg.data.seq_len
    ratio = (tokens / t_tessera) / (tokens / t_plain)
    print(f"preset {args.preset}: Tessera {tokens / t_tessera:.0f} tok/s, plain PyTorch {tokens / t_plain:.0f} "
          f"tok/s, ratio {ratio:.3f} (goal >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
