"""ZeRO++ options (qwZ, hpZ, qgZ and combinations) vs the unquantized run: loss curves and wire bytes per axis.

    PYTHONPATH=. nice -n 19 python bench/zeropp.py [--ranks 4] [--steps 300] [--png docs/benchmarks/zeropp_loss.png]
                                                   [--json partial.json] [--write docs/benchmarks/zeropp.md]

4 gloo ranks seen as 2 "nodes" x 2 (parallel.zero_hpz_partition_size=2), ZeRO-3 over dp_shard=4, bf16, the
test-tiny model (4 blocks, hidden 64, 512-token vocabulary) trained on a learnable stream: tokens from a fixed
random first-order Markov chain (each token has 8 likely successors), so the loss falls from ln 512 = 6.24
toward the chain's entropy instead of staying flat as it would on uniform tokens. Every case sees the same
batches from the same initial weights. The reference perturbation is the same run with fp32 all-gathers
(parallel.fsdp_mixed_precision=false): the gap that bf16 rounding of the gathered weights alone makes, i.e. the
noise floor against which the int8 gaps are read. Wire bytes: the comm logger over the last step.
hpZ alone is bitwise the plain run (tests/parallel/test_zeropp.py), so its curve is a check, listed last.
`--ranks 2` (one "node" pair, half the CPU of 4 ranks on a loaded box) runs the cases without hpZ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "parallel"))

from bench.sections import replace_section

KEY = "zeropp"
SECTION = "## ZeRO++: qwZ, hpZ, qgZ loss and wire bytes"
BASE = ("parallel.dp_shard=-1", "parallel.zero_stage=3", "train.precision=bf16")
CASES: dict[str, tuple[str, ...]] = {  # most informative first: a cut-short run (--json) keeps those
    "plain (bf16 all-gather)": (),
    "qwZ": ("parallel.zero_quantized_weights=true",),
    "qgZ + hpZ (2 hops)": ("parallel.zero_quantized_gradients=true", "parallel.zero_hpz_partition_size=2"),
    "qwZ + qgZ": ("parallel.zero_quantized_weights=true", "parallel.zero_quantized_gradients=true"),
    "fp32 all-gather (noise ref.)": ("parallel.fsdp_mixed_precision=false",),
    "qgZ (1 hop)": ("parallel.zero_quantized_gradients=true",),
    "hpZ (s=2)": ("parallel.zero_hpz_partition_size=2",),
}


def markov_batches(steps: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """(steps, batch, seq + 1) tokens of a fixed random Markov chain: 8 successors per token, Zipf-weighted."""
    gen = torch.Generator().manual_seed(11)
    succ = torch.randint(0, vocab, (vocab, 8), generator=gen)
    weights = 1.0 / torch.arange(1, 9, dtype=torch.float64)
    out = torch.empty(steps * batch, seq + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=gen)
    for t in range(seq):
        pick = torch.multinomial(weights.expand(steps * batch, 8), 1, generator=gen).squeeze(1)
        out[:, t + 1] = succ[out[:, t], pick]
    return out.view(steps, batch, seq + 1)


def _worker(rank: int, world: int, steps: int, partial: str) -> dict[str, Any]:
    from parallel_parity import make_config, rank_batch

    from framework.parallel.comm import CommLogger, mesh_axes
    from framework.parallel.mesh import AXES
    from framework.parallel.zero import zeropp_axes
    from framework.train.lr_schedule import lr_at
    from framework.train.parallel_engine import build_parallel_engine

    out: dict[str, Any] = {}
    for name, overrides in CASES.items():
        if world < 4 and any("hpz" in o for o in overrides):
            continue  # a node group of 2 needs 2 nodes
        cfg = make_config((*BASE, f"train.steps={steps}", "train.warmup_steps=10", *overrides))
        data = markov_batches(steps, cfg.train.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size)
        engine = build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu"))
        losses = []
        start = time.process_time()
        for step in range(steps):
            if step == steps - 1:  # the logger's dispatch mode slows every op: on for the last step only
                engine.comm = CommLogger(mesh_axes(engine.mesh, AXES) | zeropp_axes(engine.model_parts))
            losses.append(engine.forward_backward(rank_batch(data[step], engine.dp_rank, engine.dp_size,
                                                             cfg.train.micro_batch_size)))
            engine.clip_grad_norm(cfg.train.grad_clip)
            engine.optimizer_step(lr_at(cfg.train, step))
        out[name] = {"loss": losses, "wire": dict(engine.comm.wire), "cpu_s": time.process_time() - start}
        if rank == 0 and partial:  # each finished case survives an interrupted run
            Path(partial).write_text(json.dumps(_to_json(out)))
    return out


def _to_json(res: dict[str, Any]) -> dict[str, Any]:
    return {k: {**v, "wire": [[a, op, b] for (a, op), b in v["wire"].items()]} for k, v in res.items()}


def _from_json(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: {**v, "wire": {(a, op): b for a, op, b in v["wire"]}} for k, v in raw.items()}


def report(res: dict[str, Any], steps: int, png: str, ranks: int) -> str:
    ref = res["plain (bf16 all-gather)"]["loss"]
    lines = [SECTION, "",
             f"`PYTHONPATH=. nice -n 19 python bench/zeropp.py --ranks {ranks} --steps {steps} --png {png}` ({ranks} "
             f"gloo ranks{' as 2 nodes x 2' if ranks == 4 else ''}, ZeRO-3 dp_shard={ranks}, bf16, test-tiny on a "
             f"Markov-chain stream; docstring). Gap = |loss - plain "
             f"loss| per step; the fp32 all-gather row is the noise floor (bf16 rounding of the gathered weights "
             f"alone). Wire bytes per rank of the last step, by mesh axis (dp_shard_intra / _inter: inside and "
             f"across the 2 nodes).", "",
             "| case | final loss | largest gap (step) | mean gap, last 100 | all-gather B (axis) | grad B (axis) |",
             "|---|---|---|---|---|---|"]
    for name, r in res.items():
        gaps = [abs(a - b) for a, b in zip(r["loss"], ref)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        tail = gaps[-100:]
        ag = ", ".join(f"{v:,.0f} ({a})" for (a, op), v in sorted(r["wire"].items()) if op == "all_gather")
        grad = ", ".join(f"{v:,.0f} ({a} {op.replace('_', '-')})" for (a, op), v in sorted(r["wire"].items())
                         if op in ("reduce_scatter", "all_to_all"))
        lines.append(f"| {name} | {r['loss'][-1]:.4f} | {gaps[worst]:.4f} ({worst}) | {sum(tail) / len(tail):.4f} "
                     f"| {ag} | {grad} |")
    lines += ["", f"![ZeRO++ loss curves]({Path(png).name})", ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = res["plain (bf16 all-gather)"]["loss"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for i, (name, r) in enumerate(res.items()):
        top.plot(r["loss"], label=name, lw=1, color=f"C{i}")
        if not name.startswith("plain"):
            bottom.plot([a - b for a, b in zip(r["loss"], ref)], lw=1, color=f"C{i}")
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    bottom.set_ylabel("loss - plain loss")
    bottom.set_xlabel("step")
    fig.suptitle("ZeRO++ options vs the unquantized ZeRO-3 run (gloo ranks on CPU)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    from framework.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ranks", type=int, choices=(2, 4), default=4)
    ap.add_argument("--png", default="docs/benchmarks/zeropp_loss.png")
    ap.add_argument("--write", default="", help="replace this bench's section of the given markdown file")
    ap.add_argument("--json", default="", help="write the per-case results here as each case finishes")
    ap.add_argument("--from-json", default="", help="only render the report and the plot of a --json file")
    args = ap.parse_args()
    start = time.time()
    if args.from_json:
        res = _from_json(json.loads(Path(args.from_json).read_text()))
    else:
        res = run_distributed(_worker, args.ranks, timeout_s=7200, steps=args.steps, partial=args.json)[0]
    plot(res, args.png)
    text = report(res, args.steps, args.png, args.ranks)
    print(text)
    print(f"wall {time.time() - start:.0f} s; CPU s per case on rank 0: "
          + ", ".join(f"{k}: {v['cpu_s']:.0f}" for k, v in res.items()))
    if args.write:
        replace_section(Path(args.write), KEY, text)


if __name__ == "__main__":
    main()
