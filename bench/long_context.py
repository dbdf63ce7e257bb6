"""Long-sequence training on CPU, to show cp=4 trains the same model as one process: configs/smoke/long_cp4.yaml on 4
ranks (cp=4) against one process.

    PYTHONPATH=. python bench/long_context.py [--steps 8] [--seq 8192] [--write docs/benchmarks/context_parallel.md]

Runs the real trainer twice on the same synthetic data: `tessera launch local --nproc 4` with cp=4 (each rank
holds 2 of the 8 load-balanced chunks of every 8k-token sequence), then `tessera train` on one process with
parallel.cp=1. Reports the per-step losses of both (fp32: they must agree to ~1e-5) and the wall time of each
run, which on a shared 2-core machine is load, not a speed figure: the ratio is noisy and the cp run pays
4 processes' start-up on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEY = "long-context"
HEADING = "## Long-sequence training with cp=4 on CPU"
CONFIG = "configs/smoke/long_cp4.yaml"


def _losses(run: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    from bench.sections import replace_section

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args(argv)
    common = [f"train.steps={args.steps}", f"data.seq_len={args.seq}", f"model.max_seq_len={args.seq}"]
    with tempfile.TemporaryDirectory() as tmp:
        cp_run, one_run = Path(tmp) / "cp4", Path(tmp) / "cp1"
        t_cp = _run([sys.executable, "-m", "framework.cli", "launch", "local", "--nproc", "4", CONFIG,
                     f"run.dir={cp_run}", *common])
        t_one = _run([sys.executable, "-m", "framework.cli", "train", CONFIG, f"run.dir={one_run}", "parallel.cp=1",
                      *common])
        got, want = _losses(cp_run), _losses(one_run)
    diff = max(abs(got[s] - want[s]) for s in want)
    lines = [HEADING, "",
             f"`PYTHONPATH=. python bench/long_context.py --steps {args.steps} --seq {args.seq}`: `{CONFIG}` (GQA "
             f"test-tiny, YaRN RoPE x4 from 2,048, document masks, {args.seq} tokens per sequence, global batch 2) "
             f"trained by `tessera launch local --nproc 4` at cp=4 and by `tessera train` on one process.", "",
             "| step | loss, cp=4 (4 ranks) | loss, 1 process |", "|---|---|---|"]
    lines += [f"| {s} | {got[s]:.6f} | {want[s]:.6f} |" for s in sorted(want)]
    lines += ["", f"Largest loss difference {diff:.2e} (fp32). Wall time: cp=4 {t_cp:.0f} s, one process "
              f"{t_one:.0f} s (shared 2-core machine; includes start-up and data preparation; not a speed figure).",
              ""]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(args.write, KEY, text)
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
