"""Framework tax: tokens/s of Tessera's training step against a minimal plain-PyTorch loop.

Both sides train the same model (same init), on the same batches, with the same AdamW (same parameter groups
and kernel), gradient accumulation, clipping and LR schedule. Tessera's side is `Trainer.train_step()` plus
`log_record()` — loader, engine, guard, observer (MFU), metrics.jsonl — exactly what a run executes per step.
The two are timed in alternating blocks in one process so machine noise hits both alike; the figure is the
ratio of median step times (plain / Tessera = Tessera's tokens/s relative to the plain loop).

    python bench/framework_tax.py [--preset smoke-3m] [--steps 20] [--rounds 6] \
        [--write docs/benchmarks/framework_tax.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sections import replace_section
from framework.config import load_config
from framework.engine import cross_entropy
from framework.train.lr_schedule import lr_at
from framework.train.optim import build_optimizer
from framework.train.trainer import Trainer
from models.decoder import build_model

KEY = "framework-tax"
HEADING = "## Framework tax"


class PlainLoop:
    """What a researcher writes by hand: model, AdamW, accumulate, clip, step."""

    def __init__(self, cfg, batches: list[torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
        self.cfg = cfg
        self.model = build_model(cfg.model, seed=cfg.train.seed)
        self.opt = build_optimizer([self.model], cfg.train, torch.device("cpu"))
        self.batches = batches
        self.step = 0

    def train_step(self) -> float:
        batch = self.batches[self.step % len(self.batches)]
        n_micro = batch.shape[0]
        total = 0.0
        for mb in batch:
            loss = cross_entropy(self.model(mb[:, :-1]), mb[:, 1:]) / n_micro
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip, foreach=True)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.cfg.train, self.step)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return total


def _time_block(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smoke-3m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=6, help="alternating blocks per side")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", type=Path, help="append the result section to this markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [
            f"model.preset={args.preset}", "data.kind=synthetic", f"data.seq_len={args.seq}",
            f"data.vocab_size={4096 if args.preset == 'smoke-3m' else 512}", f"run.dir={tmp}/run",
            f"train.global_batch_size={args.global_batch}", f"train.micro_batch_size={args.micro_batch}",
            f"train.steps={10 ** 6}", "train.log_interval=1000000", "checkpoint.save_final=false"])
        trainer = Trainer(cfg)
        batches = [trainer.loader.next_batch() for _ in range(8)]
        trainer.loader.load_state_dict({"consumed_samples": 0})  # both sides see the same samples
        plain = PlainLoop(cfg, batches)

        def tessera_step() -> None:
            trainer.log_record(trainer.train_step())

        _time_block(tessera_step, 3)  # warm-up both
        _time_block(plain.train_step, 3)
        t_tessera: list[float] = []
        t_plain: list[float] = []
        for _ in range(args.rounds):
            t_tessera += _time_block(tessera_step, args.steps)
            t_plain += _time_block(plain.train_step, args.steps)
    tokens = args.global_batch * args.seq
    med_t, med_p = statistics.median(t_tessera), statistics.median(t_plain)
    ratio = med_p / med_t
    lines = [
        HEADING,
        "",
        f"Command: `python bench/framework_tax.py --preset {args.preset} --steps {args.steps} "
        f"--rounds {args.rounds} --threads {args.threads}`",
        "",
        "| side | median step (ms) | tokens/s |",
        "| --- | --- | --- |",
        f"| plain PyTorch loop | {1000 * med_p:.1f} | {tokens / med_p:.0f} |",
        f"| Tessera `Trainer.train_step` + logging | {1000 * med_t:.1f} | {tokens / med_t:.0f} |",
        "",
        f"**Tessera / plain tokens/s = {ratio:.3f}** (goal >= 0.97); {len(t_tessera)} steps per side in "
        f"{args.rounds} alternating blocks, model {args.preset}, batch {args.global_batch}x{args.seq}, "
        f"micro-batch {args.micro_batch}, CPU, {args.threads} thread(s).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(args.write, KEY, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
