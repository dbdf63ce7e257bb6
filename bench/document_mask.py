"""Cost of per-document attention (`data.document_mask`): decoder forward + backward with the block-causal mask
against plain causal attention (`is_causal=True`), same model and tokens.

    PYTHONPATH=. python bench/document_mask.py [--repeats 5] [--device cpu] [--write docs/benchmarks/document_mask.md]

The two variants run interleaved (plain, masked, plain, masked, ...) so machine load hits both alike; the figure
is the ratio of medians, masked / plain. Rows hold documents of ~`doc_len` tokens (EOD at random positions).
The mask itself is (B, 1, T, T) bool: B*T^2 bytes, listed per configuration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from models.config import PRESETS, ModelConfig
from models.decoder import build_model
from models.documents import DocumentMasking

SHAPES = [(4, 256, 64), (2, 1024, 256), (1, 2048, 512)]  # (rows, seq_len, mean document length)
KEY = "document-mask"
HEADING = "## Per-document attention cost"


def _step(model: torch.nn.Module, inputs: torch.Tensor, kwargs: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    model(inputs, **kwargs).float().square().mean().backward()
    if inputs.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(cfg: ModelConfig, rows: int, seq: int, doc_len: int, repeats: int, device: torch.device
            ) -> tuple[float, float]:
    """(plain median s, masked median s) of one forward + backward."""
    model = build_model(cfg, seed=0, device=device)
    gen = torch.Generator().manual_seed(0)
    eod = cfg.vocab_size - 1
    inputs = torch.randint(0, eod, (rows, seq), generator=gen)
    inputs[torch.rand(rows, seq, generator=gen) < 1.0 / doc_len] = eod
    inputs = inputs.to(device)
    masked = DocumentMasking(eod_id=eod).model_kwargs(inputs)
    times: dict[str, list[float]] = {"plain": [], "masked": []}
    for i in range(repeats + 1):
        for name, kwargs in (("plain", {}), ("masked", masked)):
            dt = _step(model, inputs, kwargs)
            model.zero_grad(set_to_none=True)
            if i:  # the first round warms up
                times[name].append(dt)
    return statistics.median(times["plain"]), statistics.median(times["masked"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="smoke-3m")
    parser.add_argument("--write", type=Path, default=None, help="replace this section of a markdown file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    cfg = ModelConfig(**{**PRESETS[args.preset], "max_seq_len": max(s for _, s, _ in SHAPES)})  # type: ignore[arg-type]
    lines = [HEADING, "",
             f"Command: `PYTHONPATH=. python bench/document_mask.py --repeats {args.repeats} --device {args.device}"
             f"{' --write ' + str(args.write) if args.write else ''}` (torch {torch.__version__}, {device}, fp32, "
             f"1 thread, model {args.preset}, median of {args.repeats}, both variants interleaved in one run). "
             "Forward + backward of the whole decoder; ratio = masked / plain (`is_causal=True`).", "",
             "| rows x seq_len | mean doc length | mask bytes | plain ms | masked ms | masked / plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for rows, seq, doc_len in SHAPES:
        plain, masked = measure(cfg, rows, seq, doc_len, args.repeats, device)
        lines.append(f"| {rows} x {seq} | {doc_len} | {rows * seq * seq / 2**20:.1f} MiB | {1e3 * plain:.1f} | "
                     f"{1e3 * masked:.1f} | {masked / plain:.2f} |")
    lines += ["", f"Load average during the run: {os.getloadavg()[0]:.1f} (the shared 2-core machine; timings are "
              "noisy, the interleaving keeps the ratio fair). SDPA computes every score and then masks, so nothing "
              "is skipped: the masked path pays for building the mask and for leaving `is_causal`'s kernel, more as "
              "attention's share grows with seq_len. FlexAttention block masks (GPU) would skip the masked tiles."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        from bench.sections import replace_section

        replace_section(args.write, KEY, text)


if __name__ == "__main__":
    main()
