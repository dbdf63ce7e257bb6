"""Routed-expert compute: `torch._grouped_mm` against the loop over experts (forward + backward), same inputs.

    PYTHONPATH=. python bench/moe_experts.py [--repeats 7] [--device cpu]

Both paths run interleaved in the same loop (loop, grouped, loop, grouped, ...) so machine load affects them
alike; the figure is the ratio of medians, grouped / loop (< 1: grouped is faster). Rows are routed with a
random top-k router, i.e. uneven per-expert counts as in training.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from models.moe.experts import GroupedExperts, grouped_mm_available

SHAPES = [  # (experts, hidden, expert hidden, tokens, top_k)
    (4, 64, 64, 256, 2),
    (8, 128, 128, 1024, 2),
    (16, 256, 128, 2048, 4),
    (64, 256, 64, 2048, 8),
]


def _step(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor) -> float:
    t0 = time.perf_counter()
    y = experts(x, counts)
    y.backward(grad)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(e: int, d: int, f: int, n: int, k: int, repeats: int, device: torch.device) -> tuple[float, float, float]:
    """(loop median s, grouped median s, max |difference| of the outputs)."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.randn(n, e, generator=gen).topk(k, dim=-1).indices.flatten()
    counts = torch.bincount(idx, minlength=e).to(device)
    x = torch.randn(int(counts.sum()), d, generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(x.shape[0], d, generator=gen).to(device)
    mods = {}
    for impl in ("loop", "grouped_mm"):
        m = GroupedExperts(e, d, f, impl=impl).to(device)  # type: ignore[arg-type]
        torch.manual_seed(1)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
        mods[impl] = m
    with torch.no_grad():
        diff = float((mods["loop"](x, counts) - mods["grouped_mm"](x, counts)).abs().max())
    times: dict[str, list[float]] = {"loop": [], "grouped_mm": []}
    for i in range(repeats + 1):
        for impl, m in mods.items():
            dt = _step(m, x, counts, grad)
            if i:  # the first round warms up
                times[impl].append(dt)
    return statistics.median(times["loop"]), statistics.median(times["grouped_mm"]), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if not grouped_mm_available(device, torch.float32):
        print(f"torch._grouped_mm does not run on {device} for float32 here; nothing to compare")
        return
    print(f"torch {torch.__version__}, {device}, fp32, 1 thread, median of {args.repeats}")
    print("| experts | hidden | expert hidden | tokens x top_k | loop ms | grouped_mm ms | grouped / loop | max diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e, d, f, n, k in SHAPES:
        loop, grouped, diff = measure(e, d, f, n, k, args.repeats, device)
        print(f"| {e} | {d} | {f} | {n} x {k} | {1e3 * loop:.2f} | {1e3 * grouped:.2f} | {grouped / loop:.3f} | "
              f"{diff:.1e} |")


if __name__ == "__main__":
    main()
