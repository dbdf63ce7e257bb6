"""ZeRO stages 0-3: measured data-parallel wire bytes per rank per step and peak model-state bytes per rank,
against the ZeRO paper (Rajbhandari et al. 2020) adjusted to Tessera's dtypes (fp32 parameters, gradients and
AdamW states: 4 + 4 + 8 bytes per parameter, so K = 12 for the fp32 master + Adam part).

    PYTHONPATH=. python bench/zero_comm_memory.py [--ranks 4]

Communication (ring, N data ranks, Ψ = parameter bytes, m micro-batches), what each configuration issues:
  0: all-reduce once per step            2Ψ(N-1)/N
  1: all-gather once + reduce-scatter once 2Ψ(N-1)/N
  2: all-gather once + reduce-scatter per micro-batch (m+1)Ψ(N-1)/N   (paper: 2Ψ at m = 1)
  3: all-gather fwd + bwd + reduce-scatter per micro-batch 3mΨ(N-1)/N  (paper: 3Ψ at m = 1)
Memory per rank (P parameters): 0: 16P; 1: 8P + 12P/N; 2: 4P + 16P/N (grads sharded, 4P/N); 3: 16P/N.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch


def _case(rank: int, world: int, stage: int, n_micro: int) -> dict[str, Any]:
    from framework.config import load_config
    from framework.parallel.engine import build_parallel_engine

    torch.set_num_threads(1)
    layout = ["parallel.dp_replicate=4", "parallel.dp_shard=1"] if stage == 0 else ["parallel.dp_shard=4"]
    cfg = load_config("configs/smoke/tiny.yaml", [
        *layout, f"parallel.zero_stage={stage}", "parallel.comm_log=true", "train.micro_batch_size=2",
        f"train.global_batch_size={2 * n_micro * world}", "parallel.fsdp_prefetch=0"])
    engine = build_parallel_engine(cfg, torch.device("cpu"))
    peak = {"v": 0}

    def sample(*_: Any) -> None:
        r = engine.memory_report()
        peak["v"] = max(peak["v"], r.get("total", 0) + r["params_unsharded"] + r["grads_unsharded"])

    for module in engine.model_parts[0].modules():
        if hasattr(module, "_get_fsdp_state") or module is engine.model_parts[0]:
            module.register_forward_hook(sample)
            module.register_full_backward_hook(sample)
    batch = torch.randint(0, cfg.model.vocab_size, (n_micro, 2, cfg.data.seq_len + 1))
    for _step in range(2):
        assert engine.comm is not None
        engine.comm.reset()
        peak["v"] = 0
        engine.forward_backward(batch)
        sample()
        engine.clip_grad_norm(1.0)
        sample()
        engine.optimizer_step(1e-3)
        sample()
    assert engine.comm is not None
    dp_axes = ("dp_shard", "dp_replicate")
    n_params = sum(p.numel() for p in engine.model_parts[0].parameters())
    return {"wire": engine.comm.wire_bytes(dp_axes), "peak": peak["v"], "params": n_params}


def formulas(stage: int, n: int, m: int, psi: float, p: int) -> tuple[float, float]:
    ring = (n - 1) / n
    comm = {0: 2 * psi * ring, 1: 2 * psi * ring, 2: (m + 1) * psi * ring, 3: 3 * m * psi * ring}[stage]
    mem = {0: 16 * p, 1: 8 * p + 12 * p / n, 2: 4 * p + 16 * p / n, 3: 16 * p / n}[stage]
    return comm, mem


def main() -> int:
    from framework.testing import run_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    n = args.ranks
    print("| stage | micro-batches | wire bytes/rank/step | formula | ratio | peak model-state bytes/rank | formula | "
          "ratio |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for stage in (0, 1, 2, 3):
        for m in (1, 4):
            res = run_distributed(_case, n, timeout_s=600, stage=stage, n_micro=m)[0]
            p = res["params"]
            comm, mem = formulas(stage, n, m, 4.0 * p, p)
            print(f"| {stage} | {m} | {res['wire']:,.0f} | {comm:,.0f} | {res['wire'] / comm:.3f} | "
                  f"{res['peak']:,} | {mem:,.0f} | {res['peak'] / mem:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
