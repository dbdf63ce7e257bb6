"""Minimal reproduction: torch.compile of a tensor-parallel transformer block against the same block in eager.

Two gloo ranks, one Tessera block under TP=2 (with and without sequence parallelism), one forward+backward of
`(block(x) * w).sum()` with the same input; compares the output and every parameter gradient (full tensors) of
the compiled region against eager, for each backend (eager = dynamo only, aot_eager = + AOT autograd,
inductor = + generated kernels) and each region (the whole block, attention only, the MLP only).

    PYTHONPATH=. python bench/compile_tp_repro.py [--backends eager aot_eager inductor] [--json out.json]

Prints one line per case: max |compiled - eager| over the output and over the gradients, and OK/WRONG (1e-5).

`--cache-hazard` reproduces the silent failure instead: the TP2 engine with train.compile (inductor) trains 5
steps in a fresh inductor cache directory, then again in a second program that created 3 extra process groups
first (so its groups are numbered differently) and finds the first run's graphs in the on-disk cache. With
`--keep-caches` (Tessera's guard, which turns those caches off under TP, disabled) the second run reduces over the
wrong group; each run's largest (loss, grad norm) difference from the 1-process eager run is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REGIONS = ("block", "attention", "feed_forward")


def _build(sp: bool, mesh: Any, region: str, backend: str | None) -> Any:
    from framework.parallel.tensor import apply_tensor_parallel
    from models.config import model_config
    from models.decoder import Decoder

    cfg = model_config("test-tiny")
    with torch.device("meta"):
        model = Decoder(cfg)
    apply_tensor_parallel(model, mesh, sequence_parallel=sp, loss_parallel=False)
    model.to_empty(device="cpu")
    model.init_weights(0)
    if backend is not None:
        for key in list(model.layers.keys()):
            block = model.layers[key]
            if region == "block":
                model.layers[key] = torch.compile(block, backend=backend, fullgraph=True)
            else:
                setattr(block, region, torch.compile(getattr(block, region), backend=backend, fullgraph=True))
    return model, cfg


def _step(model: Any, cfg: Any, sp: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    out = model(tokens)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    weights = torch.randn(out.shape, generator=gen)
    (out * weights).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.replace("_orig_mod.", "")] = g
    return out.detach(), grads


def _rank(rank: int, world: int, backends: list[str]) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.config.cache_size_limit = 64
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    rows = []
    for sp in (True, False):
        ref_out, ref_grads = _step(*_build(sp, mesh, "block", None), sp)
        for backend in backends:
            for region in REGIONS:
                torch._dynamo.reset()
                row: dict[str, Any] = {"sp": sp, "backend": backend, "region": region}
                try:
                    out, grads = _step(*_build(sp, mesh, region, backend), sp)
                    row["out_diff"] = float((out - ref_out).abs().max())
                    row["grad_diff"] = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)
                    worst = max(ref_grads, key=lambda k: float((grads[k] - ref_grads[k]).abs().max()))
                    row["worst_param"] = worst
                except Exception as exc:  # a failure to compile is a result of the repro, not its crash
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                rows.append(row)
    return rows


def _engine_run(rank: int, world: int, extra_groups: int, keep_caches: bool) -> list[tuple[float, float]]:
    import torch.distributed as dist

    import framework.parallel.compile as compile_mod
    from framework.config import load_config
    from framework.train.parallel_engine import build_parallel_engine

    if keep_caches:
        compile_mod._no_cross_process_caches = lambda: None  # the guard off: show what it prevents
    for _ in range(extra_groups):
        dist.new_group(list(range(world)))
    cfg = load_config("configs/smoke/tiny.yaml", [*_TINY, "parallel.tp=2", "parallel.dp_shard=1",
                                                  "train.compile=true", "train.compile_backend=inductor"])
    return _train(build_parallel_engine(cfg.model, cfg.train, cfg.parallel, torch.device("cpu")), cfg)


_TINY = ["train.grad_clip=0.5", "train.warmup_steps=1", "train.lr=3.0e-3"]


def _train(engine: Any, cfg: Any, steps: int = 5) -> list[tuple[float, float]]:
    from framework.train.lr_schedule import lr_at

    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.model.vocab_size, (steps, cfg.train.global_batch_size, cfg.data.seq_len + 1),
                         generator=gen)
    out = []
    for step in range(steps):
        loss = engine.forward_backward(data[step].reshape(-1, cfg.train.micro_batch_size, data.shape[-1]))
        out.append((loss, engine.clip_grad_norm(cfg.train.grad_clip)))
        engine.optimizer_step(lr_at(cfg.train, step))
    return out


def cache_hazard(keep_caches: bool) -> None:
    import tempfile

    from framework.config import load_config
    from framework.testing import run_distributed
    from framework.train.local_engine import LocalEngine

    cfg = load_config("configs/smoke/tiny.yaml", _TINY)
    ref = _train(LocalEngine(cfg.model, cfg.train, torch.device("cpu")), cfg)
    with tempfile.TemporaryDirectory() as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        for extra in (0, 3):
            got = run_distributed(_engine_run, 2, timeout_s=1800, env=env, extra_groups=extra,
                                  keep_caches=keep_caches)[0]
            diff = max(max(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(got, ref, strict=True))
            print(f"torch {torch.__version__} TP2 inductor, {extra} extra groups, caches "
                  f"{'kept' if keep_caches else 'off (Tessera)'}: max |compiled - eager| {diff:.2e} "
                  f"{'OK' if diff <= 1e-5 else 'WRONG'}", flush=True)


def main() -> None:
    from framework.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["eager", "aot_eager", "inductor"])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cache-hazard", action="store_true")
    ap.add_argument("--keep-caches", action="store_true")
    args = ap.parse_args()
    if args.cache_hazard:
        cache_hazard(args.keep_caches)
        return
    rows = run_distributed(_rank, 2, timeout_s=1200, backends=args.backends)[0]
    print(f"torch {torch.__version__}")
    for row in rows:
        if "error" in row:
            verdict = row["error"]
        else:
            ok = row["out_diff"] <= 1e-5 and row["grad_diff"] <= 1e-5
            verdict = (f"out {row['out_diff']:.2e} grad {row['grad_diff']:.2e} ({row['worst_param']}) "
                       f"{'OK' if ok else 'WRONG'}")
        print(f"sp={row['sp']!s:5} {row['backend']:9} {row['region']:12} {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
