"""GPU check (run by bench/gpu_check.sh): 1-process parity on the GPU against the CPU reference, then tokens/s and
MFU of a ~1B dense model. Synthetic data only; imports nothing beyond torch and Tessera's training core.

    python bench/gpu_bench.py [--steps 8] [--peak-tflops 989]    # prints one JSON line per result
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.config import load_config
from framework.train.engine import LocalEngine
from framework.train.schedule import lr_at
from models.flops import flops_per_token, num_params

TINY = ["train.grad_clip=0.5", "train.warmup_steps=1", "train.lr=3.0e-3"]


def _train(engine, cfg, data: torch.Tensor) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    out = []
    for step, batch in enumerate(data):
        loss = engine.forward_backward(batch.reshape(-1, cfg.train.micro_batch_size, batch.shape[-1]))
        norm = engine.clip_grad_norm(cfg.train.grad_clip)
        engine.optimizer_step(lr_at(cfg.train, step))
        out.append((loss, norm))
    return out


def parity(steps: int, device: torch.device) -> None:
    """LocalEngine and the parallel engine (world 1, recompute none/full/selective) on CUDA vs CPU fp32."""
    import torch.distributed as dist

    from framework.parallel.engine import build_parallel_engine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = load_config("configs/smoke/tiny.yaml", TINY)
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.model.vocab_size, (steps, cfg.train.global_batch_size, cfg.data.seq_len + 1),
                         generator=gen)
    ref = _train(LocalEngine(cfg.model, cfg.train, torch.device("cpu")), cfg, data)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    cases = {"local": None, "parallel/none": "none", "parallel/full": "full", "parallel/selective": "selective"}
    for name, recompute in cases.items():
        if recompute is None:
            engine = LocalEngine(cfg.model, cfg.train, device)
        else:
            c = load_config("configs/smoke/tiny.yaml",
                            [*TINY, f"parallel.recompute={recompute}", "parallel.dp_shard=1"])
            engine = build_parallel_engine(c, device)  # type: ignore[assignment]
        got = _train(engine, cfg, data)
        diff = max(max(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(got, ref))
        print(json.dumps({"check": f"parity/{name}", "max_abs_diff_vs_cpu": diff, "ok": diff <= 1e-4,
                          "final_loss": got[-1][0]}), flush=True)


def throughput(steps: int, seq: int, micro: int, peak_tflops: float, device: torch.device, preset: str) -> None:
    """tokens/s and MFU of llama-1b (bf16 autocast, fp32 master weights, fused AdamW) on one GPU."""
    overrides = [f"model.preset={preset}", f"data.seq_len={seq}", f"train.micro_batch_size={micro}",
                 f"train.global_batch_size={micro}", "train.precision=bf16", "train.warmup_steps=1",
                 f"train.steps={steps}", "data.kind=synthetic", "data.vocab_size=512"]
    cfg = load_config("configs/smoke/tiny.yaml", overrides)
    torch.backends.cuda.matmul.allow_tf32 = True
    engine = LocalEngine(cfg.model, cfg.train, device)
    batch = torch.randint(0, cfg.model.vocab_size, (1, micro, seq + 1), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        engine.forward_backward(batch)
        engine.clip_grad_norm(1.0)
        engine.optimizer_step(lr_at(cfg.train, step))
        sync()
        times.append(time.perf_counter() - t0)
    steady = times[2:] or times
    tok_s = micro * seq / (sum(steady) / len(steady))
    flops = flops_per_token(cfg.model, seq, causal=True)
    mfu = tok_s * flops / (peak_tflops * 1e12)
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    print(json.dumps({"check": f"throughput/{preset}", "params": num_params(cfg.model), "seq": seq,
                      "micro_batch": micro, "tokens_per_s": tok_s, "flops_per_token": flops, "mfu": mfu,
                      "peak_tflops": peak_tflops, "max_mem_gib": mem,
                      "step_s": steady}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H200 dense bf16")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to dry-run this script")
    parser.add_argument("--preset", default="llama-1b")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(json.dumps({"torch": torch.__version__, "device": name}), flush=True)
    if not args.skip_parity:
        parity(5, device)
    throughput(args.steps, args.seq, args.micro, args.peak_tflops, device, args.preset)
    return 0


if __name__ == "__main__":
    sys.exit(main())
